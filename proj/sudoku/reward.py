"""Sudoku rewards for reinforcement learning (`rl.reward`, dgemma/rl/reward.py), from the puzzle alone (never the
reference solution): the prompt is the puzzle's 81 digits (0 = blank), the completion the model's 81 cells.

  sudoku          1 when the completion is a valid grid that keeps every given (`data.is_solution`), else 0
  sudoku_partial  1 when solved; else half the share of the 27 units (rows, columns, boxes) holding 1..9 once
                  each, times the share of the givens kept: a denser signal for a policy that rarely solves
"""

from __future__ import annotations

import numpy as np

from dgemma.rl import reward as reward_lib
from proj.sudoku import data

_UNITS = ([np.arange(9) + 9 * r for r in range(9)] + [np.arange(0, 81, 9) + c for c in range(9)]
          + [np.asarray([9 * (3 * br + i) + 3 * bc + j for i in range(3) for j in range(3)])
             for br in range(3) for bc in range(3)])


def puzzle_cells(prompt: str) -> np.ndarray:
  """The puzzle of a prompt's text (its last 81 characters: the prompt is [BOS] + the puzzle's digits)."""
  text = prompt[-data.NUM_CELLS:]
  return np.asarray([ord(ch) - ord("0") if "0" <= ch <= "9" else 0 for ch in text.rjust(data.NUM_CELLS, "0")],
                    np.int8)


def solved(prompt: str, completion: str, reference: str = "") -> float:
  del reference
  return float(data.is_solution(data.prediction_grid(completion), puzzle_cells(prompt)))


def partial(prompt: str, completion: str, reference: str = "") -> float:
  del reference
  grid, puzzle = data.prediction_grid(completion), puzzle_cells(prompt)
  if data.is_solution(grid, puzzle):
    return 1.0
  units_ok = sum(int(np.array_equal(np.sort(grid[u]), np.arange(1, 10))) for u in _UNITS)
  givens = puzzle != 0
  kept = float(np.mean(grid[givens] == puzzle[givens])) if givens.any() else 1.0
  return 0.5 * units_ok / len(_UNITS) * kept


reward_lib.register(reward_lib.Reward("sudoku", reward_lib.per_sample(solved), "1 when the puzzle is solved"))
reward_lib.register(reward_lib.Reward("sudoku_partial", reward_lib.per_sample(partial),
                                      "1 when solved, else 0.5 x (units holding 1..9) / 27 x (givens kept)"))
