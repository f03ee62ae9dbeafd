"""Reading .jsonl files line by line, with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def records(path: str | Path) -> Iterator[tuple[str, Any]]:
  """(where, record) for every non-blank line; `where` ('data.files: PATH line N') prefixes errors."""
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"data.files: {path} line {line_number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
      yield where, record
