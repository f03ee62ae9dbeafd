"""GRPO's pieces (dgemma/rl/grpo.py) against plain numpy references written from the formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.rl import grpo
from dgemma.train import rl_step
from dgemma.rl.config import RLSettings
from tests.model_utils import float64


def test_group_advantages_by_hand():
  rewards = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 2.0, 3.0])
  adv = grpo.group_advantages(rewards, 4, 1e-6)
  # group 1: mean 0.25, sample std (ddof 1) 0.5; group 2: all equal -> 0; group 3: mean 1.5, std sqrt(5/3)
  np.testing.assert_allclose(adv[:4], np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-12)
  np.testing.assert_array_equal(adv[4:8], 0.0)
  np.testing.assert_allclose(adv[8:], (np.arange(4) - 1.5) / (np.sqrt(5 / 3) + 1e-6), rtol=1e-12)


def numpy_trajectory_loss(lp, old, draws, kl, adv, total_draws, step_weight, rl):
  """The loss of grpo's docstring, written out with loops; and its gradient w.r.t. lp."""
  K, N, C = lp.shape
  lo, hi = 1 - rl.clip_eps, 1 + rl.upper_clip
  pg = kl_sum = 0.0
  grad = np.zeros_like(lp)
  rows = 0
  for n in range(N):
    d_n = total_draws[n]
    if d_n == 0:
      continue
    rows += 1
    for k in range(K):
      for i in range(C):
        if not draws[k, n, i]:
          continue
        rho = np.exp(lp[k, n, i] - old[k, n, i])
        unclipped, clipped = rho * adv[n], min(max(rho, lo), hi) * adv[n]
        pg -= step_weight / d_n * min(unclipped, clipped)
        kl_sum += step_weight / d_n * kl[k, n, i]
        if unclipped <= clipped:  # the unclipped branch is the min: d(rho A)/d lp = rho A
          grad[k, n, i] = -step_weight / d_n * rho * adv[n]
  return pg / rows + rl.kl_weight * kl_sum / rows, grad / rows


@pytest.mark.parametrize("clip_eps_high", [0.0, 0.28])
def test_trajectory_loss_and_gradient_match_numpy(clip_eps_high):
  g = np.random.default_rng(0)
  K, N, C = 3, 6, 5
  rl = RLSettings(clip_eps=0.2, clip_eps_high=clip_eps_high, kl_weight=0.3)
  old = g.normal(-2.0, 1.0, (K, N, C))
  lp = old + g.normal(0.0, 0.3, (K, N, C))          # ratios on both sides of the clip range
  draws = g.random((K, N, C)) < 0.5
  draws[:, 5] = False                               # a row without draws counts for nothing
  kl = g.random((K, N, C))
  adv = g.normal(0.0, 1.0, N)
  # D_n counts the draws of all S = 6 steps; the K = 3 scored here hold about half of them, weighted S / K = 2
  total = draws.sum(axis=(0, 2)) * 2.0
  ref_loss, ref_grad = numpy_trajectory_loss(lp, old, draws, kl, adv, total, 2.0, rl)
  with float64():
    loss_fn = lambda x: grpo.trajectory_loss(x, jnp.asarray(old), jnp.asarray(draws), jnp.asarray(kl),
                                             jnp.asarray(adv), jnp.asarray(total), 2.0, rl)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(lp))
    loss, grad = float(loss), np.asarray(grad)
    clip_fraction, nll = float(metrics["clip_fraction"]), float(metrics["trajectory_nll"])
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
  # the surprisal per sample with draws: S / K x the scored draws' -log p, over the 5 rows that have draws
  np.testing.assert_allclose(nll, 2.0 * -np.sum(lp * draws) / 5, rtol=1e-12)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-15)
  ratio = np.exp(lp - old)
  outside = (ratio < 0.8) | (ratio > 1 + (clip_eps_high or 0.2))
  assert 0 < clip_fraction < 1
  np.testing.assert_allclose(clip_fraction, outside[draws].mean(), rtol=1e-6)


def test_first_update_is_the_policy_gradient():
  """With old = stop_gradient(lp) (one update per rollout) the ratio is 1 and the gradient is the REINFORCE one,
  -A_n / D_n per draw (over rows), whatever the clip range."""
  g = np.random.default_rng(1)
  lp = jnp.asarray(g.normal(-1.0, 0.5, (2, 3, 4)))
  draws = jnp.ones((2, 3, 4), bool)
  adv = jnp.asarray([1.0, -2.0, 0.5])
  rl = RLSettings(kl_weight=0.0)
  with float64():
    grad = jax.grad(lambda x: grpo.trajectory_loss(x, jax.lax.stop_gradient(x), draws, jnp.zeros((2, 3, 4)), adv,
                                                   jnp.full((3,), 8.0), 1.0, rl)[0])(lp)
    expected = -np.broadcast_to(np.asarray(adv)[None, :, None] / 8.0 / 3.0, (2, 3, 4))
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-12)


def test_sequence_loss_matches_numpy():
  g = np.random.default_rng(2)
  N = 8
  rl = RLSettings(clip_eps=0.2, kl_weight=0.5)
  old, length = g.normal(-40.0, 5.0, N), g.integers(5, 30, N).astype(float)
  ll = old + g.normal(0.0, 6.0, N)
  ref_ll = old + g.normal(0.0, 3.0, N)
  adv = g.normal(0.0, 1.0, N)
  rho = np.exp((ll - old) / length)
  obj = np.minimum(rho * adv, np.clip(rho, 0.8, 1.2) * adv)
  delta = (ref_ll - ll) / length
  expected = -obj.mean() + 0.5 * np.mean(np.exp(delta) - delta - 1)
  with float64():
    loss, _ = grpo.sequence_loss(jnp.asarray(ll), jnp.asarray(old), jnp.asarray(ref_ll), jnp.asarray(length),
                                 jnp.asarray(adv), rl)
    loss = float(loss)
  np.testing.assert_allclose(loss, expected, rtol=1e-9)


def test_position_kl_is_the_kl():
  g = np.random.default_rng(3)
  a, b = g.normal(size=(2, 3, 7)), g.normal(size=(2, 3, 7))
  logp = a - np.log(np.exp(a).sum(-1, keepdims=True))
  logq = b - np.log(np.exp(b).sum(-1, keepdims=True))
  with float64():
    kl = np.asarray(grpo.position_kl(jnp.asarray(logp), jnp.asarray(logq)))
  np.testing.assert_allclose(kl, (np.exp(logp) * (logp - logq)).sum(-1), rtol=1e-12)
  assert (kl > 0).all()


def test_prompts_of_drops_left_padding():
  tokens = np.array([[0, 0, 2, 7, 8, 30, 31], [2, 5, 6, 7, 8, 40, 41]])
  seg = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
  prompts, lengths, refs = rl_step.prompts_of({"tokens": tokens, "segment_ids": seg}, 2, pad_id=0)
  np.testing.assert_array_equal(lengths, [3, 5])
  np.testing.assert_array_equal(prompts, [[2, 7, 8, 0, 0], [2, 5, 6, 7, 8]])
  np.testing.assert_array_equal(refs, [[30, 31], [40, 41]])
