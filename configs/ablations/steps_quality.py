"""Ablation: sample quality against denoising steps (released entropy-bound sampler vs uniform-state
ancestral sampling) on the demo model, generative perplexity under a demo-sized AR reference.

  # the two runs it evaluates (configs/demo.py; the AR reference with the AR baseline objective):
  python train.py --config=configs/demo.py --workdir=workdirs/demo
  python train.py --config=configs/demo.py --workdir=workdirs/demo_ar --config.diffusion.objective=ar
  # the sweep: out_dir/results.csv, results.json and the PNGs
  python -m eval.ablate --config=configs/ablations/steps_quality.py
  # e.g. other runs, more samples:
  python -m eval.ablate --config=configs/ablations/steps_quality.py --config.checkpoint=workdirs/exp1 \
      --config.out_dir=ablations/exp1_steps

Interface of the fields: eval/ablate.py docstring.
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.base = "configs/demo.py"
  config.checkpoint = "workdirs/demo"
  config.metric = "samples"
  config.out_dir = "ablations/steps_quality"
  config.overrides = (
      ("sample.sampler", "released"),   # the released entropy-bound sampler unless a setting says otherwise
                                        # (the demo itself samples with 'ancestral')
      ("sample.prompt", ""),            # unconditional: BOS only
      ("sample.max_new_tokens", 64),    # two canvases of 32
      ("eval.num_samples", 16),
      ("eval.reference", "workdirs/demo_ar"),
  )
  settings = []
  for steps in (1, 2, 4, 8, 16, 32):
    settings.append((f"released_{steps}", "released (entropy bound 0.1)", (("sample.max_denoising_steps", steps),)))
  for steps in (4, 8, 16, 32):
    settings.append((f"ancestral_{steps}", "ancestral (uniform posterior)",
                     (("sample.sampler", "ancestral"), ("sample.max_denoising_steps", steps))))
  config.settings = tuple(settings)
  config.plots = (
      ("steps", "gen_ppl", "quality_vs_steps.png"),
      ("tokens_per_s", "gen_ppl", "speed_vs_quality.png"),
      ("steps", "unigram_entropy", "entropy_vs_steps.png"),
  )
  return config
