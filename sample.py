"""Samples from a trained run with the DiffusionGemma sampler (jitted lax.scan / while_loop denoising).

  python sample.py --workdir=workdirs/demo
  python sample.py --config=configs/demo.py --workdir=workdirs/demo --config.sample.prompt="ROMEO:" \
      --config.sample.num_samples=4 --steps=32 --seed=1 --temperature=0.6

  # watch the canvases being denoised (ANSI redraw per step; accepted tokens bold green):
  python sample.py --config=configs/demo.py --workdir=workdirs/demo --config.sample.show=live
  # ablation: uniform-state ancestral sampling from the posterior (configs/base.py, `sample` block)
  python sample.py --config=configs/demo.py --workdir=workdirs/demo --config.sample.sampler=ancestral \
      --config.sample.alpha_schedule=loglinear

The architecture comes from the run's saved config.json; --config (optional) supplies the `sample`
settings and the device mesh (`mesh`; default cpu_host): e.g. rows over data and experts over expert

  python sample.py --config=configs/demo.py --workdir=workdirs/demo --config.sample.num_samples=8 \
      --config.mesh.shape.data=2 --config.mesh.shape.expert=4   # on 8 devices

(experts exchange tokens by all-to-all when the run has model.moe_impl='expert_parallel').
--steps / --seed / --temperature are shorthands for sample.max_denoising_steps,
sample.seed and a constant temperature (sample.t_max = sample.t_min). Bad settings (unknown names,
steps <= 0, a prompt that does not fit sample.max_context, ...) fail before the checkpoint is read.
Each sample reports its decoder passes and tokens per pass.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from dgemma import sample_lib
from dgemma.model.config import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config whose `sample` group to use (optional).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (checkpoints + config.json).", required=True)
_STEPS = flags.DEFINE_integer("steps", None, "Max denoising steps per canvas.")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Constant sampling temperature.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    sample_lib.sample_from_workdir(_WORKDIR.value, _CONFIG.value, steps=_STEPS.value, seed=_SEED.value,
                                   temperature=_TEMPERATURE.value)
  except ConfigError as e:  # a bad setting: its message names the key; no traceback
    sys.exit(f"sample.py: {e}")


if __name__ == "__main__":
  app.run(main)
