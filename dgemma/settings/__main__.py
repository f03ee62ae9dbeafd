"""Every config key dgemma reads, with its type, default, bounds or choices and doc (the declarations of
dgemma/settings and of the groups it holds), or the settings a run trained with.

  python -m dgemma.settings                    # all keys
  python -m dgemma.settings sample             # the keys under one prefix (a group, or one key)
  python -m dgemma.settings workdirs/demo      # a run's effective settings (its config.json), one key a line
"""

import sys
from pathlib import Path

from dgemma import settings_fields
from dgemma.errors import ConfigError
from dgemma.settings import Settings, did_you_mean, from_config, from_json

PROG = "python -m dgemma.settings"


def main(argv: list[str]) -> None:
  if len(argv) > 2:
    sys.exit(f"{PROG}: one argument at most (a key prefix or a run's workdir), got {argv[1:]}")
  prefix = argv[1] if len(argv) > 1 else ""
  rows = [row for row in settings_fields.rows(Settings)
          if not prefix or row[0] == prefix or row[0].startswith(prefix + ".")]
  if rows:
    for key, kind, default, limits, doc in rows:
      print(f"{key} ({kind}) = {default!r}" + (f"  [{limits}]" if limits else "") + f"\n    {doc}")
    return
  config_json = Path(prefix) / "config.json"
  if config_json.is_file():
    try:
      settings = from_config(from_json(config_json.read_text(), config_json))
    except ConfigError as e:
      sys.exit(f"{PROG}: {e}")
    for key, value in sorted(settings_fields.flat(settings).items()):
      print(f"{key} = {value!r}")
    return
  what = "a directory without config.json (not a run's workdir)" if Path(prefix).is_dir() else "no key or group"
  sys.exit(f"{PROG}: {prefix!r}: {what}{did_you_mean(prefix)}; the argument is a key prefix (sample, "
           "sample.t_max) or a run's workdir")


if __name__ == "__main__":
  main(sys.argv)
