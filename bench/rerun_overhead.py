"""What a training run costs before its first step, and what run_programs saves on a second run in one process.

  .venv/bin/python bench/rerun_overhead.py --config=configs/tiny_test.py \
      --config.data.source=files --config.data.files="('/path/train.txt',)"

Three runs of `dgemma.train.loop.train_and_evaluate` of one config in this process, each into a new workdir
(a fresh state, nothing to resume):
  1. first: traces, compiles (or loads from JAX's persistent compilation cache) and trains, after building the
     dataset if data.cache_dir does not hold it yet (so compare the other two: both read the built dataset);
  2. again: reuses the jitted init / train / eval programs (`dgemma.train.loop.run_programs`);
  3. cleared: the same after `dgemma.train.loop.clear_programs()`, i.e. what every run in a process cost before
     the programs were cached: traced and compiled again (the compiles are loaded instead where JAX's persistent
     compilation cache is on, as in the test suite: JAX_COMPILATION_CACHE_DIR).
Prints each run's seconds and the ratio again / cleared (the saving a resume or a re-run notebook cell gets). The
runs' training steps are the same work, so with a few steps the ratio is mostly tracing and compiling.
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags
from ml_collections import config_flags

from bench.timing import host_cpu
from dgemma.train import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_test.py", "Experiment config.")
_WORKDIRS = flags.DEFINE_string("workdirs", "", "Where the three runs write (default: a temporary directory).")


def run(config, workdirs: str) -> dict[str, float]:
  """Seconds of each of the three runs (module docstring), in order."""
  root = Path(workdirs or tempfile.mkdtemp(prefix="rerun_overhead_"))
  seconds = {}
  for name in ("first", "again", "cleared"):
    if name == "cleared":
      loop.clear_programs()
    start = time.perf_counter()
    loop.train_and_evaluate(config, str(root / name))
    seconds[name] = time.perf_counter() - start
    print(f"{name}: {seconds[name]:.2f} s", flush=True)
  return seconds


def main(argv):
  del argv
  config = _CONFIG.value
  config.train.progress_bar = False
  print(host_cpu())
  seconds = run(config, _WORKDIRS.value)
  print(f"again / cleared: {seconds['again'] / seconds['cleared']:.3f}")


if __name__ == "__main__":
  app.run(main)
