"""Text -> packed token batches, with grain: the text sources (shakespeare, files, tfds) of
`dgemma.data.sources`, which is where callers go:

  prepared = sources.prepare(settings)             # builds dataset + tokenizer once, cached
  it = sources.make_iterator(settings, prepared, "train", shard_index=jax.process_index(),
                             shard_count=jax.process_count())
  batch = next(it)   # {'tokens', 'segment_ids', 'positions'}: int32[B, L]
  state = it.get_state()   # JSON-serializable; it.set_state(state) resumes exactly

data.format='sft': one row per prompt/response example, with a `loss_mask` (dgemma/data/sft.py).

Packing (concat-then-split): each document becomes [BOS] + ids + [EOS]; the stream of documents
is cut into rows of data.seq_len tokens, a long document spilling over as many rows as it needs.
In a row, segment ids number the document pieces from 1 (0 = padding, token PAD) and positions
restart at 0 at each piece. Only the stream's very end (finite epochs) leaves padding, and a final
short batch is topped up with all-padding rows so every batch has the same shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import grain
from grain import experimental as grain_experimental
import numpy as np
import tensorflow_datasets as tfds

from dgemma import tokenizers
from dgemma.data import builder as builder_lib
from dgemma.data import sft
from dgemma.errors import ConfigError, DataError

_STATE_FORMAT = 1
# Fields of the iterator state that must match on set_state (else it is another stream), and the settings behind them
_STATE_IDENTITY = ("dataset_id", "split", "shard_index", "shard_count", "sharding", "seed",
                   "shuffle")
_IDENTITY_SETTING = {"dataset_id": "the dataset (data.*)", "seed": "seed", "shuffle": "data.shuffle",
                     "shard_count": "the number of processes", "shard_index": "this process's index"}


@dataclasses.dataclass(frozen=True)
class PreparedData:
  """A built dataset and its tokenizer.

  Attributes:
    tokenizer: the Tokenizer every split is encoded with.
    dataset_id: names the built dataset (its cache entry), e.g. 'shakespeare_<hash>'.
    text_key: the feature of each example that holds the document.
    splits: the split names the dataset has.
  """

  tokenizer: tokenizers.Tokenizer
  dataset_id: str
  text_key: str
  splits: tuple[str, ...]
  _open_split: Callable[[str], Any] = dataclasses.field(repr=False)
  files: tuple = ()   # ((path, size, mtime_ns), ...) of the local files it was built from: a resume names a changed one

  def data_source(self, split: str):
    """The random-access source (len() + indexing) of a split; examples are dicts."""
    if split not in self.splits:
      hint = ("; it gets documents when data.validation_fraction > 0 and there are >= 2 "
              "documents" if split == "validation" else " (see eval.split)")
      raise DataError(f"split {split!r} not in {self.dataset_id}'s splits {self.splits}{hint}")
    return self._open_split(split)

  def num_documents(self, split: str) -> int:
    return len(self.data_source(split))

  def texts(self, split: str) -> Iterator[str]:
    """The documents of a split, in stored order."""
    source = self.data_source(split)
    for index in range(len(source)):
      yield _as_text(source[index][self.text_key])


def _as_text(value) -> str:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return _as_text(value.item())
  return str(value)


def local_texts(data, split: str) -> Iterator[str]:
  """The documents of one split of a local text source (data.source 'shakespeare' / 'files'), built once
  and cached like `prepare_local` builds them, without the tokenizer."""
  source = builder_lib.build_local_dataset(data).as_data_source(split=split)
  for index in range(len(source)):
    yield _as_text(source[index]["text"])


def prepare_local(settings) -> PreparedData:
  """A text source built here (data.source 'shakespeare' or 'files'): the dataset and its tokenizer."""
  builder = builder_lib.build_local_dataset(settings.data)

  def open_split(split, builder=builder):
    return builder.as_data_source(split=split)

  files = tuple((path, Path(path).stat().st_size, Path(path).stat().st_mtime_ns)
                for path in builder.builder_config.files)
  return _with_tokenizer(settings, dict(dataset_id=builder.builder_config.name, text_key="text",
                                        splits=tuple(sorted(builder.info.splits.keys())), _open_split=open_split,
                                        files=files))


def prepare_tfds(settings) -> PreparedData:
  """data.source 'tfds': a TFDS catalog dataset and its tokenizer."""
  return _with_tokenizer(settings, _prepare_tfds(settings.data))


def _with_tokenizer(settings, prepared_source: dict) -> PreparedData:
  """Trains (first call) or loads the tokenizer data.tokenizer asks for, on the train split's text."""
  data = settings.data
  untokenized = PreparedData(tokenizer=tokenizers.ByteTokenizer(), **prepared_source)
  plain = sft.record_text if data.format == "sft" else (lambda text: text)
  tokenizer = tokenizers.build_tokenizer(
      data, train_texts=lambda: map(plain, untokenized.texts("train")), cache_key=untokenized.dataset_id)
  return dataclasses.replace(untokenized, tokenizer=tokenizer)


def _prepare_tfds(data) -> dict:
  """A TFDS catalog dataset, built as ArrayRecord (downloads on first use: needs internet)."""
  name = data.tfds_name
  data_dir = str(builder_lib.tfds_dir(data))
  try:
    tfds_builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    tfds_builder.download_and_prepare(file_format="array_record")
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"data.tfds_name={name!r}: could not build the TFDS dataset into {data_dir} "
                     f"(it needs internet the first time): {e}") from e
  features = tfds_builder.info.features
  if data.tfds_text_key not in features:
    raise ConfigError(f"data.tfds_text_key: {data.tfds_text_key!r} is not a feature of {name} "
                      f"(features: {sorted(features.keys())})")

  def open_split(split):
    return tfds_builder.as_data_source(split=split)

  dataset_id = "tfds_" + re.sub(r"[^0-9A-Za-z._-]+", "_", name)
  return dict(dataset_id=dataset_id, text_key=data.tfds_text_key,
              splits=tuple(sorted(tfds_builder.info.splits.keys())), _open_split=open_split)


class _Tokenize(grain.transforms.Map):
  """{'text': ...} -> {'tokens': int32[BOS + ids + EOS]}."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, text_key: str):
    self._tokenizer = tokenizer
    self._text_key = text_key

  def map(self, element):
    ids = self._tokenizer.encode(_as_text(element[self._text_key]))
    tokens = np.empty(len(ids) + 2, dtype=np.int32)
    tokens[0] = self._tokenizer.bos_id
    tokens[1:-1] = ids
    tokens[-1] = self._tokenizer.eos_id
    return {"tokens": tokens}


class _NameRow(grain.transforms.Map):
  """Concat-then-split output -> {'tokens', 'segment_ids', 'positions'}, PAD where segment 0."""

  def __init__(self, pad_id: int):
    self._pad_id = pad_id

  def map(self, row):
    segment_ids = row["tokens_segment_ids"].astype(np.int32)
    tokens = row["tokens"].astype(np.int32)
    if self._pad_id != 0:
      tokens = np.where(segment_ids == 0, np.int32(self._pad_id), tokens)
    return {"tokens": tokens, "segment_ids": segment_ids,
            "positions": row["tokens_positions"].astype(np.int32)}


class _PickRow(grain.transforms.Map):
  """From a group of consecutive rows, this shard's row (a padding row if the group is short)."""

  def __init__(self, shard_index: int, pad_id: int):
    self._shard_index = shard_index
    self._pad_id = pad_id

  def map(self, group):
    if self._shard_index < group["tokens"].shape[0]:
      return {k: v[self._shard_index] for k, v in group.items()}
    return _padding_rows(group, None, self._pad_id)


class FillBatch(grain.transforms.Map):
  """Tops a short final batch up to `batch_size` rows with all-padding rows."""

  def __init__(self, batch_size: int, pad_id: int):
    self._batch_size = batch_size
    self._pad_id = pad_id

  def map(self, batch):
    missing = self._batch_size - batch["tokens"].shape[0]
    if missing == 0:
      return batch
    fill = _padding_rows(batch, missing, self._pad_id)
    return {k: np.concatenate([batch[k], fill[k]]) for k in batch}


def _padding_rows(like: dict[str, np.ndarray], count: int | None, pad_id: int) -> dict[str, np.ndarray]:
  """All-padding rows with the keys of `like` [N, L]: `count` of them, or one row [L] if None."""
  shape = (like["tokens"].shape[1],) if count is None else (count, like["tokens"].shape[1])
  return {k: np.full(shape, pad_id if k == "tokens" else 0, np.int32) for k in like}


def _restore_tuples(state):
  """Undoes JSON's tuple -> list on grain's packing state (its slices must be tuples)."""
  if isinstance(state, dict):
    return {k: ({name: tuple(sl) for name, sl in v.items()} if k == "remainder_slices"
                else _restore_tuples(v)) for k, v in state.items()}
  if isinstance(state, list):
    return [_restore_tuples(v) for v in state]
  return state


class DataChanged(DataError):
  """A data iterator state saved on other data than the iterator reads (`DataIterator.set_state`): other files, or
  the same read otherwise (data.shuffle, seed, ...); the message names what changed."""


def _changed_files(saved: list, now: list) -> str:
  """What differs between two iterator states' files ([path, size, mtime_ns] each)."""
  before, after = ({path: (size, mtime) for path, size, mtime in files} for files in (saved, now))
  edited = [p for p in after if p in before and before[p] != after[p]]
  parts = [f"{p} changed (size {before[p][0]} -> {after[p][0]} bytes)" if before[p][0] != after[p][0] else
           f"{p} changed (modified after the checkpoint was saved)" for p in edited]
  parts += [f"{p} is new" for p in after if p not in before]
  parts += [f"{p} is no longer read" for p in before if p not in after]
  return "; ".join(parts) or "the dataset was built with other settings"


class DataIterator:
  """Iterator over packed batches with a JSON-serializable, exactly-resumable state."""

  def __init__(self, dataset: grain.IterDataset, identity: dict[str, Any]):
    self._dataset = dataset
    self._iterator = iter(dataset)
    self._identity = identity

  @property
  def identity(self) -> dict[str, Any]:
    """What stream this is: dataset, split, shard, seed, shapes."""
    return dict(self._identity)

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    """Position in the stream; plain JSON types (save it with orbax JsonSave)."""
    grain_state = json.loads(json.dumps(self._iterator.get_state()))
    return dict(format=_STATE_FORMAT, **self._identity, grain=grain_state)

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes at `state` (from get_state): the next batches are those that followed it."""
    if state.get("format") != _STATE_FORMAT or "grain" not in state:
      raise ValueError(f"not a dgemma data iterator state (format {state.get('format')!r})")
    if state.get("dataset_id") != self._identity["dataset_id"] and state.get("files") and self._identity.get("files"):
      raise DataChanged(_changed_files(state["files"], self._identity["files"]))
    changed = [f"{_IDENTITY_SETTING.get(key, key)}: {state.get(key)!r} -> {self._identity[key]!r}"
               for key in _STATE_IDENTITY if state.get(key) != self._identity[key]]
    if changed:
      raise DataChanged(f"the data is read otherwise than when it was saved ({'; '.join(changed)})")
    for key in ("seq_len", "batch_size"):
      if state.get(key) != self._identity[key]:
        logging.warning("Restoring a data iterator saved with %s=%r into one with %s=%r",
                        key, state.get(key), key, self._identity[key])
    self._iterator.set_state(_restore_tuples(state["grain"]))


def make_text_iterator(settings, prepared: PreparedData, split: str, *, shard_index: int, shard_count: int,
                       seed: int, shuffle: bool, num_epochs: int) -> DataIterator:
  """Packed batches of a text source's `split` (`dgemma.data.sources.make_iterator` documents the
  arguments): {'tokens', 'segment_ids', 'positions'} (+ 'loss_mask' for SFT rows): int32[B, L].

  This process reads documents shard_index, shard_index + shard_count, ... of the split (disjoint across
  processes); a split with fewer documents than shards is packed whole by every process, each keeping
  every shard_count-th row (so all shards have the same number of batches).
  """
  data = settings.data
  batch_size = data.batch_size // shard_count
  seq_len = data.seq_len
  tokenizer = prepared.tokenizer

  source = prepared.data_source(split)
  num_documents = len(source)
  if num_documents == 0:
    raise DataError(f"split {split!r} of {prepared.dataset_id} has no documents")
  # Shard by documents; a split with fewer documents than shards is sharded by packed rows.
  sharding = "rows" if num_documents < shard_count else "documents"
  dataset = grain.MapDataset.source(source)
  if shard_count > 1 and sharding == "documents":
    dataset = dataset[shard_index::shard_count]
  if shuffle:
    dataset = dataset.shuffle(seed % 2**32)
  dataset = dataset.repeat(None if num_epochs == 0 else num_epochs)
  threads = max(1, min(4, os.cpu_count() or 1))
  read_options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=16)
  if data.format == "sft":
    canvas_len = settings.diffusion.canvas_len
    if data.sft_overflow == "error":
      sft.check_fits(tokenizer, prepared.texts(split), seq_len=seq_len, canvas_len=canvas_len, split=split)
    rows = dataset.map_with_index(sft.SftRows(
        tokenizer, prepared.text_key, seq_len=seq_len, canvas_len=canvas_len, overflow=data.sft_overflow,
        seed=seed, shard_index=shard_index)).to_iter_dataset(read_options)
  else:
    dataset = dataset.map(_Tokenize(tokenizer, prepared.text_key))
    packed = grain_experimental.ConcatThenSplitIterDataset(dataset.to_iter_dataset(read_options),
                                                           length_struct={"tokens": seq_len})
    rows = packed.map(_NameRow(tokenizer.pad_id))
  if shard_count > 1 and sharding == "rows":
    rows = rows.batch(shard_count, drop_remainder=False)
    rows = rows.map(_PickRow(shard_index, tokenizer.pad_id))
  batches = rows.batch(batch_size, drop_remainder=False)
  batches = batches.map(FillBatch(batch_size, tokenizer.pad_id))
  identity = dict(dataset_id=prepared.dataset_id, split=split, shard_index=shard_index,
                  shard_count=shard_count, sharding=sharding, seed=seed, shuffle=shuffle,
                  seq_len=seq_len, batch_size=batch_size, files=[list(f) for f in prepared.files])
  return DataIterator(batches, identity)
