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
  config.data.update(dict(source="files", files=tuple(f for f in files.split(",") if f), format="sft",
                          validation_fraction=0.02, seq_len=96, batch_size=32))
  config.data.tokenizer.kind = "byte"
  # encoder_loss_weight 0: the prompt is a random problem, nothing to learn from its next token
  config.diffusion.update(dict(canvas_len=16, encoder_loss_weight=0.0))
  config.opt.update(dict(lr=2e-3, warmup_steps=100, weight_decay=0.01))
  config.train.update(dict(num_steps=3000, log_every=50, eval_every=500, ckpt_every=500, progress_bar=False))
  config.sample.update(dict(max_new_tokens=16, max_denoising_steps=16))
  return config
