"""Ablation: predictor-corrector sampling (`sample.sampler='pc'`) against the released and the ancestral
samplers at equal decoder passes, on the demo model; generative perplexity under the demo-sized AR
reference, with the diversity statistics beside it (issue #19 item 3).

  # the two runs it evaluates (as configs/ablations/steps_quality.py):
  python train.py --config=configs/demo.py --workdir=workdirs/demo
  python train.py --config=configs/demo.py --workdir=workdirs/demo_ar --config.diffusion.objective=ar
  # the sweep: out_dir/results.csv, results.json and the PNGs
  python -m eval.ablate --config=configs/ablations/pc_sampler.py
  # e.g. another run, more samples:
  python -m eval.ablate --config=configs/ablations/pc_sampler.py --config.checkpoint=workdirs/exp1 \
      --config.out_dir=ablations/exp1_pc

A 'pc' setting with P passes and c correctors runs P / (1 + c) ancestral predictor passes, each followed
by c corrector passes at the new noise level (dgemma/sampling/rules.py `_pc_update`). Interface of the
fields: eval/ablate.py docstring.
"""

from configs.ablations import steps_quality

PASSES = (4, 8, 16, 32)


def get_config():
  config = steps_quality.get_config()  # its run, reference, prompts and sample count
  config.out_dir = "ablations/pc_sampler"
  config.overrides = tuple((k, 64 if k == "eval.num_samples" else v) for k, v in config.overrides) + (
      ("eval.real_words", "train"),)  # 64 samples (16 left differences between samplers within noise); words
                                      # against the demo's training works
  settings = []
  for passes in PASSES:
    steps = ("sample.max_denoising_steps", passes)
    settings.append((f"released_{passes}", "released (entropy bound 0.1)", (steps,)))
    settings.append((f"ancestral_{passes}", "ancestral", (("sample.sampler", "ancestral"), steps)))
    settings.append((f"pc1_{passes}", "pc, 1 corrector", (("sample.sampler", "pc"), ("sample.pc_corrector_steps", 1),
                                                           steps)))
    if passes >= 8:
      settings.append((f"pc3_{passes}", "pc, 3 correctors", (("sample.sampler", "pc"),
                                                             ("sample.pc_corrector_steps", 3), steps)))
  config.settings = tuple(settings)
  config.plots = (
      ("passes_per_canvas", "gen_ppl", "quality_vs_passes.png"),
      ("passes_per_canvas", "unigram_entropy", "entropy_vs_passes.png"),
      ("passes_per_canvas", "real_word_rate", "real_words_vs_passes.png"),
  )
  return config
