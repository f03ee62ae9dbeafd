"""Every config key dgemma reads, with its type, default, bounds or choices and doc (the declarations of
dgemma/settings and of the groups it holds).

  python -m dgemma.settings            # all keys
  python -m dgemma.settings sample     # the keys under one prefix
"""

import sys

from dgemma import settings_fields
from dgemma.settings import Settings


def main(argv: list[str]) -> None:
  prefix = argv[1] if len(argv) > 1 else ""
  for key, kind, default, limits, doc in settings_fields.rows(Settings):
    if key == prefix or key.startswith(prefix + ".") or not prefix:
      print(f"{key} ({kind}) = {default!r}" + (f"  [{limits}]" if limits else "") + f"\n    {doc}")


if __name__ == "__main__":
  main(sys.argv)
