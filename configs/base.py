"""Every key the dgemma code reads, at its default: experiment configs start from this.

The keys, their types, defaults, bounds and docs are declared once, in the library (dgemma/settings and the
groups it holds, dgemma/settings_fields.py); this file is their raw config, so a default cannot disagree with itself.
`python -m dgemma.settings` lists every key with its doc. Not meant to be run directly (its model is the full
26B trunk): see configs/demo.py and configs/tiny_test.py. `dgemma.settings.from_config` rejects keys that no
group declares. A study's config passes its modules (`imports`): they are imported here, and the groups they
register join the config (proj/sudoku/configs/sudoku.py).
"""

from typing import Sequence

import ml_collections

from dgemma import settings


def get_config(imports: Sequence[str] = ()) -> ml_collections.ConfigDict:
  return settings.default_config(imports)
