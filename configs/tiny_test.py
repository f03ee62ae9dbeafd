"""Tiny end-to-end config: trains in about 70 s on 2 CPU cores; used by the tests.

  python train.py --config=configs/tiny_test.py --workdir=/tmp/dgemma_tiny
  python train.py --config=configs/tiny_test.py --workdir=/tmp/dgemma_tiny --config.train.num_steps=20
  python sample.py --config=configs/tiny_test.py --workdir=/tmp/dgemma_tiny --config.sample.prompt="KING"
"""

from configs import base
from configs.models import tiny


def get_config():
  config = base.get_config()
  config.model = tiny.get_config()
  config.model.vocab_size = 260          # byte tokenizer: 256 bytes + 4 specials
  config.data.tokenizer.kind = "byte"
  config.data.seq_len = 64
  config.data.batch_size = 4
  config.diffusion.canvas_len = 16
  config.opt.warmup_steps = 2
  config.opt.lr = 1e-3
  config.train.num_steps = 6
  config.train.log_every = 2
  config.train.eval_every = 3
  config.train.eval_batches = 1
  config.train.ckpt_every = 3
  config.train.keep_checkpoints = 2
  config.train.progress_bar = False
  config.sample.max_new_tokens = 32
  config.sample.max_denoising_steps = 4
  return config
