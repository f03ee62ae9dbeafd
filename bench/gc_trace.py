"""Tracing and lowering a train step at CPython's garbage-collector thresholds against dgemma's commands' ones.

  .venv/bin/python bench/gc_trace.py [--config=configs/tiny_test.py] [--pairs=4]

Each measurement builds the run's jitted programs afresh (nothing cached in the process) and times
`train_step.lower(...)` (trace + lowering to StableHLO; no XLA compile), taken in turn at (700, 10, 10) (CPython's
default) and at `dgemma.tools.cli.GC_THRESHOLDS`; prints each pair and the ratio of the medians.
"""

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.tools import cli, memory
from dgemma.train import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_test.py", "Experiment config file.")
_PAIRS = flags.DEFINE_integer("pairs", 4, "Measurements at each setting, taken in turn.")
CPYTHON_DEFAULT = (700, 10, 10)


def lower_seconds(settings, mesh, thresholds) -> float:
  """Seconds to trace and lower a fresh train step of `settings` with the collector at `thresholds`."""
  loop.clear_programs()
  gc.collect()
  gc.set_threshold(*thresholds)
  try:
    t = time.perf_counter()
    programs = loop.run_programs(settings, mesh)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
      programs.train_step.lower(programs.abstract_state, loop.batch_specs(settings, mesh), rng)
    return time.perf_counter() - t
  finally:
    gc.set_threshold(*CPYTHON_DEFAULT)


def main(argv):
  del argv
  settings = settings_lib.from_config(_CONFIG.value)
  mesh = memory.one_device_mesh()
  lower_seconds(settings, mesh, cli.GC_THRESHOLDS)  # warm-up: imports and one-time caches
  default, tuned = [], []
  for i in range(_PAIRS.value):
    default.append(lower_seconds(settings, mesh, CPYTHON_DEFAULT))
    tuned.append(lower_seconds(settings, mesh, cli.GC_THRESHOLDS))
    print(f"pair {i}: {CPYTHON_DEFAULT} {default[-1]:.2f} s, {cli.GC_THRESHOLDS} {tuned[-1]:.2f} s", flush=True)
  a, b = statistics.median(default), statistics.median(tuned)
  print(f"trace + lower, median: {a:.2f} s at {CPYTHON_DEFAULT}, {b:.2f} s at {cli.GC_THRESHOLDS} ({b / a:.2f}x)")


if __name__ == "__main__":
  app.run(main)
