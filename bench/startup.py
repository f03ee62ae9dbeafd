"""How long a fresh process takes to import what each command needs, against `import jax` alone in the same run.

  .venv/bin/python bench/startup.py [--repeats=5] [--modules=jax,dgemma.api,train,eval.likelihood,train+tensorboardX]

Each entry is timed in a new interpreter (`python -c "import ..."`, `+` joins modules imported together), the
entries interleaved round by round so that a slow spell of the host falls on all of them; prints the median wall
and CPU seconds of each and its ratio to `jax` (the floor every command pays). Every training run, sample.py
call, eval command and test subprocess pays its entry's time before any work. `train+tensorboardX` is what
`train` cost while the metric writer was tensorboardX (it imports torch whenever torch is installed).
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import app, flags

from bench.timing import host_cpu

_REPEATS = flags.DEFINE_integer("repeats", 5, "Fresh processes per entry.")
_MODULES = flags.DEFINE_list("modules", ["jax", "dgemma.api", "train", "eval.likelihood", "train+tensorboardX"],
                             "What each process imports ('+' joins modules); the first is the reference.")


def import_code(entry: str) -> str:
  """The -c program of one entry: its imports, then the process's own CPU seconds on stdout."""
  imports = "; ".join(f"import {m}" for m in entry.split("+"))
  return f"import time; {imports}; print(time.process_time())"


def time_import(entry: str) -> tuple[float, float]:
  """(wall, CPU) seconds of a fresh interpreter that imports `entry`; the CPU seconds are its own, as it reports them."""
  start = time.perf_counter()
  run = subprocess.run([sys.executable, "-c", import_code(entry)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  wall = time.perf_counter() - start
  if run.returncode != 0:
    raise RuntimeError(f"--modules: importing {entry!r} failed:\n{run.stderr[-2000:]}")
  return wall, float(run.stdout.split()[-1])


def measure(entries: list[str], repeats: int) -> dict[str, dict[str, float]]:
  """Median wall and CPU seconds of each entry, and the wall ratio to the first entry's."""
  samples = {e: [] for e in entries}
  for _ in range(repeats):
    for e in entries:
      samples[e].append(time_import(e))
  out = {e: {"wall_s": statistics.median(w for w, _ in s), "cpu_s": statistics.median(c for _, c in s)}
         for e, s in samples.items()}
  for e in entries:
    out[e]["ratio"] = out[e]["wall_s"] / out[entries[0]]["wall_s"]
  return out


def main(argv):
  del argv
  if _REPEATS.value < 1:
    raise app.UsageError(f"--repeats: must be >= 1, got {_REPEATS.value}")
  print(f"cpu: {host_cpu()}; {_REPEATS.value} fresh processes per entry, interleaved; medians")
  result = measure(_MODULES.value, _REPEATS.value)
  print(f"{'imports':>28} {'wall s':>7} {'CPU s':>6} {'/ ' + _MODULES.value[0]:>8}")
  for entry, r in result.items():
    print(f"{entry:>28} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} {r['ratio']:>8.2f}")


if __name__ == "__main__":
  app.run(main)
