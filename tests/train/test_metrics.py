"""dgemma/train/metrics.py's TensorBoard event files, against the reference implementations: protobuf's own
serialisation of tensorflow.Event (tensorboardX's compiled event.proto) and tensorboardX's TFRecord writer
(both from the test extra; the library writes the bytes itself, so that no process imports torch through
tensorboardX)."""

import struct

import numpy as np
import pytest

from dgemma.train import metrics


def test_crc32c_check_value():
  assert metrics.crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
  assert metrics.crc32c(b"") == 0


@pytest.mark.parametrize("wall_time, step, file_version, scalars", [
    (1733440000.25, 0, "brain.Event:2", ()),                       # a file's first event
    (1733440001.5, 7, None, (("train/loss", 2.3125),)),
    (1733440002.0, 0, None, (("eval/loss", 0.0),)),                # step 0 omitted; a 0.0 value kept (oneof)
    (1.0, 2 ** 40 + 3, None, (("train/lr", -1e-4), ("x/é", 3e38))),   # multi-byte varints, a non-ASCII tag
    (2.0, -5, None, (("neg", 1.0),)),                               # int64 two's complement: ten varint bytes
    (3.0, 1, None, (("big", 1e39), ("small", -1e39), ("edge", 3.4028235e38 * (1 + 1e-10)), ("tiny", 1e-46),
                    ("nan", float("nan")))),                        # float32 rounding: inf, max, zero, NaN
])
def test_event_bytes_equal_protobufs_serialisation(wall_time, step, file_version, scalars):
  from tensorboardX.proto import event_pb2, summary_pb2
  event = event_pb2.Event(wall_time=wall_time, step=step)
  if file_version is not None:
    event.file_version = file_version
  if scalars:
    event.summary.CopyFrom(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v)
                                                      for t, v in scalars]))
  ours = metrics.event_proto(wall_time, step=step, file_version=file_version, scalars=scalars)
  assert ours == event.SerializeToString()
  parsed = event_pb2.Event.FromString(ours)
  assert [v.tag for v in parsed.summary.value] == [t for t, _ in scalars]
  with np.errstate(over="ignore"):  # numpy's float32 rounding: the same as protobuf's (the bytes above)
    want = np.array([v for _, v in scalars], np.float64).astype(np.float32)
  np.testing.assert_array_equal([v.simple_value for v in parsed.summary.value], want)


def test_records_equal_tensorboardx_record_writer(tmp_path):
  from tensorboardX.record_writer import RecordWriter
  payloads = [b"", b"a", metrics.event_proto(5.0, step=3, scalars=(("t", 1.5),)), bytes(range(256)) * 3]
  reference = RecordWriter(str(tmp_path / "reference"))
  for p in payloads:
    reference.write(p)
  reference.close()
  assert b"".join(metrics.tfrecord(p) for p in payloads) == (tmp_path / "reference").read_bytes()


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
  writer.write(4, {"loss": 2.75}, prefix="eval")
  writer.close()
  (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
  events = _read_events(path)
  assert events[0].file_version == "brain.Event:2" and len(events) == 3  # one event per write
  got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
  assert got == [(2, "train/loss", 3.5), (2, "train/lr", pytest.approx(1e-3, rel=1e-7)), (4, "eval/loss", 2.75)]
  assert [r["split"] for r in metrics.read_metrics(tmp_path)] == ["train", "eval"]
  writer = metrics.MetricWriter(tmp_path)  # a resumed run: a second file beside the first, the first intact
  writer.write(6, {"loss": 2.5})
  writer.close()
  assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
  assert _read_events(path)[1:] == events[1:]
