"""Nothing lost, nothing hidden (dgemma/train/loop.py, "Safety"): a non-finite step halts (or is skipped)
without saving it, a resume with another architecture is refused before anything is written, a damaged
latest checkpoint is named and fallen back from, and metrics.jsonl keeps one train row per step."""

import json
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
from dgemma import report
from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import CheckpointError, ConfigError, TrainingDiverged
from dgemma.train import loop, optimizer as optimizer_lib, state as state_lib, step as step_lib
from tests.train.test_loop import _quick_state, _small

REPO = Path(__file__).resolve().parents[2]


def _quick(config):
  """tiny_test without MoE and with one decoder pass (self_cond_prob 0): what these tests check is the loop's
  handling of steps, checkpoints and config.json, the same for any model, and this one compiles in about half
  the time (and traces faster at each of a test's several runs)."""
  config.model.num_experts = 0
  config.diffusion.self_cond_prob = 0.0
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

@pytest.mark.slow  # 12 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_diverging_run_halts_naming_the_step_and_keeps_the_last_good_checkpoint(tiny_config, tmp_path):
  config = _quick(tiny_config)
  config.opt.lr, config.train.num_steps, config.train.ckpt_every = 1e30, 12, 2
  config.train.keep_checkpoints = 1  # rotation must still keep the last finite step
  with pytest.raises(TrainingDiverged, match=r"train step \d+: non-finite") as info:
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  message = str(info.value)
  saved = workdir_ckpt.steps(tmp_path / "wd")
  assert saved, message
  last = saved[-1]
  assert f"the last checkpoint (step {last}) is kept" in message
  assert int(message.split("train step ")[1].split(":")[0]) > last  # it stopped before saving the bad step
  assert _state_is_finite(tmp_path / "wd", last, config)
  # The kept checkpoint samples; nothing non-finite was written.
  model = dgemma.load(str(tmp_path / "wd"))
  assert model.step == last


@pytest.mark.slow  # a whole 12-step run with a checkpoint every step
def test_skip_mode_drops_nonfinite_updates_and_counts_them(tiny_config, tmp_path):
  config = _quick(tiny_config)
  config.opt.lr, config.train.num_steps, config.train.ckpt_every, config.train.log_every = 1e30, 12, 1, 1
  config.train.nonfinite, config.train.max_nonfinite_skips = "skip", 3
  with pytest.raises(TrainingDiverged, match=r"3 non-finite updates in a row were skipped"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  records = [r for r in report.read_metrics(tmp_path / "wd") if r["split"] == "train"]
  assert sum(r["nonfinite_skips"] for r in records) >= 2 and "nonfinite" not in records[0]
  for step in workdir_ckpt.steps(tmp_path / "wd"):
    assert _state_is_finite(tmp_path / "wd", step, config)


@pytest.mark.slow  # 12 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
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
  runs = {}
  for skip in (True, False):
    step = jax.jit(step_lib.make_train_step(settings.model, settings.diffusion, optimizer, schedule,
                                            skip_nonfinite=skip))
    s1, m1 = step(state0, batch, jax.random.PRNGKey(0))
    s2, m2 = step(s1, padding, jax.random.PRNGKey(0))
    s3, m3 = step(s2, batch, jax.random.PRNGKey(0))
    runs[skip] = jax.device_get((s1, s2, s3, m1, m2, m3))
  s1, s2, s3, m1, m2, m3 = runs[True]
  assert (m1["nonfinite"], m2["nonfinite"], m3["nonfinite"]) == (0.0, 1.0, 0.0)
  assert np.isfinite(m2["loss"]) and m2["grad_norm"] == 0.0  # only the state went non-finite
  assert int(s2.step) == 2
  chex.assert_trees_all_equal(s2.params, s1.params)
  chex.assert_trees_all_equal(s2.opt_state, s1.opt_state)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(s3.params))
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(s3.params), jax.tree.leaves(s2.params)))
  _, s2_applied, _, _, m2_applied, _ = runs[False]
  assert m2_applied["nonfinite"] == 1.0
  assert not all(np.isfinite(x).all() for x in jax.tree.leaves(s2_applied.params))  # 'halt' mode: the loop stops


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_sampling_nonfinite_params_is_an_error(tiny_config, tmp_path):
  config = tiny_config
  config.train.num_steps = 2
  loop.train_and_evaluate(config, str(tmp_path / "wd"), stop_after_steps=0)  # a workdir, no steps yet
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps)
  state, _ = state_lib.create_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer,
                                          jax.random.PRNGKey(0))
  state = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))  # as an older version saved
  manager = workdir_ckpt.make_manager(tmp_path / "wd", async_save=False)
  workdir_ckpt.save(manager, 1, state, None)
  manager.wait_until_finished()
  manager.close()
  with pytest.raises(CheckpointError, match=r"step 1: parameters .* are not finite"):
    dgemma.load(str(tmp_path / "wd"))


@pytest.mark.slow  # a subprocess: the command, exit status and message
def test_train_py_exits_nonzero_on_divergence(tiny_config, tmp_path):
  cmd = [sys.executable, "train.py", "--config=configs/tiny_test.py", f"--workdir={tmp_path / 'wd'}",
         "--config.data.source=files", f"--config.data.files=('{tiny_config.data.files[0]}',)",
         f"--config.data.cache_dir={tiny_config.data.cache_dir}", "--config.opt.lr=1e30",
         "--config.train.num_steps=12", "--config.train.ckpt_every=2", "--config.train.progress_bar=False",
         "--config.model.num_experts=0", "--config.diffusion.self_cond_prob=0.0"]  # _quick's model
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
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

@pytest.mark.slow  # a whole run, then a resume attempt
def test_resume_with_another_architecture_is_refused_before_writing(tiny_config, tmp_path):
  config = _quick(tiny_config)
  config.train.num_steps = 2
  wd = tmp_path / "wd"
  loop.train_and_evaluate(config, str(wd))
  before = {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")}
  config.model.d_model, config.finetune.freeze_router = 128, True
  with pytest.raises(ConfigError, match=r"model\.d_model: 64 -> 128.*finetune\.freeze_router: False -> True"):
    loop.train_and_evaluate(config, str(wd))
  assert {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")} == before
  assert dgemma.load(str(wd)).step == 2  # the original run still samples
  # The architecture back, a training key changed: the run is finished, so nothing would train with it and
  # the workdir would silently hand back the saved run's model. Refused, naming the key and the way on.
  config.model.d_model, config.finetune.freeze_router = 64, False
  config.opt.lr = config.opt.lr * 2
  with pytest.raises(ConfigError, match=r"is finished \(step 2, train\.num_steps=2\).*opt\.lr: .* -> .*"
                                        r"raise train\.num_steps"):
    loop.train_and_evaluate(config, str(wd))
  assert {p.name: p.read_bytes() for p in (wd / "config.json", wd / "metrics.jsonl")} == before
  assert not (wd / loop.CONFIG_CHANGES_FILE).exists()


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
def test_resume_replaces_config_json_only_after_a_good_restore(tiny_config, tmp_path, monkeypatch):
  config = _quick(tiny_config)
  config.train.num_steps = 2
  wd = tmp_path / "wd"
  loop.train_and_evaluate(config, str(wd))
  saved = (wd / "config.json").read_text()
  config.train.num_steps, config.opt.lr = 4, 5e-4  # allowed changes on resume
  monkeypatch.setattr(workdir_ckpt, "restore", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
  config.train.on_corrupt_checkpoint = "error"
  with pytest.raises(CheckpointError, match="disk gone"):
    loop.train_and_evaluate(config, str(wd))
  assert (wd / "config.json").read_text() == saved
  assert not (wd / loop.CONFIG_CHANGES_FILE).exists()
  monkeypatch.undo()
  loop.train_and_evaluate(config, str(wd))
  assert json.loads((wd / "config.json").read_text())["train"]["num_steps"] == 4
  # config.json now holds only the new settings; the resume's changes are on record.
  rows = [json.loads(line) for line in (wd / loop.CONFIG_CHANGES_FILE).read_text().splitlines()]
  assert [r["step"] for r in rows] == [2]
  assert [c.split(":")[0] for c in rows[0]["changes"]] == ["opt.lr", "train.num_steps"]


def _trained(config, wd, steps=6, every=2, stop_after=None):
  config.train.num_steps, config.train.ckpt_every, config.train.keep_checkpoints = steps, every, 5
  config.train.log_every = 1
  return loop.train_and_evaluate(config, str(wd), stop_after_steps=stop_after)


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
def test_corrupt_latest_checkpoint_falls_back_and_resumes_exactly(tiny_config, tmp_path):
  config = _quick(tiny_config)
  reference = _trained(config, tmp_path / "ref", steps=8)  # uninterrupted: 8 steps
  wd = tmp_path / "wd"
  _trained(config, wd, steps=8, stop_after=6)  # the same 8-step schedule, stopped after step 6
  data_file = max((workdir_ckpt.step_dir(wd, 6) / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
  data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # truncated
  # Sampling names the step and the file, and says which step to sample instead.
  with pytest.raises(CheckpointError, match=rf"step 6 .*{data_file.name}.*sample\.checkpoint_step=4"):
    dgemma.load(str(wd))
  # train.on_corrupt_checkpoint='error': the same naming, with the resume hint.
  config.train.num_steps = 8
  config.train.on_corrupt_checkpoint = "error"
  with pytest.raises(CheckpointError, match=rf"step 6 .*{data_file.name}.*train\.restore_step=4"):
    loop.train_and_evaluate(config, str(wd))
  # 'fallback' (the default): step 6 moved aside (kept), step 4 restored, and the run ends as if never broken.
  config.train.on_corrupt_checkpoint = "fallback"
  resumed = loop.train_and_evaluate(config, str(wd))
  assert [p.name.split("-")[0] for p in (wd / workdir_ckpt.CORRUPT).iterdir()] == ["6"]
  assert 6 in workdir_ckpt.steps(wd) and 8 in workdir_ckpt.steps(wd)  # step 6 written again from step 4
  chex.assert_trees_all_equal(jax.device_get(resumed.params), jax.device_get(reference.params))
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), jax.device_get(reference.opt_state))
  rows = [r["step"] for r in report.read_metrics(wd) if r["split"] == "train"]
  assert rows == list(range(1, 9))  # one train row per step, the redone steps 5 and 6 included once


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
def test_truncated_metadata_is_named(tiny_config, tmp_path):
  config = _quick(tiny_config)
  wd = tmp_path / "wd"
  _trained(config, wd, steps=4)
  metadata = workdir_ckpt.step_dir(wd, 4) / "state" / "_METADATA"
  metadata.write_text(metadata.read_text()[:40])
  with pytest.raises(CheckpointError, match=r"step 4 .*state/_METADATA.*sample\.checkpoint_step=2"):
    dgemma.load(str(wd))
  assert dgemma.load(str(wd), step=2).step == 2  # the hint works


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
def test_metrics_rows_past_the_restored_step_are_dropped_and_a_partial_line_skipped(tiny_config, tmp_path):
  config = _quick(tiny_config)
  wd = tmp_path / "wd"
  _trained(config, wd, steps=4)
  shutil.rmtree(workdir_ckpt.step_dir(wd, 4))  # as if killed after logging step 4, before its checkpoint
  with open(wd / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "split": "train", "loss": 1.')  # the half-written line kill -9 leaves
  assert [r["step"] for r in report.read_metrics(wd) if r["split"] == "train"] == [1, 2, 3, 4]  # readers skip it
  loop.train_and_evaluate(config, str(wd))  # resumes from step 2
  rows = [r["step"] for r in report.read_metrics(wd) if r["split"] == "train"]
  assert rows == [1, 2, 3, 4]
  assert all(line.endswith("}") for line in (wd / "metrics.jsonl").read_text().splitlines())
