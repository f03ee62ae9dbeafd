"""The Sudoku rewards (proj/sudoku/reward.py), from the puzzle alone."""

from __future__ import annotations

import numpy as np

from proj.sudoku import data, reward

PUZZLE, SOLUTION = data.generate(1, 30, 30, seed=5)[0]


def test_solved_reads_the_puzzle_from_the_prompt():
  prompt = PUZZLE  # what the RL step decodes: the prompt's text without BOS
  assert reward.solved(prompt, SOLUTION) == 1.0
  assert reward.partial(prompt, SOLUTION) == 1.0
  # another valid grid that breaks a given is not a solution (relabel two digits everywhere)
  swapped = SOLUTION.translate(str.maketrans("12", "21"))
  assert data.is_solution(data.prediction_grid(swapped), np.zeros(81, np.int8))
  assert reward.solved(prompt, swapped) == 0.0


def test_partial_credit_counts_units_and_givens():
  grid = data.prediction_grid(SOLUTION).copy()
  # one blank cell: its row, column and box fail; every given is kept when the blank is not a given
  blank = int(np.flatnonzero(np.asarray(list(PUZZLE)) == "0")[0])
  grid[blank] = 0
  text = data.format_grid(grid)
  assert reward.solved(PUZZLE, text) == 0.0
  np.testing.assert_allclose(reward.partial(PUZZLE, text), 0.5 * 24 / 27 * 1.0)
  # a given changed to a blank: givens kept 50/51 ... of the puzzle's givens
  given = int(np.flatnonzero(np.asarray(list(PUZZLE)) != "0")[0])
  grid[given] = 0
  text = data.format_grid(grid)
  givens = sum(ch != "0" for ch in PUZZLE)
  units_ok = sum(int(sorted(data.prediction_grid(text)[u]) == list(range(1, 10))) for u in reward._UNITS)
  np.testing.assert_allclose(reward.partial(PUZZLE, text), 0.5 * units_ok / 27 * (givens - 1) / givens)
  assert reward.partial(PUZZLE, "garbage") == 0.0
