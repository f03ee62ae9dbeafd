"""The optimiser: global-norm clipping, then the update rule `opt.optimizer` names (a record of OPTIMIZERS), with a
linear warmup and cosine decay of the learning rate; frozen parameters (dgemma.finetune) get no update and no
optimizer state. Takes `dgemma.settings.OptimizerSettings`, `FinetuneSettings` and the model's `ModelConfig`.

  adamw  AdamW on every parameter; Adam moments stored in `opt.state_dtype`.
  muon   Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; optax.contrib.muon):
         each hidden weight matrix's update is its Nesterov momentum orthogonalised by five Newton-Schulz
         iterations, peak learning rate `opt.muon_lr`; every other parameter (the embedding, the router, norms,
         biases, scalars) gets optax's Nesterov AdamW at `opt.lr`, without weight decay. Which axes of a
         parameter are the matrix's input and output comes from its logical axis names (`muon_dimensions`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from dgemma import finetune
from dgemma.errors import ConfigError
from dgemma.model import lora
from dgemma.model.config import ModelConfig
from dgemma.model.transformer import boxed_param_shapes


def make_schedule(opt, num_steps: int) -> optax.Schedule:
  warmup = min(int(opt.warmup_steps), max(num_steps - 1, 0))
  if warmup == 0:  # the cosine part of the schedule below, as optax computes it (its empty warmup logs a note)
    end_value = opt.lr * opt.end_lr_fraction
    return optax.cosine_decay_schedule(init_value=opt.lr, decay_steps=max(num_steps, 1),
                                       alpha=0.0 if opt.lr == 0 else end_value / opt.lr)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.lr, warmup_steps=warmup, decay_steps=max(num_steps, warmup + 1),
      end_value=opt.lr * opt.end_lr_fraction)


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


def _adamw(opt, num_steps: int, model_cfg: Optional[ModelConfig]) -> optax.GradientTransformation:
  """optax.adamw's chain (scale_by_adam, masked decay, -lr); Adam moments stored in opt.state_dtype."""
  del model_cfg
  adam = optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps)
  if opt.state_dtype != "float32":
    adam = with_state_dtype(adam, opt.state_dtype)
  return optax.chain(adam, optax.add_decayed_weights(opt.weight_decay, _decay_mask),
                     optax.scale_by_learning_rate(make_schedule(opt, num_steps)))


# Logical axes a weight is stacked over (a scanned layer group, the experts): Muon treats each slice as its own
# matrix.
MUON_BATCH_AXES = ("layers", "expert")


def matrix_dimensions(logical_axes: Optional[tuple]) -> Optional[MuonDimensionNumbers]:
  """Muon's (input, output) axes of a parameter with these logical axis names, or None (not a hidden matrix: fewer
  than two axes besides MUON_BATCH_AXES, or the vocabulary embedding). A matrix whose first free axis is 'embed'
  reads the residual stream there and writes the rest (q/k/v [embed, heads, head_dim], an MLP's input); otherwise
  its last free axis is the output and the others are read (o_proj [heads, head_dim, embed], down projections)."""
  if not logical_axes or "vocab" in logical_axes:
    return None
  free = [i for i, name in enumerate(logical_axes) if name not in MUON_BATCH_AXES]
  if len(free) < 2:
    return None
  one = lambda axes: axes[0] if len(axes) == 1 else tuple(axes)
  if logical_axes[free[0]] == "embed":
    return MuonDimensionNumbers(reduction_axis=free[0], output_axis=one(free[1:]))
  return MuonDimensionNumbers(reduction_axis=one(free[:-1]), output_axis=free[-1])


def muon_dimensions(model_cfg: ModelConfig) -> Any:
  """The params tree of `model_cfg` with each leaf's `matrix_dimensions` (None: Adam), from the logical axis
  names every parameter carries (nothing is allocated)."""
  specs = nn.get_partition_spec(boxed_param_shapes(model_cfg))
  return jax.tree.map(lambda spec: matrix_dimensions(tuple(spec)), specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def _muon(opt, num_steps: int, model_cfg: Optional[ModelConfig]) -> optax.GradientTransformation:
  """optax.contrib.muon over the hidden matrices (peak opt.muon_lr, momentum opt.muon_momentum, decoupled weight
  decay opt.weight_decay), its Nesterov AdamW (peak opt.lr, no decay) elsewhere; one warmup + cosine shape."""
  if model_cfg is None:
    raise ValueError("opt.optimizer='muon' needs the model config (its parameters' logical axes)")
  schedule = make_schedule(opt, num_steps)
  return optax.contrib.muon(
      learning_rate=lambda step: schedule(step) * (opt.muon_lr / opt.lr), beta=opt.muon_momentum,
      weight_decay=opt.weight_decay, adam_learning_rate=schedule, adam_b1=opt.b1, adam_b2=opt.b2, eps=opt.eps,
      mu_dtype=None if opt.state_dtype == "float32" else jnp.dtype(opt.state_dtype),
      muon_weight_dimension_numbers=muon_dimensions(model_cfg))


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """A row of OPTIMIZERS: `build(opt, num_steps, model_cfg)` is the update after clipping."""
  name: str
  build: Callable[[Any, int, Optional[ModelConfig]], optax.GradientTransformation]
  supports_frozen: bool  # whether fine-tuning with frozen parameters can use it


OPTIMIZERS = {o.name: o for o in (
    Optimizer("adamw", _adamw, supports_frozen=True),
    Optimizer("muon", _muon, supports_frozen=False),
)}


def get(name: str) -> Optimizer:
  if name not in OPTIMIZERS:
    raise ConfigError(f"opt.optimizer: unknown {name!r}; one of {sorted(OPTIMIZERS)}")
  return OPTIMIZERS[name]


def check(opt, finetune_cfg=None) -> Optimizer:
  """The `opt.optimizer` record, or a ConfigError naming opt.optimizer: an unknown name, or one that cannot train
  with the frozen parameters `finetune_cfg` asks for. The loop calls it before any work."""
  record = get(opt.optimizer)
  if finetune.has_frozen(finetune_cfg) and not record.supports_frozen:
    raise ConfigError(f"opt.optimizer: {record.name!r} cannot train with frozen parameters "
                      f"(finetune.mode={finetune_cfg.mode!r}, freeze_router={finetune_cfg.freeze_router}); use 'adamw'")
  return record


def make_optimizer(opt, num_steps: int, finetune_cfg=None, model_cfg: Optional[ModelConfig] = None
                   ) -> optax.GradientTransformation:
  """clip -> the `opt.optimizer` record's update (module docstring). Parameters stay in model.param_dtype (fp32
  master weights); `model_cfg` is needed by 'muon' only.

  With frozen parameters (`finetune_cfg`: mode lora / head_only, or freeze_router) the chain runs only
  on the trainable leaves (clipping by their global norm) through `optax.multi_transform`, frozen leaves
  get `optax.set_to_zero()` and no optimizer state (dgemma/finetune.py)."""
  record = check(opt, finetune_cfg)
  tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), record.build(opt, num_steps, model_cfg))
  if not finetune.has_frozen(finetune_cfg):
    return tx
  return optax.multi_transform({finetune.TRAINABLE: tx, finetune.FROZEN: optax.set_to_zero()},
                               functools.partial(finetune.param_labels, finetune=finetune_cfg))
