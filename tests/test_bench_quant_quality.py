"""bench/quant_quality.py end to end on a saved tiny run (random weights): it loads the run, scores the
same validation batches at every scheme and prints one row per scheme, the reference's deltas zero."""

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp

from dgemma import checkpointing, config as config_lib, trainer
from tests.model_utils import random_params

ROOT = Path(__file__).resolve().parents[1]


def test_quant_quality_runs_on_a_saved_run(tiny_config, tmp_path, capsys, monkeypatch):
  config = tiny_config
  workdir = tmp_path / "run"
  model_cfg = config_lib.validate(config)
  params = random_params(model_cfg)
  state = trainer.TrainState(step=jnp.ones((), jnp.int32), params=params,
                             opt_state=trainer.make_optimizer(config.opt, 1).init(params))
  checkpointing.write_text_atomic(workdir / "config.json", config_lib.to_json(config))
  manager = checkpointing.make_manager(workdir, async_save=False)
  checkpointing.save(manager, 1, state, None)
  manager.wait_until_finished()
  manager.close()

  spec = importlib.util.spec_from_file_location("quant_quality", ROOT / "bench" / "quant_quality.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  monkeypatch.setattr(sys, "argv", ["quant_quality.py"])
  from absl import flags
  flags.FLAGS([  "quant_quality.py", f"--workdir={workdir}", "--batches=1", "--group_size=16"])
  try:
    bench.main([])
  finally:
    flags.FLAGS.unparse_flags()
  out = capsys.readouterr().out.splitlines()
  rows = {line.split()[0]: line.split() for line in out if line.split() and line.split()[0] in ("none", "int8", "int4")}
  assert set(rows) == {"none", "int8", "int4"}
  assert rows["none"][3] == "+0.0000" and rows["none"][5] == "+0.0000"
  assert float(rows["int8"][1]) < float(rows["none"][1])  # smaller weights
