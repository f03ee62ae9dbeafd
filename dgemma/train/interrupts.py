"""Training that survives an interrupt: SIGINT (Ctrl-C, a notebook's stop button) or SIGTERM (Colab and preemptible
hosts end runtimes with it) asks the loop to stop after the step it is running; the loop saves that step's
checkpoint (atomically, as every save), and `train_and_evaluate` raises TrainingInterrupted naming the step, which
train.py prints as one line with the command that resumes, exiting non-zero. A second signal exits at once: a
checkpoint being written then is not complete, and the last complete one is what a resume restores (Orbax writes
a step to a temporary directory and renames it when done).

With several processes the request is shared each step (an all-gather of one flag), so every process stops after
the same step and the checkpoint, a collective save, is written by all of them.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from absl import logging

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
  """A context in which SIGINT / SIGTERM request a stop (`requested`) instead of killing the process. Outside the
  main thread (where Python cannot install handlers) it is inert: signals act as they would without it."""

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None:  # the second signal: at once (the last complete checkpoint stays as it is)
      os.write(2, f"{signal.Signals(signum).name} again: exiting now, without finishing the current step's "
                  "checkpoint; a resume starts from the last complete one\n".encode())
      os._exit(128 + signum)
    self.signum = signum
    logging.warning("%s: stopping after the current step, which is saved first (send it again to exit at once)",
                    signal.Signals(signum).name)

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum is not None else ""

  def requested(self) -> bool:
    """Whether a stop was requested (in any process of a multi-process run)."""
    if jax.process_count() == 1:
      return self.signum is not None
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.signum is not None))))
