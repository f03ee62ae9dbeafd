"""Prepares a config's data ahead of training: fetches/builds the TFDS dataset and the tokenizer.

  python -m dgemma.data.prepare --config=configs/demo.py

Training does the same lazily; running it first separates the one-off set-up from the run.
"""

from absl import app
from ml_collections import config_flags

from dgemma import config as config_lib
from dgemma.data import pipeline

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)


def main(argv):
  del argv
  config = _CONFIG.value
  config_lib.validate(config)
  prepared = pipeline.prepare(config)
  print(f"data ready: source={config.data.source} tokenizer={config.data.tokenizer.kind} "
        f"vocab={prepared.tokenizer.vocab_size}")


if __name__ == "__main__":
  app.run(main)
