"""Writing files so that a reader never sees half of one, and reading append-only logs that a crash may
have cut short."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


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
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


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
