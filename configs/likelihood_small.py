"""Diffusion likelihood recipe: a demo-size model trained on a text file (one document per line), byte tokens.

  python -m dgemma.tools.markov_text --out_dir=data_cache/markov      # a source with a known entropy rate
  python train.py --config=configs/likelihood_small.py:data_cache/markov/train.txt --workdir=workdirs/ll_small
  python -m eval.likelihood --checkpoint=workdirs/ll_small --data=data_cache/markov/valid.txt
  python -m eval.likelihood_curve --runs=loo_ce=workdirs/ll_small --data=data_cache/markov/valid.txt \
      --truth=data_cache/markov/truth.json --out_dir=ll_curve              # every checkpoint against minutes

The best diffusion recipe found here for a likelihood bound (docs/results.md, "A diffusion likelihood against
the truth"): `loo_ce`, whose network output is the leave-one-out distribution the NELBO reads (the decoder has
no time input, so a posterior output cannot be precise at low noise); three canvases per row; one decoder pass
(no self-conditioning); the shifted decoder output (`model.decoder_shift`: position p scored where the token to
its left sits, the canvas's first position by the encoder's next-token logits); and readouts from the two right
neighbours (`model.decoder_right_readout=2`: p's logits also read the decoder's outputs at p + 1 and p + 2, which
the decoder's shared attention does not learn to read). Neither option is in the released model. On the Markov
source above it reaches 1.64 times the true bits per byte after 400 steps and 1.45 after 1,600 (about 14 minutes
here), where the shift alone gives 1.73 and 1.68, and the same model trained as an AR model
(--config.diffusion.objective=ar) reaches 1.024 in 1,000 steps: the 10% target of issue #18 is not met.
  # the released decoder (HF parity), or any other override:
  python train.py --config=configs/likelihood_small.py:/path/train.txt --workdir=workdirs/ll_released \\
      --config.model.decoder_shift=False --config.model.decoder_right_readout=0
  # override anything, e.g. the objective or a longer run:
  python train.py --config=configs/likelihood_small.py:/path/train.txt --workdir=workdirs/ll_long \\
      --config.diffusion.objective=base_ce --config.train.num_steps=4000
"""

from configs import base, demo


def get_config(train_file: str = ""):
  config = base.get_config()
  config.model = demo.get_config().model  # the demo's architecture ...
  config.model.update(dict(preset="likelihood_small", vocab_size=260))  # ... on byte tokens
  config.data.source = "files"
  config.data.files = (train_file,) if train_file else ()
  config.data.txt_mode = "line"
  config.data.validation_fraction = 0.02
  config.data.tokenizer.kind = "byte"
  config.data.seq_len = 128
  config.data.batch_size = 16
  config.diffusion.canvas_len = 32
  config.diffusion.canvases_per_row = 3  # the row's last 96 tokens are 3 canvases, each conditioned on the clean
                                         # text before it: 3x the scored canvas tokens of one canvas per row
  config.diffusion.objective = "loo_ce"
  config.model.self_conditioning = False  # one decoder pass per step
  config.model.decoder_shift = True        # position p scored from p - 1 (dgemma/model/config.py)
  config.model.decoder_right_readout = 2   # ... and from p + 1 and p + 2 (the same file)
  config.opt.lr = 2e-3
  config.opt.warmup_steps = 50
  config.train.num_steps = 1600        # about 14 minutes on this 2-core CPU (0.43 s per step, evals aside)
  config.train.log_every = 25
  config.train.eval_every = 400
  config.train.eval_batches = 4
  config.train.ckpt_every = 200        # eval.likelihood_curve scores each one
  config.train.keep_checkpoints = 100
  config.train.progress_bar = False
  config.sample.max_new_tokens = 64
  return config
