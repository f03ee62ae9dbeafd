"""Sudoku on one GPU in at most ten minutes: proj/sudoku/configs/sudoku.py's recipe, wider and with 8x the batch.

  python -m proj.sudoku.make_csv --out_dir=data/sudoku --num_train=20000 --num_test=500 --min_blanks=30 --max_blanks=45
  python train.py --config=proj/sudoku/configs/sudoku_gpu.py --workdir=workdirs/sudoku_gpu \
      --config.data.sudoku.train_csv=data/sudoku/train.csv
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku_gpu --puzzles=data/sudoku/test.csv --batch_size=500
  # the CPU recipe's width at this batch, for comparison:
  python train.py --config=proj/sudoku/configs/sudoku_gpu.py --workdir=workdirs/sudoku_gpu_narrow \
      --config.data.sudoku.train_csv=data/sudoku/train.csv --config.model.d_model=128 --config.model.num_heads=4 \
      --config.model.num_kv_heads=2 --config.model.mlp_hidden=512 --config.opt.lr=2e-3

The step count is what fits the time on the machine at hand: bench/gpu_sudoku.sh times 150 steps first and
sets train.num_steps so the run's cosine schedule ends inside its time budget (docs/experiments/sudoku.md). The same 4 + 2 layer structure as proj/sudoku/configs/sudoku.py (full attention with full RoPE in every
layer, two decoder-only layers over the canvas, no MoE, no self-conditioning), at d_model 256 with 8 heads
and a 1024-wide MLP (about 6M parameters, the size of Ye et al. 2024's Sudoku model), 256 rows a step and a
peak learning rate of 1e-3 (half the narrow recipe's, for a 4x wider model). A tiny model's step on a GPU
costs little more at 256 rows than at 32, so the batch, not the step count, is where the GPU's time goes.
Measured on one H200: 4,000 steps (16.9 steps/s) in 356 s with compilation, one sample solves 91.2% of the 500
held-out puzzles (89.2% with --renoise=none, 97.8% with --candidates=4); docs/experiments/sudoku/gpu/.
"""

from proj.sudoku.configs import sudoku


def get_config():
  config = sudoku.get_config()
  config.model.update(dict(
      preset="sudoku_gpu",
      d_model=256,
      num_heads=8,
      num_kv_heads=4,
      head_dim=32,
      mlp_hidden=1024,
  ))
  config.data.batch_size = 256
  config.opt.update(dict(lr=1e-3, warmup_steps=200))
  # the H200 run: 16.9 steps/s, 356 s with compilation
  config.train.update(dict(num_steps=4000, log_every=100, eval_every=1000, ckpt_every=1000, keep_checkpoints=2))
  config.sample.max_denoising_steps = 16
  return config
