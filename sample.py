"""Samples from a trained run with the DiffusionGemma sampler (jitted lax.scan / while_loop denoising).

  python sample.py --workdir=workdirs/demo
  python sample.py --config=configs/demo.py --workdir=workdirs/demo --config.sample.prompt="ROMEO:" \
      --config.sample.num_samples=4 --steps=32 --seed=1 --temperature=0.6

The architecture comes from the run's saved config.json; --config (optional) supplies the `sample`
settings. --steps / --seed / --temperature are shorthands for sample.max_denoising_steps,
sample.seed and a constant temperature (sample.t_max = sample.t_min).
"""

from absl import app, flags
from ml_collections import config_flags

from dgemma import sample_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config whose `sample` group to use (optional).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (checkpoints + config.json).", required=True)
_STEPS = flags.DEFINE_integer("steps", None, "Max denoising steps per canvas.")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Constant sampling temperature.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  sample_lib.sample_from_workdir(_WORKDIR.value, _CONFIG.value, steps=_STEPS.value, seed=_SEED.value,
                                 temperature=_TEMPERATURE.value)


if __name__ == "__main__":
  app.run(main)
