"""The sampler's per-step rules, apart from its loop (dgemma/sampling/sampler.py): the pieces of a step
(temperature, logit shaping, entropy, alpha), and three tables the loop and the settings check query by
name: which positions a released step accepts (`ACCEPTANCE`, `sample.acceptance`), what happens to the
others (`RENOISE`, `sample.renoise`), and how each sampler turns logits into the next canvas (`KINDS`,
`sample.sampler`: released, ancestral, pc, masked). Adding a rule touches only this file (and its test).

Acceptance rule: fn(rank_entropy_BC, logp_BCV, cfg) -> bool [B, C], where rank_entropy_BC is the
per-position entropy with positions outside the rule (held or infilled) set to +inf, logp_BCV the
log-probabilities of the tempered distribution and cfg the SamplerConfig. At least one open position is
accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from dgemma.diffusion import objectives, schedules
from dgemma.sampling import posteriors


def accept_entropy_bound(entropy_BC: jax.Array, bound: float) -> jax.Array:
  """Entropy-bound acceptance (arXiv 2505.24857): sort entropies ascending, accept while
  cumsum(H) - H_i <= bound (H_i is the running maximum), so the lowest is always accepted.
  Positions with entropy +inf (excluded from the rule) are never accepted."""
  order_BC = jnp.argsort(entropy_BC, axis=-1, stable=True)
  sorted_BC = jnp.take_along_axis(entropy_BC, order_BC, axis=-1)
  keep_sorted_BC = jnp.cumsum(sorted_BC, axis=-1) - sorted_BC <= bound  # inf - inf = nan -> False
  rows_B1 = jnp.arange(entropy_BC.shape[0])[:, None]
  return jnp.zeros(entropy_BC.shape, bool).at[rows_B1, order_BC].set(keep_sorted_BC)


def accept_fixed_k(entropy_BC: jax.Array, k: int) -> jax.Array:
  """The k lowest-entropy positions."""
  k = min(k, entropy_BC.shape[-1])
  order_BC = jnp.argsort(entropy_BC, axis=-1, stable=True)
  rank_BC = jnp.argsort(order_BC, axis=-1)
  return rank_BC < k


def accept_confidence(entropy_BC: jax.Array, top_prob_BC: jax.Array, threshold: float) -> jax.Array:
  """Positions whose most likely token has probability >= threshold; the lowest-entropy one always."""
  lowest_BC = accept_fixed_k(entropy_BC, 1)
  return (top_prob_BC >= threshold) | lowest_BC


ACCEPTANCE: dict[str, Callable] = {
    "entropy_bound": lambda ent_BC, logp_BCV, cfg: accept_entropy_bound(ent_BC, cfg.entropy_bound),
    "confidence": lambda ent_BC, logp_BCV, cfg: accept_confidence(ent_BC, jnp.exp(jnp.max(logp_BCV, axis=-1)),
                                                                  cfg.accept_confidence),
    "fixed_k": lambda ent_BC, logp_BCV, cfg: accept_fixed_k(ent_BC, cfg.accept_k),
}


def _keep_while_confident(held_BC: jax.Array, p_current_BC: jax.Array, cfg) -> jax.Array:
  return held_BC & (p_current_BC >= cfg.renoise_confidence)


@dataclasses.dataclass(frozen=True)
class RenoiseRule:
  """What a step does with the positions it did not accept.

  keep: fn(held_BC, p_current_BC, cfg) -> bool [B, C]: tokens accepted on earlier steps that stay on the
    canvas this step, outside the acceptance budget (p_current: the model's probability of the token
    there); None = nothing is held across steps (every position is open every step).
  refill_with_current: open non-accepted positions keep their token (else they get fresh uniform tokens).
  """
  name: str
  keep: Callable | None = None
  refill_with_current: bool = False


RENOISE: dict[str, RenoiseRule] = {r.name: r for r in (
    RenoiseRule("non_accepted"),                      # released: every non-accepted position re-noised
    RenoiseRule("none", refill_with_current=True),    # non-accepted positions keep their token
    RenoiseRule("low_confidence", keep=_keep_while_confident),  # accepted tokens stay until p < threshold
)}


# ---- pieces of one step --------------------------------------------------------------------------

def temperature(cfg, step) -> jax.Array:
  """T at 0-based step s: t_min + (t_max - t_min) * (S - s) / S, in fp32 like HF (which counts S..1)."""
  n = cfg.max_denoising_steps
  frac = (n - jnp.asarray(step, jnp.int32)).astype(jnp.float32) / jnp.float32(n)
  return jnp.float32(cfg.t_min) + jnp.float32(cfg.t_max - cfg.t_min) * frac


def shape_logits(logits_BCV: jax.Array, cfg) -> jax.Array:
  """Optional top-k / top-p filtering (masked logits -> -inf)."""
  neg_inf = jnp.array(-jnp.inf, logits_BCV.dtype)
  if cfg.top_k and cfg.top_k < logits_BCV.shape[-1]:
    kth_BC1 = jax.lax.top_k(logits_BCV, cfg.top_k)[0][..., -1:]
    logits_BCV = jnp.where(logits_BCV < kth_BC1, neg_inf, logits_BCV)
  if cfg.top_p < 1.0:
    sorted_BCV = jnp.sort(logits_BCV, axis=-1)[..., ::-1]
    probs_BCV = jax.nn.softmax(sorted_BCV, axis=-1)
    mass_before_BCV = jnp.cumsum(probs_BCV, axis=-1) - probs_BCV
    # the smallest logit still needed to reach mass top_p (the top token always survives)
    keep_BCV = mass_before_BCV < cfg.top_p
    cutoff_BC1 = jnp.min(jnp.where(keep_BCV, sorted_BCV, jnp.inf), axis=-1, keepdims=True)
    logits_BCV = jnp.where(logits_BCV < cutoff_BC1, neg_inf, logits_BCV)
  return logits_BCV


def entropy(logits_BCV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(entropy [B, C], log-probabilities [B, C, V]) of softmax(logits) in fp32; -inf logits allowed."""
  logp_BCV = jax.nn.log_softmax(logits_BCV.astype(jnp.float32), axis=-1)
  p_BCV = jnp.exp(logp_BCV)
  plogp_BCV = jnp.where(p_BCV > 0, p_BCV * logp_BCV, 0.0)
  return -jnp.sum(plogp_BCV, axis=-1), logp_BCV


def alpha(cfg, t) -> jax.Array:
  """Signal level alpha(t) of the ancestral / masked samplers (fp32), t in [0, 1]: the schedule
  `sample.alpha_schedule` of `dgemma.diffusion.schedules` (the one training uses, by name)."""
  return schedules.alpha(cfg.alpha_schedule, t, cfg.schedule_eps)


def stopping(cfg, argmax_BC, input_canvas_BC, prev_argmax_BC, stable_B, entropy_BC) -> tuple[jax.Array, jax.Array]:
  """(stable counter [B], stops [B]) of a released step (`sample.semantics`).

  'hf': stable counts consecutive steps whose argmax canvas equals the previous step's; a row stops once
    stable >= stability_threshold and mean(H) < confidence_threshold.
  'official' (`_early_stopping.py`: TokenStabilityEarlyStop AND EntropyEarlyStop): the argmax equals this
    step's input canvas (one step, no counter) and mean(H) <= confidence_threshold.
  """
  mean_B = jnp.mean(entropy_BC, axis=-1)
  if cfg.semantics == "official":
    same_B = jnp.all(argmax_BC == input_canvas_BC, axis=-1)
    return same_B.astype(jnp.int32), same_B & (mean_B <= cfg.confidence_threshold)
  stable_B = jnp.where(jnp.all(argmax_BC == prev_argmax_BC, axis=-1), stable_B + 1, 0).astype(jnp.int32)
  return stable_B, (stable_B >= cfg.stability_threshold) & (mean_B < cfg.confidence_threshold)


# ---- samplers --------------------------------------------------------------------------------------

def _released_update(state, cfg, noise: Any, canvas_idx, s, ent_BC, logp_BCV,
                     sampled_BC, fixed_BC, fixed_mask_BC):
  """Steps 5-6 of the released sampler: (canvas', held', accepted, shown)."""
  batch, canvas_len = state.canvas_BC.shape
  vocab = logp_BCV.shape[-1]
  renoise = RENOISE[cfg.renoise]
  # tokens held from earlier steps (renoise='low_confidence': while p(token) >= renoise_confidence)
  keep_BC = jnp.zeros((batch, canvas_len), bool)
  if renoise.keep is not None:
    p_current_BC = jnp.exp(jnp.take_along_axis(logp_BCV, state.canvas_BC[..., None], axis=-1)[..., 0])
    keep_BC = renoise.keep(state.held_BC, p_current_BC, cfg)
  # 5. acceptance over the open positions (kept and infilled ones are outside the budget)
  closed_BC = keep_BC if fixed_mask_BC is None else keep_BC | fixed_mask_BC
  rank_ent_BC = jnp.where(closed_BC, jnp.inf, ent_BC)
  new_BC = ACCEPTANCE[cfg.acceptance](rank_ent_BC, logp_BCV, cfg) & ~closed_BC
  # 6. re-noise the open non-accepted positions
  other_BC = state.canvas_BC if renoise.refill_with_current else noise.renoise(canvas_idx, s, canvas_len, vocab)
  canvas_BC = jnp.where(new_BC, sampled_BC, other_BC)
  canvas_BC = jnp.where(keep_BC, state.canvas_BC, canvas_BC)
  shown_BC = jnp.where(new_BC, sampled_BC, state.canvas_BC)
  accepted_BC = new_BC | keep_BC
  if fixed_mask_BC is not None:
    canvas_BC = jnp.where(fixed_mask_BC, fixed_BC, canvas_BC)
    shown_BC = jnp.where(fixed_mask_BC, fixed_BC, shown_BC)
    accepted_BC = accepted_BC | fixed_mask_BC
  held_BC = (new_BC | keep_BC) if renoise.keep is not None else state.held_BC
  return canvas_BC, held_BC, accepted_BC, shown_BC


def _step_alphas(cfg, s) -> tuple[jax.Array, jax.Array]:
  """(alpha_t, alpha_s) of step s on the ancestral time grid t = 1 - s/S -> s' = 1 - (s+1)/S."""
  n = jnp.float32(cfg.max_denoising_steps)
  step_f = jnp.asarray(s, jnp.float32)
  return alpha(cfg, 1.0 - step_f / n), alpha(cfg, 1.0 - (step_f + 1.0) / n)


def _released_step(state, cfg, noise, canvas_idx, s, proc_BCV, argmax_BC, fixed_BC, fixed_mask_BC):
  """Steps 4-6 of the released sampler; returns (canvas', held', accepted, shown, sampled, argmax, H)."""
  # 4. sample every position; the argmax canvas is the output
  sampled_BC = noise.sample(canvas_idx, s, proc_BCV)
  # 5. entropy (infilled positions: zero, for the stopping rule)
  ent_BC, logp_BCV = entropy(proc_BCV)
  if fixed_mask_BC is not None:
    ent_BC = jnp.where(fixed_mask_BC, 0.0, ent_BC)
    sampled_BC = jnp.where(fixed_mask_BC, fixed_BC, sampled_BC)
    argmax_BC = jnp.where(fixed_mask_BC, fixed_BC, argmax_BC)
  canvas_BC, held_BC, accepted_BC, shown_BC = _released_update(
      state, cfg, noise, canvas_idx, s, ent_BC, logp_BCV, sampled_BC, fixed_BC, fixed_mask_BC)
  return canvas_BC, held_BC, accepted_BC, shown_BC, sampled_BC, argmax_BC, ent_BC


def _posterior_step(posterior_update):
  """A step of an ancestral sampler: z_s drawn by `posterior_update`; returns the released step's tuple."""
  def step(state, cfg, noise, canvas_idx, s, proc_BCV, argmax_BC, fixed_BC, fixed_mask_BC):
    ent_BC, logp_BCV = entropy(proc_BCV)
    if fixed_mask_BC is not None:
      argmax_BC = jnp.where(fixed_mask_BC, fixed_BC, argmax_BC)
    canvas_BC, held_BC, accepted_BC, shown_BC, argmax_BC = posterior_update(
        state, cfg, noise, canvas_idx, s, logp_BCV, argmax_BC, fixed_BC, fixed_mask_BC)
    return canvas_BC, held_BC, accepted_BC, shown_BC, canvas_BC, argmax_BC, ent_BC
  return step


def _posterior_argmax(logp_BCV, argmax_BC, z_BC, alpha, fixed_BC, fixed_mask_BC):
  """argmax of the posterior p(x_i | z_t) = softmax(logp + delta(alpha) onehot(z_t)) from the leave-one-out
  logp and its argmax, without another [B, C, V] pass: z_t wins where logp_z + delta >= max logp."""
  delta = jax.nn.softplus(objectives.log_snr(alpha, logp_BCV.shape[-1]))
  logp_z_BC = jnp.take_along_axis(logp_BCV, z_BC[..., None].astype(jnp.int32), axis=-1)[..., 0]
  logp_max_BC = jnp.max(logp_BCV, axis=-1)
  out_BC = jnp.where(logp_z_BC + delta >= logp_max_BC, z_BC, argmax_BC).astype(jnp.int32)
  return out_BC if fixed_mask_BC is None else jnp.where(fixed_mask_BC, fixed_BC, out_BC)


def _ancestral_update(state, cfg, noise: Any, canvas_idx, s, logp_BCV, argmax_BC,
                      fixed_BC, fixed_mask_BC):
  """One posterior draw z_s ~ q(z_s | z_t, x_theta) from t = 1 - s/S to s = 1 - (s+1)/S; the argmax
  reported (and taken by a greedy last step, whose alpha_s = 1 makes q the posterior) is the posterior's."""
  alpha_t, alpha_s = _step_alphas(cfg, s)
  argmax_BC = _posterior_argmax(logp_BCV, argmax_BC, state.canvas_BC, alpha_t, fixed_BC, fixed_mask_BC)
  q_BCV = posteriors.uniform_posterior(jnp.exp(logp_BCV), state.canvas_BC, alpha_t, alpha_s)
  z_BC = noise.sample(canvas_idx, s, jnp.log(q_BCV))
  if cfg.greedy_last_step:
    z_BC = jnp.where(s == cfg.max_denoising_steps - 1, argmax_BC, z_BC)
  if fixed_mask_BC is not None:
    z_BC = jnp.where(fixed_mask_BC, fixed_BC, z_BC)
  return z_BC, state.held_BC, z_BC == argmax_BC, z_BC, argmax_BC


def _masked_update(state, cfg, noise: Any, canvas_idx, s, logp_BCV, argmax_BC,
                   fixed_BC, fixed_mask_BC):
  """One MDLM reveal step (module docstring); logp_BCV already excludes the mask token."""
  alpha_t, alpha_s = _step_alphas(cfg, s)
  q_BCV = posteriors.masked_posterior(jnp.exp(logp_BCV), state.canvas_BC, cfg.mask_id, alpha_t, alpha_s)
  z_BC = noise.sample(canvas_idx, s, jnp.log(q_BCV))
  if cfg.greedy_last_step:  # the last step reveals every masked position with its argmax
    last_BC = (s == cfg.max_denoising_steps - 1) & (state.canvas_BC == cfg.mask_id)
    z_BC = jnp.where(last_BC, argmax_BC, z_BC)
  if fixed_mask_BC is not None:
    z_BC = jnp.where(fixed_mask_BC, fixed_BC, z_BC)
  return z_BC, state.held_BC, z_BC != cfg.mask_id, z_BC, argmax_BC


def _pc_alphas(cfg, s) -> tuple[jax.Array, jax.Array, jax.Array]:
  """sampler='pc': (is_corrector, alpha_in, alpha_out) of pass s. The S passes are n = S / (1 + c) rounds of
  one predictor pass and c = cfg.pc_corrector_steps corrector passes; round i's predictor goes from
  t = 1 - i/n to 1 - (i+1)/n (alpha_in -> alpha_out) and its correctors stay at the new level, except in the
  last round: there the correctors come first, at t = 1/n, and the predictor to t = 0 is the last pass (a
  corrector at t = 0 would be a no-op: the posterior of a clean canvas is the canvas)."""
  per_round = 1 + cfg.pc_corrector_steps
  n = cfg.max_denoising_steps // per_round
  i, j = s // per_round, s % per_round
  last_round = i == n - 1
  corrector = jnp.where(last_round, j != per_round - 1, j != 0)
  i_f, n_f = jnp.asarray(i, jnp.float32), jnp.float32(n)
  alpha_i, alpha_next = alpha(cfg, 1.0 - i_f / n_f), alpha(cfg, 1.0 - (i_f + 1.0) / n_f)
  level = jnp.where(last_round, alpha_i, alpha_next)
  return corrector, jnp.where(corrector, level, alpha_i), jnp.where(corrector, level, alpha_next)


def _pc_update(state, cfg, noise: Any, canvas_idx, s, logp_BCV, argmax_BC, fixed_BC, fixed_mask_BC):
  """sampler='pc': a predictor pass is the ancestral posterior draw z_s ~ q(z_s | z_t, x_theta) (as
  `_ancestral_update`, on the round grid of `_pc_alphas`); a corrector pass at level alpha re-draws every
  position from the forward marginal of the model's posterior, z ~ alpha p(x0 | z) + (1 - alpha) / N:
  the move z -> x0 ~ p(x0 | z) -> z' ~ q(z' | x0) (a forward-backward corrector; predictor-corrector samplers
  for uniform-state diffusion: the Duo follow-up, arXiv 2602.21185). It leaves q(z_t) invariant when x0 is
  drawn from the joint posterior, or one position at a time; here every position draws x0 from its own
  marginal at once (all a factorized denoiser gives), which is biased however many passes are taken: fed a
  Markov source's exact marginals it samples below the source's entropy (docs/experiments/markov_oracle.md).
  With cfg.pc_corrector_fraction < 1 a corrector re-draws only
  that share of the positions (chosen per position from the pass's re-noise draw, which pc has no other use
  for: id < round(fraction * N)) and the rest keep their token, which shrinks the bias towards the exact
  one-position move at the price of slower mixing. logp_BCV is the leave-one-out prior (`_loo_prior_logits`), so the
  corrector's posterior is softmax(logp + delta(alpha) onehot(z)). The last pass takes the posterior's argmax
  with greedy_last_step (at alpha = 1 that keeps z: a clean canvas is final)."""
  corrector, alpha_in, alpha_out = _pc_alphas(cfg, s)

  def correct(logp_BCV):
    alpha_BC = jnp.broadcast_to(alpha_in, state.canvas_BC.shape)
    post_BCV = jax.nn.softmax(objectives.posterior_from_loo(logp_BCV, state.canvas_BC, alpha_BC), axis=-1)
    return alpha_out * post_BCV + (1.0 - alpha_out) / logp_BCV.shape[-1]

  q_BCV = jax.lax.cond(  # one [B, C, V] distribution per pass, not both
      corrector, correct,
      lambda lp: posteriors.uniform_posterior(jnp.exp(lp), state.canvas_BC, alpha_in, alpha_out), logp_BCV)
  z_BC = noise.sample(canvas_idx, s, jnp.log(q_BCV))
  if cfg.pc_corrector_fraction < 1.0:
    batch, canvas_len, vocab = logp_BCV.shape
    cut = max(1, round(cfg.pc_corrector_fraction * vocab))
    redraw_BC = noise.renoise(canvas_idx, s, canvas_len, vocab) < cut
    z_BC = jnp.where(corrector & ~redraw_BC, state.canvas_BC, z_BC)
  argmax_BC = _posterior_argmax(logp_BCV, argmax_BC, state.canvas_BC, alpha_in, fixed_BC, fixed_mask_BC)
  if cfg.greedy_last_step:
    z_BC = jnp.where(s == cfg.max_denoising_steps - 1, argmax_BC, z_BC)
  if fixed_mask_BC is not None:
    z_BC = jnp.where(fixed_mask_BC, fixed_BC, z_BC)
  return z_BC, state.held_BC, z_BC == argmax_BC, z_BC, argmax_BC


def input_alpha(cfg, s) -> jax.Array:
  """Samplers 'ancestral' / 'pc': the signal level alpha of pass s's input canvas (its noise level on the
  time grid; what an exact denoiser of the pass conditions on)."""
  return _pc_alphas(cfg, s)[1] if cfg.sampler == "pc" else _step_alphas(cfg, s)[0]


def _loo_prior_logits(logits_BCV, state, cfg, s):
  """sampler='ancestral' / 'pc': q(z_s | z_t, x_theta) is the true reverse step when x_theta is the
  leave-one-out prior p(x_i | z_t without i) (dgemma/diffusion/objectives.py docstring), so a model whose
  output is a posterior (every objective but the loo ones, and the released model) has delta(alpha_t)
  onehot(z_t) taken off at the level of the pass's input canvas; a leave-one-out model is read as it is."""
  if cfg.loo_logits:
    return logits_BCV
  alpha_t = jnp.broadcast_to(input_alpha(cfg, s), state.canvas_BC.shape)
  return objectives.loo_from_posterior(logits_BCV, state.canvas_BC, alpha_t)


def _without_mask_token(logits_BCV, state, cfg, s):
  """SUBS (MDLM): the mask token is never predicted."""
  return jnp.where(jnp.arange(logits_BCV.shape[-1]) == cfg.mask_id, -jnp.inf, logits_BCV)


@dataclasses.dataclass(frozen=True)
class SamplerKind:
  """One `sample.sampler`: how a step turns the decoder's logits into the next canvas.

  step: fn(state, cfg, noise, canvas_idx, s, proc_BCV, argmax_BC, fixed_BC, fixed_mask_BC) ->
    (canvas', held', accepted, shown, sampled, argmax, entropy).
  x0_logits: fn(logits_BCV, state, cfg, s) applied before the temperature (None: the logits as they are).
  returns_argmax: the canvas result is the argmax canvas (else the final canvas z_0).
  stops_early: rows may stop before max_denoising_steps (stable and confident); an ancestral sample is
    complete only at t = 0.
  starts_masked: the first canvas is all mask_id (else uniform random tokens).
  """
  name: str
  step: Callable
  x0_logits: Optional[Callable] = None
  returns_argmax: bool = False
  stops_early: bool = False
  starts_masked: bool = False


KINDS: dict[str, SamplerKind] = {k.name: k for k in (
    SamplerKind("released", _released_step, returns_argmax=True, stops_early=True),
    SamplerKind("ancestral", _posterior_step(_ancestral_update), x0_logits=_loo_prior_logits),
    SamplerKind("pc", _posterior_step(_pc_update), x0_logits=_loo_prior_logits),
    SamplerKind("masked", _posterior_step(_masked_update), x0_logits=_without_mask_token, starts_masked=True),
)}
