"""Block-causal pretraining of the `small` preset (configs/models/small.py) on the bundled Shakespeare corpus.

Each packed row of 256 tokens ends in diffusion.canvases_per_row = 4 canvases of 32 tokens, all
denoised in one decoder pass with a block-causal mask: canvas k sees itself and the clean text before
it (dgemma/diffusion/corruption.py), so one row trains 4 canvases for the price of one encoder pass.

  python -m dgemma.tools.prepare_data --config=configs/pretrain_small.py
  python train.py --config=configs/pretrain_small.py --workdir=workdirs/pretrain_small
  # override anything, e.g. a single canvas per row (the classic layout) and a shorter run:
  python train.py --config=configs/pretrain_small.py --workdir=workdirs/pretrain_small_k1 \
      --config.diffusion.canvases_per_row=1 --config.train.num_steps=500
  python sample.py --config=configs/pretrain_small.py --workdir=workdirs/pretrain_small \
      --config.sample.prompt="ROMEO:"
"""

from configs import base
from configs.models import small


def get_config():
  config = base.get_config()
  config.model = small.get_config()
  config.data.source = "shakespeare"
  config.data.validation_fraction = 0.1
  config.data.tokenizer.kind = "sentencepiece"
  config.data.tokenizer.vocab_size = 8192  # = the small preset's model.vocab_size
  config.data.seq_len = 256
  config.data.batch_size = 16
  config.diffusion.canvas_len = 32
  config.diffusion.canvases_per_row = 4  # the last 128 tokens of a row are 4 canvases; 128 clean prefix
  config.opt.lr = 1e-3
  config.opt.warmup_steps = 100
  config.train.num_steps = 2000
  config.train.log_every = 25
  config.train.eval_every = 250
  config.train.eval_batches = 4
  config.train.ckpt_every = 250
  config.sample.prompt = "ROMEO:"
  config.sample.num_samples = 4
  config.sample.max_new_tokens = 64
  config.sample.max_denoising_steps = 16
  return config
