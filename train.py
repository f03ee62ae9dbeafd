"""Trains a DiffusionGemma-style model from a config file.

  python train.py --config=configs/demo.py --workdir=workdirs/demo
  python train.py --config=configs/demo.py --workdir=workdirs/demo --config.opt.lr=3e-4 --config.train.num_steps=500

Re-running with the same --workdir resumes from the latest checkpoint (params, optimizer state,
step and data-iterator position).
"""

from absl import app, flags
from ml_collections import config_flags

from dgemma import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, config.json, metrics and TensorBoard events.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
