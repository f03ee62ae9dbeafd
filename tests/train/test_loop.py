"""Training loop: learning, checkpoint round trips, exact resume, and multi-device equivalence."""

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import data, diffusion
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import params as params_ckpt
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import ConfigError
from dgemma.train import loop, optimizer as optimizer_lib, state as state_lib, step as step_lib
from tests.conftest import TEST_XLA_FLAGS, write_corpus

REPO = Path(__file__).resolve().parents[2]


def _quick(config):
  """The loop tests' run (here, in tests/train/test_safety.py, test_step.py and tests/tools/test_relayout.py):
  tiny_test without MoE, with one decoder pass (self_cond_prob 0), lr 2e-3 over 8 steps without warmup (the first
  update moves the weights: the grad-accumulation test compares one). What these tests check (steps, checkpoints,
  exact resumes, config.json, the command line) is the same for any model, and this one compiles in about half the
  time. Every run with these settings shares one set of compiled programs (loop.run_programs within a process, JAX's
  persistent compilation cache across processes, a train.py subprocess given QUICK_FLAGS included); its data files,
  checkpoint and logging settings may differ (they are not in the programs), not its shapes or anything else in
  loop.run_programs' key. A test that needs another setting pays a compile."""
  config.model.num_experts = 0
  config.diffusion.self_cond_prob = 0.0
  config.opt.lr, config.opt.warmup_steps = 2e-3, 0
  config.train.num_steps = 8
  return config


# _quick's settings as train.py flags (the same programs, so the same persistent-cache entries)
QUICK_FLAGS = ("--config.model.num_experts=0", "--config.diffusion.self_cond_prob=0.0", "--config.opt.lr=2e-3",
               "--config.opt.warmup_steps=0", "--config.train.num_steps=8")


def _setup(config):
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps)
  schedule = optimizer_lib.make_schedule(settings.opt, settings.train.num_steps)
  return settings, mesh, optimizer, schedule


@contextlib.contextmanager
def _loop_programs(config):
  """(settings, the loop's jitted programs for them, its batch sharding), to call in the loop's mesh context (its
  activation constraints): the very programs train_and_evaluate runs, traced and compiled once for both."""
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
    yield settings, loop.run_programs(settings, mesh), mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules)


@pytest.mark.slow  # 25 training steps
def test_train_steps_lower_loss_on_fixed_batch(tiny_config):
  # The loop's own init / train / eval programs of _quick's run (shared with the other tests of that run): its 8-step
  # schedule (2e-3 decaying to 10% of it, then held) over 25 steps on one batch lowers the loss by ~2.2 (11.0 -> 8.8)
  with _loop_programs(_quick(tiny_config)) as (settings, programs, data_sharding):
    batch = step_lib.device_batch(next(data.make_iterator(settings, data.prepare(settings), "train")), data_sharding)
    state = programs.init_state(jax.random.PRNGKey(0))
    rng = jax.random.PRNGKey(1)
    fixed = jax.random.PRNGKey(7)
    before = float(programs.eval_step(state.params, batch, fixed)["loss"])
    for _ in range(25):
      state, metrics = programs.train_step(state, batch, rng)
    after = float(programs.eval_step(state.params, batch, fixed)["loss"])
  assert np.isfinite(after)
  assert after < before - 0.5, (before, after)


def test_corruption_fraction_matches_t():
  keys_B = jax.random.split(jax.random.PRNGKey(0), 64)
  tokens = jnp.zeros((64, 512), jnp.int32)
  for t in (0.1, 0.5, 0.9):
    t_B = jnp.full((64,), t)
    noisy, replaced = diffusion.corrupt_rows(keys_B, tokens, t_B, vocab_size=1000)
    assert abs(float(replaced.mean()) - t) < 0.01
    # A replaced token is uniform over the vocabulary: it equals the clean token about 1/V of the time.
    changed = np.asarray(noisy != tokens)
    assert abs(changed.mean() - t * (1 - 1 / 1000)) < 0.01
    # Unreplaced tokens are never changed.
    assert not np.any(changed & ~np.asarray(replaced))


@pytest.mark.slow  # tracing a train step (the loop's, of _quick's run): over the fast tier's budget
def test_save_restore_identical_state_and_next_batch(tiny_config, tmp_path):
  with _loop_programs(_quick(tiny_config)) as (settings, programs, data_sharding):
    prepared = data.prepare(settings)
    it = data.make_iterator(settings, prepared, "train")
    state = programs.init_state(jax.random.PRNGKey(0))
    for _ in range(2):
      state, _ = programs.train_step(state, step_lib.device_batch(next(it), data_sharding), jax.random.PRNGKey(1))
  manager = workdir_ckpt.make_manager(tmp_path, keep=2, async_save=False)
  workdir_ckpt.save(manager, 2, state, it.get_state())
  manager.wait_until_finished()
  expected_next = next(it)

  abstract = programs.abstract_state
  restored, data_state = workdir_ckpt.restore(manager, 2, abstract)
  chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(state))
  # Params only (what sampling reads): the same params, without the optimizer state.
  params_only = workdir_ckpt.restore_params(tmp_path, 2, abstract.params)
  chex.assert_trees_all_equal(jax.device_get(params_only), jax.device_get(state.params))
  it2 = data.make_iterator(settings, prepared, "train")
  it2.set_state(json.loads(json.dumps(data_state)))
  chex.assert_trees_all_equal(next(it2), expected_next)


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # muon: its state has masked (empty) Adam / Muon halves
def test_interrupted_run_resumes_exactly(tiny_config, tmp_path, optimizer):
  config = _quick(tiny_config)  # 8 steps
  config.opt.optimizer = optimizer
  config.train.ckpt_every = 2
  settings = settings_lib.from_config(config)
  programs = loop.run_programs(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))
  seen = programs.train_step._cache_size()  # other tests of _quick's run may have called it already
  full = loop.train_and_evaluate(config, str(tmp_path / "full"))
  loop.train_and_evaluate(config, str(tmp_path / "resumed"), stop_after_steps=3)
  assert workdir_ckpt.steps(tmp_path / "resumed")[-1] == 3
  resumed = loop.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 8
  chex.assert_trees_all_equal(jax.device_get(resumed.params), jax.device_get(full.params))
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), jax.device_get(full.opt_state))
  records = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  assert any(r["split"] == "eval" for r in records)
  assert all(r["tokens_per_sec"] > 0 for r in records if r["split"] == "train")
  assert list((tmp_path / "full" / "tensorboard").glob("events.out.tfevents.*"))
  # The three runs (one process, one setup) traced and compiled the train step at most once (loop.run_programs):
  # the same jitted function, and a resumed state has the fresh one's signature.
  assert loop.run_programs(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes)) is programs
  assert programs.train_step._cache_size() - seen <= 1 and programs.train_step._cache_size() >= 1


def test_run_programs_are_shared_by_runs_of_one_setup_only(tiny_config):
  """loop.run_programs: a run whose data, checkpoint or logging settings differ reuses the jitted programs (so a
  resume or a re-run notebook cell traces nothing again); any setting the programs depend on makes new ones."""
  settings = settings_lib.from_config(tiny_config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  programs = loop.run_programs(settings, mesh)
  tiny_config.data.batch_size, tiny_config.train.ckpt_every, tiny_config.seed = 8, 1, 3  # not in the programs
  tiny_config.eval.seed, tiny_config.train.init_from = 5, "/elsewhere"
  assert loop.run_programs(settings_lib.from_config(tiny_config), mesh) is programs
  for key, value in (("opt.lr", 0.5), ("train.num_steps", 7), ("diffusion.canvas_len", 8),
                     ("train.nonfinite", "skip"), ("finetune.freeze_router", True)):
    changed = settings_lib.from_config(tiny_config)
    group, name = key.split(".")
    changed = dataclasses.replace(changed, **{group: dataclasses.replace(getattr(changed, group), **{name: value})})
    assert loop.run_programs(changed, mesh) is not programs, key
  latest = loop.run_programs(changed, mesh)
  assert loop.run_programs(changed, mesh) is latest
  loop.clear_programs()
  assert loop.run_programs(changed, mesh) is not latest


@pytest.mark.slow  # a short training run (_quick's programs)
def test_finite_training_data_stops_the_run_at_its_last_batch_with_a_checkpoint(tiny_config, tmp_path, caplog):
  """The loop makes the next batch while the device runs the step; a stream that ends (data.num_epochs) stops
  the run after the step of its last batch, logged and saved, instead of failing one step later."""
  config = _quick(tiny_config)  # 8 steps
  config.data.files = (str(write_corpus(tmp_path / "short.txt", num_docs=8)),)  # one epoch: fewer batches than steps
  config.data.num_epochs = 1
  settings = settings_lib.from_config(config)
  num_batches = len(list(data.make_iterator(settings, data.prepare(settings), "train")))
  num_steps = config.train.num_steps
  assert 1 < num_batches < num_steps
  config.train.ckpt_every = 100
  config.train.eval_every = 100
  with caplog.at_level("WARNING"):
    state = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert int(state.step) == num_batches
  assert workdir_ckpt.steps(tmp_path / "run") == [num_batches]
  assert f"the training data ended (data.num_epochs=1) before step {num_steps}" in caplog.text
  records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["step"] == num_batches and records[-1]["split"] == "train"


_MULTI_DEVICE_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, sys.argv[1])
from tests.conftest import write_corpus
from tests.golden import make_partition_specs
from pathlib import Path
from configs import tiny_test
from dgemma import data, diffusion, mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.model import Transformer
from dgemma.train import optimizer as optimizer_lib, state as state_lib, step as step_lib
from dgemma.model.moe import experts_dense, experts_expert_parallel
from dgemma.model.sharding import fit_spec_to_shape
from jax.sharding import NamedSharding
from dgemma.sampling import SamplerConfig, generate
assert jax.device_count() == 8, jax.devices()
tmp = Path(sys.argv[2])
out = {"specs": make_partition_specs.compute()}  # golden PartitionSpecs of every parameter, per preset
config = tiny_test.get_config()
config.data.source = "files"
config.data.files = (str(write_corpus(tmp / "toy.txt")),)
config.data.cache_dir = str(tmp / "cache")
config.data.batch_size = 8
config.diffusion.self_cond_prob = 0.0  # one decoder pass: a smaller program to compile per mesh
settings = settings_lib.from_config(config)
prepared = data.prepare(settings)
batch = next(data.make_iterator(settings, prepared, "train"))
loss_cfg = settings.diffusion
optimizer = optimizer_lib.make_optimizer(settings.opt, 10)
schedule = optimizer_lib.make_schedule(settings.opt, 10)
rules = settings.mesh.axis_rules
flat = lambda tree: [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]
arrays, states = {}, {}
# (name, mesh, moe_impl): data + FSDP + tensor and FSDP + expert-parallel + tensor meshes against one device.
# Every axis is split in one of the two meshes (fsdp and tensor in both); the ragged MoE runs sharded in one, expert
# parallelism in the other. (Expert parallelism over more shards: the 4-way expert mesh of the sampling below and
# the 8-way padded dispatch.)
cases = [("1dev", dict(data=1, fsdp=1, expert=1, tensor=1), "ragged"),
         ("data_fsdp_tensor", dict(data=2, fsdp=2, expert=1, tensor=2), "ragged"),
         ("mixed", dict(data=1, fsdp=2, expert=2, tensor=2), "expert_parallel")]
results = {}
import time
t0 = time.time()
for name, shape, impl in cases:
  print(f"[{time.time() - t0:.0f}s] {name}", file=sys.stderr, flush=True)
  config.mesh.shape.update(shape)
  config.model.moe_impl = impl
  model_cfg = settings_lib.from_config(config).model
  devices = jax.devices()[:1] if name == "1dev" else jax.devices()
  mesh = mesh_lib.make_mesh(dict(config.mesh.shape), devices=devices)
  data_sharding = mesh_lib.batch_sharding(mesh, rules)
  with mesh_lib.mesh_context(mesh, rules):
    if name == "1dev":
      state, shardings = state_lib.create_train_state(model_cfg, mesh, rules, optimizer, jax.random.PRNGKey(0))
      init_state = jax.device_get(state)
    else:  # the same initial state placed on this mesh (one init compile for all meshes)
      _, _, shardings = state_lib.abstract_train_state(model_cfg, mesh, rules, optimizer)
      state = jax.device_put(init_state, shardings)
    step = jax.jit(step_lib.make_train_step(model_cfg, loss_cfg, optimizer, schedule),
                   in_shardings=(shardings, data_sharding, None), out_shardings=(shardings, None))
    dbatch = step_lib.device_batch(batch, data_sharding)
    hlo = step.lower(state, dbatch, jax.random.PRNGKey(3)).as_text()
    for _ in range(2):
      state, metrics = step(state, dbatch, jax.random.PRNGKey(3))
  experts = state.params["blocks"]["layer_0"]["moe"]["experts"]["gate_proj"]
  results[name] = dict(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]),
                       all_to_all="all_to_all" in hlo,
                       expert_shard=list(experts.addressable_shards[0].data.shape), expert_global=list(experts.shape),
                       batch_shard=list(dbatch["tokens"].addressable_shards[0].data.shape))
  arrays[name] = dict(mu=flat(state.opt_state[1][0].mu), params=flat(state.params))
  states[name] = (state.params, model_cfg)
np.savez(tmp / "arrays.npz", **{f"{n}/{k}/{i}": a for n, d in arrays.items() for k, v in d.items() for i, a in enumerate(v)})
out["train"] = results
sampler_cfg = settings_lib.from_config(config).canvas_sampler

# Expert-parallel dispatch with a token count that needs padding (37 tokens over 8 shards).
g = np.random.default_rng(0)
E, D, F, T, k = 8, 16, 8, 37, 3
x, w = jnp.asarray(g.normal(size=(T, D)), jnp.float32), jnp.asarray(g.uniform(size=(T, k)), jnp.float32)
wts = [jnp.asarray(g.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
idx = jnp.asarray(np.stack([g.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
config.mesh.shape.update(dict(data=1, fsdp=1, expert=8, tensor=1))
with mesh_lib.mesh_context(mesh_lib.make_mesh(dict(config.mesh.shape)), rules):
  ep = jax.jit(lambda *a: experts_expert_parallel(*a, jnp.float32))(x, *wts, w, idx)
dense = experts_dense(x, *wts, w, idx, jnp.float32)
out["ep_padded_err"], out["ep_padded_scale"] = float(jnp.max(jnp.abs(ep - dense))), float(jnp.max(jnp.abs(dense)))

print(f"[{time.time() - t0:.0f}s] sampling", file=sys.stderr, flush=True)
# Sharded sampling: the batch over data, the 4 experts over expert=4 (all-to-all), same tokens as one device.
prompts = np.array([[2, 70, 80, 90, 100], [2, 71, 81, 0, 0]], np.int32)
lengths = np.array([5, 3], np.int32)
tokens = {}
for name, shape, impl in (cases[0], ("expert", dict(data=2, fsdp=1, expert=4, tensor=1), "expert_parallel")):
  params = states["1dev"][0]
  config.mesh.shape.update(shape)
  config.model.moe_impl = impl
  model_cfg = settings_lib.from_config(config).model
  mesh = mesh_lib.make_mesh(dict(config.mesh.shape), devices=jax.devices()[:1] if name == "1dev" else jax.devices())
  with mesh_lib.mesh_context(mesh, rules):
    _, abstract, _ = state_lib.abstract_train_state(model_cfg, mesh, rules, optimizer)
    params = jax.device_put(jax.device_get(params), jax.tree.map(lambda a: a.sharding, abstract.params))
    rows = NamedSharding(mesh, fit_spec_to_shape(mesh_lib.batch_sharding(mesh, rules).spec, prompts.shape, mesh))
    res = generate(Transformer(model_cfg), params, jax.device_put(prompts, rows), lengths, sampler_cfg,
                   jax.random.key(5), 16)  # 2 rows over data=2 (fit_spec_to_shape drops expert)
  tokens[name] = np.asarray(res.tokens_BN).tolist()
out["sample"] = tokens
print(json.dumps(out))
"""


@pytest.mark.slow  # 8 virtual devices (a subprocess)
def test_eight_virtual_devices_match_one_device(tmp_path):
  """One subprocess with 8 virtual CPU devices (shared startup and compiles):
  - golden PartitionSpecs of every parameter under each mesh preset (tests/golden/partition_specs.json,
    regenerate with `python tests/golden/make_partition_specs.py`);
  - 2 training steps on data + FSDP + tensor and FSDP + expert-parallel + tensor meshes give the 1-device loss,
    gradient norm, Adam first moments (= gradients mixed over 2 steps) and parameters;
  - expert-parallel dispatch with padding equals the dense reference; sampling sharded over data and a 4-way
    expert-parallel mesh gives the 1-device tokens."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
  out = subprocess.run([sys.executable, "-c", _MULTI_DEVICE_SCRIPT, str(REPO), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-4000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  golden = json.loads((REPO / "tests" / "golden" / "partition_specs.json").read_text())
  assert res["specs"] == golden
  assert golden["gpu8_expert"]["['blocks']['layer_0']['moe']['experts']['gate_proj']"] == "P(None, 'expert', None, None)"

  train = res["train"]
  arrays = np.load(tmp_path / "arrays.npz")
  leaves = lambda name, kind: [arrays[k] for k in sorted((k for k in arrays if k.startswith(f"{name}/{kind}/")),
                                                         key=lambda k: int(k.rsplit("/", 1)[1]))]
  mu_ref, params_ref = leaves("1dev", "mu"), leaves("1dev", "params")
  mu_scale = np.sqrt(sum(np.sum(np.square(m)) for m in mu_ref))
  for name in ("data_fsdp_tensor", "mixed"):
    # Same math, different reduction order across devices: fp32 round-off only (loss ~11 a mean over
    # the batch, measured <= 2% of rtol 1e-5; grad_norm <= 2% of rtol 1e-4).
    np.testing.assert_allclose(train[name]["loss"], train["1dev"]["loss"], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(train[name]["grad_norm"], train["1dev"]["grad_norm"], rtol=1e-4, err_msg=name)
    # Gradients: every Adam first moment (a mix of both steps' gradients) within 1e-4 of the global
    # gradient scale (measured <= 1.9e-5). Params within 0.2 lr: Adam's first updates are lr * g / (|g| +
    # eps), so a round-off dg in a near-zero gradient moves a weight by up to lr * dg / eps (measured
    # 0.021 lr; a sign flip could give 2 lr), while a wrongly applied update moves weights by ~lr
    # (cf. test_grad_accumulation_matches_whole_batch).
    for i, (m, m_ref) in enumerate(zip(leaves(name, "mu"), mu_ref)):
      assert np.linalg.norm(m - m_ref) <= 1e-4 * mu_scale, (name, i)
    for p, p_ref in zip(leaves(name, "params"), params_ref):
      np.testing.assert_allclose(p, p_ref, atol=0.2 * 1e-3, rtol=0, err_msg=name)  # tiny_test lr = 1e-3
  # The meshes really split the work: the batch over data x fsdp x expert, the experts over expert
  # (exchanged by all-to-all), expert_mlp over tensor.
  assert train["data_fsdp_tensor"]["batch_shard"][0] == 2  # batch 8 over data x fsdp
  assert train["mixed"]["batch_shard"][0] == 2  # batch 8 over fsdp x expert
  assert train["mixed"]["all_to_all"] and not train["data_fsdp_tensor"]["all_to_all"]
  assert train["mixed"]["expert_shard"] == [2, 2, 32, 16]  # 4 experts over expert, embed over fsdp, mlp over tensor
  assert train["data_fsdp_tensor"]["expert_shard"] == [2, 4, 32, 16]  # embed over fsdp, expert_mlp over tensor
  # two fp32 implementations of one expert layer: 50 eps * max|out|, as in tests/model/test_moe.py
  assert res["ep_padded_err"] <= 50 * np.finfo(np.float32).eps * res["ep_padded_scale"], res["ep_padded_err"]
  assert res["sample"]["expert"] == res["sample"]["1dev"]


@pytest.mark.slow  # subprocesses (train.py)
def test_train_py_end_to_end(tiny_config, tmp_path):
  """train.py of _quick's run on a corpus it builds (a new data cache): the settings it saved, its checkpoints, and
  a quiet log, its stderr a pipe as in a log file: one line when the data is built and one when done, a line per
  logged metrics row, nothing else (no JAX platform probing, no TFDS notes, progress bars or escape codes, no
  optax note on an empty warmup)."""
  workdir = tmp_path / "wd"
  cmd = [sys.executable, "train.py", "--config=configs/tiny_test.py", f"--workdir={workdir}",
         "--config.data.source=files", f"--config.data.files=('{tiny_config.data.files[0]}',)",
         f"--config.data.cache_dir={tmp_path / 'data_cache'}",
         # the command line, not the model, is under test: _quick's run (its programs are in the compile cache)
         *QUICK_FLAGS]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["train"]["num_steps"] == 8 and saved["opt"]["lr"] == 2e-3 and saved["model"]["num_experts"] == 0
  assert saved["diffusion"]["self_cond_prob"] == 0.0
  assert workdir_ckpt.steps(workdir)[-1] == 8
  lines = out.stderr.splitlines()
  assert not any(c in out.stderr for c in "\r\x1b") and not out.stdout.strip(), out.stderr[-2000:]
  data = [line for line in lines if "] data: " in line]
  rows = [line for line in lines if re.search(r"\] \[(train|eval)\] step \d+: ", line)]
  assert len(data) == 2 and "from 1 file(s): " in data[0] and data[1].endswith(" built"), lines
  assert len(rows) == 7 and len(lines) == len(data) + len(rows), lines  # log_every 2, eval_every 3 and at the end


# ---- objectives wiring, router losses, memory knobs (tiny shapes: a few compiles) ----------------

def _synthetic_batch(length: int) -> dict[str, np.ndarray]:
  """4 rows of `length` random tokens: two documents in row 1 (the second from 5/8 of the row), the last 1/8 of row
  3 padding, so that micro-batches hold different numbers of tokens."""
  rng = np.random.default_rng(0)
  seg = np.ones((4, length), np.int32)
  seg[1, 5 * length // 8:] = 2
  seg[3, 7 * length // 8:] = 0
  pos = np.where(seg == 2, np.arange(length) - 5 * length // 8, np.arange(length)).astype(np.int32) * (seg != 0)
  return {"tokens": (rng.integers(4, 260, (4, length)) * (seg != 0)).astype(np.int32), "segment_ids": seg,
          "positions": pos}


def _small(config, *, moe: bool = False):
  """tiny_test at seq_len 32 / canvas 8 / batch 4, one decoder pass (self_cond_prob 0), MoE only if
  asked (compile time), and a synthetic batch with two documents in a row and padding in another."""
  config.data.seq_len, config.diffusion.canvas_len, config.data.batch_size = 32, 8, 4
  config.diffusion.self_cond_prob = 0.0
  config.opt.warmup_steps = 0
  if not moe:
    config.model.num_experts = 0
  return config, {k: jnp.asarray(v) for k, v in _synthetic_batch(32).items()}


def _quick_state(model_cfg, optimizer):
  """A TrainState without compiling model.init: shapes by eval_shape, N(0, 0.05) matrices, unit scales, drawn by
  numpy (jax.random's eager ops would compile a small program per leaf shape: ~3 s) and the optimizer state by one
  jitted optimizer.init."""
  from dgemma.model.transformer import param_shapes
  shapes = param_shapes(model_cfg)
  leaves, treedef = jax.tree.flatten(shapes)
  g = np.random.default_rng(0)
  params = treedef.unflatten([
      jnp.asarray(np.asarray(np.ones(s.shape) if len(s.shape) <= 1 else 0.05 * g.standard_normal(s.shape), s.dtype))
      for s in leaves])
  return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=jax.jit(optimizer.init)(params))


@pytest.mark.slow  # 11 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_router_losses_add_exactly_their_sown_values():
  from configs import tiny_test
  config, batch = _small(tiny_test.get_config(), moe=True)
  results, state = {}, None
  for weights in ((0.0, 0.0), (0.01, 0.001)):
    config.model.router_aux_loss_weight, config.model.router_z_loss_weight = weights
    settings, _, optimizer, _ = _setup(config)
    model_cfg, loss_cfg = settings.model, settings.diffusion
    state = state or _quick_state(model_cfg, optimizer)
    fn = jax.jit(lambda p, b, r: diffusion.diffusion_loss(p, b, r, model_cfg=model_cfg, loss_cfg=loss_cfg))
    results[weights] = jax.device_get(fn(state.params, batch, jax.random.PRNGKey(3)))
  (loss0, m0), (loss1, m1) = results[(0.0, 0.0)], results[(0.01, 0.001)]
  assert "router_aux_loss" not in m0 and m1["router_aux_loss"] > 0 and m1["router_z_loss"] > 0
  # loss1 - loss0 cancels two fp32 totals (~11) to the aux terms (~0.02): each total carries its own final
  # roundings (<= eps |loss| together), which rtol 1e-4 of the aux alone (2.4e-6) barely covers: add them.
  np.testing.assert_allclose(loss1 - loss0, m1["router_aux_loss"] + m1["router_z_loss"], rtol=1e-4,
                             atol=4 * np.finfo(np.float32).eps * abs(float(loss1)))
  np.testing.assert_allclose(m1["canvas_loss"], m0["canvas_loss"], rtol=1e-6)  # the same ops (measured equal)
  # The metrics are the sums over the scored passes (encoder, scored decoder pass) of what was sown.
  sown = {"encode": {"router_aux_loss": (jnp.float32(0.5),), "router_z_loss": (jnp.float32(0.25),)},
          "decode": {"router_aux_loss": (jnp.float32(1.0),), "router_z_loss": (jnp.float32(2.0),)}}
  assert {k: float(v) for k, v in diffusion.sum_sown_router_losses(sown).items()} == {"router_aux_loss": 1.5,
                                                                             "router_z_loss": 2.25}


@pytest.mark.slow  # a train-step compile (the whole batch's is _quick's run's): over the fast tier's budget
def test_grad_accumulation_matches_whole_batch(tiny_config):
  # One step of _quick's run (the loop's own train step, compiled by the other tests of that run) against the same
  # run with opt.grad_accum_steps=2, from the same state on a batch whose two micro-batches hold different numbers
  # of tokens (two documents in a row, padding in another)
  config = _quick(tiny_config)
  host_batch = _synthetic_batch(config.data.seq_len)
  out, state = {}, None
  for k in (1, 2):
    config.opt.grad_accum_steps = k
    with _loop_programs(config) as (settings, programs, data_sharding):
      if state is None:
        state = jax.device_get(_quick_state(settings.model, programs.optimizer))
      out[k] = jax.device_get(programs.train_step(jax.device_put(state, programs.state_shardings),
                                                  step_lib.device_batch(host_batch, data_sharding),
                                                  jax.random.PRNGKey(1)))
  (s1, m1), (s2, m2) = out[1], out[2]
  # micro-batches vs the whole batch: other fp32 reduction orders, means over the batch's tokens (measured
  # <= 1% of rtol 1e-5; counts and fractions exact)
  for key in ("loss", "canvas_loss", "encoder_loss", "grad_norm", "canvas_tokens", "corrupted_fraction"):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)
  # Adam's first moment after one step is (1 - b1) * grad: the accumulated gradient matches to fp32
  # round-off, measured against the global gradient norm (a scalar's gradient is a sum of many
  # cancelling terms, so its own relative error can be ~1e-4).
  mu1, mu2 = jax.tree.leaves(s1.opt_state[1][0].mu), jax.tree.leaves(s2.opt_state[1][0].mu)
  scale = np.sqrt(sum(np.sum(np.square(g)) for g in mu1))
  for g1, g2 in zip(mu1, mu2):
    assert np.linalg.norm(g2 - g1) <= 1e-5 * scale  # measured <= 4% of this
  # The first Adam update is lr * g / (|g| + eps): a round-off dg of a near-zero g moves it by up to
  # lr * dg / eps (eps = 1e-8), measured 0.03 lr (dg ~ 3e-10), and a sign flip could give 2 lr; 0.2 lr
  # allows dg up to 2e-9 while a wrongly applied update moves weights by ~lr.
  chex.assert_trees_all_close(s2.params, s1.params, atol=0.2 * config.opt.lr, rtol=0)


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_bf16_compute_and_bf16_adam_state_one_step():
  from configs import tiny_test
  config, batch = _small(tiny_test.get_config())
  config.model.dtype, config.model.param_dtype, config.opt.state_dtype = "bfloat16", "float32", "bfloat16"
  settings, _, optimizer, schedule = _setup(config)
  model_cfg, loss_cfg = settings.model, settings.diffusion
  state = _quick_state(model_cfg, optimizer)
  step = jax.jit(step_lib.make_train_step(model_cfg, loss_cfg, optimizer, schedule))
  new_state, metrics = jax.device_get(step(state, batch, jax.random.PRNGKey(1)))
  assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
  adam = new_state.opt_state[1][0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.float32)}  # fp32 master
  moved = [np.any(a != b) for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params))]
  assert np.mean(moved) > 0.9


def test_init_from_params_checkpoint(tiny_config, tmp_path):
  """train.init_from starts from converted params (AR -> diffusion adaptation) at step 0."""
  config = _quick(tiny_config)
  with _loop_programs(config) as (settings, programs, _):  # the loop's init program of _quick's run, another seed
    state = programs.init_state(jax.random.PRNGKey(42))
  model_cfg = settings.model
  ckpt = tmp_path / "converted"
  params_ckpt.save_params(ckpt, jax.device_get(state.params), model_cfg.to_dict())
  from configs import adapt_from_gemma4
  adapt = adapt_from_gemma4.get_config(str(ckpt))  # the adaptation config takes its model from the checkpoint
  assert settings_lib.model_differences(settings_lib.from_config(adapt).model, model_cfg) == []
  assert adapt.train.init_from == str(ckpt)
  config.train.init_from = str(ckpt)
  started = loop.train_and_evaluate(config, str(tmp_path / "wd"), stop_after_steps=0)
  assert int(started.step) == 0
  chex.assert_trees_all_equal(jax.device_get(started.params), jax.device_get(state.params))

  config.model.d_model = 32  # a different architecture is refused, naming the field
  with pytest.raises(ConfigError, match=r"model\.d_model"):
    loop.train_and_evaluate(config, str(tmp_path / "wd2"))
  config.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="train.init_from"):
    loop.train_and_evaluate(config, str(tmp_path / "wd3"))
