"""Training metrics: the console (absl log), TensorBoard event files and WORKDIR/metrics.jsonl, one JSON record
per line {"step", "split", ...} (process 0 only).

The event files are written here (`ScalarEventWriter`): a scalar is a few bytes of protobuf in a TFRecord, and the
writers of tensorboardX / tensorboard import torch or tensorflow when installed (1.4 s at every start of a
process that trains or samples, where torch is installed)."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

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


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # CRC-32C (Castagnoli), reflected polynomial
    table.append(crc)
  return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  """TFRecord's checksum: the CRC-32C rotated right by 15 bits plus a constant."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """One TFRecord: length (u64), its masked CRC (u32), the data, the data's masked CRC (u32); little-endian."""
  length = struct.pack("<Q", len(data))
  return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1  # int64 fields: two's complement
  while True:
    bits, n = n & 0x7F, n >> 7
    out.append(bits | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  key = _varint(number << 3 | wire_type)
  return key + (_varint(len(payload)) + payload if wire_type == 2 else payload)


def _float32(value: float) -> bytes:
  """A float field's 4 bytes, rounded to nearest as protobuf does: beyond the float32 range is +-inf (a diverging
  run's metrics still write), not struct's OverflowError."""
  with np.errstate(over="ignore"):
    return np.array(value, "<f4").tobytes()


def event_proto(wall_time: float, step: int = 0, file_version: str | None = None,
                scalars: tuple[tuple[str, float], ...] = ()) -> bytes:
  """tensorflow.Event serialised as protobuf does it: wall_time (1, double), step (2, int64; omitted when 0 as
  proto3 omits a default), file_version (3), summary (5) = Summary{value (1) = Value{tag (1), simple_value (2,
  float, in a oneof: written even when 0)}}."""
  out = _field(1, 1, struct.pack("<d", wall_time))
  if step:
    out += _field(2, 0, _varint(step))
  if file_version is not None:
    out += _field(3, 2, file_version.encode())
  if scalars:
    values = b"".join(_field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, _float32(value)))
                      for tag, value in scalars)
    out += _field(5, 2, values)
  return out


class ScalarEventWriter:
  """A TensorBoard event file of scalars in `log_dir` (`tensorboard --logdir`), flushed at every write. A new
  file per writer, named as TensorBoard's writers name theirs; a resumed run adds one beside the last."""

  _opened = 0

  def __init__(self, log_dir: str | Path):
    os.makedirs(log_dir, exist_ok=True)
    ScalarEventWriter._opened += 1  # two writers of one process within a second get two files
    self.path = Path(log_dir) / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
                                 f".{ScalarEventWriter._opened}")
    self._file = open(self.path, "xb")
    self._write(event_proto(time.time(), file_version="brain.Event:2"))

  def _write(self, event: bytes) -> None:
    self._file.write(tfrecord(event))
    self._file.flush()

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """One event: every scalar of `step` in one summary (TensorBoard plots each tag on its own)."""
    self._write(event_proto(time.time(), step=int(step), scalars=tuple((t, float(v)) for t, v in scalars.items())))

  def close(self) -> None:
    self._file.close()


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
