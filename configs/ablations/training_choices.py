"""Ablation: the training and sampling choices of DiffusionGemma on the demo model -- objective, noise type
(uniform vs masked), self-conditioning, and the sampler's entropy bound -- scored by sample quality
(generative perplexity under a demo-sized AR reference, unigram entropy, tokens per forward).

  # the released run and the AR reference (as for configs/ablations/steps_quality.py):
  python train.py --config=configs/demo.py --workdir=workdirs/demo
  python train.py --config=configs/demo.py --workdir=workdirs/demo_ar --config.diffusion.objective=ar
  # the sweep: trains one demo-sized run per training setting into out_dir/runs/<name> (~10 min each on
  # 2 CPU cores; re-running resumes / reuses them), then writes out_dir/results.csv, results.json, PNGs
  python -m eval.ablate --config=configs/ablations/training_choices.py
  # the same runs scored by their likelihood bound on the validation split (the same out_dir: finished runs
  # are reused; copy results.csv / results.json aside first, this pass rewrites them):
  python -m eval.ablate --config=configs/ablations/training_choices.py --config.metric=likelihood
  # e.g. shorter runs for a quick look (every setting, the base included, must train the same budget):
  python -m eval.ablate --config=configs/ablations/training_choices.py --config.checkpoint= \
      --config.out_dir=ablations/choices_200

Settings (every one is the demo config plus the named change; the released choices are the base):
  objective        base_ce (released) | reweighted_ce (1/(1-t) weights) | nelbo (the continuous-time bound) |
                   loo_ce | loo_nelbo_ce (leave-one-out outputs: dgemma/diffusion/objectives.py)
  noise            uniform (released) | masked: diffusion.objective='mdlm' sampled with sample.sampler='masked'
                   (the mask is one embedding row past the demo's SentencePiece pieces)
  self-conditioning  on (released, two-pass training) | off (model.self_conditioning=False)
  entropy bound    sample.entropy_bound 0.03 / 0.1 (released) / 0.3 / 1.0 on the released run: how many
                   tokens each step accepts, i.e. speed against quality
`checkpoint` is the released run; '' trains configs/demo.py + overrides into out_dir/runs/base instead.

Interface of the fields: eval/ablate.py docstring.
"""

from configs import demo
from configs.ablations import steps_quality


def get_config():
  # base, checkpoint, metric and overrides (unconditional 64-token samples, 16 of them, AR reference) as in
  # the steps-vs-quality sweep, so the two sweeps' numbers are comparable
  config = steps_quality.get_config()
  config.out_dir = "ablations/training_choices"
  # --config.metric=likelihood: the bound on the validation split as docs/experiments/training_choices.md's likelihood table
  # measures it (the first 2048 tokens of each held-out work, 8 antithetic t samples per canvas)
  config.overrides = tuple(config.overrides) + (("eval.max_tokens", 2048), ("eval.num_t_samples", 8))
  vocab = demo.get_config().model.vocab_size
  settings = [
      ("released", "released", ()),
      ("reweighted_ce", "objective", (("diffusion.objective", "reweighted_ce"),)),
      ("nelbo", "objective", (("diffusion.objective", "nelbo"),)),
      # the leave-one-out objectives (network output = p(x_i | z without i), what the NELBO reads)
      ("loo_ce", "objective", (("diffusion.objective", "loo_ce"),)),
      ("loo_nelbo_ce", "objective", (("diffusion.objective", "loo_nelbo_ce"),)),
      # the mask token needs an id outside the demo's vocabulary: one more embedding row
      ("masked_mdlm", "noise", (("diffusion.objective", "mdlm"), ("sample.sampler", "masked"),
                                ("diffusion.mask_id", vocab), ("model.vocab_size", vocab + 1))),
      ("no_self_cond", "self-conditioning", (("model.self_conditioning", False),)),
  ]
  for bound in (0.03, 0.1, 0.3, 1.0):
    settings.append((f"entropy_bound_{bound}", "entropy bound", (("sample.entropy_bound", bound),)))
  config.settings = tuple(settings)
  config.plots = (
      ("tokens_per_forward", "gen_ppl", "choices_quality_vs_parallelism.png"),
      ("tokens_per_s", "gen_ppl", "choices_speed_vs_quality.png"),
      ("unigram_entropy", "gen_ppl", "choices_entropy_vs_gen_ppl.png"),
  )
  return config
