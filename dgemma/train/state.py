"""The training state: parameters and optimizer state placed on the mesh by their logical axis names
(flax lm1b `setup_initial_state` style), created fresh, or from a params checkpoint (`train.init_from`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma import settings as settings_lib
from dgemma.checkpoints import layout
from dgemma.checkpoints import params as params_ckpt
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.diffusion import distill as distill_lib
from dgemma.errors import CheckpointError, ConfigError
from dgemma.model import ModelConfig, Transformer, param_shapes
from dgemma.model.transformer import boxed_param_shapes
from dgemma.model import lora
from dgemma.model.sharding import place, unbox
from dgemma.train import optimizer as optimizer_lib
from dgemma.train.state_types import DistillState, TrainState


def with_teacher(state: TrainState, teacher_params: Any = None) -> DistillState:
  """`state` as a DistillState whose teacher is `teacher_params` (default: `state.params` itself: for
  abstract states and sharding trees; a concrete state needs a copy, `copy_params`)."""
  return DistillState(step=state.step, params=state.params, opt_state=state.opt_state,
                      teacher_params=state.params if teacher_params is None else teacher_params)


def copy_params(params: Any, shardings: Any) -> Any:
  """New buffers holding `params` on `shardings` (the train step donates its state: no buffer twice)."""
  return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)


def drop_empty_boxes(boxed_tree):
  """`boxed_tree` without the logical-axis boxes that hold no array: optax.masked (frozen leaves) leaves boxes
  around empty MaskedNodes."""
  return jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) and not jax.tree.leaves(x.value) else x,
                      boxed_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def abstract_train_state(model_cfg: ModelConfig, mesh: Mesh, axis_rules, optimizer) -> tuple[Callable, Any, Any]:
  """Returns (init_fn(rng) -> boxed TrainState, abstract unboxed state, state shardings), allocating nothing."""
  model = Transformer(model_cfg)
  tok = jnp.zeros((1, 1), jnp.int32)  # parameter shapes do not depend on the sequence length

  def init_fn(rng):
    with nn.logical_axis_rules(()):  # no activation constraints while initialising (out_shardings place params)
      params = model.init(rng, tok, tok, tok, tok, tok, tok)["params"]
    opt_state = optimizer.init(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

  # The shapes init_fn makes, without tracing the model again (boxed_param_shapes keeps each architecture's):
  # only the optimizer's init is traced here. tests/train/test_state.py checks it against eval_shape(init_fn).
  params = boxed_param_shapes(model_cfg)
  boxed = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                     opt_state=jax.eval_shape(optimizer.init, params))
  boxed = drop_empty_boxes(boxed)
  abstract, shardings = place(boxed, mesh, axis_rules)
  return init_fn, abstract, shardings


def run_abstract_state(settings, mesh: Mesh) -> tuple[Any, Callable, Any, Any]:
  """(optimizer, init_fn, abstract state, shardings) of the run `settings` describe: its optimizer over
  train.num_steps and the state it checkpoints (a distillation run's holds the round's teacher,
  dgemma/diffusion/distill.py)."""
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps, settings.finetune, settings.model)
  init_fn, abstract, shardings = abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer)
  if distill_lib.enabled(settings.distill):
    abstract, shardings = with_teacher(abstract), with_teacher(shardings)
  return optimizer, init_fn, abstract, shardings


def param_partition_specs(model_cfg: ModelConfig, mesh: Mesh, axis_rules) -> dict[str, str]:
  """{parameter path: its PartitionSpec on `mesh`} as strings, from the logical axis names and
  the axis rules (jax.eval_shape: nothing is allocated). tests/golden/partition_specs.json."""
  optimizer = optax.sgd(1.0)  # stateless: only the params' shardings are wanted
  _, abstract, _ = abstract_train_state(model_cfg, mesh, axis_rules, optimizer)
  return {jax.tree_util.keystr(path): str(leaf.sharding.spec)
          for path, leaf in jax.tree_util.tree_leaves_with_path(abstract.params)}


def jit_init(init_fn: Callable, shardings: Any) -> Callable:
  """rng -> the fresh state `init_fn` makes, unboxed and placed on `shardings` (one jitted function)."""
  return jax.jit(lambda r: unbox(init_fn(r)), out_shardings=shardings)


def create_train_state(model_cfg: ModelConfig, mesh: Mesh, axis_rules, optimizer, rng) -> tuple[TrainState, Any]:
  init_fn, _, shardings = abstract_train_state(model_cfg, mesh, axis_rules, optimizer)
  return jit_init(init_fn, shardings)(rng), shardings


def init_from_model_config(path: str) -> ModelConfig:
  """The architecture that train.init_from's checkpoint was saved with (a training workdir with a finished
  step, or a dgemma params checkpoint)."""
  path = Path(path)
  if workdir_ckpt.is_workdir(path):
    if not workdir_ckpt.steps(path):
      raise CheckpointError(f"train.init_from: the workdir {path} holds no finished checkpoint")
    return ModelConfig.from_config_dict(settings_lib.from_json(workdir_ckpt.read_config_json(path)).model)
  if (path / params_ckpt.MODEL_CONFIG).exists():
    return ModelConfig.from_config_dict(json.loads((path / params_ckpt.MODEL_CONFIG).read_text()))
  raise FileNotFoundError(f"train.init_from: {path} is neither a training workdir (config.json + checkpoints/) "
                          f"nor a dgemma params checkpoint (no {params_ckpt.MODEL_CONFIG}; make one with "
                          f"python -m dgemma.tools.convert --from_hf DIR --to {path})")


def check_init_from(path: str, model_cfg: ModelConfig) -> None:
  """train.init_from names a dgemma params checkpoint, or a training workdir with a finished step, whose
  architecture equals the run's up to the layer layout (model.scan_layers: the checkpoint's tensors are
  relaid, dgemma/checkpoints/layout.py)."""
  saved = init_from_model_config(path)
  diffs = layout.differences_but_layout(saved, model_cfg)
  if diffs:
    raise ConfigError(f"train.init_from: the run's architecture differs from the checkpoint {path} "
                      f"(checkpoint -> run): {'; '.join(diffs)}")


def state_from_params_checkpoint(path: str, model_cfg: ModelConfig, optimizer, abstract_state, shardings,
                                 init_fn=None, rng=None) -> TrainState:
  """Step-0 state from converted / exported params (e.g. an imported Gemma 4 AR model, for AR ->
  diffusion adaptation) or a training workdir's latest params, and a fresh optimizer state; params cast to
  model.param_dtype.

  LoRA adapters (finetune.mode lora / head_only) that the checkpoint lacks start from `init_fn(rng)`
  (B = 0: the run starts exactly at the checkpoint's model); every other tensor must be there."""
  expected = abstract_state.params
  saved_cfg = init_from_model_config(path)
  relaid = saved_cfg.block_period != model_cfg.block_period  # the other model.scan_layers layout
  if workdir_ckpt.is_workdir(path):  # a run's latest params, restored straight onto the shardings
    step = workdir_ckpt.steps(path)[-1]
    if relaid:  # restored replicated in the saved layout, relaid, then placed like the run's params
      mesh = jax.tree.leaves(expected)[0].sharding.mesh
      replicated = NamedSharding(mesh, PartitionSpec())
      saved_abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
          param_shapes(saved_cfg))
      params = layout.relayout(workdir_ckpt.restore_params(path, step, saved_abstract), saved_cfg, model_cfg)
      params = jax.tree.map(lambda x, e: jax.device_put(x.astype(e.dtype), e.sharding), params, expected)
    else:
      params = workdir_ckpt.restore_params(path, step, expected)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  params_np, _ = params_ckpt.load_params(path)
  if relaid:
    params_np = layout.relayout(params_np, saved_cfg, model_cfg)
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
