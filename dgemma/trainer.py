"""The training loop: sharded state, jitted step, Orbax checkpoints, validation, metrics.

`train_and_evaluate(config, workdir)` is what `train.py` calls. The step is jitted over a
`jax.sharding.Mesh` built from `config.mesh`; parameters are placed by their logical axis names and
`config.mesh.axis_rules` (flax lm1b `setup_initial_state` style), the batch over ('data', 'fsdp').
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgemma import checkpoint_io, checkpointing, finetune
from dgemma import config as config_lib
from dgemma import diffusion
from dgemma.data import pipeline as data_pipeline
from dgemma.model import ModelConfig, Transformer
from dgemma.model import lora
from dgemma.model.sharding import fit_spec_to_shape, unbox

MESH_AXES = ("data", "fsdp", "expert", "tensor")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


# ---- mesh and shardings --------------------------------------------------------------------------

def make_mesh(mesh_config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """Mesh with axes (data, fsdp, expert, tensor); one axis may be -1 (= the remaining devices)."""
  devices = jax.devices() if devices is None else devices
  sizes = [int(mesh_config.shape.get(a, 1)) for a in MESH_AXES]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise config_lib.ConfigError(f"mesh.shape: {dict(mesh_config.shape)} does not divide {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise config_lib.ConfigError(
        f"mesh.shape: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, found {len(devices)}")
  device_grid = mesh_utils.create_device_mesh(sizes, devices=devices, allow_split_physical_axes=True)
  return Mesh(device_grid, MESH_AXES)


def axis_rules(config: ml_collections.ConfigDict) -> tuple:
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in config.mesh.axis_rules)


def batch_axes(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """Mesh axes of the logical 'batch' axis (mesh.axis_rules): the batch of every step is split over them."""
  for name, axes in axis_rules(config):
    if name == "batch":
      return () if axes is None else (tuple(axes) if isinstance(axes, tuple) else (axes,))
  raise config_lib.ConfigError("mesh.axis_rules: no rule for the logical axis 'batch'")


def batch_sharding(mesh: Mesh, config: ml_collections.ConfigDict) -> NamedSharding:
  return NamedSharding(mesh, P(tuple(a for a in batch_axes(config) if a in mesh.shape)))


def mesh_context(mesh: Mesh, config: ml_collections.ConfigDict) -> contextlib.ExitStack:
  """`with mesh_context(mesh, config):` installs the mesh (`jax.set_mesh`) and the logical axis rules
  (`nn.logical_axis_rules`): activation constraints and expert parallelism apply inside it."""
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(axis_rules(config)))
  return stack


def check_batch_fits_mesh(config, mesh: Mesh) -> None:
  axes = [a for a in batch_axes(config) if a in mesh.shape]
  shards = math.prod(mesh.shape[a] for a in axes)
  if config.data.batch_size % shards:
    raise config_lib.ConfigError(
        f"data.batch_size: {config.data.batch_size} is not divisible by the {shards} batch shards "
        f"(mesh {' x '.join(axes)} = {' x '.join(str(mesh.shape[a]) for a in axes)})")
  if shards % jax.process_count():
    raise config_lib.ConfigError(f"mesh.shape: the {shards} batch shards do not split over "
                                 f"{jax.process_count()} processes (each process feeds its own rows)")
  accum = int(config.opt.grad_accum_steps)
  if config.data.batch_size % (shards * accum):
    raise config_lib.ConfigError(
        f"opt.grad_accum_steps: {accum} micro-batches of data.batch_size={config.data.batch_size} rows do "
        f"not divide evenly over the {shards} batch shards (need batch_size % (shards * steps) == 0)")


# ---- optimiser and state -------------------------------------------------------------------------

def make_schedule(opt_config, num_steps: int) -> optax.Schedule:
  warmup = min(int(opt_config.warmup_steps), max(num_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_config.lr, warmup_steps=warmup, decay_steps=max(num_steps, warmup + 1),
      end_value=opt_config.lr * opt_config.end_lr_fraction)


_DECAYED_LEAVES = ("kernel", "embedding", "gate_proj", "up_proj", "down_proj")


def _decay_mask(params):
  """Weight decay on matrices (kernels, embedding, expert weights, LoRA factors), not on norm/router
  scales or scalars."""
  def decayed(path, _):
    name = str(getattr(path[-1], "key", ""))
    return name in _DECAYED_LEAVES or lora.is_adapter(name)
  return jax.tree_util.tree_map_with_path(decayed, params)


def with_state_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """Stores `inner`'s floating-point state (Adam mu / nu) in `dtype`; the update math runs in fp32."""
  dtype = jnp.dtype(dtype)
  def cast(tree, to):
    return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init_fn(params):
    return cast(inner.init(params), dtype)

  def update_fn(updates, state, params=None):
    updates, new_state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(new_state, dtype)
  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(opt_config, num_steps: int, finetune_config=None) -> optax.GradientTransformation:
  """clip -> AdamW (optax.adamw's chain: scale_by_adam, masked decay, -lr); Adam moments stored in
  opt.state_dtype ('float32' | 'bfloat16'). Parameters stay in model.param_dtype (fp32 master weights).

  With frozen parameters (`finetune_config`: mode lora / head_only, or freeze_router) the chain runs only
  on the trainable leaves (clipping by their global norm) through `optax.multi_transform`, frozen leaves
  get `optax.set_to_zero()` and no optimizer state (dgemma/finetune.py)."""
  adam = optax.scale_by_adam(b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps)
  state_dtype = opt_config.get("state_dtype", "float32")
  if state_dtype != "float32":
    adam = with_state_dtype(adam, state_dtype)
  tx = optax.chain(
      optax.clip_by_global_norm(opt_config.grad_clip),
      optax.chain(adam, optax.add_decayed_weights(opt_config.weight_decay, _decay_mask),
                  optax.scale_by_learning_rate(make_schedule(opt_config, num_steps))),
  )
  if not finetune.has_frozen(finetune_config):
    return tx
  return optax.multi_transform({finetune.TRAINABLE: tx, finetune.FROZEN: optax.set_to_zero()},
                               functools.partial(finetune.param_labels, finetune=finetune_config))


def init_inputs(model_cfg: ModelConfig, seq_len: int, canvas_len: int) -> tuple:
  ctx_len = seq_len - canvas_len
  ids = lambda n: jnp.zeros((1, n), jnp.int32)
  pos = lambda n: jnp.arange(n, dtype=jnp.int32)[None]
  seg = lambda n: jnp.ones((1, n), jnp.int32)
  return ids(ctx_len), pos(ctx_len), seg(ctx_len), ids(canvas_len), pos(canvas_len) + ctx_len, seg(canvas_len)


def abstract_train_state(model_cfg: ModelConfig, config, mesh: Mesh, optimizer) -> tuple[Callable, Any, Any]:
  """Returns (init_fn(rng) -> boxed TrainState, abstract unboxed state, state shardings), allocating nothing."""
  model = Transformer(model_cfg)
  inputs = init_inputs(model_cfg, config.data.seq_len, config.diffusion.canvas_len)

  def init_fn(rng):
    with nn.logical_axis_rules(()):  # no activation constraints while initialising (out_shardings place params)
      params = model.init(rng, *inputs)["params"]
    opt_state = optimizer.init(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

  boxed = jax.eval_shape(init_fn, jax.random.PRNGKey(0))
  # optax.masked (frozen leaves) leaves boxes around empty MaskedNodes: they hold no array, drop the box.
  boxed = jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) and not jax.tree.leaves(x.value) else x,
                       boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), axis_rules(config))
  unboxed = unbox(boxed)
  shardings = jax.tree.map(lambda x, spec: NamedSharding(mesh, fit_spec_to_shape(spec, x.shape, mesh)),
                           unboxed, mesh_specs, is_leaf=lambda x: isinstance(x, P))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), unboxed, shardings)
  return init_fn, abstract, shardings


def param_partition_specs(model_cfg: ModelConfig, config, mesh: Mesh) -> dict[str, str]:
  """{parameter path: its PartitionSpec on `mesh`} as strings, from the logical axis names and
  config.mesh.axis_rules (jax.eval_shape: nothing is allocated). tests/golden/partition_specs.json."""
  optimizer = optax.sgd(1.0)  # stateless: only the params' shardings are wanted
  _, abstract, _ = abstract_train_state(model_cfg, config, mesh, optimizer)
  return {jax.tree_util.keystr(path): str(leaf.sharding.spec)
          for path, leaf in jax.tree_util.tree_leaves_with_path(abstract.params)}


def create_train_state(model_cfg: ModelConfig, config, mesh: Mesh, optimizer, rng) -> tuple[TrainState, Any]:
  init_fn, _, shardings = abstract_train_state(model_cfg, config, mesh, optimizer)
  state = jax.jit(lambda r: unbox(init_fn(r)), out_shardings=shardings)(rng)
  return state, shardings


# ---- steps ---------------------------------------------------------------------------------------

def accumulate_gradients(loss_fn: Callable, params, batch: dict, rng: jax.Array, loss_cfg, num_micro: int):
  """(metrics, grads) of the whole batch, computed over `num_micro` micro-batches with a scan.

  Micro-batch j holds rows j, j + k, j + 2k, ... (k = num_micro), so on a batch-sharded mesh every
  device keeps working on its own rows. Noise is drawn per global row index and losses are divided by
  whole-batch token counts, so the summed micro-batch gradients equal the whole-batch gradient (up to
  fp32 round-off). loss_fn(params, batch, rng, example_ids_B=, totals=) -> (loss, metrics).
  """
  batch_size = batch["tokens"].shape[0]
  totals = diffusion.batch_totals(batch, loss_cfg)
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, totals=totals), has_aux=True)
  ids_B = jnp.arange(batch_size, dtype=jnp.int32)
  if num_micro == 1:
    (_, metrics), grads = grad_fn(params, batch, rng, example_ids_B=ids_B)
    return metrics, grads
  interleave = lambda x: jnp.swapaxes(x.reshape(batch_size // num_micro, num_micro, *x.shape[1:]), 0, 1)
  micro = jax.tree.map(interleave, batch)
  micro_ids = interleave(ids_B)

  def body(carry, xs):
    mb, ids = xs
    (_, m), g = grad_fn(params, mb, rng, example_ids_B=ids)
    return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, (m, g)), None

  (_, m_shape), g_shape = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro), rng,
                                                         example_ids_B=micro_ids[0]))
  acc_dtype = lambda s: jnp.float32 if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype  # fp32 sums
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, acc_dtype(s)), (m_shape, g_shape))
  (metrics, grads), _ = jax.lax.scan(body, zeros, (micro, micro_ids))
  return metrics, jax.tree.map(lambda g, s: g.astype(s.dtype), grads, g_shape)


def make_train_step(model_cfg: ModelConfig, loss_cfg: diffusion.DiffusionLossConfig, optimizer,
                    schedule: optax.Schedule, grad_accum_steps: int = 1, finetune_config=None):
  """The jittable step. With frozen parameters (`finetune_config`, dgemma/finetune.py) gradients are
  taken only w.r.t. the trainable leaves (grad_norm is theirs) and frozen leaves pass through as is."""
  has_frozen = finetune.has_frozen(finetune_config)

  def train_step(state: TrainState, batch: dict, base_rng: jax.Array):
    rng = jax.random.fold_in(base_rng, state.step)
    loss_fn = functools.partial(diffusion.diffusion_loss, model_cfg=model_cfg, loss_cfg=loss_cfg)
    if not has_frozen:
      metrics, grads = accumulate_gradients(loss_fn, state.params, batch, rng, loss_cfg, grad_accum_steps)
      grad_norm = optax.tree.norm(grads)
    else:
      mask = finetune.trainable_mask(state.params, finetune_config)
      trainable, frozen = finetune.split(state.params, mask)
      on_trainable = lambda t, *a, **k: loss_fn(finetune.join(t, frozen), *a, **k)
      metrics, grads = accumulate_gradients(on_trainable, trainable, batch, rng, loss_cfg, grad_accum_steps)
      grad_norm = optax.tree.norm(grads)
      # set_to_zero ignores these zeros (XLA drops them); the tree must match params for optax.
      grads = finetune.join(grads, jax.tree.map(lambda p: None if p is None else jnp.zeros_like(p), frozen,
                                                is_leaf=lambda x: x is None))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if has_frozen:
      params = jax.tree.map(lambda m, new, old: new if m else old, mask, params, state.params)
    metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return train_step


def make_eval_step(model_cfg: ModelConfig, loss_cfg: diffusion.DiffusionLossConfig):
  def eval_step(params, batch, rng):
    _, metrics = diffusion.diffusion_loss(params, batch, rng, model_cfg=model_cfg, loss_cfg=loss_cfg,
                                          eval_metrics=True)
    return metrics
  return eval_step


def device_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


# ---- the loop ------------------------------------------------------------------------------------

class MetricWriter:
  """Console (absl log), TensorBoard event files (tensorboardX) and metrics.jsonl in the workdir."""

  def __init__(self, workdir: Path, enabled: bool = True):
    self.enabled = enabled and jax.process_index() == 0
    self.jsonl = workdir / "metrics.jsonl"
    self.tb = None
    if self.enabled:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
    if not self.enabled:
      return
    for k, v in metrics.items():
      self.tb.add_scalar(f"{prefix}/{k}", v, step)
    with open(self.jsonl, "a") as f:
      f.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    logging.info("[%s] step %d: %s", prefix, step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))

  def close(self):
    if self.tb is not None:
      self.tb.flush()
      self.tb.close()


def evaluate(eval_step, params, data_iter: Iterator, num_batches: int, sharding, rng) -> dict[str, float]:
  totals: dict[str, float] = {}
  weights = 0.0
  for i in range(num_batches):
    m = jax.device_get(eval_step(params, device_batch(next(data_iter), sharding), jax.random.fold_in(rng, i)))
    w = float(m["canvas_tokens"])
    weights += w
    for k, v in m.items():
      if k != "canvas_tokens":
        totals[k] = totals.get(k, 0.0) + float(v) * w
  return {k: v / max(weights, 1.0) for k, v in totals.items()}


# ModelConfig fields that may differ between a params checkpoint and the run that starts from it.
_RUNTIME_FIELDS = ("dtype", "param_dtype", "moe_impl", "remat", "router_aux_loss_weight", "router_z_loss_weight")


def check_init_from(config, model_cfg: ModelConfig) -> None:
  """train.init_from names a dgemma params checkpoint whose architecture equals config.model."""
  path = Path(config.train.init_from)
  if not (path / checkpoint_io.MODEL_CONFIG).exists():
    raise FileNotFoundError(f"train.init_from: {path} is not a dgemma params checkpoint (no "
                            f"{checkpoint_io.MODEL_CONFIG}; make one with python -m dgemma.convert --from_hf DIR --to {path})")
  saved = ModelConfig.from_config_dict(json.loads((path / checkpoint_io.MODEL_CONFIG).read_text())).to_dict()
  ours = model_cfg.to_dict()
  for field, value in saved.items():
    if field not in _RUNTIME_FIELDS and ours[field] != value:
      raise config_lib.ConfigError(f"model.{field}: {ours[field]!r} differs from the checkpoint in "
                                   f"train.init_from ({value!r})")


def state_from_params_checkpoint(path: str, optimizer, abstract_state, shardings, init_fn=None,
                                 rng=None) -> TrainState:
  """Step-0 state from converted / exported params (e.g. an imported Gemma 4 AR model, for AR ->
  diffusion adaptation) and a fresh optimizer state; params cast to model.param_dtype.

  LoRA adapters (finetune.mode lora / head_only) that the checkpoint lacks start from `init_fn(rng)`
  (B = 0: the run starts exactly at the checkpoint's model); every other tensor must be there."""
  params_np, _ = checkpoint_io.load_params(path)
  expected = abstract_state.params
  got_paths = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params_np)}
  fresh_names = set()
  for p, leaf in jax.tree_util.tree_leaves_with_path(expected):
    name = jax.tree_util.keystr(p)
    if name not in got_paths and lora.is_adapter(str(p[-1].key)) and init_fn is not None:
      fresh_names.add(name)
      continue
    if name not in got_paths:
      raise ValueError(f"train.init_from: {path} has no tensor {name} (expected shape {leaf.shape})")
    if tuple(got_paths[name].shape) != tuple(leaf.shape):
      raise ValueError(f"train.init_from: {name} has shape {tuple(got_paths[name].shape)}, expected {leaf.shape}")
  if fresh_names:
    # Only the missing adapters are outputs, so XLA initialises nothing else.
    pick = lambda tree: {n: v for n, v in ((jax.tree_util.keystr(p), v) for p, v in
                                           jax.tree_util.tree_leaves_with_path(tree)) if n in fresh_names}
    fresh = jax.jit(lambda r: pick(nn.unbox(init_fn(r)).params))(rng)
    got_paths.update(jax.device_get(fresh))
  params = jax.tree_util.tree_map_with_path(
      lambda p, s: jax.device_put(np.asarray(got_paths[jax.tree_util.keystr(p)]).astype(s.dtype), s.sharding),
      expected)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)


# ---- multi-process ------------------------------------------------------------------------------

DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """`jax.distributed.initialize` for a multi-process run; returns whether it was called.

  Each argument left None is read from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID.
  Nothing set: a single-process run (no call). num_processes == 0: initialize() without arguments,
  for clusters JAX detects itself (SLURM, Open MPI, TPU pods). Must run before anything touches a
  device. On CPU the cross-process collectives use gloo ($JAX_CPU_COLLECTIVES_IMPLEMENTATION, the
  default of this JAX version).
  """
  env = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
  coordinator_address = coordinator_address or env["JAX_COORDINATOR_ADDRESS"]
  if num_processes is None and env["JAX_NUM_PROCESSES"]:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env["JAX_PROCESS_ID"]:
    process_id = int(env["JAX_PROCESS_ID"])
  if num_processes == 0:  # cluster auto-detection
    jax.distributed.initialize()
    return True
  if coordinator_address is None and num_processes is None and process_id is None:
    return False
  missing = [name for name, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                                  ("process_id", process_id)) if v is None]
  if missing:
    raise ValueError(f"--{missing[0]}: a multi-process run needs --coordinator_address, --num_processes and "
                     f"--process_id (or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID); "
                     f"missing {', '.join(missing)}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id: {process_id} not in [0, --num_processes={num_processes})")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)
  return True


def process_barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process got here, through the coordinator (no device collective)."""
  if jax.process_count() > 1:
    from jax._src import distributed  # the coordinator client jax.distributed.initialize made
    distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)


def prepare_data(config):
  """Builds the dataset and tokenizer once (process 0 first on multi-host runs), then opens them."""
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      data_pipeline.prepare(config)
    process_barrier("dgemma_prepare_data")  # not a device collective: building may take long
  return data_pipeline.prepare(config)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, stop_after_steps: int | None = None) -> TrainState:
  """Trains (resuming from the latest checkpoint in workdir/checkpoints) and returns the final state.

  `stop_after_steps` ends this run early (as a preemption would) after that many steps of this
  invocation, saving a checkpoint; the schedule still follows config.train.num_steps.
  """
  model_cfg = config_lib.validate(config)  # bad config -> one clear error, before any work
  if config.train.init_from:
    check_init_from(config, model_cfg)
  workdir_path = Path(workdir)
  workdir_path.mkdir(parents=True, exist_ok=True)
  mesh = make_mesh(config.mesh)
  check_batch_fits_mesh(config, mesh)
  with mesh_context(mesh, config):  # activation constraints and expert parallelism apply inside
    return _train(config, workdir_path, model_cfg, mesh, stop_after_steps)


def _train(config, workdir_path: Path, model_cfg: ModelConfig, mesh: Mesh, stop_after_steps: int | None) -> TrainState:
  prepared = prepare_data(config)
  if prepared.tokenizer.vocab_size > model_cfg.vocab_size:
    raise config_lib.ConfigError(f"model.vocab_size: {model_cfg.vocab_size} is smaller than the tokenizer's "
                                 f"vocabulary ({prepared.tokenizer.vocab_size})")
  checkpointing.write_text_atomic(workdir_path / "config.json", config_lib.to_json(config))

  loss_cfg = diffusion.DiffusionLossConfig.from_config(config)
  num_steps = int(config.train.num_steps)
  schedule = make_schedule(config.opt, num_steps)
  optimizer = make_optimizer(config.opt, num_steps, config.finetune)
  init_fn, abstract_state, state_shardings = abstract_train_state(model_cfg, config, mesh, optimizer)
  data_sharding = batch_sharding(mesh, config)

  manager = checkpointing.make_manager(workdir_path, keep=config.train.keep_checkpoints,
                                       async_save=config.train.async_checkpointing)
  train_iter = data_pipeline.make_iterator(config, prepared, "train", shard_index=jax.process_index(),
                                           shard_count=jax.process_count())
  latest = manager.latest_step()
  if latest is not None:
    state, data_state = checkpointing.restore(manager, latest, abstract_state)
    data_state = checkpointing.this_process_data_state(data_state)
    if data_state is not None:
      train_iter.set_state(data_state)
    logging.info("Resumed from step %d (%s)", latest, checkpointing.checkpoint_dir(workdir_path))
  elif config.train.init_from:
    state = state_from_params_checkpoint(config.train.init_from, optimizer, abstract_state, state_shardings,
                                         init_fn, jax.random.PRNGKey(config.seed))
  else:
    state, _ = create_train_state(model_cfg, config, mesh, optimizer, jax.random.PRNGKey(config.seed))

  base_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
  eval_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 2)
  train_step = jax.jit(make_train_step(model_cfg, loss_cfg, optimizer, schedule,
                                       grad_accum_steps=int(config.opt.grad_accum_steps),
                                       finetune_config=config.finetune),
                       in_shardings=(state_shardings, data_sharding, None), out_shardings=(state_shardings, None),
                       donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(model_cfg, loss_cfg), in_shardings=(state_shardings.params, data_sharding, None))
  if jax.process_count() > 1:
    # Compile both steps first, then wait for every process: the first cross-process collective
    # must start everywhere within gloo's 30 s connect timeout, and compile times differ.
    batch_spec = {k: jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32,
                                          sharding=data_sharding) for k in ("tokens", "segment_ids", "positions")}
    train_step = train_step.lower(abstract_state, batch_spec, base_rng).compile()
    eval_step = eval_step.lower(abstract_state.params, batch_spec, eval_rng).compile()
    process_barrier("dgemma_steps_compiled")
  writer = MetricWriter(workdir_path)

  start_step = int(state.step)
  end_step = num_steps if stop_after_steps is None else min(num_steps, start_step + stop_after_steps)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  bar = None
  if config.train.progress_bar and jax.process_index() == 0:
    from tqdm import tqdm
    bar = tqdm(total=num_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
  window_start, window_steps, pending = time.perf_counter(), 0, []
  for step in range(start_step, end_step):
    batch = device_batch(next(train_iter), data_sharding)
    state, metrics = train_step(state, batch, base_rng)
    if bar is not None:
      jax.block_until_ready(metrics["loss"])  # keep the progress bar honest (steps are dispatched async)
    pending.append(metrics)
    window_steps += 1
    done = step + 1
    if done % config.train.log_every == 0 or done == end_step:
      averaged = {k: float(np.mean([jax.device_get(m[k]) for m in pending])) for k in pending[-1]}
      elapsed = time.perf_counter() - window_start
      averaged["tokens_per_sec"] = window_steps * tokens_per_step / max(elapsed, 1e-9)
      writer.write(done, averaged)
      if bar is not None:
        bar.set_postfix(loss=f"{averaged['loss']:.3f}", tok_s=f"{averaged['tokens_per_sec']:.0f}")
      window_start, window_steps, pending = time.perf_counter(), 0, []
    if bar is not None:
      bar.update(1)
    if done % config.train.eval_every == 0 or done == num_steps:
      eval_iter = data_pipeline.make_iterator(config, prepared, config.eval.split,
                                              shard_index=jax.process_index(), shard_count=jax.process_count())
      writer.write(done, evaluate(eval_step, state.params, eval_iter, config.train.eval_batches,
                                  data_sharding, eval_rng), prefix="eval")
      window_start = time.perf_counter()  # do not count evaluation in tokens/s
    if done % config.train.ckpt_every == 0 or done == end_step:
      checkpointing.save(manager, done, state, checkpointing.all_process_data_states(train_iter.get_state()))
  manager.wait_until_finished()
  manager.close()
  if config.finetune.mode != "full" and config.finetune.save_adapter and int(state.step) == num_steps:
    finetune.save_adapter(workdir_path / finetune.ADAPTER_DIR, state.params, model_cfg, config.finetune,
                          base=config.train.init_from, step=int(state.step))
  writer.close()
  if bar is not None:
    bar.close()
  return state


def load_params(workdir: str, config: ml_collections.ConfigDict, step: int = -1,
                mesh: Mesh | None = None) -> tuple[ModelConfig, Any, int]:
  """Restores the params of a training run (latest step when step < 0) onto `mesh`, sharded by
  config.mesh.axis_rules (default: replicated over this host's devices)."""
  model_cfg = config_lib.validate(config)
  ckpt_root = checkpointing.checkpoint_dir(workdir)
  if not ckpt_root.is_dir():
    raise FileNotFoundError(f"--workdir: no checkpoints in {ckpt_root} (train first: python train.py --workdir={workdir})")
  manager = checkpointing.make_manager(workdir, read_only=True, async_save=False)
  steps = manager.all_steps()
  if not steps:
    raise FileNotFoundError(f"--workdir: {ckpt_root} holds no finished checkpoint")
  if step >= 0 and step not in steps:
    raise FileNotFoundError(f"sample.checkpoint_step: step {step} not in {ckpt_root} (have {sorted(steps)})")
  step = max(steps) if step < 0 else step
  if mesh is None:
    mesh = make_mesh(ml_collections.ConfigDict(dict(shape=dict(data=-1, fsdp=1, expert=1, tensor=1))))
  optimizer = make_optimizer(config.opt, int(config.train.num_steps), config.finetune)
  _, abstract_state, _ = abstract_train_state(model_cfg, config, mesh, optimizer)
  state, _ = checkpointing.restore(manager, step, abstract_state, with_data=False)
  manager.close()
  return model_cfg, state.params, step
