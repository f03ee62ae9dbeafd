"""JAX's persistent compilation cache, on by default for `dgemma.load` and every dgemma command line, so a new
process (a notebook kernel, the next sample.py) loads the programs an earlier one compiled instead of compiling
them again (a generate call of the demo: about 12 s).

  DGEMMA_COMPILATION_CACHE_DIR=/path   where to keep them (default $XDG_CACHE_HOME/dgemma/jax, else
                                       ~/.cache/dgemma/jax); '0', 'off' or '' turns the cache off
A cache directory already given to JAX (JAX_COMPILATION_CACHE_DIR, or jax.config) is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import jax
from absl import logging

ENV = "DGEMMA_COMPILATION_CACHE_DIR"
_OFF = ("", "0", "off", "false", "no", "none")


def default_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma" / "jax"


def chosen_dir(configured: Optional[str], setting: Optional[str]) -> Optional[Path]:
  """The cache directory to use given JAX's configured one and $DGEMMA_COMPILATION_CACHE_DIR (None: off)."""
  if configured:
    return Path(configured)
  if setting is not None and setting.strip().lower() in _OFF:
    return None
  return Path(setting).expanduser() if setting else default_dir()


def enable() -> Optional[str]:
  """Turns the cache on (module docstring); returns the directory in use, or None when it is off."""
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = chosen_dir(None, os.environ.get(ENV))
  if path is None:
    return None
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    logging.warning("%s: cannot create the compilation cache directory (%s); compiling without it", path, e)
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  return str(path)
