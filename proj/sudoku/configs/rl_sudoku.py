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
through, weighted 4x (rl.steps_per_update); KL to the supervised run. The whole model trains (1.3M parameters),
at a learning rate 20x below the supervised peak. Results: docs/experiments/rl.md.
"""

from configs import rl
from proj.sudoku.configs import sudoku


def get_config(base: str = ""):
  return rl.grpo(sudoku.get_config(), init_from=base, reward="sudoku")
