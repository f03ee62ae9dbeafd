"""Sudoku with DiffusionGemma-style diffusion: the puzzle is the prompt, the 81-digit solution the canvas.

  python -m proj.sudoku.make_csv --out_dir=data/sudoku --num_train=20000 --num_test=500 --min_blanks=30 --max_blanks=45
  python train.py --config=proj/sudoku/configs/sudoku.py --workdir=workdirs/sudoku \
      --config.data.sudoku.train_csv=data/sudoku/train.csv
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=data/sudoku/test.csv            # re-noising sampler
  python -m proj.sudoku.eval --checkpoint=workdirs/sudoku --puzzles=data/sudoku/test.csv --renoise=none
  # override anything, e.g. harder puzzles generated on the fly and a longer run:
  python train.py --config=proj/sudoku/configs/sudoku.py --workdir=workdirs/sudoku_hard --config.data.sudoku.train_csv= \
      --config.data.sudoku.min_blanks=45 --config.data.sudoku.max_blanks=55 --config.train.num_steps=20000

Rows are [BOS] + 81 puzzle digits (context) | 81 solution digits (canvas), byte tokens (proj/sudoku/data.py).
With the byte vocabulary (260 ids) a uniform noise token is a digit only 10/260 of the time, so corrupted
cells are mostly visibly "not a digit" (close to masking), while the released sampler's re-noised cells
look the same way: the model learns to fill exactly the cells it cannot see.
Model: 4 layers, d_model 128, dense MLP (no MoE experts) and no self-conditioning: sized for a 2-core CPU
(measured 1.9 s per step of 32 rows on both cores, 2.3 s on one: docs/experiments/sudoku.md; 0.56 s
on both cores of a Zen 5 host since layers.matmul_last; 0.55 s on a Zen 4 host with the layers unrolled).
Every layer is a 'sliding' layer whose window (256) covers the whole 163-token row, i.e. full attention
with full RoPE (base 1e4) everywhere: Gemma's 'global' layers rotate only a quarter of their head
dimensions at base 1e6 (nearly position-blind), while a Sudoku cell must find its row, column and box
peers by position. diffusion.encoder_loss_weight = 0: the context is a random puzzle whose next-token
prediction teaches nothing about solving, and the causal encoder only has to write the KV cache the canvas
reads (the encoder is still trained, through the canvas loss). The sampler stops a canvas when its argmax
is stable and confident; max_new_tokens = 81 = one canvas.
Same model size as the autoregressive baseline proj/sudoku/configs/sudoku_ar.py.
Measured (docs/experiments/sudoku.md, 500 held-out puzzles, one sample): 22% solved after one hour
(1,500 steps on one core), 41% after 2,400 steps, 48% after 4,900; on a Zen 5 host with both cores
(0.56 s per step), 61% after 5,500 steps in 52 minutes (--config.train.num_steps=5500); with the layers unrolled
(scan_layers=False, below) a Zen 4 host ran 5,800 steps in 59 minutes and solved 51%: one-hour runs spread
this widely from their initial weights alone (docs/experiments/sudoku.md, "How much one run varies"). Turning self-conditioning on
(--config.model.self_conditioning=True) or holding the givens (--config.data.sudoku.infill_givens=True)
did worse in the same hour (10% and 0%), and so did high-noise training times
(--config.diffusion.t_power=0.5: 26% against 51%, better first steps but worse last ones), while low-noise
times (t_power=2) gave 49%, level within noise, and a higher learning rate (--config.opt.lr=3e-3) 18%
(docs/experiments/sudoku.md).
Two decoder-only layers (model.decoder_head_layers=2: canvas-only depth with attention of its own, not shared
with the causal encoder; 1.19x the step) moved it most: 73% solved at step 3,000 of a 4,600-step run, about
36 minutes of this recipe's compute, 81% at 4,000 and 78% at the end (4,600 steps, about an hour's compute;
a second seed, 4,800 steps timed end to end: 77.8% in 53 minutes),
against 51-61% for the hour without them; validation canvas CE 0.025 against 0.069-0.077 (docs/experiments/sudoku.md,
"Training changes, one hour each"). Without them: --config.model.decoder_head_layers=0. On a GPU: proj/sudoku/configs/sudoku_gpu.py (91%).
As shipped (4,800 steps, seed 0, the two decoder-only layers): 85.2% solved in one sample after 60.5 minutes.
"""

from configs import base
from configs.models import tiny


def get_config():
  config = base.get_config(imports=("proj.sudoku.data",))  # the Sudoku source and its data.sudoku group
  config.model = tiny.get_config()
  config.model.update(dict(
      preset="sudoku",
      vocab_size=260,            # byte tokenizer
      d_model=128,
      num_layers=4,
      layer_types=("sliding",) * 4,  # full RoPE (base 1e4) in every layer; see the docstring
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,
      sliding_window=256,        # >= the 163-token row: every layer sees the whole puzzle
      global_num_kv_heads=1,
      global_head_dim=64,
      mlp_hidden=512,
      num_experts=0,             # dense MLP only: the smallest program for a 2-core CPU
      self_conditioning=False,   # no second decoder pass in training (half the canvas compute)
      decoder_head_layers=2,     # two decoder-only layers over the canvas (docs/experiments/sudoku.md)
      # One block of 4 layers, not nn.scan over 4 stacked copies of one: XLA's CPU while loop slices the
      # stacked weights and writes the saved activations and gradients back per iteration (0.72x the step
      # time unrolled, bench/train_ab.py in docs/benchmarks.md).
      scan_layers=False,
  ))
  config.data.update(dict(source="sudoku", seq_len=163, batch_size=32))
  config.data.tokenizer.kind = "byte"
  # Generated on first use (seed streams (seed, 0) / (seed, 1)) and cached in data_cache/sudoku/; the
  # generator CLI above writes the same train puzzles for seed 0 (num_train: ~4 min to generate on first use) and a
  # disjoint test.csv (stream 2).
  config.data.sudoku.update(dict(train_csv="", num_train=20000, validation_csv="", num_validation=200,
                                 min_blanks=30, max_blanks=45))
  config.diffusion.update(dict(canvas_len=81, encoder_loss_weight=0.0))
  config.opt.update(dict(lr=2e-3, warmup_steps=100, weight_decay=0.01))
  # The hour recipe behind the CPU figures (docs/experiments/sudoku.md: 77.8% / 78.2% solved in one
  # sample at the end, 81% at step 4,000 of seed 0): about 0.66 s a step on both cores of a 2-core host;
  # every 500th step stays for the evaluation by step.
  config.train.update(dict(num_steps=4800, log_every=50, eval_every=500, eval_batches=2, ckpt_every=500,
                           keep_checkpoints=20, progress_bar=False))
  config.sample.max_new_tokens = 81
  config.sample.max_denoising_steps = 16   # 81 cells; the entropy bound accepts several per step
  return config
