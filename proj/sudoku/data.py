"""Sudoku: an exact solver, a generator of unique-solution puzzles, the CSV format, the validity
checker, and the training rows of `data.source = 'sudoku'`.

Grids are 81-character strings (or int arrays), row by row, '0' (0) for a blank. CSV files have the
header `puzzle,solution` and one puzzle per line (the common Kaggle / "1 million sudoku" format).

  python -m proj.sudoku.make_csv --out_dir=data/sudoku --num_train=2000 --num_test=500 \
      --min_blanks=30 --max_blanks=45 --seed=0       # writes train.csv and test.csv

Solver: bitmask backtracking (one 9-bit candidate mask per row, column and box) that always branches
on the empty cell with the fewest candidates, counting solutions up to a limit (2 proves uniqueness).
Generator (seeded numpy RNG, so deterministic): a random full grid (the solver on an empty grid with
a random digit order at every branch), then cells are blanked in random order, each kept blank only
if the puzzle still has exactly one solution, until the drawn number of blanks is reached (a grid
that cannot reach it is discarded).

Training rows (fixed, no packing): [BOS] + 81 puzzle digits | 81 solution digits, byte tokens
(digit d -> id ord(d) + 4), segment ids all 1, positions 0..162. The first 82 tokens are the clean
context (the prompt) and the last 81 the canvas (diffusion.canvas_len = 81). With
`data.sudoku.augment`, each training row is first mapped by a random validity-preserving symmetry
(digit relabelling, band / stack permutations, row / column permutations inside them, transpose),
drawn from (seed, position in the stream): the same puzzle is seen in many forms, deterministically.
With `data.sudoku.infill_givens`, rows also carry `infill_mask` (1 on the canvas cells whose digit the
puzzle gives): the diffusion loss keeps those cells clean at every noise level and does not score them
(dgemma/diffusion/loss.py), and proj.sudoku.eval holds them with the sampler's infilling, so the model only ever
denoises the blanks, reading the givens from the canvas itself as well as from the prompt.

Importing this module registers the source and its settings group `data.sudoku` (`SudokuSettings`): a config
that uses them names it in `imports` (proj/sudoku/configs/sudoku.py).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import grain
import numpy as np

from dgemma import files, settings_fields, tokenizers
from dgemma.data import pipeline, sources
from dgemma.errors import ConfigError, DataError
from dgemma.settings import DataSettings
from dgemma.settings_fields import setting


@dataclasses.dataclass(frozen=True)
class SudokuSettings:
  """`config.data.sudoku`: the Sudoku source's rows [BOS, 81 puzzle | 81 solution digits]."""
  GROUP: ClassVar[str] = "data.sudoku"
  train_csv: str = setting("", "puzzle,solution CSV (python -m proj.sudoku.make_csv); '' = generate")
  num_train: int = setting(2000, "puzzles generated (unique solutions) when train_csv is empty", lo=0)
  validation_csv: str = setting("", "the same for the validation split; '' = generate")
  num_validation: int = setting(200, "... and when validation_csv is empty; cached under data.cache_dir/sudoku",
                                lo=0)
  min_blanks: int = setting(30, "blanks per generated puzzle ~ U{min_blanks..max_blanks}", lo=0, hi=64)
  max_blanks: int = setting(45, "the most blanks of a generated puzzle", lo=0, hi=64)
  augment: bool = setting(True, "train rows: a random validity-preserving symmetry per row (seeded)")
  infill_givens: bool = setting(False, "the givens' canvas cells stay clean in training (unscored) and are held "
                                "by the sampler's infilling in eval (diffusion runs only)")

  def __post_init__(self):
    settings_fields.check(self)
    settings_fields.need(self.min_blanks <= self.max_blanks, "data.sudoku.min_blanks",
                         f"need min_blanks <= max_blanks, got {self.min_blanks}..{self.max_blanks}")

NUM_CELLS = 81
ROW_LEN = 1 + 2 * NUM_CELLS   # BOS + puzzle + solution
CONTEXT_LEN = 1 + NUM_CELLS   # BOS + puzzle: the prompt
CSV_HEADER = ("puzzle", "solution")
SPLITS = ("train", "validation")

_ALL_DIGITS = 0x3FE  # bits 1..9
_ROW = tuple(i // 9 for i in range(NUM_CELLS))
_COL = tuple(i % 9 for i in range(NUM_CELLS))
_BOX = tuple((i // 27) * 3 + (i % 9) // 3 for i in range(NUM_CELLS))
_POPCOUNT = tuple(bin(m).count("1") for m in range(1024))


# ---- grids and the validity checker --------------------------------------------------------------

def parse_grid(text: str, *, allow_blanks: bool = True, where: str = "grid") -> np.ndarray:
  """81 digits ('0' = blank unless allow_blanks=False) -> int8[81]; errors name `where`."""
  text = text.strip()
  if len(text) != NUM_CELLS:
    raise DataError(f"{where}: expected {NUM_CELLS} digits, got {len(text)} characters")
  bad = [c for c in text if not ("0" <= c <= "9")]
  if bad:
    raise DataError(f"{where}: non-digit character {bad[0]!r} (only 0-9 are allowed, 0 = blank)")
  grid = _digits(text)
  if not allow_blanks and (grid == 0).any():
    raise DataError(f"{where}: a solution has no blanks, but cell {int(np.argmax(grid == 0))} is 0")
  return grid


def prediction_grid(text: str) -> np.ndarray:
  """A decoded prediction -> int8[81]; cells that are not a digit 1-9 (or are missing) become 0."""
  cells = np.zeros(NUM_CELLS, np.int8)
  for i, ch in enumerate(text[:NUM_CELLS]):
    if "1" <= ch <= "9":
      cells[i] = ord(ch) - ord("0")
  return cells


def format_grid(grid: Sequence[int]) -> str:
  return "".join(str(int(d)) for d in grid)


def is_solution(candidate: Sequence[int], puzzle: Sequence[int]) -> bool:
  """Every row, column and 3x3 box holds 1..9 once, and every given of `puzzle` is kept."""
  grid = np.asarray(candidate, np.int64).reshape(9, 9)
  puzzle = np.asarray(puzzle, np.int64).reshape(9, 9)
  if grid.shape != (9, 9) or ((grid < 1) | (grid > 9)).any():
    return False
  if ((puzzle != 0) & (grid != puzzle)).any():
    return False
  digits = set(range(1, 10))
  boxes = grid.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
  return all(set(unit.tolist()) == digits for group in (grid, grid.T, boxes) for unit in group)


def is_consistent(puzzle: Sequence[int]) -> bool:
  """No digit repeated in a row, column or box among the givens (a necessary condition to solve)."""
  rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
  for i, d in enumerate(np.asarray(puzzle).tolist()):
    if d:
      bit = 1 << d
      if (rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]]) & bit:
        return False
      rows[_ROW[i]] |= bit
      cols[_COL[i]] |= bit
      boxes[_BOX[i]] |= bit
  return True


# ---- the solver ----------------------------------------------------------------------------------

class _Search:
  """Bitmask backtracking over one grid (mutable list of 81 ints, 0 = empty)."""

  def __init__(self, grid: Sequence[int], rng: np.random.Generator | None = None):
    self.cells = [int(d) for d in grid]
    self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
    self.rng = rng
    self.first: list[int] | None = None
    for i, d in enumerate(self.cells):
      if d:
        self._set(i, d)

  def _set(self, i: int, d: int) -> None:
    bit = 1 << d
    self.cells[i] = d
    self.rows[_ROW[i]] |= bit
    self.cols[_COL[i]] |= bit
    self.boxes[_BOX[i]] |= bit

  def _unset(self, i: int, d: int) -> None:
    bit = ~(1 << d)
    self.cells[i] = 0
    self.rows[_ROW[i]] &= bit
    self.cols[_COL[i]] &= bit
    self.boxes[_BOX[i]] &= bit

  def count(self, limit: int) -> int:
    """Solutions below this node, stopping at `limit`; the first one found is kept in `first`."""
    cells, rows, cols, boxes = self.cells, self.rows, self.cols, self.boxes
    best, best_mask, best_n = -1, 0, 10
    for i in range(NUM_CELLS):
      if cells[i] == 0:
        mask = _ALL_DIGITS & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
        n = _POPCOUNT[mask]
        if n < best_n:
          best, best_mask, best_n = i, mask, n
          if n <= 1:
            break
    if best < 0:
      if self.first is None:
        self.first = list(cells)
      return 1
    digits = [d for d in range(1, 10) if best_mask >> d & 1]
    if self.rng is not None and len(digits) > 1:
      digits = [digits[k] for k in self.rng.permutation(len(digits))]
    found = 0
    for d in digits:
      self._set(best, d)
      found += self.count(limit - found)
      self._unset(best, d)
      if found >= limit:
        break
    return found


def count_solutions(puzzle: Sequence[int], limit: int = 2) -> int:
  """Number of solutions of `puzzle`, counted up to `limit` (0 for inconsistent givens)."""
  if not is_consistent(puzzle):
    return 0
  return _Search(puzzle).count(limit)


def solve(puzzle: Sequence[int]) -> np.ndarray | None:
  """A solution (the first the search finds) as int8[81], or None."""
  if not is_consistent(puzzle):
    return None
  search = _Search(puzzle)
  search.count(1)
  return None if search.first is None else np.asarray(search.first, np.int8)


# ---- the generator -------------------------------------------------------------------------------

def random_full_grid(rng: np.random.Generator) -> np.ndarray:
  """A uniformly-seeded random solved grid: the solver on an empty grid, random digit order."""
  search = _Search([0] * NUM_CELLS, rng=rng)
  search.count(1)
  return np.asarray(search.first, np.int8)


def make_puzzle(rng: np.random.Generator, num_blanks: int, max_tries: int = 50) -> tuple[np.ndarray, np.ndarray]:
  """(puzzle, solution) with exactly `num_blanks` blanks and a unique solution."""
  if not 0 <= num_blanks <= 64:
    raise ValueError(f"num_blanks: {num_blanks} not in [0, 64] (no unique puzzle has fewer than 17 givens)")
  for _ in range(max_tries):
    solution = random_full_grid(rng)
    puzzle = solution.copy()
    blanks = 0
    for i in rng.permutation(NUM_CELLS):
      if blanks == num_blanks:
        break
      digit = puzzle[i]
      puzzle[i] = 0
      if count_solutions(puzzle, limit=2) == 1:
        blanks += 1
      else:
        puzzle[i] = digit
    if blanks == num_blanks:
      return puzzle, solution
  raise RuntimeError(f"could not blank {num_blanks} cells with a unique solution in {max_tries} grids")


def generate(num: int, min_blanks: int, max_blanks: int, seed: int) -> list[tuple[str, str]]:
  """`num` (puzzle, solution) string pairs, blanks ~ U{min_blanks..max_blanks}; same seed, same list."""
  if not 0 <= min_blanks <= max_blanks:
    raise ValueError(f"blanks range: need 0 <= min_blanks <= max_blanks, got {min_blanks}..{max_blanks}")
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(num):
    puzzle, solution = make_puzzle(rng, int(rng.integers(min_blanks, max_blanks + 1)))
    rows.append((format_grid(puzzle), format_grid(solution)))
  return rows


def random_symmetry(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """(cell permutation int[81], digit map int[10] with 0 -> 0) of a random Sudoku symmetry:
  new_grid = digit_map[grid[perm]]. Preserves validity and the number of solutions."""
  def line_order():  # permute the 3 bands, and the 3 lines inside each band
    bands = rng.permutation(3)
    return np.concatenate([3 * b + rng.permutation(3) for b in bands])
  rows, cols = line_order(), line_order()
  perm_99 = rows[:, None] * 9 + cols[None, :]
  if rng.integers(2):
    perm_99 = perm_99.T
  digit_map = np.concatenate([[0], 1 + rng.permutation(9)])
  return perm_99.reshape(-1), digit_map


def apply_symmetry(grid: np.ndarray, perm: np.ndarray, digit_map: np.ndarray) -> np.ndarray:
  return digit_map[np.asarray(grid)[perm]].astype(np.int8)


# ---- CSV ------------------------------------------------------------------------------------------

def read_csv(path: str | os.PathLike, *, check_solutions: bool = True) -> list[tuple[str, str]]:
  """(puzzle, solution) pairs of a `puzzle,solution` CSV; errors name the file and line.

  check_solutions: each solution must solve its puzzle (rows, columns, boxes, givens).
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: Sudoku CSV file not found")
  rows = []
  with open(path, newline="") as f:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
      raise DataError(f"{path}:1: expected the header 'puzzle,solution', got {header!r}")
    for line_no, fields in enumerate(reader, start=2):
      if not fields:
        continue
      where = f"{path}:{line_no}"
      if len(fields) != 2:
        raise DataError(f"{where}: expected 2 fields (puzzle,solution), got {len(fields)}")
      puzzle = parse_grid(fields[0], where=f"{where}: puzzle")
      solution = parse_grid(fields[1], allow_blanks=False, where=f"{where}: solution")
      if check_solutions and not is_solution(solution, puzzle):
        raise DataError(f"{where}: the solution does not solve the puzzle (a row, column or box repeats a "
                         "digit, or a given is changed)")
      rows.append((format_grid(puzzle), format_grid(solution)))
  if not rows:
    raise DataError(f"{path}: no puzzles (only a header)")
  return rows


def csv_text(rows: Iterable[tuple[str, str]]) -> str:
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(CSV_HEADER)
  writer.writerows(rows)
  return out.getvalue()


def write_csv(path: str | os.PathLike, rows: Iterable[tuple[str, str]]) -> None:
  files.write_text_atomic(path, csv_text(rows))


# ---- data.source = 'sudoku' ----------------------------------------------------------------------

def validate(settings) -> None:
  """The sudoku source's checks (its record in dgemma.data.sources); errors name the field."""
  data, s = settings.data, settings.data.sudoku

  def need(cond: bool, field: str, msg: str):
    if not cond:
      raise ConfigError(f"{field}: {msg}")

  need(data.tokenizer.kind == "byte", "data.tokenizer.kind",
       f"data.source='sudoku' needs the byte tokenizer (digits are single bytes), got {data.tokenizer.kind!r}")
  need(data.seq_len == ROW_LEN, "data.seq_len",
       f"data.source='sudoku' rows are BOS + 81 puzzle + 81 solution digits = {ROW_LEN} tokens, got {data.seq_len}")
  need(settings.diffusion.canvas_len == NUM_CELLS, "diffusion.canvas_len",
       f"data.source='sudoku' denoises the 81-digit solution as one canvas, got {settings.diffusion.canvas_len}")
  need(not (s.infill_givens and settings.objective.autoregressive), "data.sudoku.infill_givens",
       "holds canvas cells of a diffusion run; the autoregressive baseline (diffusion.objective='ar') has no "
       "canvas: set it False")
  for csv_field, num_field in (("train_csv", "num_train"), ("validation_csv", "num_validation")):
    path = str(getattr(s, csv_field))
    if path:
      need(os.path.isfile(path), f"data.sudoku.{csv_field}", f"{path!r} does not exist")
    else:
      need(int(getattr(s, num_field)) > 0, f"data.sudoku.{num_field}",
           f"must be positive when data.sudoku.{csv_field} is empty (puzzles are generated), got "
           f"{getattr(s, num_field)}")


def givens_mask(puzzle: str) -> np.ndarray:
  """bool[81]: the cells the puzzle gives (not '0')."""
  return np.asarray([c != "0" for c in puzzle], bool)


def _split_rows(settings, split: str) -> tuple[list[tuple[str, str]], str]:
  """The split's (puzzle, solution) rows and a string naming them (for the dataset id)."""
  s = settings.data.sudoku
  csv_field, num_field, stream = (("train_csv", "num_train", 0) if split == "train"
                                  else ("validation_csv", "num_validation", 1))
  path = str(getattr(s, csv_field))
  if path:
    rows = read_csv(path)
    stat = os.stat(path)
    return rows, f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
  num, seed = int(getattr(s, num_field)), int(settings.seed)
  key = f"gen:{num}:{s.min_blanks}:{s.max_blanks}:{seed}:{stream}"
  cache = Path(settings.data.cache_dir) / "sudoku" / (
      f"{split}_{hashlib.sha256(key.encode()).hexdigest()[:12]}.csv")
  if cache.is_file():
    return read_csv(cache), key
  # Disjoint streams for train / validation: SeedSequence((seed, stream)).
  rows = generate(num, int(s.min_blanks), int(s.max_blanks), seed=int(
      np.random.SeedSequence((seed, stream)).generate_state(1)[0]))
  write_csv(cache, rows)
  return rows, key


def prepare(settings) -> pipeline.PreparedData:
  """PreparedData of the sudoku rows (examples {'puzzle', 'solution'}, byte tokenizer)."""
  splits = {split: _split_rows(settings, split) for split in SPLITS}
  names = json.dumps([splits[split][1] for split in SPLITS])
  dataset_id = "sudoku_" + hashlib.sha256(names.encode()).hexdigest()[:12]
  examples = {split: [{"puzzle": p, "solution": q} for p, q in rows] for split, (rows, _) in splits.items()}
  return pipeline.PreparedData(tokenizer=tokenizers.ByteTokenizer(), dataset_id=dataset_id, text_key="puzzle",
                               splits=SPLITS, _open_split=examples.__getitem__)


def prompt_tokens(puzzle: str, tokenizer) -> np.ndarray:
  """[BOS] + the puzzle's 81 digit tokens: int32[82]."""
  return np.asarray([tokenizer.bos_id] + tokenizer.encode(puzzle), np.int32)


def row_tokens(puzzle: str, solution: str, tokenizer) -> np.ndarray:
  """The training row [BOS] + puzzle | solution: int32[163]."""
  return np.concatenate([prompt_tokens(puzzle, tokenizer), np.asarray(tokenizer.encode(solution), np.int32)])


class _MakeRow:
  """(stream index, {'puzzle', 'solution'}) -> {'tokens', 'segment_ids', 'positions'} int32[163]
  (+ 'infill_mask' with infill_givens: 1 on the canvas cells the puzzle gives).

  Works on digit arrays: the symmetry permutes cells and relabels digits, then a 10-entry table maps
  digits to their tokens (the same tokens as row_tokens on the augmented strings, without the string
  round trip: about half the row's host time, which bounds the steps per second on an accelerator)."""

  def __init__(self, tokenizer, augment: bool, seed: int, infill: bool = False):
    self._bos_id = tokenizer.bos_id
    self._digit_ids = np.asarray(tokenizer.encode("0123456789"), np.int32)
    if self._digit_ids.shape != (10,):
      raise DataError(f"sudoku rows need one token per digit; the tokenizer gives {self._digit_ids.size} for 0-9")
    self._augment = augment
    self._seed = seed
    self._infill = infill

  def __call__(self, index: int, example: dict[str, Any]) -> dict[str, np.ndarray]:
    puzzle, solution = _digits(example["puzzle"]), _digits(example["solution"])
    if self._augment:
      perm, digit_map = random_symmetry(np.random.default_rng((self._seed, int(index))))
      puzzle, solution = apply_symmetry(puzzle, perm, digit_map), apply_symmetry(solution, perm, digit_map)
    tokens = np.concatenate([[self._bos_id], self._digit_ids[puzzle], self._digit_ids[solution]]).astype(np.int32)
    row = {"tokens": tokens, "segment_ids": np.ones((ROW_LEN,), np.int32),
           "positions": np.arange(ROW_LEN, dtype=np.int32)}
    if self._infill:
      row["infill_mask"] = np.concatenate([np.zeros(CONTEXT_LEN, np.int32), (puzzle != 0).astype(np.int32)])
    return row


def _digits(grid: str) -> np.ndarray:
  """An 81-digit string already checked (parse_grid, read_csv) or written by generate -> int8[81]."""
  return np.frombuffer(grid.encode("ascii"), np.uint8).astype(np.int8) - ord("0")


def make_iterator(settings, prepared, split: str, *, shard_index: int, shard_count: int, seed: int,
                  shuffle: bool, num_epochs: int) -> pipeline.DataIterator:
  """Batches of fixed rows (data.source='sudoku'; the state protocol of every source's iterator)."""
  source = prepared.data_source(split)
  if len(source) == 0:
    raise DataError(f"split {split!r} of {prepared.dataset_id} has no puzzles")
  sharding = "rows" if len(source) < shard_count else "documents"
  dataset = grain.MapDataset.source(source)
  if shard_count > 1:
    # Fewer puzzles than shards: every shard reads them all (rows repeat across shards).
    dataset = dataset[shard_index::shard_count] if sharding == "documents" else dataset
  if shuffle:
    dataset = dataset.shuffle(seed % 2**32)
  dataset = dataset.repeat(None if num_epochs == 0 else num_epochs)
  augment = settings.data.sudoku.augment and split == "train"
  rows = dataset.map_with_index(_MakeRow(prepared.tokenizer, augment, seed * max(shard_count, 1) + shard_index,
                                         infill=settings.data.sudoku.infill_givens))
  batch_size = settings.data.batch_size // shard_count
  # Rows are made on the calling thread: grain's reader threads cost more in polling and the GIL than a row
  # costs (a batch of 256 rows in 0.16 s with them, 0.04 s without, on a busy 2-core host). The train loop
  # makes the next batch while the device runs the step.
  batches = rows.to_iter_dataset(grain.ReadOptions(num_threads=0)).batch(batch_size, drop_remainder=False)
  batches = batches.map(pipeline.FillBatch(batch_size, prepared.tokenizer.pad_id))
  identity = dict(dataset_id=prepared.dataset_id, split=split, shard_index=shard_index, shard_count=shard_count,
                  sharding=sharding, seed=seed, shuffle=shuffle, seq_len=ROW_LEN, batch_size=batch_size)
  return pipeline.DataIterator(batches, identity)


SOURCE = sources.register(sources.DataSource("sudoku", validate, prepare, make_iterator))
settings_fields.register_group(DataSettings, "sudoku", SudokuSettings, module=__name__)
