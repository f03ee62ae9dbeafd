"""Settings declared once (as MaxText's configs/types.py declares each key): every config key is a field of a
frozen dataclass, with its default, type, bounds or choices and a one-line doc, and each group checks itself.

  @dataclasses.dataclass(frozen=True)
  class TrainSettings:
    GROUP: ClassVar[str] = "train"                                  # the config group it is read from
    num_steps: int = setting(1000, "optimizer steps of the run", lo=1)
    nonfinite: str = setting("halt", "a non-finite step: 'halt' or 'skip' it", choices=("halt", "skip"))

    def __post_init__(self):
      fields.check(self)             # types, bounds, choices; an integral float becomes an int, a list a tuple

`setting(default, doc, ...)` declares a key, whose name is the field's: `lo` / `hi` bounds (open with `lo_open` /
`hi_open`), `choices` (a tuple, or a function returning a registry's names, read when checked), `items` (the type
of a tuple's items: str, int, float, or 'pair' for (int, int) pairs), `zero_means` (a value that 0 stands for, e.g.
max_context 0 = the model's context). `group(cls, doc)` nests a group (its keys under the field's name) and
`group(cls, doc, flatten=True)` lays a group's keys into its parent's (the `sample` group holds the request's keys
and the sampler's, `SamplerSettings`). Fields declared with neither are not config keys (ModelConfig.lora, set
from the finetune group).

A study adds a group of its own to a group that derives from `Extensible` (`data`): `register_group(DataSettings,
'puzzles', PuzzleSettings, module=__name__)` in the study's module makes the keys `data.puzzles.*`. The group exists
in a config whose `imports` key names that module (`dgemma.settings` imports them before it reads the rest), so
which keys a config has never depends on what else the process imported.

The raw config (an ml_collections.ConfigDict of configs/*.py) meets these declarations only in dgemma.settings:
`from_raw` builds a group from it (unknown keys are an error naming them), `defaults` makes the raw config of
every default (configs/base.py), `to_raw` turns built settings back into one (config.json), `rows` lists every
key with its type, default, bounds and doc (python -m dgemma.settings).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Optional, Sequence

from dgemma.errors import ConfigError

_SPEC = "dgemma_setting"


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a declared field is (module docstring); kind: bool, int, float, str, tuple or 'group'."""
  doc: str
  kind: Any
  lo: Optional[float] = None
  hi: Optional[float] = None
  lo_open: bool = False
  hi_open: bool = False
  choices: Any = None
  items: Any = None
  zero_means: Any = None
  group: Any = None
  flatten: bool = False

  def options(self) -> Optional[tuple]:
    return tuple(self.choices()) if callable(self.choices) else self.choices


def _kind(default) -> Any:
  for kind in (bool, int, float, str, tuple):
    if isinstance(default, kind):
      return kind
  raise TypeError(f"setting: no kind for default {default!r}")


def setting(default, doc: str, *, lo=None, hi=None, lo_open=False, hi_open=False, choices=None, items=None,
            zero_means=None, compare: bool = True) -> Any:
  """A dataclass field that is a config key (module docstring)."""
  spec = Spec(doc, _kind(default), lo, hi, lo_open, hi_open, choices, items, zero_means)
  return dataclasses.field(default=default, compare=compare, metadata={_SPEC: spec})


def group(cls, doc: str, *, flatten: bool = False) -> Any:
  """A nested group of settings (`cls` a declared dataclass), at its defaults unless given."""
  return dataclasses.field(default_factory=cls, metadata={_SPEC: Spec(doc, "group", group=cls, flatten=flatten)})


def declared(cls_or_obj) -> Iterator[tuple[dataclasses.Field, Spec]]:
  """(field, spec) of every declared field of a group class or instance, in declaration order."""
  for f in dataclasses.fields(cls_or_obj):
    if _SPEC in f.metadata:
      yield f, f.metadata[_SPEC]


# ---- groups a study adds (module docstring) ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Extensible:
  """A group that studies may add groups to (`register_group`); a registered group reads as an attribute
  (`settings.data.puzzles`)."""
  extensions: tuple = ()  # ((key, group), ...): the registered groups of the config's imports, built

  def __getattr__(self, name: str):
    if not name.startswith("__") and name != "extensions":
      for key, value in self.extensions:
        if key == name:
          return value
    raise AttributeError(f"{type(self).__name__} has no setting or group {name!r}")


_REGISTERED: dict[type, dict[str, tuple[type, str]]] = {}


def register_group(parent: type, key: str, cls: type, module: str) -> None:
  """Adds the group `cls` under `key` to the Extensible group `parent`, for configs whose `imports` name `module`
  (the study module that calls this)."""
  if not issubclass(parent, Extensible):
    raise TypeError(f"register_group: {parent.__name__} takes no study groups")
  if any(f.name == key for f in dataclasses.fields(parent)):
    raise ValueError(f"register_group: {parent.__name__} already has a field {key!r}")
  known = _REGISTERED.setdefault(parent, {})
  if key in known and known[key] != (cls, module):
    raise ValueError(f"register_group: {parent.__name__}.{key} is {known[key][0].__name__} of {known[key][1]}")
  known[key] = (cls, module)


def _extensions(cls, imports: Sequence[str]) -> list[tuple[str, type]]:
  """(key, group class) of the groups registered to `cls` by the modules `imports` names."""
  if not (isinstance(cls, type) and issubclass(cls, Extensible)):
    return []
  return [(key, group_cls) for key, (group_cls, module) in _REGISTERED.get(cls, {}).items() if module in imports]


def _built_extensions(obj) -> tuple:
  return obj.extensions if isinstance(obj, Extensible) else ()


def _name(prefix: str, key: str) -> str:
  return f"{prefix}.{key}" if prefix else key


# ---- checking values --------------------------------------------------------------------------------

def _fail(field: str, msg: str):
  raise ConfigError(f"{field}: {msg}")


def _int(field: str, value, spec: Spec) -> int:
  if isinstance(value, float) and math.isfinite(value) and value.is_integer():
    value = int(value)  # 1e3 from a flag
  if not isinstance(value, int) or isinstance(value, bool):
    _fail(field, f"must be an integer, got {value!r}")
  return int(value)


def _float(field: str, value, spec: Spec) -> float:
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    _fail(field, f"must be a number, got {value!r}")
  value = float(value)
  if not math.isfinite(value):
    _fail(field, f"must be finite, got {value}")
  return value


def _bounds(field: str, value, spec: Spec) -> None:
  if spec.lo is not None and not (value > spec.lo if spec.lo_open else value >= spec.lo):
    _fail(field, f"must be {'>' if spec.lo_open else '>='} {spec.lo}, got {value}")
  if spec.hi is not None and not (value < spec.hi if spec.hi_open else value <= spec.hi):
    _fail(field, f"must be {'<' if spec.hi_open else '<='} {spec.hi}, got {value}")


def _item(field: str, value, items):
  if items is str:
    if not isinstance(value, str):
      _fail(field, f"needs strings, got {value!r}")
    return value
  if items is int:
    return _int(field, value, None)
  if items is float:
    return _float(field, value, None)
  if items == "pair":
    if not isinstance(value, (tuple, list)) or len(value) != 2:
      _fail(field, f"expected (int, int) pairs, got {value!r}")
    return (_int(field, value[0], None), _int(field, value[1], None))
  if items == "rule":  # a logical axis rule: (name, None | mesh axis | (mesh axes, ...))
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[0], str):
      _fail(field, f"expected (logical axis, mesh axes) rules, got {value!r}")
    axes = value[1]
    return (value[0], tuple(axes) if isinstance(axes, (tuple, list)) else axes)
  return tuple(value) if isinstance(value, list) else value


def value(field: str, raw, spec: Spec):
  """`raw` checked against `spec` and normalised (module docstring); errors name `field`."""
  kind = spec.kind
  if kind is bool:
    if not isinstance(raw, bool):
      _fail(field, f"must be True or False, got {raw!r}")
    out = raw
  elif kind is int:
    out = _int(field, raw, spec)
    if spec.zero_means is not None and out == 0:
      return spec.zero_means
  elif kind is float:
    out = _float(field, raw, spec)
  elif kind is str:
    if not isinstance(raw, str):
      _fail(field, f"must be a string, got {raw!r}")
    out = raw
  else:  # tuple
    if isinstance(raw, str):
      raw = (raw,)
    if not isinstance(raw, (tuple, list)):
      _fail(field, f"must be a tuple, got {raw!r}")
    out = tuple(_item(field, x, spec.items) for x in raw)
  options = spec.options()
  if options is not None:
    bad = [x for x in (out if kind is tuple else (out,)) if x not in options]
    if bad:
      _fail(field, f"{bad[0]!r} not in {options}")
  if kind in (int, float):
    _bounds(field, out, spec)
  return out


def check(obj, prefix: Optional[str] = None) -> None:
  """Checks and normalises every declared field of a frozen group in place (its __post_init__ calls this);
  nested groups checked themselves when they were built. Errors name `prefix.key` (default: the class's GROUP)."""
  prefix = getattr(obj, "GROUP", "") if prefix is None else prefix
  for f, spec in declared(obj):
    if spec.kind == "group":
      if not isinstance(getattr(obj, f.name), spec.group):
        _fail(_name(prefix, f.name), f"expected a {spec.group.__name__}, got {getattr(obj, f.name)!r}")
      continue
    object.__setattr__(obj, f.name, value(_name(prefix, f.name), getattr(obj, f.name), spec))


def need(cond: bool, field: str, msg: str) -> None:
  """A relation between settings (checked by a group after `check`): ConfigError naming `field` unless `cond`."""
  if not cond:
    _fail(field, msg)


# ---- the raw config ---------------------------------------------------------------------------------
# `imports`: the modules a config names (module docstring); they decide which registered groups a group has.

def _raw_tree(cls, imports: Sequence[str], leaf: Callable[[dataclasses.Field, Spec], Any]) -> dict[str, Any]:
  """{config key: leaf(field, spec) or nested {…}} of a group class: its raw config's shape (flattened groups merged,
  the registered groups of `imports` added)."""
  out: dict[str, Any] = {}
  for f, spec in declared(cls):
    if spec.kind != "group":
      out[f.name] = leaf(f, spec)
    elif spec.flatten:
      out.update(_raw_tree(spec.group, imports, leaf))
    else:
      out[f.name] = _raw_tree(spec.group, imports, leaf)
  for key, group_cls in _extensions(cls, imports):
    out[key] = _raw_tree(group_cls, imports, leaf)
  return out


def keys(cls, imports: Sequence[str] = ()) -> dict[str, Any]:
  """{config key: spec or nested {…}} of a group class."""
  return _raw_tree(cls, imports, lambda f, spec: spec)


def unknown_keys(cls, raw, prefix: str, imports: Sequence[str] = ()) -> list[str]:
  """Dotted names of the keys of `raw` (a ConfigDict or dict) that `cls` does not declare."""
  return _unknown(keys(cls, imports), raw, prefix)


def _unknown(known: dict, raw, prefix: str) -> list[str]:
  out = []
  for key in raw.keys():
    if key not in known:
      out.append(_name(prefix, key))
    elif isinstance(known[key], dict):
      if not hasattr(raw[key], "keys"):
        _fail(_name(prefix, key), f"expected a group of settings, got {raw[key]!r}")
      out += _unknown(known[key], raw[key], _name(prefix, key))
  return out


def from_raw(cls, raw, imports: Sequence[str] = (), **derived):
  """The group `cls` from its raw config `raw` (every declared key read: a missing one takes its default),
  plus `derived` values (fields that are not keys)."""
  kwargs = {}
  sub = lambda key: raw[key] if key in raw else {}
  for f, spec in declared(cls):
    if spec.kind == "group":
      kwargs[f.name] = from_raw(spec.group, raw if spec.flatten else sub(f.name), imports)
    elif f.name in raw:
      kwargs[f.name] = raw[f.name]
  extensions = tuple((key, from_raw(group_cls, sub(key), imports)) for key, group_cls in _extensions(cls, imports))
  if extensions:
    kwargs["extensions"] = extensions
  kwargs.update(derived)
  return cls(**kwargs)


def _groups(obj) -> Iterator[tuple[str, Any, bool]]:
  """(key, nested group, flattened) of a built group: its declared groups, then the registered ones it holds."""
  for f, spec in declared(obj):
    if spec.kind == "group":
      yield f.name, getattr(obj, f.name), spec.flatten
  for key, value in _built_extensions(obj):
    yield key, value, False


def to_raw(obj) -> dict:
  """A built group as its raw config (nested dicts; tuples as lists: JSON's)."""
  out: dict[str, Any] = {}
  for f, spec in declared(obj):
    v = getattr(obj, f.name)
    if spec.kind == "group":
      continue
    out[f.name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
  for key, value, flattened in _groups(obj):
    if flattened:
      out.update(to_raw(value))
    else:
      out[key] = to_raw(value)
  return out


def defaults(cls, imports: Sequence[str] = ()) -> dict:
  """The raw config of every default of `cls` (nested dicts; tuples kept)."""
  return _raw_tree(cls, imports, lambda f, spec: f.default)


def rows(cls, prefix: str = "", imports: Sequence[str] = ()) -> list[tuple[str, str, Any, str, str]]:
  """(dotted key, type, default, bounds or choices, doc) of every key of `cls` (python -m dgemma.settings)."""
  out = []
  for f, spec in declared(cls):
    name = _name(prefix, f.name)
    if spec.kind == "group":
      out += rows(spec.group, prefix if spec.flatten else name, imports)
      continue
    limits = []
    if spec.lo is not None:
      limits.append(f"{'>' if spec.lo_open else '>='} {spec.lo}")
    if spec.hi is not None:
      limits.append(f"{'<' if spec.hi_open else '<='} {spec.hi}")
    if spec.zero_means is not None:  # 0 is allowed too: it stands for a value within the bounds
      limits.append(f"or 0 = {spec.zero_means}")
    options = spec.options()
    if options is not None:
      limits.append(" | ".join(map(repr, options)))
    kind = spec.kind.__name__ + (f"[{getattr(spec.items, '__name__', spec.items)}]" if spec.items else "")
    out.append((name, kind, f.default, ", ".join(limits), spec.doc))
  for key, group_cls in _extensions(cls, imports):
    out += rows(group_cls, _name(prefix, key), imports)
  return out


def flat(obj, prefix: str = "") -> dict[str, Any]:
  """{dotted key: value} of every key of a built group (what resume checks compare)."""
  out: dict[str, Any] = {}
  for f, spec in declared(obj):
    if spec.kind != "group":
      out[_name(prefix, f.name)] = getattr(obj, f.name)
  for key, value, flattened in _groups(obj):
    out.update(flat(value, prefix if flattened else _name(prefix, key)))
  return out
