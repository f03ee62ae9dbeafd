"""Supervised fine-tuning on a .jsonl file of prompt/response pairs or chats (dgemma/data/sft.py).

Each line is {"prompt": ..., "response": ...} or {"messages": [{"role": "user", "content": ...}, ...,
{"role": "model", "content": ...}]} (field names: data.prompt_field / response_field / messages_field).
A row is [left-padded clean prompt + clean earlier response canvases | one response canvas]; only
response tokens are scored, the canvas tail after the response is end tokens (the model learns to
stop). The config argument after ':' is the .jsonl file (several: comma-separated).

  python train.py --config=configs/sft_jsonl.py:data/train.jsonl --workdir=workdirs/sft
  # override anything, e.g. longer rows, refusing (not truncating) over-long prompts, fewer steps:
  python train.py --config=configs/sft_jsonl.py:data/train.jsonl --workdir=workdirs/sft \
      --config.data.seq_len=512 --config.data.sft_overflow=error --config.train.num_steps=300
  # fine-tune converted Gemma weights with Gemma's tokenizer (chat turns then use <|turn>/<turn|> ids):
  python train.py --config=configs/sft_jsonl.py:data/train.jsonl --workdir=workdirs/sft_gemma \
      --config.data.tokenizer.kind=file --config.data.tokenizer.path=/ckpts/gemma/tokenizer.model \
      --config.train.init_from=/ckpts/gemma  # and the checkpoint's model group (configs/adapt_from_gemma4.py)
  python sample.py --config=configs/sft_jsonl.py:data/train.jsonl --workdir=workdirs/sft \
      --config.sample.prompt="What is 2+2?"   # rendered as a user turn, as in training
"""

from configs import base
from configs.models import small


def get_config(files: str = ""):
  config = base.get_config()
  config.model = small.get_config()
  config.data.source = "files"
  config.data.files = tuple(f for f in files.split(",") if f)
  config.data.format = "sft"
  config.data.validation_fraction = 0.05
  config.data.tokenizer.kind = "sentencepiece"  # trained on the records' text (kind=file for Gemma's)
  config.data.tokenizer.vocab_size = 8192
  config.data.seq_len = 384              # context (prompt + earlier canvases) 320 + one canvas of 64
  config.data.batch_size = 16
  config.data.sft_overflow = "truncate_left"
  config.diffusion.canvas_len = 64
  config.diffusion.self_cond_prob = 0.5
  config.opt.lr = 3e-4
  config.opt.warmup_steps = 50
  config.opt.weight_decay = 1e-4
  config.opt.b1, config.opt.b2 = 0.95, 0.99  # the official SFT recipe's Adam betas
  config.train.num_steps = 1000
  config.train.log_every = 25
  config.train.eval_every = 250
  config.train.ckpt_every = 250
  config.sample.max_new_tokens = 128
  config.sample.max_denoising_steps = 32
  return config
