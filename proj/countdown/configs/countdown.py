"""Countdown's supervised warm start (proj/countdown/data.py): SFT on generated problems, the prompt a user turn, the
answer one expression. The policy reinforcement learning starts from (proj/countdown/configs/rl_countdown.py).

  python -m proj.countdown.make_jsonl --out_dir=data/countdown --num_train=20000 --num_test=500
  python train.py --config=proj/countdown/configs/countdown.py:data/countdown/train.jsonl --workdir=workdirs/countdown
  python -m proj.countdown.eval --checkpoint=workdirs/countdown --data=data/countdown/test.jsonl

The Sudoku model's shape (4 layers + 2 decoder-only layers, d_model 128, byte tokens: proj/sudoku/configs/sudoku.py);
rows of 96 tokens: the rendered prompt (about 70 bytes) and one 16-token canvas (answers are at most 10 characters,
then end tokens).
"""

from configs import base
from proj.sudoku.configs import sudoku


def get_config(files: str = ""):
  config = base.get_config()
  config.model = sudoku.get_config().model
  config.data.source = "files"
  config.data.files = tuple(f for f in files.split(",") if f)
  config.data.format = "sft"
  config.data.validation_fraction = 0.02
  config.data.tokenizer.kind = "byte"
  config.data.seq_len = 96
  config.data.batch_size = 32
  config.diffusion.canvas_len = 16
  config.diffusion.encoder_loss_weight = 0.0   # the prompt is a random problem: nothing to learn from its next token
  config.opt.lr = 2e-3
  config.opt.warmup_steps = 100
  config.opt.weight_decay = 0.01
  config.train.num_steps = 3000
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.ckpt_every = 500
  config.train.progress_bar = False
  config.sample.max_new_tokens = 16
  config.sample.max_denoising_steps = 16
  return config
