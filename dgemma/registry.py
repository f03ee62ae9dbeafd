"""What the registries (data sources, rewards, eval metrics, settings groups) share: a study's records registered by
importing the modules its config names (`imports`), and a user's function named by 'module.path:function'."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Sequence

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


class Table(dict):
  """A registry: {name: record} (each record has a `.name`) that a config key (`field`) chooses from. A study adds its
  records with `register` when its module is imported (the config names that module in `imports`)."""

  def __init__(self, field: str, records: Iterable[Any]):
    super().__init__((r.name, r) for r in records)
    self.field = field

  def register(self, record: Any) -> Any:
    self[record.name] = record
    return record

  def names(self) -> tuple[str, ...]:
    """Every record's name, those of the studies imported so far included."""
    return tuple(self)

  def lookup(self, name: str) -> Any:
    """The record `name`; one line naming the field when there is none."""
    if name not in self:
      raise ConfigError(f"{self.field}: {name!r} not in {self.names()} (a study's records are registered by the "
                        "modules its config names in `imports`)")
    return self[name]
