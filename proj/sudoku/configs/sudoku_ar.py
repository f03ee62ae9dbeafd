"""Autoregressive baseline for the Sudoku benchmark: proj/sudoku/configs/sudoku.py's model, rows and budget, trained with
causal next-token CE over the whole row (diffusion.objective='ar') and decoded greedily, digit by digit.

  python train.py --config=proj/sudoku/configs/sudoku_ar.py --workdir=workdirs/sudoku_ar \
      --config.data.sudoku.train_csv=data/sudoku/train.csv
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku_ar --puzzles=data/sudoku/test.csv   # dgemma.sampling.ar_generate
  # override anything, e.g. a shorter run:
  python train.py --config=proj/sudoku/configs/sudoku_ar.py --workdir=workdirs/sudoku_ar --config.train.num_steps=1000

The row loss covers the puzzle digits too (they are part of the row); eval reads only the 81 digits
generated after [BOS] + puzzle. model.self_conditioning is already off in proj/sudoku/configs/sudoku.py; its two
decoder-only layers (model.decoder_head_layers) never run in an AR model, so they are dropped here: the AR model
is the diffusion model's shared stack, the same 4 layers (the baseline of docs/experiments/sudoku.md was trained so).
"""

from proj.sudoku.configs import sudoku


def get_config():
  config = sudoku.get_config()
  config.diffusion.objective = "ar"
  config.model.decoder_head_layers = 0  # decoder-only: an AR model never runs them
  return config
