"""Data sources behind one interface: each `data.source` is a record of `SOURCES` with three functions,

  validate(settings)                     cheap checks before anything is built (files exist, shapes fit)
  prepare(settings) -> PreparedData      builds the dataset and its tokenizer once (cached), then opens it
  make_iterator(settings, prepared, split, *, shard_index, shard_count, seed, shuffle, num_epochs)
      -> DataIterator                    batches {'tokens', 'segment_ids', 'positions', ...}: int32[B, L]
                                         with an exactly-resumable JSON state

and callers go through `prepare` / `make_iterator` below. `settings` is a `dgemma.settings.Settings`.
Adding a source touches this table and the source's own module (and its test):

  shakespeare  the bundled Shakespeare corpus (dgemma/data/shakespeare.py), packed text
  files        the user's .txt / .jsonl files, packed text, or SFT rows with data.format='sft'
  tfds         a TFDS catalog dataset (needs internet the first time), packed text
A study's source (proj/<study>/) is added by `register` when its module is imported: a config that uses it names
that module in `imports`, which dgemma.settings imports before it checks data.source.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from dgemma import registry
from dgemma.data import builder, pipeline
from dgemma.data.pipeline import DataIterator, PreparedData
from dgemma.errors import ConfigError


def _validate_files(settings) -> None:
  builder.check_files(settings.data.files)


def _validate_tfds(settings) -> None:
  if not settings.data.tfds_name:
    raise ConfigError("data.tfds_name: empty, but data.source='tfds' needs a TFDS catalog name (e.g. 'lm1b')")


def _no_checks(settings) -> None:
  del settings


@dataclasses.dataclass(frozen=True)
class DataSource:
  name: str
  validate: Callable
  prepare: Callable
  make_iterator: Callable


SOURCES = registry.Table("data.source", (
    DataSource("shakespeare", _no_checks, pipeline.prepare_local, pipeline.make_text_iterator),
    DataSource("files", _validate_files, pipeline.prepare_local, pipeline.make_text_iterator),
    DataSource("tfds", _validate_tfds, pipeline.prepare_tfds, pipeline.make_text_iterator),
))
register, names, get = SOURCES.register, SOURCES.names, SOURCES.lookup  # a study's module calls register


def prepare(settings) -> PreparedData:
  """Checks the source's settings (its `validate`), then builds the dataset and the tokenizer of
  settings.data (first call; later calls reuse the cache)."""
  source = get(settings.data.source)
  tok = settings.data.tokenizer
  if tok.kind == "file" and not os.path.isfile(tok.path):
    raise FileNotFoundError(f"data.tokenizer.path: {tok.path!r} does not exist (data.tokenizer.kind='file' needs a "
                            "SentencePiece .model or a tokenizer.json file)")
  source.validate(settings)
  return source.prepare(settings)


def make_iterator(settings, prepared: PreparedData, split: str, *, shard_index: int = 0, shard_count: int = 1,
                  seed: int | None = None, shuffle: bool | None = None,
                  num_epochs: int | None = None) -> DataIterator:
  """Batches of `split`, B = data.batch_size // shard_count rows of L = data.seq_len tokens.

  shard_index / shard_count: this process's share (processes read disjoint documents).
  shuffle: default data.shuffle for 'train', False for other splits; order from `seed` (default
    settings.seed), reshuffled each epoch.
  num_epochs: default data.num_epochs (0 = repeat forever); a finite stream's last batch is topped up
    with padding rows.
  """
  data = settings.data
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ConfigError(f"shard_index: {shard_index} not in [0, shard_count={shard_count})")
  if data.batch_size % shard_count:
    raise ConfigError(f"data.batch_size: {data.batch_size} is not divisible by the {shard_count} data shards "
                      "(processes)")
  num_epochs = data.num_epochs if num_epochs is None else int(num_epochs)
  if num_epochs < 0:
    raise ConfigError(f"data.num_epochs: must be >= 0 (0 = repeat forever), got {num_epochs}")
  return get(data.source).make_iterator(
      settings, prepared, split, shard_index=shard_index, shard_count=shard_count,
      seed=int(settings.seed if seed is None else seed),
      shuffle=bool(data.shuffle and split == "train") if shuffle is None else bool(shuffle), num_epochs=num_epochs)
