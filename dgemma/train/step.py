"""The jitted steps: one optimizer update (with gradient accumulation, frozen leaves, and the guard against
a non-finite loss, gradient or state) and one validation batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from dgemma import finetune
from dgemma.diffusion import distill as distill_lib
from dgemma.diffusion import loss as diffusion_loss_lib
from dgemma.model import ModelConfig
from dgemma.train.state_types import TrainState


def all_finite(tree) -> jax.Array:
  """Whether every floating-point leaf of `tree` is finite (a bool scalar)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def accumulate_gradients(loss_fn: Callable, params, batch: dict, rng: jax.Array, loss_cfg, num_micro: int):
  """(metrics, grads) of the whole batch, computed over `num_micro` micro-batches with a scan.

  Micro-batch j holds rows j, j + k, j + 2k, ... (k = num_micro), so on a batch-sharded mesh every
  device keeps working on its own rows. Noise is drawn per global row index and losses are divided by
  whole-batch token counts, so the summed micro-batch gradients equal the whole-batch gradient (up to
  fp32 round-off). loss_fn(params, batch, rng, example_ids_B=, totals=) -> (loss, metrics).
  """
  batch_size = batch["tokens"].shape[0]
  totals = diffusion_loss_lib.batch_totals(batch, loss_cfg)
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


def apply_gradients(state: TrainState, grads, metrics: dict, optimizer, schedule: optax.Schedule, finetune_cfg,
                    skip_nonfinite: bool):
  """(state after one optimizer update, metrics + grad_norm, lr, nonfinite). `grads` covers the trainable leaves
  (a tree like the params with None at frozen ones when `finetune_cfg` freezes some); frozen leaves (a QLoRA run's
  quantized base among them) pass through as the input buffers. metrics['nonfinite'] is 1.0 when metrics['loss'],
  the gradient norm or the updated state is not finite; with `skip_nonfinite` such an update is dropped (params and
  optimizer state stay, the step counter moves on)."""
  has_frozen = finetune.has_frozen(finetune_cfg)
  grad_norm = optax.tree.norm(grads)
  if has_frozen:
    mask = finetune.trainable_mask(state.params, finetune_cfg)
    # set_to_zero ignores these zeros (XLA drops them); the tree must match params for optax.
    frozen = finetune.split(state.params, mask)[1]
    grads = finetune.join(grads, jax.tree.map(lambda p: None if p is None else jnp.zeros_like(p), frozen,
                                              is_leaf=lambda x: x is None))
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if has_frozen:  # frozen leaves are the input buffers, untouched
    params = jax.tree.map(lambda m, new, old: new if m else old, mask, params, state.params)
    changed = finetune.split(params, mask)[0]
  else:
    changed = params
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & all_finite((changed, opt_state))
  if skip_nonfinite:
    keep = lambda new, old: jnp.where(finite, new, old)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    params = (jax.tree.map(lambda m, new, old: keep(new, old) if m else old, mask, params, state.params)
              if has_frozen else jax.tree.map(keep, params, state.params))
  metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step), nonfinite=1.0 - finite.astype(jnp.float32))
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(model_cfg: ModelConfig, loss_cfg, optimizer, schedule: optax.Schedule,
                    grad_accum_steps: int = 1, finetune_cfg=None, skip_nonfinite: bool = False, distill_cfg=None):
  """The jittable step (state, batch, base_rng) -> (state, metrics).

  With distill.method='dcd' (`distill_cfg`) the state is a DistillState and the loss is consistency
  distillation against its teacher, which is refreshed to the student at the first step of each round
  (dgemma/diffusion/distill.py); otherwise the diffusion loss of `loss_cfg`.

  With frozen parameters (`finetune_cfg`, dgemma/finetune.py) gradients are taken only w.r.t. the
  trainable leaves (grad_norm is theirs) and frozen leaves pass through as is.
  metrics['nonfinite'] is 1.0 when the loss, the gradient norm or the updated state is not finite. With
  `skip_nonfinite` such an update is dropped (params and optimizer state stay, the step counter moves on:
  train.nonfinite='skip'); otherwise the state is updated regardless and the loop halts on the flag."""
  has_frozen = finetune.has_frozen(finetune_cfg)
  distilling = distill_lib.enabled(distill_cfg)

  def train_step(state: TrainState, batch: dict, base_rng: jax.Array):
    rng = jax.random.fold_in(base_rng, state.step)
    if distilling:
      teacher_params = distill_lib.refresh_teacher(state.teacher_params, state.params, state.step, distill_cfg)
      loss_fn = distill_lib.make_loss_fn(teacher_params, model_cfg=model_cfg, loss_cfg=loss_cfg,
                                         distill_cfg=distill_cfg, step=state.step)
    else:
      loss_fn = functools.partial(diffusion_loss_lib.diffusion_loss, model_cfg=model_cfg, loss_cfg=loss_cfg,
                                  step=state.step)
    if not has_frozen:
      metrics, grads = accumulate_gradients(loss_fn, state.params, batch, rng, loss_cfg, grad_accum_steps)
    else:
      trainable, frozen = finetune.split(state.params, finetune.trainable_mask(state.params, finetune_cfg))
      on_trainable = lambda t, *a, **k: loss_fn(finetune.join(t, frozen), *a, **k)
      metrics, grads = accumulate_gradients(on_trainable, trainable, batch, rng, loss_cfg, grad_accum_steps)
    new_state, metrics = apply_gradients(state, grads, metrics, optimizer, schedule, finetune_cfg, skip_nonfinite)
    if distilling:
      new_state = new_state.replace(teacher_params=teacher_params)
    return new_state, metrics
  return train_step


def make_eval_step(model_cfg: ModelConfig, loss_cfg):
  """Validation metrics of one batch. The times are drawn uniformly whatever the training draws
  (`diffusion.t_power`, `diffusion.t_mixture` apply to training only): the validation `canvas_nelbo` is then a
  plain average over uniform t, without the importance weights that make the training-time estimate noisier,
  and runs that train with different time samplers are scored on the same times."""
  eval_cfg = dataclasses.replace(loss_cfg, t_power=1.0, t_mixture=())

  def eval_step(params, batch, rng):
    _, metrics = diffusion_loss_lib.diffusion_loss(params, batch, rng, model_cfg=model_cfg, loss_cfg=eval_cfg,
                                                   eval_metrics=True)
    return metrics
  return eval_step


def device_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
