"""GRPO (Shao et al. 2024) for the diffusion model: groups of samples per prompt drawn with the released sampler,
group-normalised advantages, a clipped importance ratio and a KL term to the frozen reference (the run's start).
This module holds the method's arithmetic; the loop's RL step that runs it is dgemma/train/rl_step.py.

One RL step (`rl_step.GRPO`, what the train loop runs in place of the supervised step):
  1. rollout: each of the batch's prompts is repeated group_size times and sampled with the jitted sampler
     (dgemma.sampling.generate, one canvas, its trajectory recorded) under the current parameters;
  2. rewards on the host (`rl.reward`, dgemma/rl/reward.py) of the decoded outputs; advantages
     A = (r - group mean) / (group std + eps) (sample std, ddof 1, as Tunix);
  3. `rl.num_iterations` optimizer updates on these samples (train.num_steps counts updates). The first update's
     policy is the rollout's, so with one update the ratio is exactly 1 (its gradient the policy gradient); with
     more, the rollout's log-probabilities are recomputed once (`policy.replay`) and the ratio moves.

Loss, 'trajectory' (dgemma/rl/policy.py): each accepted draw (step s, position i) of sample n is an action with
ratio rho = exp(log p_theta - log p_old), clipped to [1 - clip_eps, 1 + clip_eps_high] PPO-style:
  J_n = (S / K) / D_n * sum_{s in the K scored steps} sum_{i drawn} min(rho A_n, clip(rho) A_n)
  loss = -mean_n J_n + beta * mean_n (S / K) / D_n * sum KL(p_theta || p_ref) at the drawn positions
D_n is the sample's number of draws over all S steps, so J_n is its mean over draws and a random subset of K
steps (`rl.steps_per_update`) weighted S / K is an unbiased estimate of it ("sequence-mean-token-mean", the
aggregation Tunix's GRPO uses). The KL is exact at each visited position (the full distributions are at hand),
where AR GRPO estimates it at the drawn token (Schulman's k3).
'elbo': one ratio per sample, rho_n = exp((ELBO_theta - ELBO_old) / L_n) over its L_n output tokens (ESPO's
length-normalised sequence ratio), the same clipping, and k3 of the normalised ELBO difference to the reference.

Tunix (google-tunix: GRPO, PPO, DPO on qwix LoRA) was read for this and is not imported: its group advantages,
clipped loss, loss aggregation and KL estimators are a few lines each and are written here with the same
conventions (above), while its rollout and log-probability code is autoregressive throughout (one causal forward
over prompt + completion, per-token log-probs shifted by one, vLLM / its sampler for rollouts), which a canvas
sampler's trajectory does not fit; and importing it pulls in datasets, kagglehub, tensorflow_datasets, transformers
and more at import time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards_N: np.ndarray, group_size: int, eps: float) -> np.ndarray:
  """(r - group mean) / (group std + eps) per group of `group_size` contiguous rows (sample std, ddof 1); a group
  whose rewards are all equal gets 0."""
  r_GK = np.asarray(rewards_N, np.float64).reshape(-1, group_size)
  centred = r_GK - r_GK.mean(axis=1, keepdims=True)
  return (centred / (r_GK.std(axis=1, ddof=1, keepdims=True) + eps)).reshape(-1)


def clipped_objective(ratio, advantage, clip_lo: float, clip_hi: float):
  """(min(rho A, clip(rho, 1 - lo, 1 + hi) A), whether rho lies outside the clip range)."""
  clipped = jnp.clip(ratio, 1.0 - clip_lo, 1.0 + clip_hi)
  return jnp.minimum(ratio * advantage, clipped * advantage), (ratio < 1.0 - clip_lo) | (ratio > 1.0 + clip_hi)


def safe_ratio(log_ratio):
  """exp of a log ratio clipped to +-20 (a far-off ratio is clipped away by the objective anyway)."""
  return jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))


def trajectory_loss(lp_KNC, old_lp_KNC, draws_KNC, kl_KNC, advantages_N, draws_total_N, step_weight, rl):
  """(loss, metrics) of the scored steps (module docstring). lp / old_lp: log-probabilities of the draws [K, N, C];
  draws: which positions hold a draw; kl: KL(p_theta || p_ref) at each position; draws_total_N: D_n over all steps;
  step_weight: S / K."""
  draws = draws_KNC.astype(jnp.float32)
  ratio = safe_ratio(lp_KNC - old_lp_KNC)
  objective, outside = clipped_objective(ratio, advantages_N[None, :, None], rl.clip_eps, rl.upper_clip)
  scale_N = step_weight / jnp.maximum(draws_total_N, 1.0)
  per_row = lambda x_KNC: scale_N * jnp.sum(x_KNC * draws, axis=(0, 2))
  rows = jnp.maximum(jnp.sum((draws_total_N > 0).astype(jnp.float32)), 1.0)  # samples with draws (at least 1)
  pg = -jnp.sum(per_row(objective)) / rows
  kl = jnp.sum(per_row(kl_KNC)) / rows
  n_draws = jnp.maximum(jnp.sum(draws), 1.0)
  # the trajectory's surprisal, nats per sample (its expectation is the entropy of the draws that reach the
  # canvas): how much of a sample's randomness the policy gradient can credit to the model
  nll = step_weight * jnp.sum(-lp_KNC * draws) / rows
  metrics = dict(pg_loss=pg, kl=kl, clip_fraction=jnp.sum(outside * draws) / n_draws,
                 ratio_mean=jnp.sum(ratio * draws) / n_draws, trajectory_nll=jax.lax.stop_gradient(nll))
  return pg + rl.kl_weight * kl, metrics


def sequence_loss(ll_N, old_ll_N, ref_ll_N, length_N, advantages_N, rl):
  """(loss, metrics) of the 'elbo' log-likelihood: one length-normalised ratio per sample, k3 KL to the reference."""
  length_N = jnp.maximum(length_N.astype(jnp.float32), 1.0)
  ratio = safe_ratio((ll_N - old_ll_N) / length_N)
  objective, outside = clipped_objective(ratio, advantages_N, rl.clip_eps, rl.upper_clip)
  delta = jnp.clip((ref_ll_N - ll_N) / length_N, -20.0, 20.0)
  kl = jnp.mean(jnp.exp(delta) - delta - 1.0)
  pg = -jnp.mean(objective)
  metrics = dict(pg_loss=pg, kl=kl, clip_fraction=jnp.mean(outside.astype(jnp.float32)), ratio_mean=jnp.mean(ratio))
  return pg + rl.kl_weight * kl, metrics


def position_kl(logp_NCV, ref_logp_NCV):
  """KL(p || p_ref) at each position [N, C] from two log-probability tables (0 log 0 = 0)."""
  p = jnp.exp(logp_NCV)
  return jnp.sum(jnp.where(p > 0, p * (logp_NCV - ref_logp_NCV), 0.0), axis=-1)
