"""Uniform-state discrete diffusion: corruption and the DiffusionGemma training loss.

Recipe (../shared/reference/diffusiongemma.md, "Training recipe"): one diffusion time per example
t ~ U(eps, 1), alpha(t) = 1 - t; every canvas token is replaced by a uniformly random vocabulary token
with probability t; the loss is the plain cross-entropy of the clean token at every canvas position
(corrupted or not), plus a next-token loss on the encoder's causal logits over the clean context.
A packed row of `seq_len` tokens is split into a clean context (the first seq_len - canvas_len tokens)
and one canvas (the last canvas_len tokens), so the model learns block-autoregressive generation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dgemma.model import ModelConfig, Transformer, init_cache


@dataclasses.dataclass(frozen=True)
class DiffusionLossConfig:
  canvas_len: int
  t_eps: float = 1e-4
  encoder_loss_weight: float = 1.0
  self_cond_prob: float = 0.5

  @classmethod
  def from_config(cls, config) -> "DiffusionLossConfig":
    d = config.diffusion
    return cls(canvas_len=int(d.canvas_len), t_eps=float(d.t_eps),
               encoder_loss_weight=float(d.encoder_loss_weight), self_cond_prob=float(d.self_cond_prob))


def corrupt_uniform(rng: jax.Array, tokens_BC: jax.Array, t_B: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Replaces each token with a uniform random vocabulary token with probability t (per example).

  Returns (noisy_BC, replaced_BC). A replacement may draw the clean token itself (uniform-state
  diffusion: the noise distribution is uniform over the whole vocabulary).
  """
  rng_mask, rng_tok = jax.random.split(rng)
  replaced_BC = jax.random.uniform(rng_mask, tokens_BC.shape) < t_B[:, None]
  random_BC = jax.random.randint(rng_tok, tokens_BC.shape, 0, vocab_size, dtype=tokens_BC.dtype)
  return jnp.where(replaced_BC, random_BC, tokens_BC), replaced_BC


def split_context_canvas(batch: dict[str, jax.Array], canvas_len: int) -> tuple[dict, dict]:
  """Splits packed rows [B, L] into context [B, L - C] and canvas [B, C] (same keys)."""
  split = batch["tokens"].shape[1] - canvas_len
  ctx = {k: v[:, :split] for k, v in batch.items()}
  canvas = {k: v[:, split:] for k, v in batch.items()}
  return ctx, canvas


def masked_cross_entropy(logits_BNV: jax.Array, targets_BN: jax.Array, weights_BN: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (sum of weighted CE, sum of weights, sum of weighted correct argmax), all fp32."""
  logits_BNV = logits_BNV.astype(jnp.float32)
  logz_BN = jax.nn.logsumexp(logits_BNV, axis=-1)
  target_logit_BN = jnp.take_along_axis(logits_BNV, targets_BN[..., None], axis=-1)[..., 0]
  ce_BN = logz_BN - target_logit_BN
  weights_BN = weights_BN.astype(jnp.float32)
  correct_BN = (jnp.argmax(logits_BNV, axis=-1) == targets_BN).astype(jnp.float32)
  return jnp.sum(ce_BN * weights_BN), jnp.sum(weights_BN), jnp.sum(correct_BN * weights_BN)


def diffusion_loss(params: Any, batch: dict[str, jax.Array], rng: jax.Array, *, model_cfg: ModelConfig,
                   loss_cfg: DiffusionLossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DiffusionGemma SFT/pretraining loss on packed rows `{tokens, segment_ids, positions}` [B, L].

  Returns (scalar loss, metrics). The canvas loss averages CE over every non-padding canvas token.
  """
  model = Transformer(model_cfg)
  ctx, canvas = split_context_canvas(batch, loss_cfg.canvas_len)
  batch_size, ctx_len = ctx["tokens"].shape
  rng_t, rng_noise, rng_sc = jax.random.split(rng, 3)
  t_B = jax.random.uniform(rng_t, (batch_size,), minval=loss_cfg.t_eps, maxval=1.0)
  noisy_BC, replaced_BC = corrupt_uniform(rng_noise, canvas["tokens"], t_B, model_cfg.vocab_size)

  # Encoder: causal pass over the clean context fills the KV cache (and gives next-token logits).
  cache = init_cache(model_cfg, batch_size, ctx_len, dtype=jnp.dtype(model_cfg.dtype))
  want_enc_logits = loss_cfg.encoder_loss_weight > 0
  enc_logits_BTV, cache = model.apply({"params": params}, ctx["tokens"], ctx["positions"], ctx["segment_ids"],
                                      cache, return_logits=want_enc_logits, method=Transformer.encode)

  def decode(sc_logits_BCV, sc_mask_B):
    return model.apply({"params": params}, noisy_BC, canvas["positions"], canvas["segment_ids"], cache,
                       sc_logits_BCV=sc_logits_BCV, sc_mask_B=sc_mask_B, method=Transformer.decode)

  # Self-conditioning training: a first pass without it; its logits (no gradient) feed the scored
  # second pass for each example with probability self_cond_prob (zeros otherwise).
  if model_cfg.self_conditioning and loss_cfg.self_cond_prob > 0:
    first_BCV = jax.lax.stop_gradient(decode(None, None))
    sc_mask_B = jax.random.uniform(rng_sc, (batch_size,)) < loss_cfg.self_cond_prob
    logits_BCV = decode(first_BCV, sc_mask_B)
  else:
    logits_BCV = decode(None, None)

  canvas_w_BC = canvas["segment_ids"] != 0
  ce_sum, n_canvas, correct = masked_cross_entropy(logits_BCV, canvas["tokens"], canvas_w_BC)
  canvas_loss = ce_sum / jnp.maximum(n_canvas, 1.0)
  metrics = {"canvas_loss": canvas_loss, "canvas_accuracy": correct / jnp.maximum(n_canvas, 1.0),
             "canvas_tokens": n_canvas,
             "corrupted_fraction": jnp.sum(replaced_BC * canvas_w_BC) / jnp.maximum(n_canvas, 1.0)}
  loss = canvas_loss
  if want_enc_logits:
    # Next-token targets inside a segment: position i predicts i+1 when both belong to the same document.
    seg_BT = ctx["segment_ids"]
    targets_BT = ctx["tokens"][:, 1:]
    w_BT = (seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, 1:] != 0)
    enc_sum, n_enc, _ = masked_cross_entropy(enc_logits_BTV[:, :-1], targets_BT, w_BT)
    encoder_loss = enc_sum / jnp.maximum(n_enc, 1.0)
    metrics["encoder_loss"] = encoder_loss
    loss = loss + loss_cfg.encoder_loss_weight * encoder_loss
  metrics["loss"] = loss
  return loss, metrics
