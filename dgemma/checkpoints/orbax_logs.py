"""Orbax's INFO records off absl's log: a run logs thousands of them (a 150-step tiny run: 3,093 of its
3,207 lines), an evaluation sweep a hundred per checkpoint load. Every place in this package that makes
an Orbax checkpointer installs the filter first, so training, sampling and every eval tool stay readable;
`--verbosity=1` (or more) brings them back. Warnings and errors pass, except Orbax's notes that a manager
opened read-only is read-only (several per load: dgemma opens every manager that only reads that way on
purpose)."""

from __future__ import annotations

import logging as py_logging
import re

from absl import flags


_READ_ONLY = re.compile(r"read.only", re.IGNORECASE)


class _QuietOrbax(py_logging.Filter):
  """Drops Orbax's INFO records unless --verbosity asks for more than INFO."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname.replace("\\", "/") or record.levelno >= py_logging.ERROR:
      return True
    if record.levelno >= py_logging.WARNING:
      return not _READ_ONLY.search(record.getMessage())
    return flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].value > 0


_QUIET_ORBAX = _QuietOrbax()


def quiet_orbax() -> None:
  """Installs the Orbax filter on absl's logger (idempotent)."""
  logger = py_logging.getLogger("absl")
  if _QUIET_ORBAX not in logger.filters:
    logger.addFilter(_QUIET_ORBAX)
