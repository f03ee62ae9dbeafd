"""GRPO on top of a study's supervised config (dgemma/rl, docs/rl.md): what proj/sudoku/configs/rl_sudoku.py and
proj/countdown/configs/rl_countdown.py share.

  config = rl.grpo(sudoku.get_config(), init_from="workdirs/sudoku", reward="sudoku")
"""


def grpo(config, *, init_from: str, reward: str):
  """`config` trained on rewards of its own samples from the run `init_from`: groups of 8 samples for each of 8
  prompts a step, 4 of the denoising steps scored per update, KL 0.04 to the start, lr 1e-4 (cosine-decayed after 10
  warmup steps, no weight decay), 400 updates, a checkpoint every 50."""
  config.train.init_from = init_from
  config.rl.algorithm = "grpo"
  config.rl.reward = reward
  config.rl.group_size = 8
  config.rl.steps_per_update = 4
  config.rl.kl_weight = 0.04
  config.data.batch_size = 8
  config.opt.lr = 1e-4
  config.opt.warmup_steps = 10
  config.opt.weight_decay = 0.0
  config.train.num_steps = 400
  config.train.log_every = 5
  config.train.eval_every = 100
  config.train.ckpt_every = 50
  config.train.keep_checkpoints = 20
  return config
