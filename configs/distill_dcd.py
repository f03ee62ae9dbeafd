"""Discrete consistency distillation (Duo) of a trained run into a few-step student.

  python train.py --config=configs/distill_dcd.py:workdirs/demo --workdir=workdirs/demo_dcd
  python -m eval.samples --checkpoint=workdirs/demo_dcd --config=configs/demo.py \
      --config.sample.max_denoising_steps=4 --reference=workdirs/demo_ar --real_words=train
  # override anything, e.g. an 8-step student with longer rounds:
  python train.py --config=configs/distill_dcd.py:workdirs/demo --workdir=workdirs/demo_dcd8 \
      --config.distill.student_steps=8 --config.distill.round_steps=200 --config.train.num_steps=800

The argument is the teacher: a training workdir (its latest step). The student starts as a copy of it and keeps
its architecture, data, tokenizer and objective (read from its config.json); only the distillation, the
optimizer and the loop change. Rounds: distill.teacher_steps = 64 to student_steps = 4 is five rounds of
round_steps each (dgemma/diffusion/distill.py); a checkpoint ends every round, so the round whose dt is
1 / 8 (step 4 * round_steps) is the 8-step student.

Measured (docs/experiments/distillation.md): on an order-1 Markov source, rounds of 80
steps gave no measurable few-step gain and rounds of 400 (--config.distill.teacher_steps=16
--config.distill.round_steps=400 --config.train.num_steps=1200) did; lengthen the rounds for real use.
Without an argument the file describes the demo (so it validates on its own), and training refuses to start
until a teacher is named.
"""

from configs import demo
from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.diffusion import distill as distill_lib


def get_config(teacher: str = ""):
  if teacher:
    if not workdir_ckpt.is_workdir(teacher):
      raise FileNotFoundError(f"configs/distill_dcd.py:TEACHER: {teacher} is not a training workdir "
                              "(config.json + checkpoints/, from train.py)")
    config = settings_lib.from_json(workdir_ckpt.read_config_json(teacher))
  else:
    config = demo.get_config()
  config.train.init_from = teacher
  config.distill.method = "dcd"
  config.distill.teacher_steps = 64
  config.distill.student_steps = 4
  config.distill.round_steps = 80
  config.train.num_steps = config.distill.round_steps * distill_lib.num_rounds(config.distill)  # 400
  config.train.ckpt_every = config.distill.round_steps  # one student per round
  config.train.keep_checkpoints = distill_lib.num_rounds(config.distill)
  config.train.eval_every = config.distill.round_steps
  config.opt.lr = config.opt.lr / 4    # fine-tuning a trained model (Duo distils at a lower rate than it trains)
  config.opt.warmup_steps = 10
  config.opt.end_lr_fraction = 1.0     # constant after warmup: every round gets the same rate
  return config
