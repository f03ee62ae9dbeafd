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
