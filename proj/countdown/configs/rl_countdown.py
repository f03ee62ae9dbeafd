"""GRPO on Countdown (dgemma/rl) from the supervised warm start (proj/countdown/configs/countdown.py, the argument
after ':' is its workdir): reward 1 for an expression that reaches the target with each number once.

  python train.py --config=proj/countdown/configs/rl_countdown.py:workdirs/countdown --workdir=workdirs/countdown_rl \
      --config.data.files="('data/countdown/train.jsonl',)"
  python -m proj.countdown.eval --checkpoint=workdirs/countdown_rl --data=data/countdown/test.jsonl
"""

from proj.countdown.configs import countdown


def get_config(base: str = ""):
  config = countdown.get_config("data/countdown/train.jsonl")
  config.train.init_from = base
  config.rl.algorithm = "grpo"
  config.rl.reward = "countdown"
  config.rl.group_size = 8
  config.rl.steps_per_update = 4
  config.data.batch_size = 8        # problems per step: 64 samples
  config.opt.lr = 1e-4
  config.opt.warmup_steps = 10
  config.opt.weight_decay = 0.0
  config.train.num_steps = 400
  config.train.log_every = 5
  config.train.eval_every = 100
  config.train.ckpt_every = 50
  return config
