"""The optimiser: global-norm clipping, then AdamW with a linear warmup and cosine decay of the learning
rate; Adam moments stored in `opt.state_dtype`; frozen parameters (dgemma.finetune) get no update and no
optimizer state. Takes `dgemma.settings.OptimizerSettings` and `FinetuneSettings`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from dgemma import finetune
from dgemma.model import lora


def make_schedule(opt, num_steps: int) -> optax.Schedule:
  warmup = min(int(opt.warmup_steps), max(num_steps - 1, 0))
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


def make_optimizer(opt, num_steps: int, finetune_cfg=None) -> optax.GradientTransformation:
  """clip -> AdamW (optax.adamw's chain: scale_by_adam, masked decay, -lr); Adam moments stored in
  opt.state_dtype ('float32' | 'bfloat16'). Parameters stay in model.param_dtype (fp32 master weights).

  With frozen parameters (`finetune_cfg`: mode lora / head_only, or freeze_router) the chain runs only
  on the trainable leaves (clipping by their global norm) through `optax.multi_transform`, frozen leaves
  get `optax.set_to_zero()` and no optimizer state (dgemma/finetune.py)."""
  adam = optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps)
  if opt.state_dtype != "float32":
    adam = with_state_dtype(adam, opt.state_dtype)
  tx = optax.chain(
      optax.clip_by_global_norm(opt.grad_clip),
      optax.chain(adam, optax.add_decayed_weights(opt.weight_decay, _decay_mask),
                  optax.scale_by_learning_rate(make_schedule(opt, num_steps))),
  )
  if not finetune.has_frozen(finetune_cfg):
    return tx
  return optax.multi_transform({finetune.TRAINABLE: tx, finetune.FROZEN: optax.set_to_zero()},
                               functools.partial(finetune.param_labels, finetune=finetune_cfg))
