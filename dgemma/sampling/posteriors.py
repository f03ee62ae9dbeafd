"""Reverse-process posteriors q(z_s | z_t, x) of the ancestral samplers (uniform-state and masked), s < t.

x is the model's x0 prediction (a distribution over the vocabulary); the samplers draw z_s from these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def uniform_posterior(x_BCV: jax.Array, z_BC: jax.Array, alpha_t, alpha_s) -> jax.Array:
  """q(z_s | z_t, x) over the vocabulary [B, C, V] (fp32; rows sum to 1), s < t, alpha_s > 0.

  Reference doc, "Uniform-state diffusion likelihood": with N = vocab size and z_t one-hot,
    q  proportional to  N alpha_t x*z_t + (alpha_t/alpha_s - alpha_t) z_t + (alpha_s - alpha_t) x
                        + (1 - alpha_t/alpha_s)(1 - alpha_s)/N,
  normaliser N alpha_t x[z_t] + 1 - alpha_t. x: a distribution (the model's x0-prediction).
  """
  x_BCV = x_BCV.astype(jnp.float32)
  n = x_BCV.shape[-1]
  a_t, a_s = jnp.asarray(alpha_t, jnp.float32), jnp.asarray(alpha_s, jnp.float32)
  is_z_BCV = jnp.arange(n, dtype=jnp.int32) == z_BC[..., None].astype(jnp.int32)
  x_z_BC1 = jnp.sum(jnp.where(is_z_BCV, x_BCV, 0.0), axis=-1, keepdims=True)
  q_BCV = (a_s - a_t) * x_BCV + (1.0 - a_t / a_s) * (1.0 - a_s) / n
  q_BCV = q_BCV + jnp.where(is_z_BCV, n * a_t * x_z_BC1 + (a_t / a_s - a_t), 0.0)
  return q_BCV / jnp.sum(q_BCV, axis=-1, keepdims=True)


def masked_posterior(x_BCV: jax.Array, z_BC: jax.Array, mask_id: int, alpha_t, alpha_s) -> jax.Array:
  """MDLM posterior q(z_s | z_t, x) [B, C, V] (fp32), s < t: a masked z_t is revealed as x with
  probability (alpha_s - alpha_t) / (1 - alpha_t) and stays masked otherwise; a revealed z_t is kept.
  x: a distribution with no mass on mask_id."""
  x_BCV = x_BCV.astype(jnp.float32)
  a_t, a_s = jnp.asarray(alpha_t, jnp.float32), jnp.asarray(alpha_s, jnp.float32)
  reveal = (a_s - a_t) / jnp.maximum(1.0 - a_t, jnp.finfo(jnp.float32).tiny)
  iota_V = jnp.arange(x_BCV.shape[-1], dtype=jnp.int32)
  is_mask_V = (iota_V == mask_id).astype(jnp.float32)
  from_mask_BCV = reveal * x_BCV + (1.0 - reveal) * is_mask_V
  keep_BCV = (iota_V == z_BC[..., None].astype(jnp.int32)).astype(jnp.float32)
  return jnp.where((z_BC == mask_id)[..., None], from_mask_BCV, keep_BCV)
