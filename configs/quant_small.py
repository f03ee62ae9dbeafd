"""The `small` preset (15.6M parameters) trained briefly on Shakespeare: the model the quantized-inference
quality delta in docs/benchmarks.md is measured on (bench/quant_quality.py).

  python train.py --config=configs/quant_small.py --workdir=workdirs/quant_small
  python bench/quant_quality.py --workdir=workdirs/quant_small
  # override example: a longer run
  python train.py --config=configs/quant_small.py --workdir=workdirs/quant_small --config.train.num_steps=1000
"""

from configs import base
from configs.models import small


def get_config():
  config = base.get_config()
  config.model = small.get_config()
  # 8 experts top-2 on CPU: slabs of 2x the mean load are 2.8x faster than dense or ragged_dot forward+backward
  # (docs/benchmarks.md "MoE layer"); dropless either way.
  config.model.moe_impl = "capacity"
  config.model.moe_capacity_factor = 2.0
  config.data.source = "shakespeare"
  config.data.validation_fraction = 0.1
  config.data.tokenizer.kind = "sentencepiece"
  config.data.tokenizer.vocab_size = 8192  # the small preset's vocabulary
  config.data.seq_len = 128
  config.data.batch_size = 8
  config.diffusion.canvas_len = 32
  config.opt.lr = 2e-3
  config.opt.warmup_steps = 50
  config.train.num_steps = 300
  config.train.log_every = 25
  config.train.eval_every = 300
  config.train.eval_batches = 4
  config.train.ckpt_every = 300
  config.sample.max_new_tokens = 64
  config.sample.max_denoising_steps = 16
  return config
