"""The flags every eval command shares (--checkpoint, --config, --step) and its eval.* shorthands, on top of
dgemma/tools/cli.py (one-line errors, config files that report a missing file).

  if __name__ == "__main__":
    cli_flags.define("data", "num_t_samples")      # --data, --num_t_samples: eval.data, eval.num_t_samples
    cli_flags.main(main, "eval.likelihood")          # main(argv) calls cli_flags.run_eval(argv, run)
"""

from __future__ import annotations

from typing import Callable, Optional

import ml_collections
from absl import flags
from ml_collections import config_flags

from dgemma import api, checkpoints
from dgemma import settings as settings_lib
from dgemma.tools import cli

_DEFINED: dict = {}


def define(*eval_keys: str) -> None:
  """--config, --checkpoint, --step, and one --NAME flag per eval.NAME key, its type and help the key's declaration
  (dgemma/settings/groups.py EvalSettings; `cli.define_setting_flags`)."""
  _DEFINED["config"] = config_flags.DEFINE_config_file(
      "config", None, "Config whose `sample` / `eval` settings to use (for a checkpoint without a run config, "
      "also its data / diffusion settings); optional.")
  _DEFINED["checkpoint"] = flags.DEFINE_string("checkpoint", None, "A training workdir, params checkpoint, adapter "
                                               "or Hugging Face directory.", required=True)
  _DEFINED["step"] = flags.DEFINE_integer("step", -1, "Training step of a workdir (-1 = latest).")
  _DEFINED["eval"] = cli.define_setting_flags(settings_lib.EvalSettings, *eval_keys, unset=True)


def eval_config(config: Optional[ml_collections.ConfigDict], checkpoint: str,
                eval_flags: dict) -> Optional[ml_collections.ConfigDict]:
  """The config an eval command runs with: --config (or, when an eval.* flag is given, the checkpoint's own
  run config) with those flags written into `eval`; None = the checkpoint's own settings."""
  if config is None and any(f.value is not None for f in eval_flags.values()):
    config = api.run_config(checkpoints.header(checkpoint, checkpoints.CHECKPOINT_FLAG))
  if config is not None:
    config = ml_collections.ConfigDict(config.to_dict())
    for name, flag in eval_flags.items():
      if flag.value is not None:
        config.eval[name] = flag.value
  return config


def checked_settings(checkpoint: str, config: Optional[ml_collections.ConfigDict]) -> settings_lib.Settings:
  """The settings `dgemma.load(checkpoint, config=config)` will use, checked, without reading weights."""
  return settings_lib.from_config(api.run_config(checkpoints.header(checkpoint, checkpoints.CHECKPOINT_FLAG), config))


def run_eval(argv, run: Callable) -> None:
  cli.no_extra_args(argv)
  checkpoint = _DEFINED["checkpoint"].value
  run(checkpoint, eval_config(cli.config(_DEFINED["config"]), checkpoint, _DEFINED["eval"]),
      step=_DEFINED["step"].value)


def main(main_fn: Callable, prog: str) -> None:
  cli.run(main_fn, prog, user_errors=(ValueError,))
