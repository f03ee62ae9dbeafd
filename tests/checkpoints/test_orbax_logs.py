"""dgemma.checkpoints.orbax_logs: Orbax's INFO records are dropped from absl's log (warnings kept, other
libraries untouched) as soon as this package makes an Orbax checkpointer, so sampling and the eval tools
are as quiet as training (a sweep of 15 checkpoint loads logged 161 Orbax INFO lines before)."""

import logging

import numpy as np

from dgemma.checkpoints import orbax_logs, params as params_ckpt


def _record(path, level):
  return logging.LogRecord("absl", level, path, 1, "msg", None, None)


def test_filter_drops_orbax_info_only():
  f = orbax_logs._QUIET_ORBAX
  orbax_file = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
  assert not f.filter(_record(orbax_file, logging.INFO))  # absl's --verbosity is 0 (or unparsed) here
  assert f.filter(_record(orbax_file, logging.WARNING)) and f.filter(_record(orbax_file, logging.ERROR))
  assert f.filter(_record("/work/dgemma/train/metrics.py", logging.INFO))


def test_saving_and_loading_a_params_checkpoint_installs_it(tmp_path):
  logger = logging.getLogger("absl")
  logger.removeFilter(orbax_logs._QUIET_ORBAX)
  assert orbax_logs._QUIET_ORBAX not in logger.filters
  params_ckpt.save_params(tmp_path / "p", {"w": np.ones((2, 3), np.float32)}, {"vocab_size": 8})
  assert orbax_logs._QUIET_ORBAX in logger.filters
  logger.removeFilter(orbax_logs._QUIET_ORBAX)
  params, _ = params_ckpt.load_params(tmp_path / "p")
  np.testing.assert_array_equal(params["w"], np.ones((2, 3), np.float32))
  assert orbax_logs._QUIET_ORBAX in logger.filters
  orbax_logs.quiet_orbax()
  assert logger.filters.count(orbax_logs._QUIET_ORBAX) == 1  # idempotent


def test_read_only_notes_are_dropped_but_other_warnings_kept():
  # dgemma opens every manager that only reads read-only on purpose: Orbax's notes about it (several per load)
  # are noise; its other warnings stay
  f = orbax_logs._QUIET_ORBAX
  orbax_file = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
  note = lambda msg: logging.LogRecord("absl", logging.WARNING, orbax_file, 1, msg, None, None)
  assert not f.filter(note("Given directory is read only=/w/checkpoints"))
  assert not f.filter(note("CheckpointManagerOptions.read_only=True, setting save_interval_steps=0."))
  assert f.filter(note("Checkpoint step 3 is incomplete"))
