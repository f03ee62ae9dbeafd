"""The Countdown reward (`rl.reward = 'countdown'`, dgemma/rl/reward.py): 1 when the completion is an expression that
uses each of the prompt's numbers exactly once and equals its target exactly (proj/countdown/data.py `check`), else 0.
"""

from __future__ import annotations

from dgemma.rl import reward as reward_lib
from proj.countdown import data


def solved(prompt: str, completion: str, reference: str = "") -> float:
  del reference
  problem = data.parse_prompt(prompt)
  return float(problem is not None and data.check(completion, *problem))


reward_lib.register(reward_lib.Reward("countdown", reward_lib.per_sample(solved),
                                      "1 when the expression reaches the target with each number once"))
