"""Nothing lost, nothing hidden (dgemma/train/loop.py, "Safety"): a non-finite step halts (or is skipped)
without saving it, a resume with another architecture is refused before anything is written, a damaged
latest checkpoint is named and fallen back from, and metrics.jsonl keeps one train row per step."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dgemma
from dgemma import mesh as mesh_lib
from dgemma import run_report
from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import CheckpointError, ConfigError, DataError, TrainingDiverged
from dgemma.train import loop, optimizer as optimizer_lib, state as state_lib, step as step_lib
from tests.train.test_loop import QUICK_FLAGS, _quick, _quick_state, _small
from tests.train_utils import sigterm_when_logged

REPO = Path(__file__).resolve().parents[2]


def _tiny_config(corpus_file, tmp_path_factory):
  """What tests/conftest.py's tiny_config gives (the same data settings, so the same config.json), for this module's
  fixtures."""
  from configs import tiny_test
  config = tiny_test.get_config()
  config.data.source, config.data.files = "files", (str(corpus_file),)
  config.data.cache_dir = str(tmp_path_factory.getbasetemp() / "data_cache")
  config.train.async_checkpointing = False
  return config


class Run:
  """A finished run: its workdir, the config it ran with and its final state (on the host)."""

  def __init__(self, workdir, config, state):
    self.workdir, self.config, self.state = workdir, config, state

  def copy(self, to: Path) -> Path:
    """The workdir copied to `to`: tests change their copy, never the run."""
    shutil.copytree(self.workdir, to)
    return to

  def new_config(self):
    """The run's config, to change."""
    return self.config.copy_and_resolve_references()


@pytest.fixture(scope="module")
def quick_run(corpus_file, tmp_path_factory):
  """_quick's run (tests/train/test_loop.py: 8 steps), uninterrupted, with a checkpoint every 2 steps (all kept) and
  a metrics row per step, trained once for this module. Tests work on copies of its workdir; a run they make with
  its settings reuses its compiled programs (and its final state is the reference of an exact resume)."""
  config = _quick(_tiny_config(corpus_file, tmp_path_factory))
  config.train.ckpt_every, config.train.keep_checkpoints, config.train.log_every = 2, 5, 1
  workdir = tmp_path_factory.mktemp("quick_run") / "wd"
  state = jax.device_get(loop.train_and_evaluate(config, str(workdir)))
  assert workdir_ckpt.steps(workdir) == [2, 4, 6, 8]
  return Run(workdir, config, state)


def _diverging(config):
  """_quick's model (tests/train/test_loop.py) over 12 steps at lr 1e30 with tiny_test's warmup of 2 steps: the
  first update is 0 and the second huge but finite (so a finite checkpoint can precede the divergence)."""
  config = _quick(config)
  config.opt.lr, config.opt.warmup_steps, config.train.num_steps = 1e30, 2, 12
  return config


def _state_is_finite(workdir, step, config) -> bool:
  """Every leaf of the saved state at `step` (params and optimizer state) is finite."""
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps, settings.finetune)
  _, abstract, _ = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer)
  manager = workdir_ckpt.make_manager(workdir, read_only=True, async_save=False)
  state, _ = workdir_ckpt.restore(manager, step, abstract, with_data=False)
  manager.close()
  return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(jax.device_get(state))
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


# ---- non-finite steps ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def diverged(corpus_file, tmp_path_factory):
  """A diverging run (_quick's model at lr 1e30, 'halt' mode, a checkpoint every 2 steps, only the latest kept:
  rotation must still keep the last finite step) made once by train.py, the issue's command: (workdir, its config,
  the finished process). What the loop keeps and what the command prints are two tests of this one run (a
  subprocess: its ~5 s of imports and its compiles once)."""
  config = _diverging(_tiny_config(corpus_file, tmp_path_factory))
  config.train.ckpt_every, config.train.keep_checkpoints = 2, 1
  workdir = tmp_path_factory.mktemp("diverged") / "wd"
  cmd = [sys.executable, "train.py", "--config=configs/tiny_test.py", f"--workdir={workdir}",
         "--config.data.source=files", f"--config.data.files=('{config.data.files[0]}',)",
         f"--config.data.cache_dir={config.data.cache_dir}", "--config.train.progress_bar=False",
         *(f for f in QUICK_FLAGS if not f.startswith(("--config.opt.", "--config.train.num_steps="))),
         "--config.opt.lr=1e30", "--config.opt.warmup_steps=2", "--config.train.num_steps=12",
         "--config.train.ckpt_every=2", "--config.train.keep_checkpoints=1"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert (workdir / "config.json").is_file(), out.stderr[-4000:]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["opt"]["lr"] == 1e30 and saved["train"]["keep_checkpoints"] == 1, saved  # the flags took
  return workdir, config, out


@pytest.mark.slow  # train.py in a subprocess (the `diverged` run)
def test_diverging_run_halts_naming_the_step_and_keeps_the_last_good_checkpoint(diverged):
  workdir, config, out = diverged
  # train.py prints a TrainingDiverged (a user error, dgemma/tools/cli.py) as one line `train.py: <its message>`
  message = [line for line in out.stderr.splitlines() if line.startswith("train.py: ")][-1]
  assert re.search(r"train step \d+: non-finite", message), message
  saved = workdir_ckpt.steps(workdir)
  assert saved, message
  last = saved[-1]
  assert f"the last checkpoint (step {last}) is kept" in message
  assert int(message.split("train step ")[1].split(":")[0]) > last  # it stopped before saving the bad step
  assert _state_is_finite(workdir, last, config)
  # The kept checkpoint samples; nothing non-finite was written.
  model = dgemma.load(str(workdir))
  assert model.step == last


@pytest.mark.slow  # a whole 12-step run with a checkpoint every step
def test_skip_mode_drops_nonfinite_updates_and_counts_them(tiny_config, tmp_path):
  config = _diverging(tiny_config)
  config.train.ckpt_every, config.train.log_every = 1, 1
  config.train.nonfinite, config.train.max_nonfinite_skips = "skip", 3
  with pytest.raises(TrainingDiverged, match=r"3 non-finite updates in a row were skipped"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  records = [r for r in run_report.read_metrics(tmp_path / "wd") if r["split"] == "train"]
  assert sum(r["nonfinite_skips"] for r in records) >= 2 and "nonfinite" not in records[0]
  for step in workdir_ckpt.steps(tmp_path / "wd"):
    assert _state_is_finite(tmp_path / "wd", step, config)


@pytest.mark.slow  # a train-step compile: over the fast tier's budget
def test_skipped_update_keeps_params_and_the_next_one_applies():
  """The step itself, with an update that divides the gradient by its norm: on an all-padding batch (no
  targets: loss 0, gradient 0, gradient norm 0, all finite) the update is 0/0 = NaN, so only the updated
  state is non-finite. skip_nonfinite drops it (params and optimizer state stay, the counter moves on) and
  the next finite update applies; without skipping it is applied (the loop then halts)."""
  from configs import tiny_test
  config, batch = _small(tiny_test.get_config())
  settings = settings_lib.from_config(config)
  padding = dict(batch, segment_ids=jnp.zeros_like(batch["segment_ids"]))
  normalize = optax.stateless(lambda g, p: jax.tree.map(lambda x: x / optax.tree.norm(g), g))
  optimizer = optax.chain(normalize, optax.scale_by_adam(), optax.scale(-1e-3))
  schedule = lambda count: 1e-3
  state0 = _quick_state(settings.model, optimizer)
  step = jax.jit(step_lib.make_train_step(settings.model, settings.diffusion, optimizer, schedule,
                                          skip_nonfinite=True))
  s1, m1 = step(state0, batch, jax.random.PRNGKey(0))
  s2, m2 = step(s1, padding, jax.random.PRNGKey(0))
  s3, m3 = step(s2, batch, jax.random.PRNGKey(0))
  s1, s2, s3, m1, m2, m3 = jax.device_get((s1, s2, s3, m1, m2, m3))
  assert (m1["nonfinite"], m2["nonfinite"], m3["nonfinite"]) == (0.0, 1.0, 0.0)
  assert np.isfinite(m2["loss"]) and m2["grad_norm"] == 0.0  # only the state went non-finite
  assert int(s2.step) == 2
  chex.assert_trees_all_equal(s2.params, s1.params)
  chex.assert_trees_all_equal(s2.opt_state, s1.opt_state)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(s3.params))
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(s3.params), jax.tree.leaves(s2.params)))
  # Without skipping ('halt' mode: the loop then stops) the second update is applied. The step's update is
  # apply_gradients with the skip flag (dgemma/train/step.py), given the loss and the gradient: here, from s1, the
  # all-padding batch's (loss m2['loss'], gradient 0: m2's norm is 0), so it alone shows that, without a second
  # train step to compile.
  zero_grads = jax.tree.map(np.zeros_like, s1.params)
  applied, m2_applied = jax.device_get(jax.jit(lambda s, g, m: step_lib.apply_gradients(
      s, g, m, optimizer, schedule, None, skip_nonfinite=False))(s1, zero_grads, {"loss": m2["loss"]}))
  assert m2_applied["nonfinite"] == 1.0 and int(applied.step) == 2
  assert not all(np.isfinite(x).all() for x in jax.tree.leaves(applied.params))


@pytest.mark.slow  # the module's quick_run (a training run)
def test_sampling_nonfinite_params_is_an_error(quick_run, tmp_path):
  wd = tmp_path / "wd"
  wd.mkdir()
  shutil.copyfile(quick_run.workdir / "config.json", wd / "config.json")
  nan = jax.tree.map(lambda x: x * np.nan, quick_run.state.params)
  workdir_ckpt.save_step(wd, 1, quick_run.state.replace(params=nan))  # as an older version saved
  with pytest.raises(CheckpointError, match=r"step 1: parameters .* are not finite"):
    dgemma.load(str(wd))


@pytest.mark.slow  # train.py in a subprocess (the `diverged` run): the command, exit status and message
def test_train_py_exits_nonzero_on_divergence(diverged):
  _, _, out = diverged
  assert out.returncode != 0
  assert "train.py: train step" in out.stderr and "non-finite" in out.stderr and "Traceback" not in out.stderr
  # Orbax's INFO lines (thousands per run before) are filtered out; the run's own lines stay.
  import orbax.checkpoint
  others = {p.name for pkg in (jax, optax) for p in Path(pkg.__file__).parent.rglob("*.py")}
  orbax_files = {p.name for p in Path(orbax.checkpoint.__file__).parent.rglob("*.py")} - others
  info = [line for line in out.stderr.splitlines() if line.startswith("I") and "] " in line]
  assert not [line for line in info if line.split("] ")[0].rsplit(" ", 1)[-1].split(":")[0] in orbax_files]
  assert any("metrics.py" in line and "[train] step 2" in line for line in info)


# ---- resuming ---------------------------------------------------------------------------------------
# On copies of the module's quick_run (steps 2, 4, 6, 8 saved, one metrics row per step): each test changes its copy
# as a failure would have left it, and a resume with the run's settings reuses the run's compiled programs.

@pytest.mark.slow  # the module's quick_run (a training run), then resume attempts
def test_resume_with_another_architecture_is_refused_before_writing(quick_run, tmp_path):
  wd = quick_run.copy(tmp_path / "wd")
  config = quick_run.new_config()
  before = {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")}
  config.model.d_model, config.finetune.freeze_router = 128, True
  with pytest.raises(ConfigError, match=r"model\.d_model: 64 -> 128.*finetune\.freeze_router: False -> True"):
    loop.train_and_evaluate(config, str(wd))
  assert {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")} == before
  assert dgemma.load(str(wd)).step == 8  # the original run still samples
  # The architecture back, a training key changed: the run is finished, so nothing would train with it and
  # the workdir would silently hand back the saved run's model. Refused, naming the key and the way on.
  config.model.d_model, config.finetune.freeze_router = 64, False
  config.opt.lr = config.opt.lr * 2
  with pytest.raises(ConfigError, match=r"is finished \(step 8, train\.num_steps=8\).*opt\.lr: .* -> .*"
                                        r"raise train\.num_steps"):
    loop.train_and_evaluate(config, str(wd))
  assert {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")} == before
  assert not (wd / loop.CONFIG_CHANGES_FILE).exists()


@pytest.mark.slow  # the module's quick_run (a training run), then a resume
def test_resume_replaces_config_json_only_after_a_good_restore(quick_run, tmp_path, monkeypatch):
  # A run of 4 steps at lr 5e-4, finished (the copy's steps 2 and 4, its config.json saying so), resumed with the
  # allowed changes: quick_run's settings (8 steps, lr 2e-3), whose programs are compiled.
  wd = quick_run.copy(tmp_path / "wd")
  for step in (6, 8):
    shutil.rmtree(workdir_ckpt.step_dir(wd, step))
  was = quick_run.new_config()
  was.train.num_steps, was.opt.lr = 4, 5e-4
  workdir_ckpt.write_config_json(wd, settings_lib.from_config(was).config_json)
  saved = (wd / "config.json").read_text()
  config = quick_run.new_config()  # allowed changes on resume: train.num_steps 4 -> 8, opt.lr 5e-4 -> 2e-3
  monkeypatch.setattr(workdir_ckpt, "restore", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
  config.train.on_corrupt_checkpoint = "error"
  with pytest.raises(CheckpointError, match="disk gone"):
    loop.train_and_evaluate(config, str(wd))
  assert (wd / "config.json").read_text() == saved
  assert not (wd / loop.CONFIG_CHANGES_FILE).exists()
  monkeypatch.undo()
  loop.train_and_evaluate(config, str(wd))
  assert json.loads((wd / "config.json").read_text())["train"]["num_steps"] == 8
  # config.json now holds only the new settings; the resume's changes are on record.
  rows = [json.loads(line) for line in (wd / loop.CONFIG_CHANGES_FILE).read_text().splitlines()]
  assert [r["step"] for r in rows] == [4]
  assert [c.split(":")[0] for c in rows[0]["changes"]] == ["opt.lr", "train.num_steps"]


@pytest.mark.slow  # the module's quick_run (a training run), then a resume
def test_corrupt_latest_checkpoint_falls_back_and_resumes_exactly(quick_run, tmp_path):
  wd = quick_run.copy(tmp_path / "wd")
  shutil.rmtree(workdir_ckpt.step_dir(wd, 8))  # the same 8-step run, stopped after step 6's checkpoint
  config = quick_run.new_config()
  data_file = max((workdir_ckpt.step_dir(wd, 6) / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
  data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # truncated
  # Sampling names the step and the file, and says which step to sample instead.
  with pytest.raises(CheckpointError, match=rf"step 6 .*{data_file.name}.*sample\.checkpoint_step=4"):
    dgemma.load(str(wd))
  # train.on_corrupt_checkpoint='error': the same naming, with the resume hint.
  config.train.on_corrupt_checkpoint = "error"
  with pytest.raises(CheckpointError, match=rf"step 6 .*{data_file.name}.*train\.restore_step=4"):
    loop.train_and_evaluate(config, str(wd))
  # 'fallback' (the default): step 6 moved aside (kept), step 4 restored, and the run ends as if never broken:
  # as the uninterrupted run did.
  config.train.on_corrupt_checkpoint = "fallback"
  resumed = loop.train_and_evaluate(config, str(wd))
  assert [p.name.split("-")[0] for p in (wd / workdir_ckpt.CORRUPT).iterdir()] == ["6"]
  assert 6 in workdir_ckpt.steps(wd) and 8 in workdir_ckpt.steps(wd)  # step 6 written again from step 4
  chex.assert_trees_all_equal(jax.device_get(resumed.params), quick_run.state.params)
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), quick_run.state.opt_state)
  rows = [r["step"] for r in run_report.read_metrics(wd) if r["split"] == "train"]
  assert rows == list(range(1, 9))  # one train row per step, the redone steps 5 to 8 included once


@pytest.mark.slow  # the module's quick_run (a training run), then a resume of two steps
def test_a_resume_with_changed_settings_names_the_step_it_restored(quick_run, tmp_path, caplog):
  """A resume that changes a training key (data.num_epochs) and falls back past a damaged latest step: the warning
  listing the changes names the step restored (4), not the damaged one it tried first (6), as does the record in
  config_changes.jsonl."""
  import logging
  wd = quick_run.copy(tmp_path / "wd")
  shutil.rmtree(workdir_ckpt.step_dir(wd, 8))  # the run stopped after step 6's checkpoint, which is damaged
  metadata = workdir_ckpt.step_dir(wd, 6) / "state" / "_METADATA"
  metadata.write_text(metadata.read_text()[:40])
  config = quick_run.new_config()
  config.data.num_epochs = 1000  # a training key the data stream does not depend on (8 steps are within one epoch)
  with caplog.at_level(logging.WARNING):
    loop.train_and_evaluate(config, str(wd))
  said = [r.getMessage() for r in caplog.records if "changed training settings" in r.getMessage()]
  assert len(said) == 1 and " from step 4 with changed training settings" in said[0], said
  assert "data.num_epochs: 0 -> 1000" in said[0]
  records = [json.loads(line) for line in (wd / loop.CONFIG_CHANGES_FILE).read_text().splitlines()]
  assert [r["step"] for r in records] == [4]


@pytest.mark.slow  # the module's quick_run (a training run)
def test_truncated_metadata_is_named(quick_run, tmp_path):
  wd = quick_run.copy(tmp_path / "wd")
  metadata = workdir_ckpt.step_dir(wd, 8) / "state" / "_METADATA"
  metadata.write_text(metadata.read_text()[:40])
  with pytest.raises(CheckpointError, match=r"step 8 .*state/_METADATA.*sample\.checkpoint_step=6"):
    dgemma.load(str(wd))
  assert dgemma.load(str(wd), step=6).step == 6  # the hint works


@pytest.mark.slow  # the module's quick_run (a training run), then a resume
def test_metrics_rows_past_the_restored_step_are_dropped_and_a_partial_line_skipped(quick_run, tmp_path):
  wd = quick_run.copy(tmp_path / "wd")
  shutil.rmtree(workdir_ckpt.step_dir(wd, 8))  # as if killed after logging step 8, before its checkpoint
  with open(wd / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "split": "train", "loss": 1.')  # the half-written line kill -9 leaves
  assert [r["step"] for r in run_report.read_metrics(wd) if r["split"] == "train"] == list(range(1, 9))  # skipped
  loop.train_and_evaluate(quick_run.new_config(), str(wd))  # resumes from step 6
  rows = [r["step"] for r in run_report.read_metrics(wd) if r["split"] == "train"]
  assert rows == list(range(1, 9))
  assert all(line.endswith("}") for line in (wd / "metrics.jsonl").read_text().splitlines())


# ---- interrupts --------------------------------------------------------------------------------------

@pytest.mark.slow  # the module's quick_run (a training run), then an interrupted run and its resume
def test_a_signal_saves_the_current_step_and_the_resume_equals_an_uninterrupted_run(quick_run, tmp_path,
                                                                                     monkeypatch):
  """A real SIGTERM (what Colab and preemptible hosts send) delivered to this process while step 3 is logged, after
  the loop looked for one in that step: it runs step 4 (the step in progress when it next looks), saves it, and
  raises TrainingInterrupted naming it; re-running the workdir resumes there, and the run ends as the
  uninterrupted one did (every parameter and optimizer moment equal, one metrics row per step). The handlers are
  the process's own again afterwards."""
  import signal
  from dgemma.errors import TrainingInterrupted
  config = quick_run.new_config()
  config.train.ckpt_every = 100  # no scheduled checkpoint before the end: the interrupt's is the only one
  wd = tmp_path / "wd"
  before = signal.getsignal(signal.SIGTERM)
  with sigterm_when_logged(monkeypatch, 3), pytest.raises(
      TrainingInterrupted, match=r"interrupted by SIGTERM after step 4 of 8; saved: .*4$") as stopped:
    loop.train_and_evaluate(config, str(wd))
  assert stopped.value.exit_code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
  assert workdir_ckpt.steps(wd) == [4]
  resumed = loop.train_and_evaluate(config, str(wd))
  chex.assert_trees_all_equal(jax.device_get(resumed.params), quick_run.state.params)
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), quick_run.state.opt_state)
  rows = [r["step"] for r in run_report.read_metrics(wd) if r["split"] == "train"]
  assert rows == list(range(1, 9))


@pytest.mark.slow  # train.py in a subprocess
def test_train_py_on_a_signal_prints_one_line_to_resume(corpus_file, tmp_path):
  """train.py (a long run of _quick's model), SIGTERM once its steps are logged: the current step is saved, exit
  status 143 (the shell's for SIGTERM) and one line naming the step and the command that resumes."""
  import signal
  import time
  workdir = tmp_path / "wd"
  cmd = [sys.executable, "train.py", "--config=configs/tiny_test.py", f"--workdir={workdir}",
         "--config.data.source=files", f"--config.data.files=('{corpus_file}',)",
         f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.progress_bar=False",
         *(f for f in QUICK_FLAGS if not f.startswith("--config.train.num_steps=")),
         "--config.train.num_steps=100000", "--config.train.log_every=1", "--config.train.eval_every=100000"]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  metrics = workdir / "metrics.jsonl"
  while not (metrics.exists() and metrics.read_text().count('"split": "train"') >= 3):
    assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  line = err.strip().splitlines()[-1]
  match = re.fullmatch(r"train\.py: interrupted by SIGTERM after step (\d+) of 100000; saved: \S+; resume with: "
                       r"python train\.py --config=configs/tiny_test\.py --workdir=\S+ .*", line)
  assert match, line
  assert workdir_ckpt.steps(workdir)[-1] == int(match.group(1)) >= 3


_TWO_SIGNALS = """
import os, signal, sys, time
from dgemma.train import interrupts
with interrupts.StopRequest() as stop:
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(0.1)
  print("requested", stop.requested(), stop.name, flush=True)
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(5)
print("not reached", flush=True)
"""


@pytest.mark.slow  # a subprocess
def test_a_second_signal_exits_at_once():
  """The first SIGINT only asks (the loop saves the step it is in); the second ends the process at once with the
  shell's status for SIGINT (130), saying so; what it interrupts is at most an incomplete checkpoint, which a
  resume never reads (test_corrupt_latest_checkpoint_falls_back_and_resumes_exactly, tests/checkpoints)."""
  out = subprocess.run([sys.executable, "-c", _TWO_SIGNALS], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stdout.splitlines() == ["requested True SIGINT"]
  assert "SIGINT again: exiting now" in out.stderr


def test_a_resume_whose_data_changed_names_the_change_and_restart_goes_on(quick_run, corpus_file, tmp_path):
  """A resume that reads the data otherwise than its checkpoint (data.shuffle), or whose data file was edited since:
  refused in one DataError naming the setting or the file (with its size change) and what to do; nothing is
  written. With data.restart_if_changed the run resumes its model and optimizer and reads the changed data from its
  beginning, to the end of the schedule."""
  data = tmp_path / "corpus.txt"
  data.write_text(corpus_file.read_text())
  config = quick_run.new_config()
  config.data.files = (str(data),)
  wd = tmp_path / "wd"
  loop.train_and_evaluate(config, str(wd), stop_after_steps=2)
  assert workdir_ckpt.steps(wd) == [2]
  config.data.shuffle = False
  with pytest.raises(DataError, match=rf"^data: the data is read otherwise than when it was saved \(data.shuffle: "
                     rf"True -> False\) since step 2 of {wd} was saved"):
    loop.train_and_evaluate(config, str(wd))
  config.data.shuffle = True
  size = data.stat().st_size
  with open(data, "a", encoding="utf-8") as f:
    f.write("A line added after the checkpoint.\n")
  with pytest.raises(DataError, match=rf"^data: {data} changed \(size {size} -> {size + 35} bytes\) since step "
                     rf"2 of {wd} was saved.*--config.data.restart_if_changed=True"):
    loop.train_and_evaluate(config, str(wd))
  assert workdir_ckpt.steps(wd) == [2]
  config.data.restart_if_changed = True
  state = loop.train_and_evaluate(config, str(wd))
  assert int(state.step) == config.train.num_steps and workdir_ckpt.steps(wd)[-1] == config.train.num_steps


def test_a_save_that_fails_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(quick_run, tmp_path):
  """A checkpoint that cannot be written (here a file size limit, RLIMIT_FSIZE of 200 kB for this process: every
  write past it fails, as on a full disk) while saving asynchronously: the run stops at the first step after the
  failure is known with one CheckpointError naming the step's directory, the system's reason and the free space,
  and keeping the last complete checkpoint; re-run without the limit, it resumes there and ends as the
  uninterrupted run did."""
  import resource
  import signal
  config = quick_run.new_config()
  config.train.async_checkpointing = True
  wd = tmp_path / "wd"
  loop.train_and_evaluate(config, str(wd), stop_after_steps=2)
  assert workdir_ckpt.steps(wd) == [2]
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
  resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
  try:
    with pytest.raises(CheckpointError, match=rf"saving checkpoint {wd / 'checkpoints'}/4 failed: File too large "
                       r"\([0-9.]+ GiB free there\); training stopped and the last complete checkpoint, step 2, is "
                       r"kept"):
      loop.train_and_evaluate(config, str(wd))
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)
  assert workdir_ckpt.steps(wd) == [2]
  resumed = loop.train_and_evaluate(config, str(wd))
  chex.assert_trees_all_equal(jax.device_get(resumed.params), quick_run.state.params)
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), quick_run.state.opt_state)


def test_an_sft_run_stopped_by_a_signal_resumes_exactly(quick_run, corpus_file, tmp_path, monkeypatch):
  """An SFT run (data.format='sft', prompt / response pairs) gets SIGTERM while step 3 is logged: step 4 is saved,
  TrainingInterrupted raised, and the resumed run ends as the uninterrupted one (params and optimizer state equal):
  the loop's interrupt handling does not depend on the data it trains on."""
  from dgemma.errors import TrainingInterrupted
  lines = corpus_file.read_text().splitlines()
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text("".join(json.dumps({"prompt": a[:40], "response": b[:40]}) + "\n"
                           for a, b in zip(lines[::2], lines[1::2])))
  config = quick_run.new_config()
  config.data.format, config.data.files = "sft", (str(pairs),)
  config.train.ckpt_every = 100
  straight = jax.device_get(loop.train_and_evaluate(config, str(tmp_path / "straight")))
  with sigterm_when_logged(monkeypatch, 3), pytest.raises(TrainingInterrupted,
                                                           match=r"interrupted by SIGTERM after step 4 of 8"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert workdir_ckpt.steps(tmp_path / "wd") == [4]
  resumed = loop.train_and_evaluate(config, str(tmp_path / "wd"))
  chex.assert_trees_all_equal(jax.device_get(resumed.params), straight.params)
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), straight.opt_state)
