"""The persistent compilation cache of dgemma.load and the command lines (dgemma/jax_cache.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma import jax_cache

REPO = Path(__file__).resolve().parents[1]


def test_the_cache_directory_is_chosen_by_jax_then_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert jax_cache.chosen_dir(None, None) == tmp_path / "xdg" / "dgemma" / "jax"  # on by default
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert jax_cache.chosen_dir(None, None) == Path.home() / ".cache" / "dgemma" / "jax"
  assert jax_cache.chosen_dir(None, "/somewhere") == Path("/somewhere")
  for off in ("0", "off", "", "false"):
    assert jax_cache.chosen_dir(None, off) is None
  assert jax_cache.chosen_dir("/from/jax", "0") == Path("/from/jax")  # a directory given to JAX is kept


@pytest.mark.slow  # a subprocess (the command line in a fresh process)
def test_a_command_line_fills_the_cache(tiny_run, tmp_path):  # (reading it back is JAX's own)
  env = {k: v for k, v in os.environ.items()  # JAX's own cache settings (make test turns the cache off) left out
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMPILATION_CACHE"))}
  env.update(DGEMMA_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "sample.py", f"--checkpoint={tiny_run[0]}", "--steps=2"]
  first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  assert any((tmp_path / "cache").iterdir())  # the generate program (seconds to compile) was written
