"""Training objectives and likelihood bounds: pure functions of logits / token arrays (no model).

Notation (../shared/reference/diffusiongemma.md, "Training recipe" and "Uniform-state diffusion
likelihood"): vocabulary size N (= K), clean token x, noisy token z, diffusion time t in (0, 1), signal
alpha = alpha(t) (probability that a token is kept), alpha' = d alpha / dt < 0. Uniform-state forward
process: q(z_t | x) = alpha onehot(x) + (1 - alpha) / N. All functions below take per-token `alpha` /
`dalpha` arrays broadcastable to the token arrays, compute in fp32 and return per-token values; the
caller sums them with its padding weights.

Objectives (`per_token_loss(name, ...)`):
  base_ce            CE(softmax(f), x) at every canvas position (released recipe).
  reweighted_ce      w(t) CE, w(t) = min(-alpha'/alpha, cap). Linear schedule alpha = 1 - t, alpha' = -1:
                     w = 1 / (1 - t). This is the time factor of the uniform-state NELBO below
                     (integrand = (-alpha'/alpha) * [...]); contrast masked diffusion (MDLM), whose
                     NELBO weight is -alpha'/(1 - alpha) = 1/t. w diverges as t -> 1 (E_t[w] = inf for
                     t ~ U(0, 1)), hence the cap (w = cap for t > 1 - 1/cap).
  loo_ce             CE under softmax(f + delta onehot(z)), delta = log(1 + N alpha / (1 - alpha)):
                     the Bayes posterior over x given z when f is the prior "from the other tokens",
                     since q(z | x) / q(z | x' != z) = (alpha + (1 - alpha)/N) / ((1 - alpha)/N)
                     = 1 + N alpha / (1 - alpha) = exp(delta) for x = z.
  reweighted_loo_ce  w(t) * loo_ce.
  nelbo              the continuous-time uniform-state NELBO integrand (`uniform_nelbo_per_token`) of
                     x_theta = softmax(f - delta onehot(z)): the network keeps the posterior meaning of
                     every other objective here (and of the released model), the NELBO gets its
                     leave-one-out form (below).
  loo_nelbo          the same NELBO with x_theta = softmax(f): the network itself must output the
                     leave-one-out distribution (UDLM / Duo's parameterisation).
  loo_nelbo_ce       loo_nelbo + loo_ce: both are minimised by the true leave-one-out distribution, so
                     their sum is too; loo_ce's bounded per-token loss keeps learning where the NELBO
                     alone stalls, and the NELBO's clean-token term (about 1 / (N x_theta[z]) for a kept
                     token, whatever t) stops the network from learning "never my own input token",
                     which loo_ce alone does not penalise at low noise (docs/experiments/likelihood_small.md, point 4).
  loo_replaced_ce    CE(softmax(f), x) only where the forward process drew a fresh token (its draw mask
                     `replaced_N`, which counts a draw that returned x); 0 at kept tokens. A drawn token is
                     independent of x_i, so p(x_i | z, drawn) = p(x_i | z_-i): the loss is proper for the
                     leave-one-out distribution, with a plain CE's full gradient where loo_ce's is about
                     t / (N x_theta[z]), and it can never reward "never my own token" (z != x in place of
                     the draw mask would: it leaves out the draws that returned x_i; tests/diffusion/
                     test_objectives.py shows both by enumeration).
  loo_ce_replaced_ce loo_ce + loo_replaced_ce (both proper for the leave-one-out distribution).
  blind_ce           CE(softmax(f), x) at every canvas position, f standing for the leave-one-out logits: proper
                     only for a network whose output at i never reads z_i (model.decoder_two_stream), since
                     then x_i given what the output sees is a sample of p(x_i | z_-i) at kept and drawn
                     positions alike. Where loo_ce's gradient at a kept token is about t / (N x_theta[z]),
                     a kept token with clean neighbours teaches the two-sided conditional at full weight.
  mdlm               masked-diffusion NELBO: -alpha'/(1 - alpha) CE (mask logit removed) on masked
                     positions, 0 elsewhere (Sahoo et al. 2024; SUBS parameterisation).
  ar                 (handled by the caller: next-token CE of the causal encoder, no canvas.)

What x_theta is (checked by enumeration in tests/diffusion/test_objectives.py). The uniform NELBO and the
ancestral posterior q(z_s | z_t, x_theta) (dgemma/sampling/posteriors.py) are exact, i.e. the NELBO equals
-log p(x) and the ancestral step is the true reverse marginal, when x_theta at position i is the
leave-one-out distribution p(x_i | z_t without position i), NOT the posterior p(x_i | z_t): the evidence
of z_i itself enters through the formulas (the reverse jump rate to j is xbar_j / xbar_{z_i},
xbar = N alpha x_theta + 1 - alpha, and the true ratio q_t(z with z_i = j) / q_t(z) has exactly this form
with x_theta = p(x_i | z_-i)). Feeding the posterior counts z_i twice. The two are one shift apart:
p(x_i | z) is proportional to p(x_i | z_-i) q(z_i | x_i), so log p(x_i | z) = f_loo + delta onehot(z_i)
+ const (`posterior_from_loo`, `loo_from_posterior`). Each record says what its network output f stands
for (`leave_one_out`); `posterior_logits` / `loo_prior_logits` convert it for the released sampler (which
reads posteriors) and for the NELBO and the ancestral / pc samplers (which read leave-one-out priors).

Each objective is a record of `OBJECTIVES` (its corruption, per-token loss, what its output stands for, whether it is
leave-one-out, which samplers fit it); callers query the record instead of comparing names, so adding an
objective touches only this file (and its test).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dgemma.errors import ConfigError



# ---- time weight -------------------------------------------------------------------------------

def time_weight(alpha: jax.Array, dalpha: jax.Array, cap: float) -> jax.Array:
  """w(t) = min(-alpha'/alpha, cap): the NELBO's time factor (1 / (1 - t) for alpha = 1 - t)."""
  alpha = jnp.maximum(jnp.asarray(alpha, jnp.float32), jnp.finfo(jnp.float32).tiny)  # no 0 / 0 at t = 1
  return jnp.minimum(-jnp.asarray(dalpha, jnp.float32) / alpha, cap)


def _clip_alpha(alpha: jax.Array) -> jax.Array:
  # 0 < alpha < 1 strictly: alpha = 1 (t = 0) has no noise, alpha = 0 has no signal (delta -> inf / 0).
  tiny = jnp.finfo(jnp.float32).tiny
  return jnp.clip(jnp.asarray(alpha, jnp.float32), tiny, 1.0 - jnp.finfo(jnp.float32).epsneg)


def log_snr(alpha: jax.Array, vocab_size: int) -> jax.Array:
  """log rho, rho = N alpha / (1 - alpha); delta = log(1 + rho) = softplus(log rho)."""
  alpha = _clip_alpha(alpha)
  return math.log(vocab_size) + jnp.log(alpha) - jnp.log1p(-alpha)


# ---- cross-entropies -----------------------------------------------------------------------------

def _gather(x_NV: jax.Array, idx_N: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_NV, idx_N[..., None].astype(jnp.int32), axis=-1)[..., 0]


def cross_entropy(logits_NV: jax.Array, x0_N: jax.Array) -> jax.Array:
  """-log softmax(f)[x] per token (fp32)."""
  logits_NV = logits_NV.astype(jnp.float32)
  return jax.nn.logsumexp(logits_NV, axis=-1) - _gather(logits_NV, x0_N)


def loo_cross_entropy(logits_NV: jax.Array, x0_N: jax.Array, zt_N: jax.Array, alpha_N: jax.Array) -> jax.Array:
  """-log softmax(f + delta onehot(z))[x], delta = log(1 + rho), rho = N alpha / (1 - alpha).

  No one-hot: logsumexp_j(f_j + delta [j = z]) = log(sum_j e^f_j + (e^delta - 1) e^f_z)
  = logaddexp(logsumexp(f), f_z + log rho), since e^delta - 1 = rho.
  """
  logits_NV = logits_NV.astype(jnp.float32)
  log_rho_N = log_snr(alpha_N, logits_NV.shape[-1])
  f_z_N = _gather(logits_NV, zt_N)
  logz_N = jnp.logaddexp(jax.nn.logsumexp(logits_NV, axis=-1), f_z_N + log_rho_N)
  delta_N = jax.nn.softplus(log_rho_N)
  return logz_N - _gather(logits_NV, x0_N) - jnp.where(x0_N == zt_N, delta_N, 0.0)


def _shift_observed(logits_NV: jax.Array, zt_N: jax.Array, alpha_N: jax.Array, sign: float) -> jax.Array:
  """f + sign * delta onehot(z), delta = log(1 + N alpha / (1 - alpha)), fp32."""
  logits_NV = logits_NV.astype(jnp.float32)
  delta_N = jax.nn.softplus(log_snr(alpha_N, logits_NV.shape[-1]))
  is_z_NV = jnp.arange(logits_NV.shape[-1], dtype=jnp.int32) == zt_N[..., None]
  return logits_NV + jnp.where(is_z_NV, sign * delta_N[..., None], 0.0)


def posterior_from_loo(logits_NV: jax.Array, zt_N: jax.Array, alpha_N: jax.Array) -> jax.Array:
  """f + delta onehot(z): the posterior logits log p(x | z_t) from leave-one-out logits f = log p(x | z_t minus
  this token) (Bayes: p(x_i | z) is proportional to p(x_i | z_-i) q(z_i | x_i), and q(z_i | x_i) is
  (1 - alpha)/N times 1 + rho [x_i = z_i], rho = N alpha / (1 - alpha), delta = log(1 + rho))."""
  return _shift_observed(logits_NV, zt_N, alpha_N, 1.0)


def loo_from_posterior(logits_NV: jax.Array, zt_N: jax.Array, alpha_N: jax.Array) -> jax.Array:
  """f - delta onehot(z): the inverse of `posterior_from_loo` (leave-one-out logits from posterior logits)."""
  return _shift_observed(logits_NV, zt_N, alpha_N, -1.0)


# ---- uniform-state NELBO -------------------------------------------------------------------------

def uniform_nelbo_per_token(logits_NV: jax.Array, x0_N: jax.Array, zt_N: jax.Array, alpha_t: jax.Array,
                            dalpha_t: jax.Array) -> jax.Array:
  """Continuous-time uniform-state NELBO integrand per token (UDLM, Schiff et al. 2024; Duo, Sahoo
  et al. 2025), x_theta = softmax(logits). E_{t, z_t}[this] (+ the t = 0 reconstruction term, zero for
  alpha(0) = 1) upper-bounds -log p(x). O(V) per token, no one-hot vectors, fp32.

  Reference form (doc), xbar = N alpha onehot(x) + (1 - alpha), xbar_th = N alpha x_theta + (1 - alpha):
    (alpha' / (N alpha)) [ N/xbar_z - N/xbar_th_z - sum_j (xbar_j / xbar_z)
                           (log xbar_th_z - log xbar_th_j + log xbar_j - log xbar_z) ].
  Rearrangement: sum_j xbar_j = sum_j xbar_th_j = N, so with u = xbar_th_z / xbar_z the bracket is
    -(1 / xbar_z) [ N (log u + 1/u - 1) + KL(xbar || xbar_th) ],   KL = sum_j xbar_j log(xbar_j / xbar_th_j),
  both terms >= 0 (log u >= 1 - 1/u; Gibbs for equal total mass). Write beta = 1 - alpha,
  rho = N alpha / beta, r_j = xbar_th_j / beta = 1 + rho p_j (log r_j = softplus(log rho + log p_j)),
  xbar_j / beta = 1 + rho [j = x]. Then KL / beta = (1 + rho) log((1 + rho) / r_x) + log r_x - sum_j log r_j
  (the log beta terms cancel), log u = log r_z - [z = x] log(1 + rho), beta / xbar_z = [z = x] / (1 + rho)
  + [z != x], and
    integrand = (-alpha'/alpha) (beta / xbar_z) [ (log u + 1/u - 1) / beta + (KL / beta) / N ].
  Only per-token scalars, one log-softmax and one softplus + sum over the vocabulary are needed.
  """
  logits_NV = logits_NV.astype(jnp.float32)
  N = logits_NV.shape[-1]
  alpha_N = jnp.broadcast_to(_clip_alpha(alpha_t), x0_N.shape)
  dalpha_N = jnp.broadcast_to(jnp.asarray(dalpha_t, jnp.float32), x0_N.shape)
  log_rho_N = log_snr(alpha_N, N)
  logp_NV = jax.nn.log_softmax(logits_NV, axis=-1)
  log_r_NV = jax.nn.softplus(log_rho_N[..., None] + logp_NV)  # log(xbar_th_j / beta)
  sum_log_r_N = jnp.sum(log_r_NV, axis=-1)
  log_r_x_N, log_r_z_N = _gather(log_r_NV, x0_N), _gather(log_r_NV, zt_N)
  log_1p_rho_N = jax.nn.softplus(log_rho_N)                   # log(xbar_x / beta)
  same_N = x0_N == zt_N
  log_u_N = log_r_z_N - jnp.where(same_N, log_1p_rho_N, 0.0)
  # Both terms are >= 0 exactly; the max only removes fp32 round-off (where the value and its gradient ~ 0).
  itakura_N = jnp.maximum(log_u_N + jnp.expm1(-log_u_N), 0.0)  # log u + 1/u - 1
  kl_over_beta_N = jnp.maximum(
      (1.0 + jnp.exp(log_rho_N)) * (log_1p_rho_N - log_r_x_N) + log_r_x_N - sum_log_r_N, 0.0)
  beta_over_xbar_z_N = jnp.where(same_N, jnp.exp(-log_1p_rho_N), 1.0)
  bracket_N = itakura_N / (1.0 - alpha_N) + kl_over_beta_N / N
  return (-dalpha_N / alpha_N) * beta_over_xbar_z_N * bracket_N


# ---- masked diffusion (MDLM baseline) ------------------------------------------------------------

def mdlm_nelbo_per_token(logits_NV: jax.Array, x0_N: jax.Array, zt_N: jax.Array, alpha_t: jax.Array,
                         dalpha_t: jax.Array, mask_id: int) -> jax.Array:
  """MDLM continuous-time NELBO integrand: (-alpha'/(1 - alpha)) CE(x_theta, x) [z = MASK], with
  x_theta = softmax over the vocabulary without the mask token (SUBS: never predict MASK; unmasked
  tokens are copied, so they cost 0). Linear schedule: weight 1/t."""
  logits_NV = logits_NV.astype(jnp.float32)
  is_mask_V = jnp.arange(logits_NV.shape[-1], dtype=jnp.int32) == mask_id
  ce_N = cross_entropy(jnp.where(is_mask_V, -jnp.inf, logits_NV), x0_N)
  alpha_N = jnp.broadcast_to(jnp.asarray(alpha_t, jnp.float32), x0_N.shape)
  weight_N = -jnp.asarray(dalpha_t, jnp.float32) / jnp.maximum(1.0 - alpha_N, jnp.finfo(jnp.float32).tiny)
  return jnp.where(zt_N == mask_id, weight_N * ce_N, 0.0)


# ---- the registry --------------------------------------------------------------------------------

def _base_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return cross_entropy(logits_NV, x0_N)


def _reweighted_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return time_weight(alpha_N, dalpha_N, reweight_cap) * cross_entropy(logits_NV, x0_N)


def _loo_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return loo_cross_entropy(logits_NV, x0_N, zt_N, alpha_N)


def _reweighted_loo_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return time_weight(alpha_N, dalpha_N, reweight_cap) * loo_cross_entropy(logits_NV, x0_N, zt_N, alpha_N)


def _nelbo(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return uniform_nelbo_per_token(loo_from_posterior(logits_NV, zt_N, alpha_N), x0_N, zt_N, alpha_N, dalpha_N)


def _loo_nelbo(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return uniform_nelbo_per_token(logits_NV, x0_N, zt_N, alpha_N, dalpha_N)


def _loo_nelbo_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return uniform_nelbo_per_token(logits_NV, x0_N, zt_N, alpha_N, dalpha_N) + loo_cross_entropy(
      logits_NV, x0_N, zt_N, alpha_N)


def _loo_replaced_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  if replaced_N is None:  # z != x would leave out the draws that returned x: a biased target (module docstring)
    raise ValueError("loo_replaced_ce needs replaced_N, the forward process's draw mask")
  return jnp.where(replaced_N, cross_entropy(logits_NV, x0_N), 0.0)


def _loo_ce_replaced_ce(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return loo_cross_entropy(logits_NV, x0_N, zt_N, alpha_N) + _loo_replaced_ce(
      logits_NV, x0_N, zt_N, alpha_N, dalpha_N, reweight_cap=reweight_cap, mask_id=mask_id, replaced_N=replaced_N)


def _mdlm(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, reweight_cap, mask_id, replaced_N=None):
  return mdlm_nelbo_per_token(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, mask_id)


UNIFORM, MASK, NONE = "uniform", "mask", "none"  # corruption kinds


@dataclasses.dataclass(frozen=True)
class Objective:
  """One training objective: how the canvas is corrupted and scored, and what that implies downstream.

  corruption: 'uniform' (tokens replaced by uniform random tokens), 'mask' (by diffusion.mask_id) or
    'none' (autoregressive: no canvas, next-token CE of the causal encoder over the whole row).
  loss: per-token canvas loss fn(logits, x0, zt, alpha, alpha', *, reweight_cap, mask_id, replaced_N=None)
    (None for AR); replaced_N is the forward process's draw mask (`per_token_loss`).
  leave_one_out: the network output f stands for the leave-one-out logits log p(x_i | z_-i) (the loo_*
    objectives); otherwise for the posterior logits log p(x_i | z) (module docstring).
  loss_is_nelbo: the training loss is already the NELBO integrand (the eval metric reuses it).
  needs_two_stream: proper only for a network blind to each position's own token (model.decoder_two_stream);
    settings refuse it otherwise.
  samplers: the `sample.sampler` values that fit a model trained this way (() for AR: no canvas sampler).
  """

  name: str
  corruption: str
  loss: Callable | None
  leave_one_out: bool = False
  loss_is_nelbo: bool = False
  needs_two_stream: bool = False
  samplers: tuple[str, ...] = ("released", "ancestral", "pc")

  @property
  def autoregressive(self) -> bool:
    return self.corruption == NONE

  @property
  def masked(self) -> bool:
    return self.corruption == MASK

  def posterior_logits(self, logits_NV: jax.Array, zt_N: jax.Array, alpha_N: jax.Array) -> jax.Array:
    """log p(x_i | z_t) (up to a constant): the x0 prediction the released sampler reads (fp32)."""
    if self.leave_one_out:
      return posterior_from_loo(logits_NV, zt_N, alpha_N)
    return logits_NV.astype(jnp.float32)

  def loo_prior_logits(self, logits_NV: jax.Array, zt_N: jax.Array, alpha_N: jax.Array) -> jax.Array:
    """log p(x_i | z_t without i): the x_theta of the uniform NELBO and the ancestral posterior (fp32)."""
    if self.leave_one_out:
      return logits_NV.astype(jnp.float32)
    return loo_from_posterior(logits_NV, zt_N, alpha_N)

  def nelbo_per_token(self, logits_NV, x0_N, zt_N, alpha_N, dalpha_N, *, mask_id: int) -> jax.Array:
    """The NELBO integrand of the model's prediction at (alpha, alpha') (fp32 [N])."""
    if self.masked:
      return mdlm_nelbo_per_token(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, mask_id)
    return uniform_nelbo_per_token(self.loo_prior_logits(logits_NV, zt_N, alpha_N), x0_N, zt_N, alpha_N, dalpha_N)

  def reconstruction_per_token(self, logits_NV, x0_N, zt_N, alpha_N, *, mask_id: int) -> jax.Array:
    """-log p(x | z_t) of the model's last reverse step to t = 0 (fp32 [N]): the posterior's CE (uniform),
    x_theta's CE on the still-masked tokens and 0 elsewhere (mdlm)."""
    if self.masked:
      no_mask_NV = jnp.where(jnp.arange(logits_NV.shape[-1]) == mask_id, -jnp.inf, logits_NV.astype(jnp.float32))
      return jnp.where(zt_N == mask_id, cross_entropy(no_mask_NV, x0_N), 0.0)
    return cross_entropy(self.posterior_logits(logits_NV, zt_N, alpha_N), x0_N)


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("base_ce", UNIFORM, _base_ce),
    Objective("reweighted_ce", UNIFORM, _reweighted_ce),
    Objective("loo_ce", UNIFORM, _loo_ce, leave_one_out=True),
    Objective("reweighted_loo_ce", UNIFORM, _reweighted_loo_ce, leave_one_out=True),
    Objective("nelbo", UNIFORM, _nelbo, loss_is_nelbo=True),
    Objective("loo_nelbo", UNIFORM, _loo_nelbo, leave_one_out=True, loss_is_nelbo=True),
    Objective("loo_nelbo_ce", UNIFORM, _loo_nelbo_ce, leave_one_out=True),
    Objective("loo_replaced_ce", UNIFORM, _loo_replaced_ce, leave_one_out=True),
    Objective("loo_ce_replaced_ce", UNIFORM, _loo_ce_replaced_ce, leave_one_out=True),
    Objective("blind_ce", UNIFORM, _base_ce, leave_one_out=True, needs_two_stream=True),
    Objective("mdlm", MASK, _mdlm, loss_is_nelbo=True, samplers=("masked",)),
    Objective("ar", NONE, None, samplers=()),
)}


def get(name: str) -> Objective:
  """The objective called `name`; an unknown name raises ConfigError naming diffusion.objective."""
  if name not in OBJECTIVES:
    raise ConfigError(f"diffusion.objective: {name!r} not in {tuple(OBJECTIVES)}")
  return OBJECTIVES[name]


def per_token_loss(name: str, logits_NV: jax.Array, x0_N: jax.Array, zt_N: jax.Array, alpha_N: jax.Array,
                   dalpha_N: jax.Array, *, reweight_cap: float = 10.0, mask_id: int = 4,
                   replaced_N: jax.Array | None = None) -> jax.Array:
  """The per-token training loss of objective `name` (see the module docstring); fp32 [N].

  replaced_N: where the forward process drew a fresh token (the draw itself, which may equal x: NOT z != x);
  only loo_replaced_ce / loo_ce_replaced_ce read it (and need it)."""
  objective = get(name)
  if objective.loss is None:
    raise ConfigError(f"diffusion.objective: {name!r} has no per-token canvas loss (it has no canvas)")
  return objective.loss(logits_NV, x0_N, zt_N, alpha_N, dalpha_N, reweight_cap=reweight_cap, mask_id=mask_id,
                        replaced_N=replaced_N)
