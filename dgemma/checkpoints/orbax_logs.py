"""Orbax's INFO records off absl's log: a run logs thousands of them (a 150-step tiny run: 3,093 of its
3,207 lines), an evaluation sweep a hundred per checkpoint load. Every place in this package that makes
an Orbax checkpointer installs the filter first, so training, sampling and every eval tool stay readable;
`--verbosity=1` (or more) brings them back. Warnings and errors pass, except Orbax's notes that a manager
opened read-only is read-only (several per load: dgemma opens every manager that only reads that way on
purpose); an error keeps its first line, not its traceback. `closed_loop_noise_dropped` drops what
a failed asynchronous save leaves behind: tensorstore's callbacks into Orbax's closed event loops."""

from __future__ import annotations

import contextlib
import logging as py_logging
import re
import sys
from typing import Iterator

from absl import flags


_READ_ONLY = re.compile(r"read.only", re.IGNORECASE)


def _verbose() -> bool:
  """--verbosity asks for more than INFO."""
  return flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].value > 0


class _QuietOrbax(py_logging.Filter):
  """Drops Orbax's INFO records and its errors' tracebacks unless --verbosity asks for more than INFO."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname.replace("\\", "/"):
      return True
    if record.levelno >= py_logging.ERROR:
      # A failed save is logged by each of Orbax's threads with the whole traceback (hundreds of lines for a full
      # disk); the run reports it in one line (checkpoints.workdir.save_error). Each record keeps its first line,
      # its traceback too with --verbosity=1 or more.
      if (record.exc_info is not None or "\n" in record.getMessage()) and not _verbose():
        first = record.getMessage().strip().splitlines()[0] if record.getMessage().strip() else ""
        record.msg, record.args, record.exc_info, record.exc_text = first[:300], None, None, None
      return True
    if record.levelno >= py_logging.WARNING:
      return not _READ_ONLY.search(record.getMessage())
    return _verbose()


_QUIET_ORBAX = _QuietOrbax()


def _is_closed_loop_noise(unraisable) -> bool:
  text = str(unraisable.exc_value)
  return ((isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in text)
          or (isinstance(unraisable.exc_value, ImportError) and "shutting down" in text))


@contextlib.contextmanager
def closed_loop_noise_dropped() -> Iterator[None]:
  """While a run saves asynchronously: drops the unraisable RuntimeError('Event loop is closed') that tensorstore's
  callbacks raise into Orbax's closed event loops once a save has failed (dozens of tracebacks; the save's own
  error is reported in one line, checkpoints.workdir.save_error). Other unraisable exceptions go to the hook
  installed before. A block that ends in an exception leaves the filter in place for the rest of the process
  (Orbax's coroutines then fail again at interpreter shutdown)."""
  before = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None if _is_closed_loop_noise(unraisable) else before(unraisable)
  yield
  sys.unraisablehook = before


def quiet_orbax() -> None:
  """Installs the Orbax filter on absl's logger (idempotent)."""
  logger = py_logging.getLogger("absl")
  if _QUIET_ORBAX not in logger.filters:
    logger.addFilter(_QUIET_ORBAX)
