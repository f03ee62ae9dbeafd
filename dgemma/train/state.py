"""The training state: parameters and optimizer state placed on the mesh by their logical axis names
(flax lm1b `setup_initial_state` style), created fresh, or from a params checkpoint (`train.init_from`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh

from dgemma import checkpoints, finetune as finetune_lib, quant
from dgemma.diffusion import distill as distill_lib
from dgemma.errors import CheckpointError
from dgemma.model import ModelConfig, Transformer
from dgemma.model import lora as lora_lib
from dgemma.model.transformer import boxed_param_shapes
from dgemma.model.sharding import place, unbox
from dgemma.train import optimizer as optimizer_lib
from dgemma.train.state_types import DistillState, RLState, TrainState


def with_teacher(state: TrainState, teacher_params: Any = None) -> DistillState:
  """`state` as a DistillState whose teacher is `teacher_params` (default: `state.params` itself: for
  abstract states and sharding trees; a concrete state needs a copy, `copy_params`)."""
  return DistillState(step=state.step, params=state.params, opt_state=state.opt_state,
                      teacher_params=state.params if teacher_params is None else teacher_params)


def with_reference(state: TrainState, finetune_cfg, ref_params: Any = None) -> RLState:
  """`state` as an RLState whose frozen reference is `ref_params` (default: the trained leaves of `state.params`
  themselves, `finetune.trained_leaves`: for abstract states and sharding trees; a concrete state needs a copy,
  `copy_params`)."""
  return RLState(step=state.step, params=state.params, opt_state=state.opt_state,
                 ref_params=finetune_lib.trained_leaves(state.params, finetune_cfg) if ref_params is None
                 else ref_params)


def copy_params(params: Any, shardings: Any) -> Any:
  """New buffers holding `params` on `shardings` (the train step donates its state: no buffer twice)."""
  return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)


def drop_empty_boxes(boxed_tree):
  """`boxed_tree` without the logical-axis boxes that hold no array: optax.masked (frozen leaves) leaves boxes
  around empty MaskedNodes."""
  return jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) and not jax.tree.leaves(x.value) else x,
                      boxed_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def abstract_train_state(model_cfg: ModelConfig, mesh: Mesh, axis_rules, optimizer,
                         quantizer: Optional[quant.Quantizer] = None) -> tuple[Callable, Any, Any]:
  """Returns (init_fn(rng) -> boxed TrainState, abstract unboxed state, state shardings), allocating nothing.
  With `quantizer` (a QLoRA run's frozen base, `dgemma.finetune.base_quantizer`) the leaves it picks are `QArray`s
  in the state: a fresh state quantizes its random base inside the jitted init, so no float copy of it is an
  output."""
  model = Transformer(model_cfg)
  tok = jnp.zeros((1, 1), jnp.int32)  # parameter shapes do not depend on the sequence length
  quantize = quantizer.boxed if quantizer is not None else (lambda boxed: boxed)

  def init_fn(rng):
    with nn.logical_axis_rules(()):  # no activation constraints while initialising (out_shardings place params)
      params = quantize(model.init(rng, tok, tok, tok, tok, tok, tok)["params"])
    opt_state = optimizer.init(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

  # The shapes init_fn makes, without tracing the model again (boxed_param_shapes keeps each architecture's):
  # only the optimizer's init is traced here. tests/train/test_state.py checks it against eval_shape(init_fn).
  params = quantize(boxed_param_shapes(model_cfg))
  boxed = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                     opt_state=jax.eval_shape(optimizer.init, params))
  boxed = drop_empty_boxes(boxed)
  abstract, shardings = place(boxed, mesh, axis_rules)
  return init_fn, abstract, shardings


def run_abstract_state(settings, mesh: Mesh) -> tuple[Any, Callable, Any, Any]:
  """(optimizer, init_fn, abstract state, shardings) of the run `settings` describe: its optimizer over
  train.num_steps and the state it checkpoints (a distillation run's holds the round's teacher,
  dgemma/diffusion/distill.py; a reinforcement-learning run's its reference, dgemma/rl)."""
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps, settings.finetune, settings.model)
  init_fn, abstract, shardings = abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer,
                                                      finetune_lib.base_quantizer(settings.finetune))
  if distill_lib.enabled(settings.distill):
    abstract, shardings = with_teacher(abstract), with_teacher(shardings)
  if settings.rl.enabled:
    abstract, shardings = with_reference(abstract, settings.finetune), with_reference(shardings, settings.finetune)
  return optimizer, init_fn, abstract, shardings


def step_shardings(settings, shardings: Any, abstract: Any) -> Any:
  """The state shardings the train step is compiled for: `shardings`, except that a QLoRA run's frozen base
  (finetune.base_quant; not in a distillation or reinforcement-learning run, whose extra params share it) is laid
  out in memory as the step's compiler picks (`Layout.AUTO`). A TPU's compiler otherwise copies every stacked packed
  int4 expert weight into its own tiled layout before the layer loop, about 5 GiB a block of the released model;
  held in that layout from the start (dgemma.train.loop places the state in the compiled step's input formats), the
  frozen weights are read as they are. docs/finetuning.md. Not on CPU when the base holds plain int4 arrays
  (`abstract`'s dtypes: an all-int4 base's weights outside the stacked layers, e.g. the embedding or decoder-head
  layers): a program compiled with laid-out arguments there asks for int4 packed two to a byte, a layout no CPU array
  has, and CPU's compiler picks the default layouts anyway."""
  if (finetune_lib.base_quantizer(settings.finetune) is None or distill_lib.enabled(settings.distill)
      or settings.rl.enabled):
    return shardings
  on_cpu = jax.tree.leaves(shardings.params)[0].mesh.devices.flat[0].platform == "cpu"
  if on_cpu and any(jnp.dtype(leaf.dtype) == jnp.dtype(jnp.int4) for leaf in jax.tree.leaves(abstract.params)):
    return shardings
  labels = finetune_lib.param_labels(shardings.params, settings.finetune)
  params = jax.tree.map(lambda sharding, label: sharding if label == finetune_lib.TRAINABLE else
                        Format(Layout.AUTO, sharding), shardings.params, labels)
  return shardings.replace(params=params)


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


INIT_FROM = "train.init_from"


def check_init_from(path: str, model_cfg: ModelConfig) -> None:
  """train.init_from names a checkpoint of any kind (a training workdir with a finished step, a params checkpoint,
  an adapter or a Hugging Face directory) whose architecture equals the run's up to the layer layout
  (model.scan_layers: relaid) and whose LoRA adapters, if any, this run can keep or fold in
  (checkpoints.adapter_transfer). Reads metadata only."""
  saved = checkpoints.header(path, INIT_FROM)
  if saved.kind == "workdir" and saved.step is None:
    raise CheckpointError(f"{INIT_FROM}: the workdir {path} holds no finished checkpoint")
  checkpoints.check_loadable_as(saved, model_cfg)


def state_from_checkpoint(path: str, model_cfg: ModelConfig, optimizer, shardings, axis_rules, init_fn=None,
                          rng=None, quantizer: Optional[quant.Quantizer] = None) -> TrainState:
  """Step-0 state from any checkpoint kind (`check_init_from`; e.g. an imported Gemma 4 AR model for AR ->
  diffusion adaptation, or another run's latest params) and a fresh optimizer state; params in
  model.param_dtype on the run's shardings (checkpoints.load_as).

  LoRA adapters (finetune.mode lora / head_only) that the checkpoint lacks start from `init_fn(rng)` (B = 0:
  the run starts exactly at the checkpoint's model); a LoRA run's own adapters are kept when this run has the
  same layout, else folded into their weights first; every other tensor must be there. With `quantizer` (QLoRA)
  the frozen weights are held quantized: an HF directory or params checkpoint is quantized as it is read, without
  the float tree (checkpoints.load_as says when a float copy exists)."""
  mesh = jax.tree.leaves(shardings.params)[0].mesh

  def fresh(missing):
    # The adapters the checkpoint lacks start from init_fn (B = 0). Only they are outputs, so XLA initialises nothing
    # else; any other missing tensor stays missing (load_as names it).
    keys = {k for k in missing if lora_lib.is_adapter(k[-1])}
    if not keys:
      return {}
    pick = lambda params: {k: v for k, v in flax.traverse_util.flatten_dict(params).items() if k in keys}
    return jax.device_get(jax.jit(lambda r: pick(nn.unbox(init_fn(r)).params))(rng))

  loaded = checkpoints.load_as(checkpoints.header(path, INIT_FROM), model_cfg,
                               placement=checkpoints.Placement(mesh, axis_rules), quantizer=quantizer,
                               leaves=fresh if init_fn is not None else None)
  params = jax.device_put(loaded.params, shardings.params)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
