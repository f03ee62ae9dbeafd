"""Wall-time measurement shared by the bench scripts (imports only jax and the standard library)."""

import statistics
import time

import jax


def median_seconds(fn, reps: int) -> float:
  """Median wall time of fn() (blocked until ready) over `reps` calls, after one warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)
