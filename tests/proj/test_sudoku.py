"""Sudoku benchmark: solver and generator, validity checker, CSV errors, data rows, eval.sudoku end to end."""

import itertools
import json

import numpy as np
import pytest

import dgemma
from dgemma import tokenizers
from proj.sudoku import data as sudoku
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from proj.sudoku import eval as eval_sudoku

# A well-known puzzle (unique solution) and its solution.
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def _grid(text):
  return sudoku.parse_grid(text)


def _brute_force_count(puzzle):
  """Slow obvious reference: every way to fill each row's blanks with a permutation of the digits the
  row is missing, each candidate grid checked whole with `is_solution`."""
  puzzle = np.asarray(puzzle)
  row_options = []
  for r in range(9):
    row = puzzle[9 * r:9 * r + 9]
    blanks = [9 * r + int(c) for c in np.flatnonzero(row == 0)]
    missing = sorted(set(range(1, 10)) - set(row.tolist()))
    row_options.append([(blanks, perm) for perm in itertools.permutations(missing)])
  count = 0
  for choice in itertools.product(*row_options):
    candidate = puzzle.copy()
    for blanks, perm in choice:
      candidate[blanks] = perm
    count += sudoku.is_solution(candidate, puzzle)
  return count


def test_validity_checker_hand_made_cases():
  puzzle, solution = _grid(PUZZLE), _grid(SOLUTION)
  assert sudoku.is_solution(solution, puzzle)
  assert sudoku.is_solution(solution, np.zeros(81, np.int8))
  swapped = solution.copy()
  swapped[[0, 1]] = swapped[[1, 0]]          # row still 1..9, columns 0 and 1 now repeat
  assert not sudoku.is_solution(swapped, np.zeros(81, np.int8))
  relabelled = np.where(solution == 1, 2, np.where(solution == 2, 1, solution))  # a valid grid ...
  assert sudoku.is_solution(relabelled, np.zeros(81, np.int8))
  assert not sudoku.is_solution(relabelled, puzzle)                               # ... that changes givens
  latin = np.asarray([(r + c) % 9 + 1 for r in range(9) for c in range(9)])      # rows, columns ok, boxes not
  assert all(sorted(latin.reshape(9, 9)[r]) == list(range(1, 10)) for r in range(9))
  assert not sudoku.is_solution(latin, np.zeros(81, np.int8))
  blank = solution.copy()
  blank[40] = 0
  assert not sudoku.is_solution(blank, np.zeros(81, np.int8))
  assert not sudoku.is_consistent(_grid("55" + "0" * 79))
  assert sudoku.is_consistent(puzzle)


def test_solver_counts_match_brute_force_and_generator_is_unique_and_deterministic():
  puzzle, solution = _grid(PUZZLE), _grid(SOLUTION)
  assert sudoku.count_solutions(puzzle, limit=10) == 1
  np.testing.assert_array_equal(sudoku.solve(puzzle), solution)
  rng = np.random.default_rng(7)
  grid = sudoku.random_full_grid(rng)
  assert sudoku.is_solution(grid, np.zeros(81, np.int8))
  # Blanking every 1 and 2: swapping them everywhere gives a second solution.
  two = np.where(np.isin(grid, (1, 2)), 0, grid).astype(np.int8)
  assert sudoku.count_solutions(two, limit=10) == _brute_force_count(two) >= 2
  assert sudoku.count_solutions(two, limit=1) == 1  # the limit stops the search
  for trial in range(4):  # random blank sets: exact counts against the brute force
    cells = rng.choice(81, size=14, replace=False)
    holed = grid.copy()
    holed[cells] = 0
    assert sudoku.count_solutions(holed, limit=1000) == _brute_force_count(holed), trial
  assert sudoku.count_solutions(_grid("11" + "0" * 79)) == 0

  rows = sudoku.generate(3, 40, 46, seed=5)
  assert rows == sudoku.generate(3, 40, 46, seed=5)
  assert rows != sudoku.generate(3, 40, 46, seed=6)
  for puzzle_text, solution_text in rows:
    p, s = _grid(puzzle_text), _grid(solution_text)
    assert 40 <= int((p == 0).sum()) <= 46
    assert sudoku.count_solutions(p, limit=2) == 1 and sudoku.is_solution(s, p)
    # Unique, and removing one more given from a generated puzzle can only keep or add solutions.
    given = int(np.flatnonzero(p)[0])
    fewer = p.copy()
    fewer[given] = 0
    assert sudoku.count_solutions(fewer, limit=50) >= 1
    # A symmetry maps it to another unique puzzle with the same blanks and a mapped solution.
    perm, digit_map = sudoku.random_symmetry(np.random.default_rng(1))
    p2, s2 = sudoku.apply_symmetry(p, perm, digit_map), sudoku.apply_symmetry(s, perm, digit_map)
    assert sudoku.is_solution(s2, p2) and (p2 == 0).sum() == (p == 0).sum()
    assert sudoku.count_solutions(p2, limit=2) == 1


def test_csv_round_trip_and_errors_name_file_and_line(tmp_path):
  good = tmp_path / "good.csv"
  sudoku.write_csv(good, [(PUZZLE, SOLUTION), (PUZZLE, SOLUTION)])
  assert sudoku.read_csv(good) == [(PUZZLE, SOLUTION)] * 2
  cases = {
      "short.csv": (f"{PUZZLE[:-1]},{SOLUTION}", "short.csv:3: puzzle: expected 81 digits, got 80"),
      "letter.csv": (f"{PUZZLE[:-1]}x,{SOLUTION}", "letter.csv:3: puzzle: non-digit character 'x'"),
      "blank_solution.csv": (f"{PUZZLE},0{SOLUTION[1:]}", "blank_solution.csv:3: solution: a solution has no blanks"),
      "wrong.csv": (f"{PUZZLE},{SOLUTION[1]}{SOLUTION[0]}{SOLUTION[2:]}", "wrong.csv:3: the solution does not solve"),
      "fields.csv": (f"{PUZZLE}", "fields.csv:3: expected 2 fields"),
  }
  for name, (bad_line, message) in cases.items():
    path = tmp_path / name
    path.write_text(f"puzzle,solution\n{PUZZLE},{SOLUTION}\n{bad_line}\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
      sudoku.read_csv(path)
  (tmp_path / "header.csv").write_text(f"quiz,solution\n{PUZZLE},{SOLUTION}\n")
  with pytest.raises(ValueError, match="header.csv:1: expected the header"):
    sudoku.read_csv(tmp_path / "header.csv")


def sudoku_config(tmp_path, train_csv="", validation_csv="", **sudoku_fields):
  from proj.sudoku.configs import sudoku as sudoku_configs
  from configs.models import tiny
  config = sudoku_configs.get_config()
  config.model = tiny.get_config()
  config.model.vocab_size = 260
  config.model.self_conditioning = False
  config.data.batch_size = 2
  config.data.cache_dir = str(tmp_path / "data_cache")
  config.data.sudoku.train_csv = str(train_csv)
  config.data.sudoku.validation_csv = str(validation_csv)
  config.data.sudoku.update(sudoku_fields)
  config.train.num_steps = 1
  config.opt.warmup_steps = 1  # <= train.num_steps (settings.from_config checks it)
  config.train.async_checkpointing = False
  config.sample.max_denoising_steps = 3
  return config


def test_sudoku_rows_alignment_determinism_resume_and_config_errors(tmp_path):
  from dgemma import data as data_lib
  rows = sudoku.generate(5, 30, 35, seed=3)
  train_csv = tmp_path / "train.csv"
  sudoku.write_csv(train_csv, rows)
  config = sudoku_config(tmp_path, train_csv, train_csv, augment=False)
  config.data.shuffle = False
  settings = settings_lib.from_config(config)
  prepared = data_lib.prepare(settings)
  tok = prepared.tokenizer
  batch = next(data_lib.make_iterator(settings, prepared, "train"))
  assert batch["tokens"].shape == (2, 163)
  for b in range(2):   # unshuffled, unaugmented: exactly the CSV rows, prompt | canvas aligned cell by cell
    tokens = batch["tokens"][b]
    assert tokens[0] == tok.bos_id
    assert tok.decode(tokens[1:82]) == rows[b][0] and tok.decode(tokens[82:]) == rows[b][1]
  np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(163), (2, 163)))
  np.testing.assert_array_equal(batch["segment_ids"], np.ones((2, 163)))

  settings = settings_lib.from_config(sudoku_config(tmp_path, train_csv, train_csv, augment=True))
  prepared = data_lib.prepare(settings)
  first, second = (data_lib.make_iterator(settings, prepared, "train") for _ in range(2))
  stream = [next(first) for _ in range(4)]   # 8 rows: more than an epoch of 5 puzzles
  state = first.get_state()
  after = next(first)
  for got in stream:
    np.testing.assert_array_equal(got["tokens"], next(second)["tokens"])  # same seed, same rows
  resumed = data_lib.make_iterator(settings, prepared, "train")
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed)["tokens"], after["tokens"])
  blanks = sorted(p.count("0") for p, _ in rows)
  seen_augmented = 0
  for got in stream:
    for tokens in got["tokens"]:
      puzzle, solution = _grid(tok.decode(tokens[1:82])), _grid(tok.decode(tokens[82:]))
      assert sudoku.is_solution(solution, puzzle) and int((puzzle == 0).sum()) in blanks
      seen_augmented += tok.decode(tokens[1:82]) not in {p for p, _ in rows}
  assert seen_augmented > 0
  validation = next(data_lib.make_iterator(settings, prepared, "validation"))  # never augmented
  assert tok.decode(validation["tokens"][0][1:82]) == rows[0][0]

  def fails(match, **changes):
    bad = sudoku_config(tmp_path, train_csv, train_csv)
    for key, value in changes.items():
      node = bad
      *parents, leaf = key.split("__")
      for p in parents:
        node = node[p]
      node[leaf] = value
    with pytest.raises(ConfigError, match=match):  # the settings' checks, then the source's (before building)
      data_lib.prepare(settings_lib.from_config(bad))

  fails("data.sudoku.train_csv: '/nonexistent.csv' does not exist", data__sudoku__train_csv="/nonexistent.csv")
  fails("data.seq_len: data.source='sudoku' rows are", data__seq_len=164)
  fails("data.tokenizer.kind: data.source='sudoku' needs the byte tokenizer", data__tokenizer__kind="sentencepiece",
        data__tokenizer__vocab_size=512, model__vocab_size=512)  # (sizes the settings' own checks accept)
  fails("diffusion.canvas_len: data.source='sudoku'", diffusion__canvas_len=80)
  fails("data.sudoku.min_blanks", data__sudoku__min_blanks=50, data__sudoku__max_blanks=40)
  fails("data.sudoku.num_validation: must be positive", data__sudoku__validation_csv="",
        data__sudoku__num_validation=0)
  bad_csv = tmp_path / "bad.csv"
  bad_csv.write_text(f"puzzle,solution\n{PUZZLE},{SOLUTION[:-1]}\n")
  with pytest.raises(ValueError, match="bad.csv:2: solution: expected 81 digits"):
    data_lib.prepare(settings_lib.from_config(sudoku_config(tmp_path, bad_csv, train_csv)))


def test_training_row_is_the_string_path_on_the_augmented_grids():
  """_MakeRow works on digit arrays and a digit -> token table; the obvious reference is row_tokens on the
  augmented strings, with the same symmetry drawn from (seed, stream position)."""
  tok = tokenizers.ByteTokenizer()
  rows = sudoku.generate(3, 30, 40, seed=5)
  for augment in (False, True):
    make_row = sudoku._MakeRow(tok, augment, seed=7, infill=True)
    for index in (0, 1, 12345):
      puzzle, solution = rows[index % 3]
      if augment:
        perm, digit_map = sudoku.random_symmetry(np.random.default_rng((7, index)))
        puzzle, solution = (sudoku.format_grid(sudoku.apply_symmetry(sudoku.parse_grid(g), perm, digit_map))
                            for g in (puzzle, solution))
      got = make_row(index, {"puzzle": rows[index % 3][0], "solution": rows[index % 3][1]})
      np.testing.assert_array_equal(got["tokens"], sudoku.row_tokens(puzzle, solution, tok))
      assert got["tokens"].dtype == np.int32
      np.testing.assert_array_equal(got["infill_mask"][sudoku.CONTEXT_LEN:], sudoku.givens_mask(puzzle))
      assert not got["infill_mask"][:sudoku.CONTEXT_LEN].any()


@pytest.mark.slow  # 13 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_infill_givens_rows_hold_the_givens_clean_and_unscored(tmp_path, monkeypatch):
  """data.sudoku.infill_givens: rows mark the puzzle's givens in the canvas; the diffusion loss feeds
  them clean at every noise level and scores only the blanks (checked against the decoder's own
  input and logits, captured, with a plain numpy cross-entropy)."""
  import jax
  import jax.numpy as jnp
  from dgemma import data as data_lib
  from dgemma import diffusion
  from dgemma.model import Transformer
  from tests.model_utils import random_params
  rows = sudoku.generate(4, 30, 45, seed=5)
  train_csv = tmp_path / "train.csv"
  sudoku.write_csv(train_csv, rows)
  config = sudoku_config(tmp_path, train_csv, train_csv, augment=True, infill_givens=True)
  config.data.batch_size = 4
  settings = settings_lib.from_config(config)
  model_cfg = settings.model
  prepared = data_lib.prepare(settings)
  batch = next(data_lib.make_iterator(settings, prepared, "train"))
  tok = prepared.tokenizer
  for b in range(4):
    puzzle = tok.decode(batch["tokens"][b][1:82])
    assert not batch["infill_mask"][b][:82].any()
    np.testing.assert_array_equal(batch["infill_mask"][b][82:], [c != "0" for c in puzzle])
  held = batch["infill_mask"][:, 82:] != 0
  clean = batch["tokens"][:, 82:]

  real_decode, seen = Transformer.decode, {}

  def spy(module, tokens, *args, **kwargs):
    logits = real_decode(module, tokens, *args, **kwargs)
    jax.debug.callback(lambda t, l: seen.update(tokens=np.asarray(t), logits=np.asarray(l, np.float64)),
                       tokens, logits)  # (decode runs traced)
    return logits

  monkeypatch.setattr(Transformer, "decode", spy)
  loss_cfg = settings.diffusion
  jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
  params = random_params(model_cfg)
  noised_blanks = 0
  for seed in range(3):
    _, metrics = diffusion.diffusion_loss(params, jbatch, jax.random.PRNGKey(seed), model_cfg=model_cfg,
                                          loss_cfg=loss_cfg)
    np.testing.assert_array_equal(seen["tokens"][held], clean[held])   # givens: clean at every t
    noised_blanks += int((seen["tokens"][~held] != clean[~held]).sum())
    logp = seen["logits"] - np.log(np.exp(seen["logits"]).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, clean[..., None], -1)[..., 0]
    assert float(metrics["canvas_tokens"]) == (~held).sum()
    # the same fp32 logits: the library's fp32 log-softmax and mean vs float64 here, a few roundings of
    # |logits| ~ 4 per token: ~10 eps * |logit| / CE <~ 3e-6 relative; rtol 1e-5
    np.testing.assert_allclose(float(metrics["canvas_loss"]), ce[~held].mean(), rtol=1e-5)
  assert noised_blanks > 0

  config.diffusion.objective = "ar"
  with pytest.raises(ConfigError, match="data.sudoku.infill_givens: holds canvas cells of a diffusion run"):
    data_lib.prepare(settings_lib.from_config(config))


def _slow_metrics(records):
  """Recomputes the metrics from the written predictions with plain loops."""
  solved = correct = blank_total = blank_correct = 0
  for r in records:
    puzzle, solution, pred = r["puzzle"], r["solution"], r["prediction"]
    grid = [[pred[9 * i + j] if len(pred) > 9 * i + j else "." for j in range(9)] for i in range(9)]
    units = [[grid[i][j] for j in range(9)] for i in range(9)] + [[grid[i][j] for i in range(9)] for j in range(9)]
    units += [[grid[3 * bi + i][3 * bj + j] for i in range(3) for j in range(3)] for bi in range(3) for bj in range(3)]
    valid = all(sorted(u) == list("123456789") for u in units)
    kept = all(p == "0" or p == pred[k] for k, p in enumerate(puzzle))
    solved += valid and kept
    for k in range(81):
      hit = k < len(pred) and pred[k] == solution[k]
      correct += hit
      if puzzle[k] == "0":
        blank_total += 1
        blank_correct += hit
  n = len(records)
  return dict(solve_rate=solved / n, cell_accuracy=correct / (81 * n), blank_accuracy=blank_correct / blank_total)


@pytest.mark.slow  # the Sudoku evaluation end to end (a saved run, sampling, the report)
def test_eval_sudoku_end_to_end_on_a_tiny_random_model(tmp_path, monkeypatch):
  import jax
  from tests.model_utils import save_random_run

  rows = sudoku.generate(2, 30, 35, seed=11)
  puzzles_csv = tmp_path / "puzzles.csv"
  sudoku.write_csv(puzzles_csv, rows)
  config = sudoku_config(tmp_path, puzzles_csv, puzzles_csv)
  # A "trained" run without training: random init saved as step 1 with the run's config.json.
  workdir = tmp_path / "run"
  save_random_run(config, workdir)
  model = dgemma.load(str(workdir))  # the run's own settings (config.json)

  out = tmp_path / "preds.jsonl"
  metrics = eval_sudoku.evaluate(str(workdir), str(puzzles_csv), predictions_path=str(out), batch_size=2,
                                 print_fn=lambda *_: None)
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["puzzle"], r["solution"]) for r in records] == rows
  assert all(len(r["prediction"]) == 81 for r in records)
  slow = _slow_metrics(records)
  for key in slow:
    assert metrics[key] == pytest.approx(slow[key], abs=1e-12), key  # ratios of the same counts, float64
  assert json.loads(out.with_suffix(".metrics.json").read_text())["solve_rate"] == metrics["solve_rate"]
  assert metrics["variant"] == "released_renoise_non_accepted" and metrics["num_puzzles"] == 2
  assert metrics["givens_held"] is False
  # --hold_givens=yes on a run trained without: every given comes out as given, as its own variant.
  held_out_path = tmp_path / "held.jsonl"
  h_metrics = eval_sudoku.evaluate(str(workdir), str(puzzles_csv), predictions_path=str(held_out_path),
                                   batch_size=2, hold_givens=True, print_fn=lambda *_: None)
  assert h_metrics["variant"] == "released_renoise_non_accepted_givens_held" and h_metrics["givens_held"] is True
  assert all(json.loads(line)["givens_kept"] for line in held_out_path.read_text().splitlines())
  ar_config = settings_lib.from_json((workdir / "config.json").read_text())
  ar_config.diffusion.objective = "ar"
  ar_model = model.with_config(ar_config)
  for held in (dict(hold_givens=True), dict(keep=[(SOLUTION, np.ones(81, bool))] * 2)):
    with pytest.raises(ConfigError, match="held cells need a diffusion run"):
      eval_sudoku.solve_puzzles(ar_model, [p for p, _ in rows], batch_size=2, **held)

  # The ablation runner's metric: the run's validation puzzles (here the same 2), same sampler -> same numbers.
  ablation = eval_sudoku.ablation_metrics(model)
  for key in ("solve_rate", "cell_accuracy", "blank_accuracy", "num_puzzles"):
    assert ablation[key] == metrics[key], key

  # The scorer on hand-made predictions: one solved, one with a changed given, one short and wrong.
  wrong_given = ("1" if SOLUTION[0] != "1" else "2") + SOLUTION[1:]
  m, recs = eval_sudoku.score([PUZZLE] * 3, [SOLUTION] * 3, [SOLUTION, wrong_given, "12345"])
  assert m["solve_rate"] == pytest.approx(1 / 3)
  slow = _slow_metrics(recs)
  assert {k: m[k] for k in slow} == pytest.approx(slow)
  assert [r["solved"] for r in recs] == [True, False, False] and recs[1]["givens_kept"] is False

  with pytest.raises(ConfigError, match="sample.renoise: .sometimes. not in"):
    eval_sudoku.evaluate(str(workdir), str(puzzles_csv), overrides={"renoise": "sometimes"})
  with pytest.raises(ConfigError, match="sample.not_a_setting: unknown"):
    eval_sudoku.evaluate(str(workdir), str(puzzles_csv), overrides={"not_a_setting": 1})
  with pytest.raises(ConfigError, match="sample.quant_group_size"):  # 7 does not divide d_model: before loading
    eval_sudoku.evaluate(str(workdir), str(puzzles_csv), overrides={"quantize": "int4", "quant_group_size": 7})

  # sample.quantize: the puzzles are solved with int8 weights, written as their own variant.
  from dgemma import quant
  schemes = []
  real_quantize = quant.quantize_params

  def spy(params, qcfg, *args, **kwargs):
    shapes_only = all(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))  # under jax.eval_shape
    out = real_quantize(params, qcfg, *args, **kwargs)
    schemes.append((qcfg.scheme, shapes_only,
                    any(quant.is_quantized(x) for x in jax.tree.leaves(out, is_leaf=quant.is_quantized))))
    return out

  monkeypatch.setattr(quant, "quantize_params", spy)
  q_metrics = eval_sudoku.evaluate(str(workdir), str(puzzles_csv), overrides={"quantize": "int8"}, batch_size=2,
                                   print_fn=lambda *_: None)
  # quant.check's shape-only pass before loading (settings.from_config runs it, once per settings built),
  # then the real weights, once
  assert len(schemes) >= 2 and schemes[-1] == ("int8", False, True), schemes
  assert schemes[:-1] == [("int8", True, True)] * (len(schemes) - 1), schemes
  assert q_metrics["variant"] == "released_renoise_non_accepted_int8" and q_metrics["num_puzzles"] == 2
  assert (workdir / "sudoku_predictions_released_renoise_non_accepted_int8.metrics.json").is_file()

  # Generate and verify (--candidates): round c re-samples only the puzzles no earlier sample solved,
  # with the key sample_key(seed, row, c); the first sample passing the rules check is kept. The random
  # model solves nothing, so a wrapper around the real solver plants a solution as row 1's candidate 1.
  monkeypatch.setattr(quant, "quantize_params", real_quantize)
  real_solve, calls = eval_sudoku.solve_puzzles, []

  def planted(model, puzzles, *, indices=None, candidate=0, **kw):
    texts = real_solve(model, puzzles, indices=indices, candidate=candidate, **kw)
    rows_ = list(range(len(puzzles)) if indices is None else indices)
    calls.append((rows_, candidate))
    return [rows[1][1] if (r, candidate) == (1, 1) else t for r, t in zip(rows_, texts)]

  monkeypatch.setattr(eval_sudoku, "solve_puzzles", planted)
  v_out = tmp_path / "verified.jsonl"
  v_metrics = eval_sudoku.evaluate(str(workdir), str(puzzles_csv), predictions_path=str(v_out), batch_size=2,
                                   candidates=3, print_fn=lambda *_: None)
  assert calls == [([0, 1], 0), ([0, 1], 1), ([0], 2)]
  v_records = [json.loads(line) for line in v_out.read_text().splitlines()]
  assert [r["candidate"] for r in v_records] == [0, 1] and [r["solved"] for r in v_records] == [False, True]
  assert v_records[0]["prediction"] == records[0]["prediction"]  # row 0: no sample passed -> its first
  assert v_metrics["samples_drawn"] == 5 and v_metrics["solved_by_candidate"] == [0, 1, 0]
  assert v_metrics["solve_rate"] == 0.5 and v_metrics["variant"] == "released_renoise_non_accepted_resample_verified_of_3"
  # Candidate keys differ from candidate 0's, which is the single-sample key.
  assert not np.array_equal(jax.random.key_data(eval_sudoku.sample_key(0, 1, 1)),
                            jax.random.key_data(eval_sudoku.sample_key(0, 1, 0)))
  with pytest.raises(ConfigError, match="--candidates must be >= 1"):
    eval_sudoku.evaluate(str(workdir), str(puzzles_csv), candidates=0)

  # --retry=repair: the second round holds the first sample's non-conflicting cells fixed (infilling).
  calls.clear()
  seen_keep = []

  def spy_keep(model, puzzles, *, keep=None, **kw):
    seen_keep.append(keep)
    return real_solve(model, puzzles, keep=keep, **kw)

  monkeypatch.setattr(eval_sudoku, "solve_puzzles", spy_keep)
  r_metrics = eval_sudoku.evaluate(str(workdir), str(puzzles_csv), batch_size=2, candidates=2, retry="repair",
                                   predictions_path=str(tmp_path / "repair.jsonl"), print_fn=lambda *_: None)
  assert seen_keep[0] is None and len(seen_keep[1]) == 2 and r_metrics["samples_drawn"] == 4
  for (text, held), first in zip(seen_keep[1], records):
    assert text == first["prediction"]
    grid, puzzle = eval_sudoku.prediction_grid(text), sudoku.parse_grid(first["puzzle"])
    np.testing.assert_array_equal(held, ~eval_sudoku.conflict_cells(grid, puzzle))
  with pytest.raises(ConfigError, match="--retry"):
    eval_sudoku.evaluate(str(workdir), str(puzzles_csv), candidates=2, retry="sometimes")
  # Held cells come out as given, whatever the (random) model predicts.
  held = np.arange(81) % 2 == 0
  held_out = real_solve(model, [p for p, _ in rows], batch_size=2,
                        keep=[(solution, held) for _, solution in rows])  # the repair round's program
  for out_text, (_, solution) in zip(held_out, rows):
    assert [out_text[i] for i in np.flatnonzero(held)] == [solution[i] for i in np.flatnonzero(held)]
  # A run trained with data.sudoku.infill_givens holds every given, as its training did (the random
  # model alone does not keep them); with `keep` too, the givens are written over the held text.
  assert not all(r["givens_kept"] for r in records)
  givens_config = settings_lib.from_json((workdir / "config.json").read_text())
  givens_config.data.sudoku.infill_givens = True
  givens_model = model.with_config(givens_config)
  for keep in (None, [(SOLUTION[::-1], np.ones(81, bool))] * 2):
    outs = real_solve(givens_model, [p for p, _ in rows], batch_size=2, keep=keep)
    for out_text, (puzzle, _) in zip(outs, rows):
      assert all(o == c for o, c in zip(out_text, puzzle) if c != "0")
      if keep is not None:  # the rest of the held text stays as held
        assert all(o == h for o, h, c in zip(out_text, SOLUTION[::-1], puzzle) if c == "0")


def test_solve_rate_by_blanks_counts_each_band_of_five():
  """score's solve_rate_by_blanks against counts by hand: PUZZLE with some blanks filled in from SOLUTION
  gives puzzles of known blank counts; the solved ones are those whose prediction is SOLUTION."""
  blank_cells = [k for k, c in enumerate(PUZZLE) if c == "0"]
  def with_blanks(n):  # the first len - n blanks filled from the solution: n blanks remain
    fill = set(blank_cells[:len(blank_cells) - n])
    return "".join(SOLUTION[k] if k in fill else c for k, c in enumerate(PUZZLE))
  assert len(blank_cells) >= 45
  cases = [(30, True), (34, False), (35, True), (36, True), (44, False), (45, True)]
  puzzles = [with_blanks(n) for n, _ in cases]
  assert [p.count("0") for p in puzzles] == [n for n, _ in cases]
  predictions = [SOLUTION if ok else "12345" for _, ok in cases]
  m, _ = eval_sudoku.score(puzzles, [SOLUTION] * len(cases), predictions)
  assert m["solve_rate_by_blanks"] == {"30-34": dict(puzzles=2, solve_rate=0.5), "35-39": dict(puzzles=2, solve_rate=1.0),
                                       "40-44": dict(puzzles=1, solve_rate=0.0), "45-49": dict(puzzles=1, solve_rate=1.0)}
  assert m["solve_rate"] == pytest.approx(4 / 6)


def test_probe_hides_k_blank_cells_and_holds_the_rest(tmp_path, monkeypatch):
  """eval.sudoku --probe: per k, exactly k blank cells (all of them for k = 0) are left open, every
  other cell is held at the reference solution, one denoising step; the accuracy is counted on the
  open cells only. The real solver runs (random model); a spy records what it was asked."""
  from tests.model_utils import save_random_run
  rows = sudoku.generate(2, 30, 35, seed=11)
  puzzles_csv = tmp_path / "puzzles.csv"
  sudoku.write_csv(puzzles_csv, rows)
  workdir = tmp_path / "run"
  save_random_run(sudoku_config(tmp_path, puzzles_csv, puzzles_csv), workdir)
  real_solve, calls = eval_sudoku.solve_puzzles, []

  def spy(model, puzzles, *, keep=None, **kw):
    texts = real_solve(model, puzzles, keep=keep, **kw)
    calls.append((model.settings.sample.max_denoising_steps, keep, texts))
    return texts

  monkeypatch.setattr(eval_sudoku, "solve_puzzles", spy)
  result = eval_sudoku.probe(str(workdir), str(puzzles_csv), [1, 3, 0], batch_size=2, print_fn=lambda *_: None)
  assert [c[0] for c in calls] == [1, 1, 1]
  for (_, keep, texts), k in zip(calls, (1, 3, 0)):
    hits = total = 0
    for (puzzle, solution), (held_text, held), text in zip(rows, keep, texts):
      open_cells = np.flatnonzero(~held)
      blanks = [i for i, c in enumerate(puzzle) if c == "0"]
      assert len(open_cells) == (len(blanks) if k == 0 else k) and set(open_cells) <= set(blanks)
      assert held_text == solution
      assert all(text[i] == solution[i] for i in np.flatnonzero(held))   # held cells come out as held
      hits += sum(text[i] == solution[i] for i in open_cells)
      total += len(open_cells)
    assert result["hidden_cell_accuracy"][str(k)] == pytest.approx(hits / total)
  assert json.loads((workdir / "sudoku_probe.json").read_text()) == result


def test_conflict_cells_and_held_cells_in_the_sampler():
  puzzle, solution = sudoku.parse_grid(PUZZLE), sudoku.parse_grid(SOLUTION)
  assert not eval_sudoku.conflict_cells(solution, puzzle).any()
  blanks = np.flatnonzero(puzzle == 0)
  a, b = blanks[0], blanks[-1]
  broken = solution.copy()
  broken[a] = 0                                  # a hole
  d = solution[b] % 9 + 1                        # a digit repeated in b's row (with some other cell)
  broken[b] = d
  bad = eval_sudoku.conflict_cells(broken, puzzle)
  assert bad[a] and bad[b] and not bad[puzzle != 0].any()
  row = np.arange(9) + 9 * (b // 9)
  twin = row[(broken[row] == d) & (row != b)]
  assert all(bad[t] or puzzle[t] != 0 for t in twin)   # the other copy is flagged unless it is a given
