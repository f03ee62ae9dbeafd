"""Training metrics: the console (absl log), TensorBoard event files and WORKDIR/metrics.jsonl, one JSON record
per line {"step", "split", ...} (process 0 only).

The event files go through the tensorboard package's event-file writer (`ScalarEventWriter`), imported when a run
first writes metrics, never TensorFlow or torch (tensorboardX imports torch whenever it is installed: 1.4 s at every
start of a process that trains or samples)."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
from absl import logging

from dgemma import files
from dgemma.checkpoints import workdir as workdir_ckpt

METRICS_FILE = "metrics.jsonl"


def interactive_output() -> bool:
  """Whether stderr is read as it is written: a terminal, or a notebook (IPython's kernel). A progress bar belongs
  there; in a log file or a pipe its redraws are escape codes between the log lines."""
  try:
    if sys.stderr.isatty():
      return True
  except (AttributeError, ValueError):  # a replaced or closed stream
    pass
  return "ipykernel" in sys.modules


def read_metrics(workdir: str | Path) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl (a half-written last line, which kill -9 can leave, is skipped)."""
  path = Path(workdir) / METRICS_FILE
  if not path.exists():
    raise FileNotFoundError(f"--workdir: {path} not found (train first)")
  return list(files.read_jsonl_records(path))


def train_minutes(workdir: str | Path) -> dict[int, float]:
  """Cumulative training minutes at each logged train step of a workdir: the sum of the logged windows
  (log_every steps of batch x seq_len tokens at the window's tokens/s; evaluation and checkpointing excluded)."""
  config = json.loads(workdir_ckpt.read_config_json(workdir))
  tokens_per_step = config["data"]["batch_size"] * config["data"]["seq_len"]
  minutes, total, last_step = {}, 0.0, 0
  for row in read_metrics(workdir):
    if row.get("split") != "train" or not row.get("tokens_per_sec"):
      continue
    total += (row["step"] - last_step) * tokens_per_step / row["tokens_per_sec"] / 60.0
    last_step = row["step"]
    minutes[row["step"]] = total
  return minutes


class ScalarEventWriter:
  """A TensorBoard event file of scalars in `log_dir` (`tensorboard --logdir`), flushed at every write, through
  the tensorboard package's own event-file writer (the one torch.utils.tensorboard uses), imported here on first
  use. A new file per writer; a resumed run adds one beside the last.

  The writer reaches file operations through tensorboard's TensorFlow compatibility layer, which imports
  TensorFlow when it is installed; `_tensorboard_without_tensorflow` makes it take tensorboard's own stub, so
  training never imports TensorFlow (or torch)."""

  def __init__(self, log_dir: str | Path):
    _tensorboard_without_tensorflow()
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # pylint: disable=g-import-not-at-top
    os.makedirs(log_dir, exist_ok=True)
    self._writer = EventFileWriter(str(log_dir))

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """One event: every scalar of `step` in one summary (TensorBoard plots each tag on its own)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2  # pylint: disable=g-import-not-at-top
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as protobuf writes it (a diverging run)
      values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(np.float32(v))) for tag, v in scalars.items()]
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                           summary=summary_pb2.Summary(value=values)))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def _tensorboard_without_tensorflow() -> None:
  """tensorboard.compat picks its stub of TensorFlow's file API when `tensorboard.compat.notf` is importable (its
  build's "no TensorFlow" switch); registering an empty module under that name flips it."""
  if "tensorboard.compat.notf" not in sys.modules:
    sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")


class MetricWriter:
  """Console, TensorBoard and metrics.jsonl in the workdir."""

  def __init__(self, workdir: Path, enabled: bool = True):
    self.enabled = enabled and jax.process_index() == 0
    self.jsonl = Path(workdir) / METRICS_FILE
    self.tb = ScalarEventWriter(Path(workdir) / "tensorboard") if self.enabled else None

  def truncate_after(self, step: int) -> None:
    """Drops the records past `step` (a resume from `step` writes them again) and a half-written last
    line, so every step has one train row. Atomic: the file is rewritten beside and renamed."""
    if not self.enabled or not self.jsonl.exists():
      return
    kept = [r for r in files.read_jsonl_records(self.jsonl) if int(r.get("step", 0)) <= step]
    files.write_text_atomic(self.jsonl, "".join(json.dumps(r) + "\n" for r in kept))

  def write(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
    if not self.enabled:
      return
    self.tb.write_scalars(step, {f"{prefix}/{k}": v for k, v in metrics.items()})
    with open(self.jsonl, "a") as f:
      f.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    logging.info("[%s] step %d: %s", prefix, step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))

  def close(self):
    if self.tb is not None:
      self.tb.close()
