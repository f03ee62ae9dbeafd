"""What the registries (data sources, rewards, eval metrics, settings groups) share: a study's records registered by
importing the modules its config names (`imports`), and a user's function named by 'module.path:function'."""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from dgemma.errors import ConfigError


def import_modules(modules: Sequence[str], field: str) -> None:
  """Imports each module (a study's, which registers its records when imported); one that cannot be found is an
  error naming `field`, while an error inside one that exists is raised as it is."""
  for module in modules:
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if not module.startswith(str(e.name)):
        raise
      raise ConfigError(f"{field}: cannot import {module!r} ({e}; a study's modules import from the repository "
                        "root)") from e


def load_function(path: str, field: str) -> Callable:
  """The function `path` ('module.path:function') names; one line naming `field` when it cannot be had."""
  module_name, sep, attr = path.partition(":")
  if not sep or not module_name or not attr:
    raise ConfigError(f"{field}: {path!r} is not 'module.path:function'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"{field}: cannot import {module_name!r} ({e})") from e
  fn = getattr(module, attr, None)
  if not callable(fn):
    raise ConfigError(f"{field}: {module_name!r} has no function {attr!r}")
  return fn
