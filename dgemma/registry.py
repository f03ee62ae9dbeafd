"""What the registries (data sources, rewards, eval metrics) share: a study's records registered by importing its
module, and a user's function named by 'module.path:function'."""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from dgemma.errors import ConfigError


def import_studies(modules: Sequence[str]) -> None:
  """Imports each study module (which registers its records); a study that is not installed (dgemma without its
  proj/ folder) is left out, while an error inside an installed one is raised."""
  for module in modules:
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if not module.startswith(str(e.name)):
        raise


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
