"""dgemma/settings_fields.py: each setting declared once (type, default, bounds or choices, doc), checked when its group is
built, and the raw config made from the declarations (configs/base.py is `dgemma.settings.default_config()`)."""

import dataclasses
from typing import ClassVar

import pytest

from configs import base
from dgemma import settings as settings_lib, settings_fields
from dgemma.errors import ConfigError
from dgemma.settings_fields import group, setting


@dataclasses.dataclass(frozen=True)
class _Inner:
  GROUP: ClassVar[str] = "outer.inner"
  depth: int = setting(2, "how deep", lo=1, hi=8)

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class _Flat:
  GROUP: ClassVar[str] = "outer"
  flat_rate: float = setting(0.5, "a rate", lo=0.0, hi=1.0, lo_open=True)

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class _Outer:
  GROUP: ClassVar[str] = "outer"
  name: str = setting("a", "a choice", choices=("a", "b"))
  count: int = setting(0, "0 = the default count", lo=1, zero_means=7)
  pairs: tuple = setting((), "(int, int) pairs", items="pair")
  words: tuple = setting(("x",), "words", items=str)
  on: bool = setting(True, "a switch")
  inner: _Inner = group(_Inner, "a nested group")
  flat: _Flat = group(_Flat, "keys laid into this group", flatten=True)
  derived: int = 0  # not a key

  def __post_init__(self):
    settings_fields.check(self)


def test_a_group_is_checked_and_normalised_when_built():
  outer = _Outer(count=3.0, pairs=[[1, 2]], words="y")
  assert (outer.count, outer.pairs, outer.words) == (3, ((1, 2),), ("y",))  # int, tuples, a lone string
  assert _Outer().count == 7  # 0 stands for the default count
  for kwargs, message in ((dict(name="c"), r"outer.name: 'c' not in \('a', 'b'\)"),
                          (dict(count=9.5), "outer.count: must be an integer, got 9.5"),
                          (dict(count=-1), "outer.count: must be >= 1, got -1"),
                          (dict(on=1), "outer.on: must be True or False, got 1"),
                          (dict(pairs=((1, 2, 3),)), r"outer.pairs: expected \(int, int\) pairs"),
                          (dict(words=(1,)), "outer.words: needs strings, got 1")):
    with pytest.raises(ConfigError, match=message):
      _Outer(**kwargs)
  with pytest.raises(ConfigError, match="outer.flat_rate: must be > 0.0, got 0.0"):
    _Flat(flat_rate=0.0)  # a flattened group's key is named in its parent group
  with pytest.raises(ConfigError, match="outer.inner.depth: must be <= 8, got 9"):
    dataclasses.replace(_Outer().inner, depth=9)  # a typed override is checked as a config would be


def test_the_raw_config_comes_from_the_declarations():
  defaults = settings_fields.defaults(_Outer)
  assert defaults == {"name": "a", "count": 0, "pairs": (), "words": ("x",), "on": True, "inner": {"depth": 2},
                      "flat_rate": 0.5}  # nested and flattened groups; derived fields are no keys
  built = settings_fields.from_raw(_Outer, {"name": "b", "inner": {"depth": 4}, "flat_rate": 0.25}, derived=5)
  assert (built.name, built.inner.depth, built.flat.flat_rate, built.derived, built.count) == ("b", 4, 0.25, 5, 7)
  assert settings_fields.unknown_keys(_Outer, {"nme": 1, "inner": {"dpth": 1}}, "outer") == ["outer.nme", "outer.inner.dpth"]
  raw = settings_fields.to_raw(built)
  assert settings_fields.from_raw(_Outer, raw, derived=5) == built
  assert settings_fields.flat(built, "outer")["outer.inner.depth"] == 4 and "outer.flat_rate" in settings_fields.flat(built, "outer")
  listed = {row[0]: row for row in settings_fields.rows(_Outer, "outer")}
  assert listed["outer.count"][1:4] == ("int", 0, ">= 1, or 0 = 7") and listed["outer.name"][3] == "'a' | 'b'"


def test_the_field_name_is_the_key():
  """No declaration can give a key another name than its field's: what a config says is what the code reads."""
  with pytest.raises(TypeError, match="key"):
    setting(1, "x", key="y")  # pylint: disable=unexpected-keyword-arg
  built, raw = settings_lib.Settings(), settings_fields.flat(settings_lib.Settings())
  for key, *_ in settings_fields.rows(settings_lib.Settings):
    node = built
    for part in key.split("."):
      node = getattr(node, part)  # every dotted key reads as attributes of the built settings, holding its value
    assert node == raw[key], key

@dataclasses.dataclass(frozen=True)
class _Study:
  GROUP: ClassVar[str] = "outer.study"
  level: int = setting(3, "a study's setting", lo=1)

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class _Extensible(settings_fields.Extensible):
  GROUP: ClassVar[str] = "outer"
  size: int = setting(1, "a core key", lo=1)

  def __post_init__(self):
    settings_fields.check(self)


def test_a_study_group_exists_only_for_configs_that_import_its_module():
  """A group a study registers joins a config whose imports name the registering module, and no other: which keys
  a config has never depends on what else the process imported (a run saved by a process that had a study loaded
  reads back in a fresh one)."""
  settings_fields.register_group(_Extensible, "study", _Study, module="tests.a_study")
  assert settings_fields.defaults(_Extensible) == {"size": 1}
  assert settings_fields.defaults(_Extensible, ("tests.a_study",)) == {"size": 1, "study": {"level": 3}}
  assert settings_fields.unknown_keys(_Extensible, {"study": {"level": 2}}, "outer") == ["outer.study"]
  assert settings_fields.unknown_keys(_Extensible, {"study": {"levl": 2}}, "outer", ("tests.a_study",)) == [
      "outer.study.levl"]
  built = settings_fields.from_raw(_Extensible, {"study": {"level": 5}}, ("tests.a_study",))
  assert built.study.level == 5 and settings_fields.flat(built, "outer")["outer.study.level"] == 5
  assert settings_fields.to_raw(built) == {"size": 1, "study": {"level": 5}}
  assert settings_fields.from_raw(_Extensible, settings_fields.to_raw(built), ("tests.a_study",)) == built
  assert "study" not in settings_fields.to_raw(settings_fields.from_raw(_Extensible, {}))
  with pytest.raises(ConfigError, match="outer.study.level: must be >= 1, got 0"):
    settings_fields.from_raw(_Extensible, {"study": {"level": 0}}, ("tests.a_study",))
  with pytest.raises(AttributeError, match="no setting or group 'study'"):
    settings_fields.from_raw(_Extensible, {}).study  # pylint: disable=expression-not-assigned
  with pytest.raises(ValueError, match="already has a field 'size'"):
    settings_fields.register_group(_Extensible, "size", _Study, module="tests.a_study")


def test_base_config_is_every_declared_default():
  # configs/base.py is generated: a key's default lives in its declaration only
  config = base.get_config()
  assert config.to_dict() == settings_lib.default_config().to_dict()
  assert settings_fields.defaults(settings_lib.Settings)["sample"]["t_max"] == settings_lib.SamplerConfig().t_max
  assert config.imports == () and "sudoku" not in config.data  # no study's group without its module in imports
  settings = settings_lib.from_config(config)
  assert settings.model == settings_lib.ModelConfig()  # the released architecture is the default model


def test_every_key_has_a_doc_and_one_declaration():
  rows = settings_fields.rows(settings_lib.Settings)
  keys = [row[0] for row in rows]
  assert len(keys) == len(set(keys)) > 150  # no key declared twice (flattened groups included)
  assert all(row[4].strip() for row in rows), [row[0] for row in rows if not row[4].strip()]


def test_a_new_setting_needs_one_declaration():
  # what docs/architecture.md shows: a field declared in its group is a config key with its default and checks
  @dataclasses.dataclass(frozen=True)
  class Train(settings_lib.TrainSettings):
    warmup_floor: float = setting(0.0, "the learning rate never falls below this", lo=0.0)

  assert settings_fields.defaults(Train)["warmup_floor"] == 0.0
  assert settings_fields.from_raw(Train, {"warmup_floor": 1e-5}).warmup_floor == 1e-5
  with pytest.raises(ConfigError, match="train.warmup_floor: must be >= 0.0, got -1.0"):
    settings_fields.from_raw(Train, {"warmup_floor": -1.0})


def test_settings_replace_rebuilds_what_depends_on_the_key(tiny_config):
  settings = settings_lib.from_config(tiny_config)
  longer = settings.replace(**{"diffusion.canvas_len": 8, "sample.end_ids": (1, 7)})
  assert longer.canvas_sampler.canvas_len == 8 and longer.end_ids == (1, 7)  # derived values follow
  assert longer.sample.end_ids == (1, 7) and settings.sample.end_ids == ()  # the key holds what was set
  assert settings.replace(**{"sample.end_ids": ()}).end_ids == settings.end_ids  # () = auto again
  with pytest.raises(ConfigError, match="sample.t_max: must be > 0.0"):
    settings.replace(**{"sample.t_max": 0.0})
  with pytest.raises(ConfigError, match=r"sample.lol: not a config key \(python -m dgemma.settings"):
    settings.replace(**{"sample.lol": 1})
  assert settings_lib.load_json(settings.config_json) == settings  # config.json holds every key
