"""Writing files so that a reader never sees half of one, and reading append-only logs that a crash may
have cut short."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from dgemma.errors import CheckpointError, ConfigError


_UMASK_LOCK = threading.Lock()


def umask_mode() -> int:
  """The mode a plain new file gets under the process umask (0o644 under the usual 022): what files written
  through a temporary file (mkstemp and safetensors create theirs 0600) are given before the rename."""
  with _UMASK_LOCK:  # the umask can only be read by setting it
    mask = os.umask(0o022)
    os.umask(mask)
  return 0o666 & ~mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` via a temporary file, fsync and rename: readers never see a partial file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, umask_mode())  # mkstemp creates 0600; results are meant to be shared
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def copy_file_atomic(source: str | os.PathLike, path: str | os.PathLike) -> None:
  """Copies `source` to `path` via a temporary file and rename (the umask's permissions)."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    shutil.copyfile(source, tmp)
    os.chmod(tmp, umask_mode())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_writable(path: str | os.PathLike, field: str) -> None:
  """`path` can be written as a file (the check commands make before any expensive work): not a directory, and
  its nearest existing parent is a directory this process may write in. Errors name `field`."""
  p = Path(path).expanduser().absolute()
  if p.is_dir():
    raise ConfigError(f"{field}: {path} is a directory; name a file")
  parent = p.parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir():
    raise ConfigError(f"{field}: cannot create {path}: {parent} is a file, not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f"{field}: cannot write {path}: no write permission in {parent}")


def parse_json(text: str, path: str | os.PathLike) -> Any:
  """`text` (the contents of the checkpoint metadata file `path`) as JSON; a truncated or damaged file is a
  CheckpointError naming it."""
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e}); the file is damaged or was cut short") from None


def read_json(path: str | os.PathLike) -> Any:
  """A checkpoint metadata file (config.json, model_config.json, ...) as JSON (`parse_json`)."""
  return parse_json(Path(path).read_text(encoding="utf-8"), path)


def read_jsonl_records(path: str | os.PathLike) -> Iterator[dict]:
  """The records of an append-only JSONL log. A last line without its newline that is not JSON is a write
  that a crash (kill -9) cut short: it is skipped. Any other line that is not JSON raises, naming the file
  and line."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  complete, tail = lines[:-1], lines[-1]  # `tail` is '' when the file ends with a newline
  for number, line in enumerate(complete, 1):
    if line.strip():
      try:
        yield json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number}: not valid JSON ({e})") from e
  if tail.strip():
    try:
      yield json.loads(tail)
    except json.JSONDecodeError:
      pass  # the half-written last record of an interrupted run
