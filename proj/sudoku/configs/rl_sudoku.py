"""GRPO on Sudoku (dgemma/rl): a supervised Sudoku run (proj/sudoku/configs/sudoku.py, the argument after ':') is
trained on rewards of its own one-sample answers to the training puzzles, drawn with the same released sampler the
benchmark uses (16 steps, entropy bound, re-noising).

  python train.py --config=proj/sudoku/configs/rl_sudoku.py:workdirs/sudoku --workdir=workdirs/sudoku_rl \
      --config.data.sudoku.train_csv=data/sudoku/train.csv
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku_rl --puzzles=data/sudoku/test.csv
  # the ELBO log-likelihood instead of the exact trajectory one, partial credit, other group sizes:
  python train.py ... --config.rl.log_likelihood=elbo --config.rl.reward=sudoku_partial --config.rl.group_size=16

Each step: data.batch_size = 8 puzzles x rl.group_size = 8 samples; advantages within each puzzle's group (a
puzzle the policy always or never solves teaches nothing); one update on 4 of the 16 denoising steps a sample went
through, weighted 4x (rl.steps_per_update); KL to the supervised run (`grpo` below, which
proj/countdown/configs/rl_countdown.py shares). The whole model trains (1.3M parameters),
at a learning rate 20x below the supervised peak. Results: docs/experiments/rl.md.
"""

from proj.sudoku.configs import sudoku


def get_config(base: str = ""):
  return grpo(sudoku.get_config(), init_from=base, reward="sudoku", reward_module="proj.sudoku.reward")


def grpo(config, *, init_from: str, reward: str, reward_module: str):
  """`config` trained on rewards of its own samples from the run `init_from`: groups of 8 samples for each of 8
  prompts a step, 4 of the denoising steps scored per update, KL 0.04 to the start, lr 1e-4 (cosine-decayed after 10
  warmup steps, no weight decay), 400 updates, a checkpoint every 50. `reward_module` registers `reward`."""
  config.imports = tuple(config.imports) + (reward_module,)
  config.rl.update(dict(algorithm="grpo", reward=reward, group_size=8, steps_per_update=4, kl_weight=0.04))
  config.data.batch_size = 8
  config.opt.update(dict(lr=1e-4, warmup_steps=10, weight_decay=0.0))
  config.train.update(dict(init_from=init_from, num_steps=400, log_every=5, eval_every=100, ckpt_every=50,
                           keep_checkpoints=20))
  return config
