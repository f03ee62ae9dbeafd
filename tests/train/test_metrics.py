"""dgemma/train/metrics.py: metrics.jsonl and the TensorBoard event files, written through the tensorboard
package's event-file writer and read back here with tensorboardX's record checksum (an independent reader), and
without importing TensorFlow or torch."""

import struct
import subprocess
import sys

import numpy as np
import pytest

from dgemma.train import metrics


def _read_events(path):
  """Every event of a file, each record's length and checksums verified."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c
  data, events, at = path.read_bytes(), [], 0
  while at < len(data):
    header = data[at:at + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
    body = data[at + 12:at + 12 + length]
    assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(body)
    events.append(event_pb2.Event.FromString(body))
    at += 16 + length
  return events


def test_metric_writer_files_read_back(tmp_path):
  writer = metrics.MetricWriter(tmp_path)
  writer.write(2, {"loss": 3.5, "lr": 1e-3})
  writer.write(4, {"loss": 2.75, "grad_norm": 1e39}, prefix="eval")  # a diverging run's value: +inf in float32
  writer.close()
  (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
  events = _read_events(path)
  assert events[0].file_version == "brain.Event:2" and len(events) == 3  # one event per write
  got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
  assert got == [(2, "train/loss", 3.5), (2, "train/lr", pytest.approx(1e-3, rel=1e-7)), (4, "eval/loss", 2.75),
                 (4, "eval/grad_norm", np.inf)]
  assert [r["split"] for r in metrics.read_metrics(tmp_path)] == ["train", "eval"]
  writer = metrics.MetricWriter(tmp_path)  # a resumed run: a second file beside the first, the first intact
  writer.write(6, {"loss": 2.5})
  writer.close()
  assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
  assert _read_events(path)[1:] == events[1:]


def test_writing_metrics_imports_no_tensorflow():
  assert "tensorflow" not in sys.modules or pytest.skip("TensorFlow was imported before this test")
  metrics._tensorboard_without_tensorflow()
  from tensorboard.compat import tf  # what the event-file writer reaches its files through
  assert tf.__name__ == "tensorboard.compat.tensorflow_stub" and "tensorflow" not in sys.modules


@pytest.mark.slow  # a subprocess: a fresh process that trains writes metrics without torch or TensorFlow
def test_a_training_process_imports_neither_torch_nor_tensorflow(tmp_path):
  code = ("import sys\nfrom dgemma.train import metrics\nw = metrics.MetricWriter(sys.argv[1])\n"
          "w.write(1, {'loss': 1.0})\nw.close()\nprint(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]"
