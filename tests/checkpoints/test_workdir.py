"""The workdir lock (dgemma/checkpoints/workdir.py `locked`): one training run writes a workdir at a time."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import CheckpointError
from dgemma.train import loop


def test_a_second_run_fails_at_once_naming_the_first(tiny_config, tmp_path, monkeypatch):
  # The lock is held as train.py holds it; the second run fails before it builds or writes anything.
  reached = []
  monkeypatch.setattr(loop, "_train", lambda *a, **k: reached.append(1))
  with workdir_ckpt.locked(tmp_path / "wd"):
    with pytest.raises(CheckpointError, match=rf"--workdir: .*wd is in use by process {os.getpid()} on "):
      loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))
  assert not reached
  assert os.listdir(tmp_path / "wd") == [workdir_ckpt.LOCK_FILE]  # nothing else was written
  loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))  # released: the next run goes ahead
  assert reached == [1]


def test_a_lock_left_by_an_ended_process_is_taken_over(tmp_path, caplog):
  (tmp_path / workdir_ckpt.LOCK_FILE).write_text("process 999999 on somewhere (started 2026-01-01 00:00:00: x)\n")
  with workdir_ckpt.locked(tmp_path):
    assert f"process {os.getpid()} on " in (tmp_path / workdir_ckpt.LOCK_FILE).read_text()
  assert any("taking over the lock of process 999999" in r.getMessage() for r in caplog.records)
  assert (tmp_path / workdir_ckpt.LOCK_FILE).read_text() == ""  # released: no holder named


@pytest.mark.slow  # subprocesses: a holder killed with SIGKILL
def test_a_killed_holder_releases_the_lock(tmp_path):
  code = ("import sys, time\nfrom dgemma.checkpoints import workdir\n"
          "with workdir.locked(sys.argv[1]):\n  print('held', flush=True)\n  time.sleep(600)\n")
  holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError, match=f"in use by process {holder.pid} "):
      with workdir_ckpt.locked(tmp_path):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
  deadline = time.time() + 30
  while True:  # the kernel releases a dead process's flock at once; allow for a slow reap
    try:
      with workdir_ckpt.locked(tmp_path):
        break
    except CheckpointError:
      assert time.time() < deadline
      time.sleep(0.1)
