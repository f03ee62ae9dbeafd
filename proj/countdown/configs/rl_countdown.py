"""GRPO on Countdown (dgemma/rl) from the supervised warm start (proj/countdown/configs/countdown.py, the argument
after ':' is its workdir): reward 1 for an expression that reaches the target with each number once.

  python train.py --config=proj/countdown/configs/rl_countdown.py:workdirs/countdown --workdir=workdirs/countdown_rl \
      --config.data.files="('data/countdown/train.jsonl',)"
  python -m proj.countdown.eval --checkpoint=workdirs/countdown_rl --data=data/countdown/test.jsonl
"""

from proj.countdown.configs import countdown
from proj.sudoku.configs import rl_sudoku


def get_config(base: str = ""):
  return rl_sudoku.grpo(countdown.get_config("data/countdown/train.jsonl"), init_from=base, reward="countdown",
                        reward_module="proj.countdown.reward")
