"""Ablation: the released re-noising sampler vs no re-noising (and low-confidence re-noising) on Sudoku.

  python -m eval.ablate --config=proj/sudoku/configs/renoise.py --config.checkpoint=workdirs/sudoku
  # e.g. another output folder and only the first 100 validation puzzles' worth of compute:
  python -m eval.ablate --config=proj/sudoku/configs/renoise.py --config.checkpoint=workdirs/sudoku \
      --config.out_dir=/tmp/renoise_sudoku

`checkpoint` is a run of proj/sudoku/configs/sudoku.py (python train.py --config=proj/sudoku/configs/sudoku.py --workdir=workdirs/sudoku);
every setting changes only `sample.*`, so all are evaluated on that one run (no training). The metric
(proj/sudoku/eval.py `ablation_metrics`): solve rate, cell accuracy and blank accuracy on the run's held-out
validation puzzles. Settings cross sample.renoise ('non_accepted' = released: every non-accepted cell gets
a fresh uniform token each step; 'none': non-accepted cells keep their sampled token; 'low_confidence':
accepted cells stay until their probability drops below sample.renoise_confidence) with the denoising-step
budget; the plot draws solve rate against sample.max_denoising_steps, one line per policy.
"""

import ml_collections

RENOISE = ("non_accepted", "none", "low_confidence")
STEPS = (8, 16, 48)


def get_config():
  config = ml_collections.ConfigDict()
  config.base = "proj/sudoku/configs/sudoku.py"
  config.checkpoint = "workdirs/sudoku"
  config.overrides = {}
  config.settings = tuple(
      (f"{renoise}_steps{steps}", renoise, {"sample.renoise": renoise, "sample.max_denoising_steps": steps})
      for renoise in RENOISE for steps in STEPS)
  config.metric = "proj.sudoku.eval:ablation_metrics"
  config.plots = (("sample.max_denoising_steps", "solve_rate", "renoise_sudoku_solve_rate.png"),
                  ("sample.max_denoising_steps", "cell_accuracy", "renoise_sudoku_cell_accuracy.png"))
  config.out_dir = "workdirs/ablations/renoise_sudoku"
  return config
