"""Writes Sudoku puzzles with unique solutions as puzzle,solution CSVs (train.csv, test.csv).

  python -m proj.sudoku.make_csv --out_dir=data/sudoku --num_train=2000 --num_test=500 \\
      --min_blanks=30 --max_blanks=45 --seed=0

Train and test come from independent seed streams ((seed, 0) and (seed, 2); the training pipeline's
generated validation split uses (seed, 1)), and test puzzles whose solution is in train are dropped.
"""

import time
from pathlib import Path

import numpy as np
from absl import flags

from proj.sudoku import data as sudoku
from dgemma.tools import cli

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory for train.csv and test.csv.", required=True)
_NUM_TEST = flags.DEFINE_integer("num_test", 500, "Test puzzles.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
# the same counts and blanks the Sudoku source generates with (data.sudoku.*; --num_train=0: no train.csv)
_GENERATE = cli.define_setting_flags(sudoku.SudokuSettings, "num_train", "min_blanks", "max_blanks")


def write_splits(out_dir: str, num_train: int, num_test: int, min_blanks: int, max_blanks: int,
                 seed: int) -> tuple[int, int]:
  """Writes out_dir/train.csv (when num_train > 0) and out_dir/test.csv; returns their sizes."""
  state = lambda stream: int(np.random.SeedSequence((seed, stream)).generate_state(1)[0])
  train = sudoku.generate(num_train, min_blanks, max_blanks, state(0)) if num_train else []
  seen = {solution for _, solution in train}
  test = [row for row in sudoku.generate(num_test, min_blanks, max_blanks, state(2)) if row[1] not in seen]
  out = Path(out_dir)
  if train:
    sudoku.write_csv(out / "train.csv", train)
  sudoku.write_csv(out / "test.csv", test)
  return len(train), len(test)


def main(argv):
  cli.no_extra_args(argv)
  start = time.perf_counter()
  low, high = _GENERATE["min_blanks"].value, _GENERATE["max_blanks"].value
  n_train, n_test = write_splits(_OUT_DIR.value, _GENERATE["num_train"].value, _NUM_TEST.value, low, high, _SEED.value)
  print(f"wrote {n_train} train and {n_test} test puzzles ({low}-{high} blanks) "
        f"to {_OUT_DIR.value} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
  cli.run(main, "proj.sudoku.make_csv", user_errors=(ValueError,))
