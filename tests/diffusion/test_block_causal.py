"""Block-causal multi-canvas training (diffusion.canvases_per_row = K > 1) against the obvious slow
reference: the single-canvas loss of each row cut after canvas k, one call per canvas.

The reference rows are the cut rows left-padded back to the full length (padding slots have segment 0
and are never attended), so every reference call shares one compiled program.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import tiny
from dgemma import diffusion
from dgemma.diffusion.config import DiffusionSettings
from dgemma.model import ModelConfig, Transformer, init_cache
from tests.model_utils import f64_config, float64, random_params, to_f64

B, L, C, K = 2, 40, 8, 3
P = L - K * C  # clean prefix before the first canvas
# Sliding window 12 < the row: sliding layers see only part of the context. No MoE (per-token, so
# irrelevant to the masks; saves compile time).
CFG = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), vocab_size=64, sliding_window=12,
                          num_experts=0)


def _batch():
  """Row 0: one document. Row 1: a document ends inside canvas 0 (position 20), the next one runs to
  37, then padding in the last canvas. loss_mask drops row 0's first 10 tokens (encoder targets) and
  2 tokens of its canvas 1."""
  g = np.random.default_rng(0)
  seg = np.ones((B, L), np.int32)
  seg[1, 20:] = 2
  seg[1, 37:] = 0
  pos = np.tile(np.arange(L), (B, 1))
  pos[1, 20:] -= 20
  pos = pos * (seg != 0)
  tokens = g.integers(5, CFG.vocab_size, (B, L)) * (seg != 0)
  loss_mask = (seg != 0).astype(np.int32)
  loss_mask[0, :10] = 0
  loss_mask[0, P + C + 3:P + C + 5] = 0
  return {"tokens": tokens.astype(np.int32), "segment_ids": seg, "positions": pos.astype(np.int32),
          "loss_mask": loss_mask}


def _cut_rows(batch):
  """[B * K, L]: row b * K + k = row b cut after canvas k, left-padded to L (PAD, segment 0)."""
  out = {key: np.zeros((B * K, L), np.int32) for key in batch}
  for b in range(B):
    for k in range(K):
      end = P + (k + 1) * C
      for key, v in batch.items():
        out[key][b * K + k, L - end:] = v[b, :end]
  return out


def _loss_cfg(k, self_cond_prob=0.5):
  return DiffusionSettings(canvas_len=C, self_cond_prob=self_cond_prob, canvases_per_row=k)


@functools.cache
def jitted_loss(k: int):
  """diffusion_loss of CFG with K = k canvases per row, (params, batch, rng, example_ids_B, totals);
  one compiled program per batch shape, shared with tests/data/test_sft.py."""
  return jax.jit(lambda p, b, r, ids, t: diffusion.diffusion_loss(p, b, r, model_cfg=CFG, loss_cfg=_loss_cfg(k),
                                                                   example_ids_B=ids, totals=t))


def test_one_forward_equals_a_loop_over_canvases():
  params = random_params(CFG)
  batch = _batch()
  cut = _cut_rows(batch)
  rng = jax.random.PRNGKey(3)
  many = _loss_cfg(K)
  totals = diffusion.batch_totals(batch, many)
  # Same scored tokens: the K canvases of each row are the last canvases of the cut rows.
  ref_totals = diffusion.batch_totals(cut, _loss_cfg(1))
  assert float(totals["canvas_tokens"]) == float(ref_totals["canvas_tokens"]) == K * C * B - 3 - 2
  _, m_many = jitted_loss(K)(params, batch, rng, jnp.arange(B, dtype=jnp.int32), totals)
  # Canvas k of row b draws its noise as example b * K + k: the cut row b * K + k.
  ref_totals = dict(totals, examples=jnp.float32(B * K))
  _, m_loop = jitted_loss(1)(params, cut, rng, jnp.arange(B * K, dtype=jnp.int32), ref_totals)
  for key in ("canvas_loss", "canvas_ce", "corrupted_fraction", "canvas_tokens"):
    np.testing.assert_allclose(m_many[key], m_loop[key], rtol=1e-4, err_msg=key)  # fp32 round-off
  assert float(m_many["corrupted_fraction"]) > 0.1
  # Both self-conditioning states occur among the B * K canvases (the check above covers both).
  keys = [jax.random.split(jax.random.fold_in(jax.random.split(rng)[0], i), 3)[2] for i in range(B * K)]
  sc = [bool(jax.random.uniform(k, ()) < 0.5) for k in keys]
  assert any(sc) and not all(sc), sc


def encoded_rows(cfg, params, batch):
  """(apply, cache of the clean row up to the last canvas, the K canvases' columns of `batch`): what the
  one-forward block-causal decoder reads."""
  model = Transformer(cfg)
  apply = lambda *a, **k: model.apply({"params": params}, *a, **k)
  ctx = {k: v[:, :L - C] for k, v in batch.items()}
  _, cache = apply(ctx["tokens"], ctx["positions"], ctx["segment_ids"], init_cache(cfg, B, L - C),
                   return_logits=False, method=Transformer.encode)
  return apply, cache, {k: v[:, P:] for k, v in batch.items()}


def _decode_both(params, batch, cut, noisy_BKC, sc_logits_BKCV, sc_mask_BK, cfg=CFG):
  """Per-canvas logits of the one-forward block-causal decoder and of the per-canvas loop."""
  apply, cache, can = encoded_rows(cfg, params, batch)
  many = apply(noisy_BKC.reshape(B, K * C), can["positions"], can["segment_ids"], cache,
               sc_logits_BCV=sc_logits_BKCV.reshape(B, K * C, -1),
               sc_mask_B=jnp.repeat(sc_mask_BK, C, axis=1), num_canvases=K, method=Transformer.decode)
  cctx = {k: v[:, :L - C] for k, v in cut.items()}
  ccan = {k: v[:, L - C:] for k, v in cut.items()}
  _, ccache = apply(cctx["tokens"], cctx["positions"], cctx["segment_ids"], init_cache(cfg, B * K, L - C),
                    return_logits=False, method=Transformer.encode)
  loop = apply(noisy_BKC.reshape(B * K, C), ccan["positions"], ccan["segment_ids"], ccache,
               sc_logits_BCV=sc_logits_BKCV.reshape(B * K, C, -1), sc_mask_B=sc_mask_BK.reshape(-1),
               method=Transformer.decode)
  return many.reshape(B, K, C, -1), loop.reshape(B, K, C, -1)


def test_per_canvas_logits_and_no_leak_between_canvases():
  # In float64 (tests/model_utils.py): one forward and the per-canvas loop have different shapes, so
  # different fp32 reduction orders (|logits| ~ 4, CPU-dependent round-off up to ~1e-4); in float64 they
  # agree to ~1e-13, so atol 1e-9 holds anywhere, while a mask error moves them by > 1e-2.
  with float64():
    _per_canvas_logits_and_no_leak_between_canvases()


def _per_canvas_logits_and_no_leak_between_canvases():
  params = to_f64(random_params(CFG))
  batch = _batch()
  g = np.random.default_rng(1)
  noisy = jnp.asarray(g.integers(0, CFG.vocab_size, (B, K, C)), jnp.int32)
  sc_logits = jnp.asarray(g.normal(0, 3, (B, K, C, CFG.vocab_size)), jnp.float64)
  sc_mask = jnp.asarray([[True, False, True], [False, True, True]])
  fn = jax.jit(functools.partial(_decode_both, cfg=f64_config(CFG)))
  many, loop = fn(params, batch, _cut_rows(batch), noisy, sc_logits, sc_mask)
  assert many.dtype == jnp.float64
  valid = (batch["segment_ids"][:, P:] != 0).reshape(B, K, C)
  np.testing.assert_allclose(np.asarray(many)[valid], np.asarray(loop)[valid], atol=1e-9, rtol=0)
  # Perturbing canvas 1's noisy tokens and self-conditioning input changes canvas 1 only.
  noisy2 = noisy.at[:, 1].set((noisy[:, 1] + 7) % CFG.vocab_size)
  sc2 = sc_logits.at[:, 1].multiply(-1.0)
  many2, _ = fn(params, batch, _cut_rows(batch), noisy2, sc2, sc_mask)
  many, many2 = np.asarray(many), np.asarray(many2)
  np.testing.assert_array_equal(many2[:, 0], many[:, 0])
  np.testing.assert_array_equal(many2[:, 2], many[:, 2])
  assert np.abs(many2[:, 1] - many[:, 1]).max() > 1e-2
  # The per-canvas sc mask is honoured: canvas 0 of row 1 has sc off, so its sc logits are ignored.
  sc3 = sc_logits.at[1, 0].multiply(-1.0)
  many3, _ = fn(params, batch, _cut_rows(batch), noisy, sc3, sc_mask)
  np.testing.assert_array_equal(np.asarray(many3), many)
  # A canvas depends on the clean earlier canvases (through the cache), never on its own clean tokens:
  # changing the clean tokens of canvas 0 changes canvases 1 and 2 only.
  clean2 = dict(batch, tokens=batch["tokens"].copy())
  clean2["tokens"][:, P:P + C] = (clean2["tokens"][:, P:P + C] + 5) % CFG.vocab_size
  many4, loop4 = fn(params, clean2, _cut_rows(clean2), noisy, sc_logits, sc_mask)
  many4 = np.asarray(many4)
  np.testing.assert_array_equal(many4[:, 0], many[:, 0])
  assert np.abs(many4[:, 1:] - many[:, 1:]).max() > 1e-2
  np.testing.assert_allclose(many4[valid], np.asarray(loop4)[valid], atol=1e-9, rtol=0)
