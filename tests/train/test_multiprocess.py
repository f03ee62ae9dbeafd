"""Multi-process training on localhost: 2 CPU processes x 4 virtual devices, gloo collectives.

One test, three phases (process startups and compiles are the cost, so they are shared: one pair of processes runs
both A and C):
  A. `train.py` in 2 processes (--coordinator_address/--num_processes/--process_id), FSDP over the 8
     devices of both processes, each process reading its own half of the data: 2 steps + a checkpoint.
  B. This (1-device) process computes the same 2 steps on the global batch (process 0's rows, then
     process 1's) and gets the loss process 0 logged; the 2-process checkpoint restores here with the
     same parameters and optimizer state (Orbax resharding 8 shards -> 1 device); both processes'
     data-iterator positions are in it.
  C. A checkpoint written by this 1 process (B's state, written before A+C start) restores in the 2 processes onto
     the FSDP mesh (1 -> 8 shards over 2 processes), every gathered tensor equal; the 2-process checkpoint restored
     there equals its restore in B bit for bit.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from dgemma import data as data_lib
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.files import write_text_atomic
from dgemma.train import optimizer as optimizer_lib, state as state_lib, step as step_lib
from tests.conftest import TEST_XLA_FLAGS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # subprocesses: 2 x train.py + restores (tests/conftest.py, the fast tier)

def _config(tiny_config):
  """Small and quick to compile: no MoE, one decoder pass, short rows; FSDP over all devices."""
  config = tiny_config
  config.data.seq_len, config.diffusion.canvas_len = 32, 8
  config.data.batch_size, config.train.num_steps = 8, 2
  config.model.num_experts = 0
  config.diffusion.self_cond_prob = 0.0
  config.train.log_every = config.train.ckpt_every = 2
  config.mesh.shape.update(dict(data=1, fsdp=-1, expert=1, tensor=1))
  return config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_two(cmd_for_process, timeout=900) -> list[str]:
  """Runs the 2 processes of a localhost job (4 CPU devices each, gloo) and returns their stdout."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
             XLA_FLAGS=TEST_XLA_FLAGS)
  procs = [subprocess.Popen(cmd_for_process(i), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, err[-4000:]
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


# One process of the pair: A (train.py as `python train.py FLAGS` runs it), then C in the same process.
_WORKER = r"""
import runpy, sys
repo, wd_one, wd_two, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# ---- A. train.py: its __main__ (cli.run -> absl's app.run, which ends with SystemExit)
sys.argv = ["train.py", *flags]
try:
  runpy.run_path(f"{repo}/train.py", run_name="__main__")
except SystemExit as e:
  assert e.code in (None, 0), e.code
print("trained")
# ---- C. restores, on the 8 devices of both processes (jax.distributed initialised by train.py's --flags)
sys.path.insert(0, repo)
import jax, numpy as np
from jax.experimental import multihost_utils
from dgemma import mesh as mesh_lib, settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.train import optimizer as optimizer_lib, state as state_lib
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
pid = jax.process_index()
settings = settings_lib.from_config(settings_lib.from_json(open(f"{wd_one}/config.json").read()))
mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
_, abstract, _ = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules,
                                                optimizer_lib.make_optimizer(settings.opt, 2))
manager = workdir_ckpt.make_manager(wd_one, read_only=True, async_save=False)
state, _ = workdir_ckpt.restore(manager, 2, abstract, with_data=False)
ref = np.load(f"{wd_one}/reference.npz")
leaves = jax.tree_util.tree_leaves_with_path(state.params)
sharded = 0
for path, leaf in leaves:
  sharded += len(leaf.sharding.device_set) == 8 and not leaf.is_fully_replicated
  np.testing.assert_array_equal(multihost_utils.process_allgather(leaf, tiled=True), ref[jax.tree_util.keystr(path)])
assert sharded > 0  # FSDP: tensors split over the devices of both processes
print("restored", len(leaves), "tensors,", sharded, "sharded")
# The 2-process checkpoint, restored here too: gathered tensors for the test to compare with its own restore.
state, _ = workdir_ckpt.restore(workdir_ckpt.make_manager(wd_two, read_only=True, async_save=False), 2, abstract,
                                with_data=False)
gathered = {jax.tree_util.keystr(p): multihost_utils.process_allgather(v, tiled=True)
            for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
if pid == 0:
  np.savez(f"{wd_two}/restored_by_two.npz", **gathered)
"""


def test_two_processes_match_one_and_checkpoints_reshard(tiny_config, tmp_path):
  config = _config(tiny_config)
  settings = settings_lib.from_config(config)
  prepared = data_lib.prepare(settings)  # build the dataset once, before both processes look for it

  # ---- B (first half). The 2 steps in this process on the global batch; its state saved for C
  model_cfg, axis_rules = settings.model, settings.mesh.axis_rules
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes, devices=jax.devices()[:1])
  optimizer = optimizer_lib.make_optimizer(settings.opt, 2)
  loss_cfg = settings.diffusion
  step = jax.jit(step_lib.make_train_step(model_cfg, loss_cfg, optimizer, optimizer_lib.make_schedule(settings.opt, 2)))
  shards = [data_lib.make_iterator(settings, prepared, "train", shard_index=i, shard_count=2) for i in range(2)]
  state, _ = state_lib.create_train_state(model_cfg, mesh, axis_rules, optimizer, jax.random.PRNGKey(config.seed))
  base_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
  losses = []
  for _ in range(2):
    rows = [next(it) for it in shards]
    batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    state, metrics = step(state, batch, base_rng)
    losses.append(float(metrics["loss"]))
  wd_one = tmp_path / "one"
  manager = workdir_ckpt.make_manager(wd_one, async_save=False)
  workdir_ckpt.save(manager, 2, state, None)
  manager.wait_until_finished()
  write_text_atomic(wd_one / "config.json", settings_lib.to_json(config))
  np.savez(wd_one / "reference.npz", **{jax.tree_util.keystr(p): np.asarray(v)
                                        for p, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))})

  # ---- A + C. 2 processes: train.py, then the restores
  wd_two = tmp_path / "two"
  port = _free_port()
  flags = ["--config=configs/tiny_test.py", f"--workdir={wd_two}", f"--coordinator_address=localhost:{port}",
           "--num_processes=2", "--config.data.source=files", f"--config.data.files=('{config.data.files[0]}',)",
           f"--config.data.cache_dir={config.data.cache_dir}", f"--config.data.seq_len={config.data.seq_len}",
           f"--config.diffusion.canvas_len={config.diffusion.canvas_len}", "--config.data.batch_size=8",
           "--config.train.num_steps=2", "--config.train.log_every=2", "--config.train.ckpt_every=2",
           "--config.model.num_experts=0", "--config.diffusion.self_cond_prob=0.0",
           "--config.train.async_checkpointing=False", "--config.mesh.shape.data=1", "--config.mesh.shape.fsdp=-1"]
  outs = _run_two(lambda i: [sys.executable, "-c", _WORKER, str(REPO), str(wd_one), str(wd_two), *flags,
                             f"--process_id={i}"])
  assert all("trained" in o and "restored" in o for o in outs), outs
  logged = [json.loads(l) for l in (wd_two / "metrics.jsonl").read_text().splitlines()]
  loss_two = [r["loss"] for r in logged if r["split"] == "train" and r["step"] == 2]
  assert len(loss_two) == 1  # only process 0 writes metrics
  # another reduction order (2 processes, FSDP): the 8-device meshes of tests/train/test_loop.py measure <= 2% of this
  np.testing.assert_allclose(loss_two[0], np.mean(losses), rtol=1e-5)

  # ---- B (second half). The 2-process checkpoint restored in this process
  _, abstract, _ = state_lib.abstract_train_state(model_cfg, mesh, axis_rules, optimizer)
  restored, data_state = workdir_ckpt.restore(workdir_ckpt.make_manager(wd_two, read_only=True), 2, abstract)
  assert int(restored.step) == 2
  # Each process's data position is saved (own shard); a 1-process run cannot use them (warned, None).
  assert len(data_state["per_process"]) == 2 and data_state["per_process"][0] != data_state["per_process"][1]
  assert workdir_ckpt.this_process_data_state(data_state) is None
  # Against the recomputation: same up to fp32 reduction order, which Adam's first steps (update lr * g /
  # (|g| + eps)) turn into up to lr * dg / eps on weights with near-zero gradients: measured ~0.1 lr here
  # (cf. test_grad_accumulation); a wrongly combined gradient or update moves weights by ~lr.
  chex.assert_trees_all_close(jax.device_get(restored.params), jax.device_get(state.params),
                              atol=0.2 * config.opt.lr, rtol=0)
  # The 2-process checkpoint restored by 2 processes (FSDP) and by this one: bit-identical tensors.
  two = np.load(wd_two / "restored_by_two.npz")
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(restored.params)):
    np.testing.assert_array_equal(two[jax.tree_util.keystr(path)], leaf)
