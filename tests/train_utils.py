"""What the training tests share: a real SIGTERM delivered in the middle of a run."""

import contextlib
import os
import signal

from dgemma.train import metrics as metrics_lib


@contextlib.contextmanager
def sigterm_when_logged(monkeypatch, step: int):
  """Inside the block, this process gets a real SIGTERM right after the train metrics row of `step` is written
  (MetricWriter.write), i.e. while the run goes on to its next step; the writer is itself again afterwards."""
  write = metrics_lib.MetricWriter.write

  def write_then_signal(self, at, values, prefix="train"):
    write(self, at, values, prefix)
    if at == step and prefix == "train":
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(metrics_lib.MetricWriter, "write", write_then_signal)
  try:
    yield
  finally:
    monkeypatch.setattr(metrics_lib.MetricWriter, "write", write)
