"""Host time to make one training batch: the data pipeline alone, no model (what bounds the steps per second
when the device step is shorter, as on a GPU).

  .venv/bin/python bench/data_throughput.py --config=proj/sudoku/configs/sudoku_gpu.py \
      --config.data.sudoku.train_csv=/work/sudoku/data/train.csv [--batches=100 --rounds=3]

Builds the config's training stream exactly as the train loop does (`dgemma.data.make_iterator`, split 'train'),
takes one batch (start-up), then times `batches` batches, `rounds` times, and prints ms per batch (median and min
over the rounds) and rows per second. To compare two versions of the pipeline, run this script from each checkout
in turn (docs/benchmarks.md, "Sudoku rows on the host", has the interleaved command).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags
from ml_collections import config_flags

from bench.timing import host_cpu
from dgemma import data as data_lib
from dgemma import settings as settings_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config.")
_BATCHES = flags.DEFINE_integer("batches", 100, "Batches per timing.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timings.")


def main(argv):
  del argv
  settings = settings_lib.from_config(_CONFIG.value)
  prepared = data_lib.prepare(settings)
  stream = data_lib.make_iterator(settings, prepared, "train")
  next(stream)
  times = []
  for _ in range(_ROUNDS.value):
    start = time.perf_counter()
    for _ in range(_BATCHES.value):
      next(stream)
    times.append((time.perf_counter() - start) / _BATCHES.value)
  rows = settings.data.batch_size
  print(f"cpu: {host_cpu()}")
  print(f"config: {_CONFIG.value.model.get('preset', '?')}  source={settings.data.source}  batch={rows}x{settings.data.seq_len}")
  print(f"host batch: median {1e3 * statistics.median(times):.1f} ms, min {1e3 * min(times):.1f} ms "
        f"({rows / statistics.median(times):,.0f} rows/s) over {_ROUNDS.value} x {_BATCHES.value} batches")


if __name__ == "__main__":
  app.run(main)
