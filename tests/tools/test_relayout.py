"""dgemma/tools/relayout.py: a workdir copied into the other layer layout holds exactly the same state and
resumes there."""

import inspect
import json
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import layout, workdir as workdir_ckpt
from dgemma.errors import ConfigError
from dgemma.tools import cli, relayout
from dgemma.train import loop, state as state_lib
from tests.train.test_loop import _quick


def _restore(workdir, step):
  settings = settings_lib.from_config(settings_lib.from_json(workdir_ckpt.read_config_json(workdir)))
  _, _, abstract, _ = state_lib.run_abstract_state(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))
  manager = workdir_ckpt.make_manager(workdir, keep=10, async_save=False)
  try:
    state, data_state = workdir_ckpt.restore(manager, step, abstract)
  finally:
    manager.close()
  return settings, jax.device_get(state), data_state


def test_the_copy_holds_the_same_state_relaid_and_the_same_data_position(tiny_run, tmp_path):
  src, config = tiny_run
  other = config.copy_and_resolve_references()
  other.model.scan_layers = False
  with pytest.raises(ConfigError, match=r"model.scan_layers: True -> False.*python -m dgemma.tools.relayout .*--noscan_layers"):
    loop.check_resume(src, settings_lib.from_config(other))  # resuming in the other layout is refused, naming this tool
  out = tmp_path / "unrolled"
  step = relayout.relayout_workdir(str(src), str(out), scan_layers=False)
  assert step == workdir_ckpt.steps(src)[-1] and workdir_ckpt.steps(out) == [step]
  old_settings, old, old_data = _restore(src, step)
  new_settings, new, new_data = _restore(out, step)
  assert old_settings.model.scan_layers and not new_settings.model.scan_layers
  # config.json: only model.scan_layers changed
  old_cfg, new_cfg = (json.loads(workdir_ckpt.read_config_json(w)) for w in (src, out))
  assert new_cfg["model"].pop("scan_layers") is False and old_cfg["model"].pop("scan_layers") is True
  assert new_cfg == old_cfg
  # exact: the copy relaid back is the original, params and Adam moments alike; the step and data position kept
  assert int(new.step) == int(old.step) == step
  chex.assert_trees_all_equal(layout.relayout(new.params, new_settings.model, old_settings.model), old.params)
  chex.assert_trees_all_equal(layout.relayout(new.opt_state, new_settings.model, old_settings.model), old.opt_state)
  assert new_data == old_data
  with pytest.raises(FileExistsError, match="--out"):
    relayout.relayout_workdir(str(src), str(out), scan_layers=False)
  with pytest.raises(ConfigError, match="--scan_layers"):
    relayout.relayout_workdir(str(src), str(tmp_path / "same"), scan_layers=True)
  assert not (tmp_path / "same").exists()
  # A missing --workdir is a user error: the command (cli.run) prints it as one line `dgemma.tools.relayout: ...`
  # with exit status 1, no traceback (cli.run's printing: tests/tools/test_cli.py).
  with pytest.raises(cli.USER_ERRORS, match=r"--workdir: .*none is not a training workdir"):
    relayout.relayout_workdir(str(tmp_path / "none"), str(tmp_path / "x"), scan_layers=True)
  assert 'cli.run(main, "dgemma.tools.relayout")' in inspect.getsource(relayout)


@pytest.mark.slow  # a training run, a subprocess (the command line), then two resumed training runs
def test_the_command_writes_a_workdir_that_resumes_where_the_original_would(tiny_config, tmp_path):
  # _quick's run (tests/train/test_loop.py: its stacked programs are the loop tests'; the relaid MoE model: the test
  # above), stopped after 3 of its 8 steps
  config = _quick(tiny_config)
  config.train.log_every, config.train.eval_every = 1, 100  # no evaluation before the runs end (stop_after_steps)
  src = tmp_path / "run"
  loop.train_and_evaluate(config, str(src), stop_after_steps=3)
  out = tmp_path / "unrolled"
  run = subprocess.run([sys.executable, "-m", "dgemma.tools.relayout", f"--workdir={src}", f"--out={out}",
                        "--noscan_layers"], capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr
  step = workdir_ckpt.steps(out)[-1]
  assert step == 3

  # Resume both for 1 step (stop_after_steps: no final evaluation, whose unrolled program would be one more
  # compile): the same batch (data position) from the same state, so the resumed step's loss agrees up to the fp32
  # round-off of a scanned against an unrolled program (a few ulps per op over a 4-layer forward: ~1e-6 relative;
  # 1e-4 leaves two orders of margin, a wrong layout moves it by O(1)).
  losses = {}
  for name, workdir, scan in (("stacked", src, True), ("unrolled", out, False)):
    cfg = config.copy_and_resolve_references()
    cfg.model.scan_layers = scan
    assert cfg.train.num_steps > step + 1
    assert (step + 1) % cfg.train.eval_every != 0  # no evaluation at the resumed step either
    loop.train_and_evaluate(cfg, str(workdir), stop_after_steps=1)
    assert workdir_ckpt.steps(workdir)[-1] == step + 1
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses[name] = [r["loss"] for r in rows if r.get("split") == "train" and r["step"] == step + 1][-1]
  assert np.isclose(losses["unrolled"], losses["stacked"], rtol=1e-4), losses
