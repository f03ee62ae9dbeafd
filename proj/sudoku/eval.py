"""Sudoku benchmark: solve held-out puzzles with a trained run, report solve rate and cell accuracy.

  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=data/sudoku/test.csv
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=data/sudoku/test.csv --renoise=none   # ablation
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku_ar --puzzles=data/sudoku/test.csv     # AR baseline (greedy)
  # any sampler setting of configs/base.py's `sample` group, e.g. fewer denoising steps:
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=test.csv --set=max_denoising_steps=16
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=test.csv --set=quantize=int8  # int8 / int4 weights
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=test.csv --candidates=8   # generate and verify
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=test.csv --probe=1,5,15,0  # hole-filling probe

The run's own config.json gives the model and data settings. Diffusion runs decode each puzzle with
`dgemma.sampling.generate` (the released entropy-bound sampler with re-noising of non-accepted cells by
default; `--renoise=none` keeps them instead); runs trained with diffusion.objective='ar' decode the 81
digits greedily with `dgemma.sampling.ar_generate`. The prompt is [BOS] + the 81 puzzle digits, exactly
the context of the training rows (proj/sudoku/data.py). A run trained with data.sudoku.infill_givens
also holds each puzzle's givens in the canvas (the sampler's infilling), as its training did.

Generate and verify (`--candidates=N`, diffusion runs): a puzzle whose sample breaks the rules (a row,
column or box with a repeat or a hole, or a given changed; checked from the puzzle alone, never from the
reference solution) is sampled again with a new key, up to N samples in all; the first sample that
passes is the prediction. This is a different decoding budget from one sample (up to N x the forwards),
reported as its own variant `..._<retry>_verified_of_N` with `samples_drawn` and `solved_by_candidate`.
`--retry=repair` instead holds the cells of the last sample that break no rule fixed (the sampler's
infilling) and re-noises only the conflicting ones.

Givens: `--hold_givens=yes` holds each puzzle's givens in the canvas (the sampler's infilling) for any
diffusion run; the default ('run') does so exactly when the run was trained with data.sudoku.infill_givens.

Probe (`--probe=1,5,15,0`, a diagnostic, not the benchmark): k random blank cells per puzzle are hidden
(0 = all blanks), every other cell is held at the reference solution, and one decoder pass fills the
holes (argmax). The accuracy on the hidden cells separates what the model knows from what the sampler
makes of it; written to <checkpoint>/sudoku_probe.json.

Metrics (every puzzle counts; a prediction with a non-digit or a missing cell is simply wrong there):
  solve_rate     fraction of puzzles whose prediction is a valid grid (every row, column and box holds
                 1..9) that keeps every given (`proj.sudoku.data.is_solution`);
  cell_accuracy  fraction of all 81 x N cells equal to the reference solution;
  blank_accuracy the same over the puzzles' blank cells only;
  solve_rate_by_blanks  {"30-34": {"puzzles", "solve_rate"}, ...}: the solve rate within bands of 5 blanks.
Predictions go to `--predictions` (default <checkpoint>/sudoku_predictions_<variant>.jsonl), one JSON
object per puzzle, and the metrics to the same path with `.metrics.json`; both are written atomically.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dgemma
from dgemma import api, checkpoints, files, tokenizers
from dgemma import data as data_lib
from dgemma import settings as settings_lib
from proj.sudoku import data as sudoku
from dgemma.errors import ConfigError
from dgemma.model import Transformer
from dgemma.sampling import ar_generate, check_request, generate
from dgemma.tools import cli


prediction_grid = sudoku.prediction_grid


def score(puzzles: Sequence[str], solutions: Sequence[str], predictions: Sequence[str]) -> tuple[dict, list[dict]]:
  """(metrics, per-puzzle records) of decoded predictions against the reference solutions."""
  records = []
  solved = cells = blanks = blank_hits = 0
  by_band = {}  # 5 * (blanks // 5) -> [puzzles, solved]
  for puzzle_text, solution_text, text in zip(puzzles, solutions, predictions, strict=True):
    puzzle, solution = sudoku.parse_grid(puzzle_text), sudoku.parse_grid(solution_text)
    pred = prediction_grid(text)
    ok = sudoku.is_solution(pred, puzzle)
    correct_81 = pred == solution
    is_blank = puzzle == 0
    solved += ok
    cells += int(correct_81.sum())
    blanks += int(is_blank.sum())
    blank_hits += int((correct_81 & is_blank).sum())
    band = by_band.setdefault(5 * (int(is_blank.sum()) // 5), [0, 0])
    band[0] += 1
    band[1] += bool(ok)
    records.append(dict(puzzle=puzzle_text, solution=solution_text, prediction=text, solved=bool(ok),
                        cells_correct=int(correct_81.sum()), givens_kept=bool((pred[~is_blank] == puzzle[~is_blank]).all())))
  n = len(records)
  metrics = dict(num_puzzles=n, solve_rate=solved / max(n, 1), cell_accuracy=cells / max(n * sudoku.NUM_CELLS, 1),
                 blank_accuracy=blank_hits / max(blanks, 1),
                 solve_rate_by_blanks={f"{lo}-{lo + 4}": dict(puzzles=n_band, solve_rate=s_band / n_band)
                                       for lo, (n_band, s_band) in sorted(by_band.items())})
  return metrics, records


def _configured_run(checkpoint: str, overrides: dict[str, Any] | None):
  """The run's config with the sample overrides applied, and its checked settings (no weights read)."""
  config = api.run_config(checkpoints.header(checkpoint, checkpoints.CHECKPOINT_FLAG))
  apply_sample_overrides(config, overrides or {})
  return config, settings_lib.from_config(config)


def apply_sample_overrides(config, overrides: dict[str, Any]) -> None:
  """Sets config.sample.<name> = value for each override (unknown names are rejected)."""
  for name, value in overrides.items():
    if name not in config.sample:
      raise ConfigError(f"sample.{name}: unknown sampler setting (see configs/base.py, `sample` group)")
    with config.sample.ignore_type():
      config.sample[name] = value


def sample_key(seed: int, index: int, candidate: int = 0) -> jax.Array:
  """The sampler key of puzzle `index` (its row in the CSV), candidate `candidate`: candidate 0 is
  fold_in(key(seed), index), so a puzzle's first sample does not depend on batching or on --candidates."""
  key = jax.random.fold_in(jax.random.key(seed), index)
  return key if candidate == 0 else jax.random.fold_in(key, candidate)


def solve_puzzles(model: dgemma.Model, puzzles: Sequence[str], *, batch_size: int = 50,
                  seed: int | None = None, indices: Sequence[int] | None = None, candidate: int = 0,
                  keep: Sequence[tuple[str, np.ndarray]] | None = None, hold_givens: bool | None = None) -> list[str]:
  """Decoded 81-character predictions (non-digits kept as '.'), one per puzzle, in order.

  Diffusion: `generate` with the model's sampler settings (model.settings.sample, weights as loaded,
  sample.quantize included); AR objective: greedy `ar_generate`. Batches are padded to `batch_size` rows
  (one compiled program).
  indices: each puzzle's row in its CSV (default 0..n-1) and candidate: which sample of it; together
  they pick the row's key (`sample_key`).
  keep: per puzzle, (81-character text, bool[81]) cells held fixed in the canvas (the sampler's
    infilling: never re-noised, not counted against the acceptance budget); diffusion runs only.
  hold_givens: also hold each puzzle's givens in the canvas; None = as the run was trained
    (data.sudoku.infill_givens).
  """
  settings = model.settings
  tokenizer = tokenizers.ByteTokenizer()
  net, params = Transformer(model.model_cfg), model.params
  is_ar = settings.objective.autoregressive
  sampler_cfg = None if is_ar else settings.canvas_sampler
  seed = settings.sample.seed if seed is None else int(seed)
  prompts = np.stack([sudoku.prompt_tokens(p, tokenizer) for p in puzzles]) if puzzles else np.zeros((0, 82))
  batch_size = max(1, min(batch_size, len(puzzles)))
  if sampler_cfg is not None:
    check_request(sampler_cfg, batch=batch_size, prompt_len=sudoku.CONTEXT_LEN, max_new_tokens=sudoku.NUM_CELLS)
  lengths = np.full((batch_size,), sudoku.CONTEXT_LEN, np.int32)
  indices = np.arange(len(puzzles)) if indices is None else np.asarray(indices)
  hold_givens = holds_givens(settings, hold_givens)
  if is_ar and (keep is not None or hold_givens):
    raise ConfigError("keep / --hold_givens: held cells need a diffusion run (the AR baseline decodes left to right)")
  if hold_givens:
    givens = [(p, sudoku.givens_mask(p)) for p in puzzles]
    keep = givens if keep is None else [(_merge_held(t, m, p), m | g) for (t, m), (p, g) in zip(keep, givens)]
  if keep is not None:
    keep_tokens = np.stack([np.asarray(tokenizer.encode(t.replace(".", "0")), np.int32) for t, _ in keep])
    keep_mask = np.stack([np.asarray(m, bool) for _, m in keep])
  texts = []
  for start in range(0, len(puzzles), batch_size):
    chunk = prompts[start:start + batch_size]
    n = len(chunk)
    pad_rows = lambda a: np.concatenate([a, np.repeat(a[-1:], batch_size - n, axis=0)])
    chunk = pad_rows(chunk)
    rows = indices[start:start + batch_size]
    rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - n)])
    keys = jnp.stack([sample_key(seed, int(i), candidate) for i in rows])
    if is_ar:
      tokens, _ = ar_generate(net, params, chunk, lengths, keys, max_new_tokens=sudoku.NUM_CELLS,
                              temperature=0.0, end_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
    else:
      infill = {} if keep is None else dict(infill_tokens_BN=pad_rows(keep_tokens[start:start + batch_size]),
                                            infill_mask_BN=pad_rows(keep_mask[start:start + batch_size]))
      tokens = generate(net, params, chunk, lengths, sampler_cfg, keys, max_new_tokens=sudoku.NUM_CELLS,
                        **infill).tokens_BN
    tokens = np.asarray(jax.device_get(tokens))[:n]
    texts.extend(_decode_cells(row, tokenizer) for row in tokens)
  return texts


def holds_givens(settings, hold_givens: bool | None) -> bool:
  """Whether the givens are held in the canvas: `hold_givens`, or None = as the run was trained
  (data.sudoku.infill_givens; never for the AR baseline)."""
  if hold_givens is None:
    return settings.data.sudoku.infill_givens and not settings.objective.autoregressive
  return bool(hold_givens)


def _merge_held(text: str, mask: np.ndarray, puzzle: str) -> str:
  """`text` with the puzzle's givens written over it (the cells `infill_givens` holds)."""
  return "".join(p if p != "0" else (t if m else "0") for t, m, p in zip(text, mask, puzzle))


def _decode_cells(ids: np.ndarray, tokenizer) -> str:
  """One character per generated position: the byte if it is printable ASCII, else '.'."""
  out = []
  for i in ids.tolist():
    ch = tokenizer.decode([i])
    out.append(ch if len(ch) == 1 and ch.isprintable() and ch.isascii() else ".")
  return "".join(out)


def conflict_cells(pred: np.ndarray, puzzle: np.ndarray) -> np.ndarray:
  """bool[81]: the blank cells of `puzzle` whose predicted digit is missing (0) or repeated in its
  row, column or box. A filled grid that keeps the givens and has none is the solution."""
  grid = np.asarray(pred, np.int64).reshape(9, 9)
  bad = grid == 0
  for unit_cells in _UNITS:
    digits = grid.reshape(-1)[unit_cells]
    counts = np.bincount(digits, minlength=10)
    bad.reshape(-1)[unit_cells] |= (digits > 0) & (counts[digits] > 1)
  return bad.reshape(-1) & (np.asarray(puzzle).reshape(-1) == 0)


_UNITS = ([np.arange(9) + 9 * r for r in range(9)] + [np.arange(0, 81, 9) + c for c in range(9)]
          + [np.array([9 * (3 * (b // 3) + i) + 3 * (b % 3) + j for i in range(3) for j in range(3)])
             for b in range(9)])
RETRIES = ("resample", "repair")


def solve_with_candidates(model: dgemma.Model, puzzles: Sequence[str], candidates: int, *,
                          retry: str = "resample", batch_size: int = 50,
                          hold_givens: bool | None = None) -> tuple[list[str], list[int], int]:
  """Generate and verify: up to `candidates` samples per puzzle, drawn in rounds; a puzzle whose
  sample passes the rules check (`sudoku.is_solution`: valid rows, columns, boxes and every given
  kept; the reference solution is never read) keeps it and leaves the later rounds. A puzzle no sample
  passes keeps its first. Returns (predictions, candidate index of each prediction, samples drawn).
  retry: 'resample' draws each retry afresh; 'repair' holds every cell of the puzzle's latest sample
  outside `conflict_cells` fixed and re-noises only the conflicting ones (infilling)."""
  if retry not in RETRIES:
    raise ConfigError(f"--retry: {retry!r} not in {RETRIES}")
  texts = solve_puzzles(model, puzzles, batch_size=batch_size, hold_givens=hold_givens)
  latest = list(texts)
  chosen, drawn = [0] * len(puzzles), len(puzzles)
  grids = [sudoku.parse_grid(p) for p in puzzles]
  for c in range(1, candidates):
    open_rows = [i for i, t in enumerate(texts) if not sudoku.is_solution(prediction_grid(t), grids[i])]
    if not open_rows:
      break
    keep = None
    if retry == "repair":
      keep = [(latest[i], ~conflict_cells(prediction_grid(latest[i]), grids[i])) for i in open_rows]
    again = solve_puzzles(model, [puzzles[i] for i in open_rows], batch_size=batch_size,
                          indices=open_rows, candidate=c, keep=keep, hold_givens=hold_givens)
    drawn += len(open_rows)
    for i, text in zip(open_rows, again):
      latest[i] = text
      if sudoku.is_solution(prediction_grid(text), grids[i]):
        texts[i], chosen[i] = text, c
  return texts, chosen, drawn


def evaluate(checkpoint: str, puzzles_csv: str, *, overrides: dict[str, Any] | None = None,
             predictions_path: str | None = None, batch_size: int = 50, limit: int = 0, step: int = -1,
             candidates: int = 1, retry: str = "resample", hold_givens: bool | None = None,
             print_fn=print) -> dict:
  """Runs the benchmark; returns the metrics (also written next to the predictions).
  candidates > 1: generate and verify (`solve_with_candidates`), a diffusion run only.
  hold_givens: hold the givens in the canvas (None: as the run was trained, data.sudoku.infill_givens)."""
  config, settings = _configured_run(checkpoint, overrides)
  if candidates < 1:
    raise ConfigError(f"--candidates must be >= 1, got {candidates}")
  if retry not in RETRIES:
    raise ConfigError(f"--retry: {retry!r} not in {RETRIES}")
  if candidates > 1 and settings.objective.autoregressive:
    raise ConfigError("--candidates > 1 needs a diffusion run: the AR baseline decodes greedily, so every "
                      "candidate would be the same")
  if not settings.objective.autoregressive:
    settings.canvas_sampler  # pylint: disable=pointless-statement  (bad sampler settings fail before loading)
  rows = sudoku.read_csv(puzzles_csv)
  if limit > 0:
    rows = rows[:limit]
  model = _load_sudoku_run(checkpoint, config, settings, step)
  start = time.perf_counter()
  hold_givens = holds_givens(settings, hold_givens)
  predictions, chosen, drawn = solve_with_candidates(model, [p for p, _ in rows], candidates,
                                                     retry=retry, batch_size=batch_size, hold_givens=hold_givens)
  seconds = time.perf_counter() - start
  metrics, records = score([p for p, _ in rows], [s for _, s in rows], predictions)
  for record, c in zip(records, chosen):
    record["candidate"] = c
  sampler = settings.sample
  variant = "ar_greedy" if settings.objective.autoregressive else f"{sampler.sampler}_renoise_{sampler.renoise}"
  if hold_givens:
    variant += "_givens_held"
  if settings.sample.quant.scheme != "none":
    variant += f"_{settings.sample.quant.scheme}"
  if candidates > 1:
    variant += f"_{retry}_verified_of_{candidates}"
    metrics.update(candidates=candidates, samples_drawn=drawn,
                   solved_by_candidate=[sum(1 for r, c in zip(records, chosen) if r["solved"] and c == k)
                                        for k in range(candidates)])
  metrics.update(variant=variant, givens_held=bool(hold_givens),
                 checkpoint=str(checkpoint), step=int(model.step), puzzles=str(puzzles_csv),
                 seconds=round(seconds, 2), sample_overrides=dict(overrides or {}))
  out = Path(predictions_path or Path(checkpoint) / f"sudoku_predictions_{variant}.jsonl")
  files.write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in records))
  files.write_text_atomic(out.with_suffix(".metrics.json"), json.dumps(metrics, indent=2) + "\n")
  print_fn(f"{variant} (step {model.step}): solve rate {metrics['solve_rate']:.4f}, cell accuracy "
           f"{metrics['cell_accuracy']:.4f}, blank accuracy {metrics['blank_accuracy']:.4f} on {len(rows)} puzzles "
           f"({seconds:.1f}s); predictions -> {out}")
  print_fn("  solve rate by blanks: " + ", ".join(f"{band} {v['solve_rate']:.3f} ({v['puzzles']})"
                                                 for band, v in metrics["solve_rate_by_blanks"].items()))
  return metrics


def probe_holes(model: dgemma.Model, rows: Sequence[tuple[str, str]], holes: Sequence[int], *, seed: int = 0,
                batch_size: int = 50, hold_givens: bool | None = None) -> dict[int, float]:
  """What the model knows, apart from the sampler: for each k in `holes`, k random blank cells of each
  puzzle (0 or more than it has: all of them) are hidden and every other cell is held at the reference
  solution (the sampler's infilling); one decoder pass, argmax. Returns {k: accuracy on the hidden cells}.
  Cells are drawn from np.random.default_rng(seed), in puzzle order, k by k."""
  one_pass = model.with_overrides(**{"sample.max_denoising_steps": 1})
  rng = np.random.default_rng(seed)
  puzzles = [p for p, _ in rows]
  out = {}
  for k in holes:
    keep, hidden = [], []
    for puzzle, solution in rows:
      blanks = np.flatnonzero(sudoku.parse_grid(puzzle) == 0)
      cells = blanks if k <= 0 or k >= len(blanks) else rng.choice(blanks, size=k, replace=False)
      held = np.ones(sudoku.NUM_CELLS, bool)
      held[cells] = False
      keep.append((solution, held))
      hidden.append(cells)
    texts = solve_puzzles(one_pass, puzzles, batch_size=batch_size, keep=keep, hold_givens=hold_givens)
    hits = sum(int(texts[r][i] == rows[r][1][i]) for r, cells in enumerate(hidden) for i in cells)
    out[int(k)] = hits / max(sum(len(c) for c in hidden), 1)
  return out


def probe(checkpoint: str, puzzles_csv: str, holes: Sequence[int], *, overrides: dict[str, Any] | None = None,
          batch_size: int = 50, limit: int = 0, step: int = -1, hold_givens: bool | None = None,
          print_fn=print) -> dict:
  """`probe_holes` on a run and a CSV; writes <checkpoint>/sudoku_probe.json and returns it."""
  config, settings = _configured_run(checkpoint, overrides)
  if settings.objective.autoregressive:
    raise ConfigError("--probe: needs a diffusion run (holes are filled in one denoising pass)")
  rows = sudoku.read_csv(puzzles_csv)
  rows = rows[:limit] if limit > 0 else rows
  model = _load_sudoku_run(checkpoint, config, settings, step)
  accuracy = probe_holes(model, rows, holes, batch_size=batch_size, hold_givens=hold_givens)
  result = dict(checkpoint=str(checkpoint), step=int(model.step), puzzles=str(puzzles_csv), num_puzzles=len(rows),
                hidden_cell_accuracy={str(k): v for k, v in accuracy.items()})
  files.write_text_atomic(Path(checkpoint) / "sudoku_probe.json", json.dumps(result, indent=2) + "\n")
  print_fn(json.dumps(result))
  return result


def _load_sudoku_run(checkpoint: str, config, settings, step: int) -> dgemma.Model:
  if settings.data.source != "sudoku":
    raise ConfigError(f"--checkpoint: {checkpoint} was trained with data.source={settings.data.source!r}, not 'sudoku'")
  return dgemma.load(checkpoint, step=step, config=config, field=checkpoints.CHECKPOINT_FLAG)


def ablation_metrics(model: dgemma.Model) -> dict:
  """Metric 'sudoku' of the ablation runner (`python -m eval.ablate`, eval/ablate.py): the benchmark on
  the run's held-out validation puzzles (data.sudoku.validation_csv, or the generated validation split,
  a seed stream disjoint from training), decoded with the model's (the setting's) sample settings."""
  if model.settings.data.source != "sudoku":
    raise ConfigError(f"metric: 'sudoku' needs a run trained with data.source='sudoku', got "
                      f"{model.settings.data.source!r}")
  source = data_lib.prepare(model.settings).data_source("validation")
  rows = [(source[i]["puzzle"], source[i]["solution"]) for i in range(len(source))]
  start = time.perf_counter()
  predictions = solve_puzzles(model, [p for p, _ in rows])
  metrics, _ = score([p for p, _ in rows], [s for _, s in rows], predictions)
  metrics["seconds"] = round(time.perf_counter() - start, 2)
  return metrics


def _parse_set(values: Sequence[str]) -> dict[str, Any]:
  out = {}
  for item in values:
    if "=" not in item:
      raise ConfigError(f"--set: expected NAME=VALUE, got {item!r}")
    name, value = item.split("=", 1)
    try:
      out[name] = json.loads(value)
    except json.JSONDecodeError:
      out[name] = value
  return out


def main(argv: Sequence[str] | None = None) -> None:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="training workdir (config.json + checkpoints/)")
  parser.add_argument("--puzzles", required=True, help="puzzle,solution CSV")
  parser.add_argument("--predictions", default=None, help="output JSONL (default: in the workdir)")
  parser.add_argument("--renoise", default=None, help="sample.renoise: non_accepted (released) | none | low_confidence")
  parser.add_argument("--set", action="append", default=[], help="sample.NAME=VALUE (repeatable)")
  parser.add_argument("--batch_size", type=int, default=50)
  parser.add_argument("--limit", type=int, default=0, help="only the first N puzzles (0 = all)")
  parser.add_argument("--step", type=int, default=-1, help="checkpoint step (-1 = latest)")
  parser.add_argument("--candidates", type=int, default=1,
                      help="generate and verify: up to N samples per puzzle, keeping the first that passes the "
                           "rules check (diffusion runs; 1 = a single sample)")
  parser.add_argument("--retry", default="resample", choices=RETRIES,
                      help="--candidates > 1: 'resample' afresh, or 'repair' (keep the last sample's "
                           "non-conflicting cells, re-noise the conflicting ones)")
  parser.add_argument("--hold_givens", default="run", choices=("run", "yes", "no"),
                      help="hold each puzzle's givens in the canvas (the sampler's infilling): 'run' = as the run "
                           "was trained (data.sudoku.infill_givens)")
  parser.add_argument("--probe", default="",
                      help="diagnostic instead of solving: comma-separated hole counts k (0 = all blanks); k blank "
                           "cells hidden, the rest held at the reference solution, one decoder pass; prints the "
                           "argmax accuracy on the hidden cells and writes <checkpoint>/sudoku_probe.json")
  args = parser.parse_args(argv)
  overrides = _parse_set(args.set)
  hold_givens = None if args.hold_givens == "run" else args.hold_givens == "yes"
  if args.renoise is not None:
    overrides["renoise"] = args.renoise
  try:
    if args.probe:
      probe(args.checkpoint, args.puzzles, [int(k) for k in args.probe.split(",")], overrides=overrides,
            batch_size=args.batch_size, limit=args.limit, step=args.step, hold_givens=hold_givens)
      return
    evaluate(args.checkpoint, args.puzzles, overrides=overrides, predictions_path=args.predictions,
             batch_size=args.batch_size, limit=args.limit, step=args.step, candidates=args.candidates,
             retry=args.retry, hold_givens=hold_givens)
  except cli.USER_ERRORS + (ValueError,) as e:
    sys.exit(f"proj.sudoku.eval: {e}")


if __name__ == "__main__":
  main()
