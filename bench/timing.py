"""Wall-time measurement shared by the bench scripts (imports only jax and the standard library)."""

import os
import platform
import statistics
import time
from pathlib import Path

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


def matmul_gflops(n: int = 2048, reps: int = 10, trials: int = 5) -> float:
  """The best of `trials` timings of `reps` f32 n^3 matmuls, in GFLOP/s: the machine's practical peak, the
  reference the throughput benchmarks report their rates against. (One timing moved by 1.4x between two runs on a
  quiet machine; the best of several is stable to a few percent.)"""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = 0.0
  for _ in range(trials):
    t = time.perf_counter()
    for _ in range(reps):
      out = f(a)
    out.block_until_ready()
    best = max(best, 2 * n**3 * reps / (time.perf_counter() - t) / 1e9)
  return best


def host_cpu() -> str:
  """The CPU these figures come from, e.g. 'AMD EPYC (family 26 model 2; avx512f avx512_bf16), 2 cores'. Ratios against
  torch or a matmul rate move with it: XLA's CPU kernels and torch's use AVX-512 differently."""
  fields = {}
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      key, _, value = line.partition(":")
      fields.setdefault(key.strip(), value.strip())
  except OSError:
    return platform.processor() or platform.machine()
  flags = set(fields.get("flags", "").split())
  wide = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags] or [f for f in ("avx2",) if f in flags]
  return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')} model "
          f"{fields.get('model', '?')}; {' '.join(wide) or 'no avx2'}), {os.cpu_count()} cores")
