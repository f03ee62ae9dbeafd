"""Training metrics: the console (absl log), TensorBoard event files (tensorboardX) and
WORKDIR/metrics.jsonl, one JSON record per line {"step", "split", ...} (process 0 only)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
from absl import logging
from tensorboardX import SummaryWriter

from dgemma import files
from dgemma.checkpoints import workdir as workdir_ckpt

METRICS_FILE = "metrics.jsonl"


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


class MetricWriter:
  """Console, TensorBoard and metrics.jsonl in the workdir."""

  def __init__(self, workdir: Path, enabled: bool = True):
    self.enabled = enabled and jax.process_index() == 0
    self.jsonl = Path(workdir) / METRICS_FILE
    self.tb = SummaryWriter(str(Path(workdir) / "tensorboard")) if self.enabled else None

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
    for k, v in metrics.items():
      self.tb.add_scalar(f"{prefix}/{k}", v, step)
    with open(self.jsonl, "a") as f:
      f.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    logging.info("[%s] step %d: %s", prefix, step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))

  def close(self):
    if self.tb is not None:
      self.tb.flush()
      self.tb.close()
