"""The validation pass of training: the eval step over `train.eval_batches` batches of `eval.split`,
metrics averaged weighted by canvas tokens."""

from __future__ import annotations

from typing import Iterator

import jax

from dgemma.train.step import device_batch


def validation_rng(settings) -> jax.Array:
  """The validation pass's noise key, from `eval.seed` and not the training `seed`: runs that differ in the training
  seed (or the time sampler, dgemma.train.step.make_eval_step) are scored on the same t and z_t draws of the same
  (unshuffled) batches. (eval.seed = seed = 0 gives the key the loop drew from the training seed before.)"""
  return jax.random.fold_in(jax.random.PRNGKey(settings.eval.seed), 2)


def validation_metrics(eval_step, params, data_iter: Iterator, num_batches: int, sharding, rng) -> dict[str, float]:
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
