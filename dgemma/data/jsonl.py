"""Reading the user's text files: decoding with errors that name the file and line, and .jsonl records.

`data.encoding_errors` decides what an invalid UTF-8 byte does: 'strict' (default) raises a ValueError
naming the file, the line and the byte offset, with the setting that would let it through; 'replace'
substitutes U+FFFD for it (and the dataset cache key records the choice).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from dgemma.errors import DataError

ENCODING_HINT = "set data.encoding_errors='replace' to read it with U+FFFD in place of bad bytes"


def decode(data: bytes, path: str | Path, encoding_errors: str = "strict", *, first_line: int = 1,
           hint: str = ENCODING_HINT) -> str:
  """UTF-8 text of `data` (the bytes of `path` from line `first_line` on); errors name file and line, then `hint`."""
  try:
    return data.decode("utf-8", errors=encoding_errors)
  except UnicodeDecodeError as e:
    line = first_line + data.count(b"\n", 0, e.start)
    raise DataError(f"{path} line {line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start} of the "
                     f"file: {e.reason}); {hint}") from None


def read_text(path: str | Path, encoding_errors: str = "strict") -> str:
  """The whole file as text (see `decode`)."""
  return decode(Path(path).read_bytes(), path, encoding_errors)


def records(path: str | Path, encoding_errors: str = "strict") -> Iterator[tuple[str, Any]]:
  """(where, record) for every non-blank line; `where` ('data.files: PATH line N') prefixes errors."""
  with open(path, "rb") as f:
    for line_number, raw in enumerate(f, 1):
      line = decode(raw, path, encoding_errors, first_line=line_number)
      if not line.strip():
        continue
      where = f"data.files: {path} line {line_number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from e
      yield where, record
