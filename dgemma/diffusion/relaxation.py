"""The Gaussian relaxation of uniform-state diffusion, and Duo's curriculum through it.

Duo (Sahoo et al., ICML 2025, "The Diffusion Duality", arXiv 2506.10892): put Gaussian noise on the one-hot
clean token, w = a e_x + s eps (eps ~ N(0, I_N), a^2 + s^2 = 1), and take z = argmax(w). By symmetry every
wrong token is equally likely to win, so z is exactly a uniform-state latent:

  q(z = x) = P(r, N) = int phi(u) Phi(u + r)^(N - 1) du,   r = a / s (the signal-to-noise ratio),

and alpha = (N P - 1) / (N - 1), i.e. q(z) = alpha onehot(x) + (1 - alpha) / N (the paper's "diffusion
transformation operator" T, here `alpha_of_snr`). Inverting it (`snr_of_alpha`) gives, for every discrete
alpha(t) of our schedules, a Gaussian latent whose argmax has exactly the marginal our corruption draws.

The curriculum (`diffusion.curriculum_steps` > 0): for the first steps of training the decoder reads the
tempered softmax of that latent, softmax(w / tau), embedded as probs @ table * sqrt(D), instead of the
one-hot of its argmax. The loss is unchanged: the objective at z = argmax(w) and alpha(t). As tau -> 0 the
input becomes one-hot(z), i.e. ordinary training; a larger tau lets the input carry how far ahead the
winner was, an easier, lower-variance problem early on (Duo reports about half the training to a given
loss). tau is interpolated geometrically from `curriculum_tau_start` to `curriculum_tau_end` over the
curriculum; after it, training is the discrete recipe exactly (dgemma/diffusion/loss.py).

Duo also draws the curriculum's times its own way: the latent's log-SNR gamma = -2 log r uniform on a window
(gamma in [-3.5, -1.75] for GPT-2's 50,257 tokens, i.e. alpha from about 0.93 down to 0.04: neither nearly
clean nor nearly pure noise, and more weight on the noisy end). `curriculum_alpha_range` = (alpha_lo,
alpha_hi) gives that window by its alpha levels, so it carries over to any vocabulary (`curriculum_alpha`);
empty keeps the schedule's alpha(t) during the curriculum too.

P(r, N) is computed once per vocabulary size on the host in float64 (`snr_table`): the trapezoid rule on a
fine grid of u, with 1 - P = int phi(u) (1 - Phi(u + r)^(N-1)) du formed from log Phi so that alpha near 1
keeps its digits. The table is indexed by -log(1 - alpha), in which r is smooth.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

_U_GRID = np.linspace(-12.0, 12.0, 4801)  # quadrature nodes (spacing 0.005); phi(12) ~ 1e-32
_SNR_GRID = np.linspace(0.0, 20.0, 2001)  # r = a / s; at r = 20, 1 - alpha < 1e-40 for any N <= 2^20


def one_minus_alpha_of_snr(snr, vocab_size: int) -> np.ndarray:
  """1 - alpha(r) for an N-token vocabulary, float64 (exact quadrature of the argmax probability)."""
  r = np.atleast_1d(np.asarray(snr, np.float64))[:, None]
  n = int(vocab_size)
  weights = np.exp(-0.5 * _U_GRID ** 2) / math.sqrt(2 * math.pi) * np.gradient(_U_GRID)
  weights[0] *= 0.5  # trapezoid rule: half weight at the ends
  weights[-1] *= 0.5
  # 1 - Phi(u + r)^(N-1), from log Phi: no cancellation when it is tiny (alpha near 1)
  miss = -np.expm1((n - 1) * special.log_ndtr(_U_GRID[None, :] + r))
  one_minus_p = miss @ weights
  return (n / (n - 1)) * one_minus_p


def alpha_of_snr(snr, vocab_size: int) -> np.ndarray:
  """Duo's transformation operator: the uniform-state alpha of z = argmax(r e_x + eps), float64."""
  return 1.0 - one_minus_alpha_of_snr(snr, vocab_size)


@functools.lru_cache(maxsize=8)
def snr_table(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(-log(1 - alpha(r)), r) on `_SNR_GRID`, both increasing: the table `snr_of_alpha` interpolates."""
  if vocab_size < 2:
    raise ValueError(f"the Gaussian relaxation needs a vocabulary of at least 2 tokens, got {vocab_size}")
  surprisal = -np.log(np.maximum(one_minus_alpha_of_snr(_SNR_GRID, vocab_size), 1e-300))
  return surprisal, _SNR_GRID.copy()


def snr_of_alpha_host(alpha: float, vocab_size: int) -> float:
  """`snr_of_alpha` on the host in float64 (a Python float: constants of a traced program)."""
  surprisal, snr = snr_table(vocab_size)
  return float(np.interp(-math.log1p(-min(max(float(alpha), 0.0), 1.0 - 1e-7)), surprisal, snr))


def snr_of_alpha(alpha, vocab_size: int) -> jax.Array:
  """The inverse of `alpha_of_snr`: r with alpha(r) = alpha (fp32, any shape; alpha in [0, 1))."""
  surprisal, snr = snr_table(vocab_size)
  alpha = jnp.asarray(alpha, jnp.float32)
  target = -jnp.log1p(-jnp.clip(alpha, 0.0, 1.0 - 1e-7))
  return jnp.interp(target, jnp.asarray(surprisal, jnp.float32), jnp.asarray(snr, jnp.float32))


@functools.lru_cache(maxsize=8)
def alpha_table(vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(r, alpha(r), d alpha / d r) on `_SNR_GRID`, float64: what `alpha_of_log_snr` interpolates (from
  `snr_table`'s quadrature: alpha = 1 - exp(-surprisal))."""
  surprisal, snr = snr_table(vocab_size)
  alpha = -np.expm1(-surprisal)
  return snr, alpha, np.gradient(alpha, snr)


def alpha_of_log_snr(gamma, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """(alpha, d alpha / d gamma) of the Gaussian latent at gamma = -log(a^2 / s^2) = -2 log r (Duo's
  parameterisation; a^2 = sigmoid(-gamma)), fp32, from the table by linear interpolation."""
  snr, alpha, dalpha_dsnr = (jnp.asarray(x, jnp.float32) for x in alpha_table(vocab_size))
  r = jnp.exp(-0.5 * jnp.asarray(gamma, jnp.float32))
  return jnp.interp(r, snr, alpha), jnp.interp(r, snr, dalpha_dsnr) * (-0.5 * r)


def curriculum_alpha(t, loss_cfg, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Duo's curriculum times: (alpha(t), alpha'(t)) with the latent's log-SNR gamma uniform in t between the
  levels of `curriculum_alpha_range` = (alpha_lo, alpha_hi): t = 0 at alpha_hi, t = 1 at alpha_lo, and
  alpha' = d alpha / d gamma * (gamma(alpha_lo) - gamma(alpha_hi)) (the NELBO's weight for t ~ U(0, 1))."""
  lo, hi = loss_cfg.curriculum_alpha_range
  gamma_of = lambda a: -2.0 * math.log(max(snr_of_alpha_host(a, vocab_size), 1e-6))
  gamma_start, gamma_end = gamma_of(hi), gamma_of(lo)
  alpha, dalpha_dgamma = alpha_of_log_snr(gamma_start + jnp.asarray(t, jnp.float32) * (gamma_end - gamma_start),
                                          vocab_size)
  return alpha, dalpha_dgamma * (gamma_end - gamma_start)


def relaxed_rows(keys_B: jax.Array, tokens_BC: jax.Array, alpha_B: jax.Array, vocab_size: int,
                 tau: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-example Gaussian latents of clean rows at uniform-state level alpha_b.

  Returns (z_BC = argmax(w), probs_BCV = softmax(w / tau)) for w = a onehot(x) + s eps, a = r / sqrt(1 + r^2),
  s = 1 / sqrt(1 + r^2) (variance preserving, as Duo), r = snr_of_alpha(alpha_b): z has exactly the
  marginal of `corrupt_rows` at p = 1 - alpha_b. fp32.
  """
  snr_B = snr_of_alpha(alpha_B, vocab_size)
  norm_B = jax.lax.rsqrt(1.0 + snr_B * snr_B)

  def row(key, tokens_C, a, s):
    eps_CV = jax.random.normal(key, (*tokens_C.shape, vocab_size), jnp.float32)
    w_CV = a * jax.nn.one_hot(tokens_C, vocab_size, dtype=jnp.float32) + s * eps_CV
    return jnp.argmax(w_CV, axis=-1).astype(tokens_C.dtype), jax.nn.softmax(w_CV / tau, axis=-1)
  return jax.vmap(row)(keys_B, tokens_BC, snr_B * norm_B, norm_B)


def coupled_rows(keys_B: jax.Array, tokens_BC: jax.Array, alpha_t_B: jax.Array, alpha_s_B: jax.Array,
                 vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Two uniform-state latents of clean rows on one Gaussian trajectory: (z_t, z_s) = (argmax(r_t e_x + eps),
  argmax(r_s e_x + eps)) with ONE eps per token, r = snr_of_alpha(alpha).

  Duo's deterministic trajectories for consistency distillation (dgemma/diffusion/distill.py): the discrete
  process has no probability-flow ODE, the Gaussian one does, and its DDIM path through the clean x keeps eps
  fixed. Each of z_t, z_s has exactly the marginal of `corrupt_rows` at its alpha; with alpha_s >= alpha_t
  only x's score grows from t to s, so z_t = x implies z_s = x (the pair never moves away from the data).
  argmax(a e_x + s eps) = argmax(r e_x + eps) for s > 0, so the variance-preserving scale drops out.
  """
  snr_t_B, snr_s_B = snr_of_alpha(alpha_t_B, vocab_size), snr_of_alpha(alpha_s_B, vocab_size)

  def row(key, tokens_C, r_t, r_s):
    eps_CV = jax.random.normal(key, (*tokens_C.shape, vocab_size), jnp.float32)
    onehot_CV = jax.nn.one_hot(tokens_C, vocab_size, dtype=jnp.float32)
    z = lambda r: jnp.argmax(r * onehot_CV + eps_CV, axis=-1).astype(tokens_C.dtype)
    return z(r_t), z(r_s)
  return jax.vmap(row)(keys_B, tokens_BC, snr_t_B, snr_s_B)


def curriculum_tau(step: jax.Array, loss_cfg) -> jax.Array:
  """The relaxation temperature at training step `step`: geometric from curriculum_tau_start (step 0) to
  curriculum_tau_end (the last curriculum step), fp32; meaningful only while step < curriculum_steps."""
  n = max(int(loss_cfg.curriculum_steps), 1)
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(n - 1, 1), 0.0, 1.0)
  log_tau = (1.0 - frac) * math.log(loss_cfg.curriculum_tau_start) + frac * math.log(loss_cfg.curriculum_tau_end)
  return jnp.exp(log_tau)
