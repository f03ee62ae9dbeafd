"""Autoregressive -> diffusion adaptation: start from an imported Gemma 4 AR checkpoint and train
with the diffusion objective, keeping the encoder's next-token loss so causal mode is not forgotten.

  # 1. import the Hugging Face Gemma 4 text checkpoint (self-conditioning is freshly initialised):
  python -m dgemma.tools.convert --from_hf /path/to/gemma-4-hf --to /ckpts/gemma4_dgemma --dtype bfloat16
  # 2. adapt on your text (the config argument after ':' is the converted checkpoint):
  python train.py --config=configs/adapt_from_gemma4.py:/ckpts/gemma4_dgemma --workdir=workdirs/adapt \
      --config.data.source=files --config.data.files="('corpus.jsonl',)" --config.opt.lr=5e-5

The config argument may name any checkpoint dgemma.load takes (the HF directory itself works too). The model
group is read from it (configs/models/from_checkpoint.py), so it always matches; the tokenizer is the one beside
the weights (tokenizer.model, else tokenizer.json; copy Gemma's there), else set --config.data.tokenizer.path.
"""

from configs import base
from configs.models import from_checkpoint


def get_config(checkpoint: str = ""):
  config = base.get_config()
  config.data.tokenizer.kind = "file"  # the checkpoint's (from_checkpoint.apply, below)
  config.data.seq_len = 1024
  config.data.batch_size = 8
  config.diffusion.canvas_len = 256
  config.diffusion.objective = "base_ce"
  config.diffusion.encoder_loss_weight = 1.0  # keep the causal (encoder) mode trained
  config.model.remat = "full"
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"
  config.opt.lr = 5e-5
  config.opt.warmup_steps = 200
  config.opt.b1, config.opt.b2 = 0.95, 0.99
  config.opt.weight_decay = 1e-4
  config.train.num_steps = 2000
  config.train.eval_every = 500
  config.train.ckpt_every = 500
  return from_checkpoint.apply(config, checkpoint) if checkpoint else config
