"""Prepares a config's data ahead of training: fetches/builds the dataset and trains the tokenizer.

  python -m dgemma.tools.prepare_data --config=configs/demo.py

Training does the same on its first run; running it first separates the one-off set-up from the run.
"""

from ml_collections import config_flags

from dgemma import data
from dgemma import settings as settings_lib
from dgemma.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)


def main(argv):
  cli.no_extra_args(argv)
  settings = settings_lib.from_config(cli.config(_CONFIG))
  prepared = data.prepare(settings)
  print(f"data ready: source={settings.data.source} tokenizer={settings.data.tokenizer.kind} "
        f"vocab={prepared.tokenizer.vocab_size}")


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.prepare_data", user_errors=(ValueError,))
