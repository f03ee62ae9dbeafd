"""The forward process: corrupting clean canvases, and splitting packed rows into context and canvas.

Uniform-state diffusion replaces each canvas token, with probability 1 - alpha(t), by a token drawn
uniformly from the whole vocabulary (which may be the clean token itself); masked diffusion (the MDLM
baseline) replaces it by `mask_id` instead. Randomness is per example (one key per row), so a batch split
into micro-batches sees exactly the noise of the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def corrupt_rows(keys_B: jax.Array, tokens_BC: jax.Array, p_B: jax.Array, vocab_size: int,
                 mask_id: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-example keys: each row replaces each token with probability p_b, by a uniform random token
  (mask_id None) or by `mask_id` (masked diffusion). Returns (noisy_BC, replaced_BC)."""
  def row(key, tokens_C, p):
    k_mask, k_tok = jax.random.split(key)
    replaced_C = jax.random.uniform(k_mask, tokens_C.shape) < p
    if mask_id is None:
      fill_C = jax.random.randint(k_tok, tokens_C.shape, 0, vocab_size, dtype=tokens_C.dtype)
    else:
      fill_C = jnp.full_like(tokens_C, mask_id)
    return jnp.where(replaced_C, fill_C, tokens_C), replaced_C
  return jax.vmap(row)(keys_B, tokens_BC, p_B)


def split_context_canvas(batch: dict[str, jax.Array], canvas_len: int) -> tuple[dict, dict]:
  """Splits packed rows [B, L] into context [B, L - C] and canvas [B, C] (same keys)."""
  split = batch["tokens"].shape[1] - canvas_len
  ctx = {k: v[:, :split] for k, v in batch.items()}
  canvas = {k: v[:, split:] for k, v in batch.items()}
  return ctx, canvas
