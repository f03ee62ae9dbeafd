"""Grouped-query attention over a fixed-size KV cache, and the encoder / decoder masks.

Mask semantics (built once per forward by `encoder_masks` / `decoder_masks`, shared by every layer
of a kind). A query may attend a key only if both carry the same non-zero segment id (0 = padding
or empty slot), plus:

Encoder (causal, HF `create_causal_mask` / `create_sliding_window_causal_mask`):
  global:  k_slot <= q_slot                          (`causal_mask_function`: kv_idx <= q_idx)
  sliding: k_slot <= q_slot and q_pos - k_pos < W    (`sliding_window_overlay`: kv_idx > q_idx - W)
  i.e. a sliding query sees W keys including itself. HF indexes by cache slot; we use the per-row
  positions so left-padded prompts keep the same window (identical when positions == slots, as in
  HF `generate`). `use_bidirectional_attention == 'all'` (which halves the window and switches to
  `abs(q - k) <= W`) is not used by DiffusionGemma's causal encoder, so it does not apply.

Decoder (HF `DiffusionGemmaDecoderModel`): `create_diffusion_decoder_attention_mask` uses
  `bidirectional_mask_function` for BOTH layer kinds (the window is passed only as `local_size`, which
  merely decides whether the mask may be skipped), so no window is applied inside the canvas:
  canvas -> canvas: always (bidirectional).
  canvas -> cache, global:  every valid slot (slot < cache.length).
  canvas -> cache, sliding: only what HF's `DynamicSlidingWindowLayer` keeps, i.e. the last W - 1 context
    tokens (`cache_utils.py`: `self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]`). With the
    canvas starting right after the context (HF `decoder_position_ids = arange(cur_len, ...)`), that is
    `anchor - k_pos < W` where `anchor` = the first (smallest) canvas position of the query's segment:
    the same window the encoder would give a token at the canvas start, for every canvas query alike
    (not a per-query window). HF's StaticCache keeps W tokens instead of W - 1; we follow the default
    DynamicCache, which `DiffusionGemmaForBlockDiffusion.forward` and `generate` use.
Block-causal decoder (training with `diffusion.canvases_per_row` = K > 1): the decoder input is K
  canvases of C tokens laid end to end, and the cache holds the clean row up to the start of the last
  canvas, so canvas k (0-based) starts at cache slot `length - (K - 1 - k) * C`. A query in canvas k
  attends bidirectionally inside canvas k only, and to cache slots before canvas k's start (the clean
  text preceding it, including the clean versions of canvases 0..k-1); its sliding anchor is the first
  position of its segment inside canvas k. So each canvas sees exactly what the single-canvas decoder
  would see with the row cut after it; noisy tokens of other canvases are never keys (K = 1 is the
  single-canvas decoder above).
A query with no allowed key outputs zeros (finite; its row is padding anyway).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dgemma.model.config import GLOBAL, ModelConfig
from dgemma.model import layers
from dgemma.model import lora as lora_lib
from dgemma.model import moe_kernels
from dgemma.model.sharding import constrain

# Masked logits: finite in fp32 (so in float64 too), and exp(_NEG - max) == 0 in either.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _same_segment(seg_q_BT: jax.Array, seg_k_BS: jax.Array) -> jax.Array:
  return (seg_q_BT[:, :, None] == seg_k_BS[:, None, :]) & (seg_q_BT[:, :, None] != 0)


def encoder_masks(cfg: ModelConfig, positions_BT, segment_ids_BT, positions_BS, segment_ids_BS, start):
  """(sliding_BTS, global_BTS) masks for T new tokens written at cache slots [start, start + T).

  `positions_BS` / `segment_ids_BS` are the cache's, already updated with the new tokens.
  """
  T, S = positions_BT.shape[1], positions_BS.shape[1]
  q_slot_T = start + jnp.arange(T, dtype=jnp.int32)
  k_slot_S = jnp.arange(S, dtype=jnp.int32)
  causal_TS = k_slot_S[None, :] <= q_slot_T[:, None]
  glob_BTS = _same_segment(segment_ids_BT, segment_ids_BS) & causal_TS[None]
  window_BTS = (positions_BT[:, :, None] - positions_BS[:, None, :]) < cfg.sliding_window
  return glob_BTS & window_BTS, glob_BTS


def decoder_masks(cfg: ModelConfig, positions_BC, segment_ids_BC, positions_BS, segment_ids_BS, length,
                  num_canvases: int = 1, per_query_window: bool = False):
  """(sliding, global) masks [B, C, S + C]: keys are the S cache slots followed by the C canvas tokens.

  num_canvases K > 1: the C decoder tokens are K canvases of C // K, each reading the cache only up to
  its own start (block-causal; module docstring).
  Sliding layers read the context keys at positions p with anchor - p < W, anchor = the first canvas
  position (HF's dynamic sliding cache keeps the last W - 1 context positions for the whole canvas); with
  `per_query_window` (the official JAX sampler, sample.semantics='official') q - p < W per query instead,
  so canvas token i reads W - 1 - i of them.
  """
  S, C = positions_BS.shape[1], positions_BC.shape[1]
  if C % num_canvases:
    raise ValueError(f"decoder_masks: {C} canvas tokens do not split into {num_canvases} canvases")
  same_CC = segment_ids_BC[:, :, None] == segment_ids_BC[:, None, :]
  canvas_BCC = _same_segment(segment_ids_BC, segment_ids_BC)
  if num_canvases == 1:
    written_CS = (jnp.arange(S, dtype=jnp.int32) < length)[None, :]
  else:
    block_C = jnp.arange(C, dtype=jnp.int32) // (C // num_canvases)
    # Canvas k reads cache slots before its own start: length - (K - 1 - k) * (C // K).
    limit_C = length - (num_canvases - 1 - block_C) * (C // num_canvases)
    written_CS = jnp.arange(S, dtype=jnp.int32)[None, :] < limit_C[:, None]
    same_block_CC = (block_C[:, None] == block_C[None, :])[None]
    same_CC, canvas_BCC = same_CC & same_block_CC, canvas_BCC & same_block_CC
  cache_BCS = _same_segment(segment_ids_BC, segment_ids_BS) & written_CS[None]
  if per_query_window:
    anchor_BC = positions_BC
  else:  # first canvas position of each query's segment (in its canvas; the HF sliding cache is cut there)
    big = jnp.iinfo(jnp.int32).max
    anchor_BC = jnp.min(jnp.where(same_CC, positions_BC[:, None, :], big), axis=-1)
  window_BCS = (anchor_BC[:, :, None] - positions_BS[:, None, :]) < cfg.sliding_window
  glob = jnp.concatenate([cache_BCS, canvas_BCC], axis=-1)
  slide = jnp.concatenate([cache_BCS & window_BCS, canvas_BCC], axis=-1)
  return slide, glob


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, dtype) -> jax.Array:
  """softmax(q k^T) v with scale 1.0 (HF `self.scaling = 1.0`), GQA, fp32 softmax.

  The scores are laid out batch-first, [B, K, G*T, S], with the keys and values moved to [B, K, S, H] (a
  copy of the small operands): both dots and their gradients are then plain batched matmuls. With the
  scores as [B, K, G, T, S] against keys as [B, S, K, H], XLA CPU ran the probs-times-values dot alone at
  1/5.7 of this layout's rate and copied the probs transposed for the backward (docs/benchmarks.md,
  "Training"); the numbers are the same up to the dots' summation order.
  """
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K  # HF repeat_kv: query head n uses kv head n // G
  q_BKQH = jnp.transpose(q_BTNH.reshape(B, T, K, G, H), (0, 2, 3, 1, 4)).reshape(B, K, G * T, H)
  k_BKSH = jnp.transpose(k_BSKH, (0, 2, 1, 3))
  v_BKSH = jnp.transpose(v_BSKH, (0, 2, 1, 3)).astype(dtype)
  logits_BKGTS = jnp.einsum("bkqh,bksh->bkqs", q_BKQH, k_BKSH,
                            preferred_element_type=layers.at_least_f32(jnp.result_type(q_BTNH, k_BSKH))
                            ).reshape(B, K, G, T, S)
  m = mask_BTS[:, None, None, :, :]
  probs = jax.nn.softmax(jnp.where(m, logits_BKGTS, _NEG), axis=-1)
  probs = jnp.where(m, probs, 0.0)  # rows without any allowed key -> zeros, not uniform / NaN
  out_BKQH = jnp.einsum("bkqs,bksh->bkqh", probs.reshape(B, K, G * T, S).astype(dtype), v_BKSH)
  return jnp.transpose(out_BKQH.reshape(B, K, G, T, -1), (0, 3, 1, 2, 4)).reshape(B, T, N, -1)


# 'auto' per backend. No backend has a measured win for tokamax yet: on CPU its XLA implementation is the same
# arithmetic as `attend` with the scores as [B, T, N, S] (no faster); on GPU the prompt encode with each is
# measured by bench/gpu_full_model.py (issue #17 item 4), not yet run. Until a figure says otherwise, 'xla'.
_AUTO_IMPL = {"cpu": "xla", "gpu": "xla", "tpu": "xla"}


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """`cfg.attention_impl` with 'auto' replaced by the choice for `backend` (default: JAX's default backend,
  read at trace time; `_AUTO_IMPL` says why each)."""
  if impl != "auto":
    return impl
  return _AUTO_IMPL.get(backend or jax.default_backend(), "xla")


def attend_tokamax(q_BTNH, k_BSKH, v_BSKH, mask_BTS, dtype, implementation=None) -> jax.Array:
  """`attend` on `tokamax.dot_product_attention` (GQA, scale 1.0, the same boolean mask): a flash-attention
  kernel on GPU (Mosaic on sm90/sm100, else Triton) and TPU, which never materialises the [T, S] scores;
  tokamax's XLA implementation on CPU. A query row with no allowed key gives zeros, as `attend` does (the
  kernels would average the values). implementation None: 'xla' on CPU, tokamax's own order elsewhere.
  Imports tokamax on first use (about 1 s), as dgemma.model.moe_kernels does."""
  import tokamax  # pylint: disable=g-import-not-at-top
  moe_kernels.absl_flags_parsed()
  out_BTNH = tokamax.dot_product_attention(q_BTNH.astype(dtype), k_BSKH.astype(dtype), v_BSKH.astype(dtype),
                                           mask=mask_BTS[:, None], scale=1.0,
                                           implementation=moe_kernels.default_implementation(implementation))
  return jnp.where(jnp.any(mask_BTS, axis=-1)[:, :, None, None], out_BTNH, 0).astype(dtype)


class Attention(nn.Module):
  """HF `DiffusionGemma{Encoder,Decoder}TextAttention` for one layer kind.

  q = rope(q_norm(q_proj x)); k = rope(k_norm(k_proj x)); v = v_norm(v_proj x), or v = v_norm(raw k
  projection) on global layers with `global_k_eq_v` (no v_proj). Keys are cached post-norm post-RoPE.
  Encode (decode=False) attends with `cfg.attention_impl` (`resolve_impl`), decode always with `attend`.
  Encode writes the new k/v into the cache at `write_index` and attends over the whole
  cache (a ring cache's sliding layer, `ring_slots_BT` given: attends over [ring; new tokens], then writes
  the new tokens at their ring slots); decode attends over [cache; canvas] and leaves the cache untouched.
  """

  cfg: ModelConfig
  kind: str
  lora_active: bool = True  # LoRA (target 'attn') on q/k/v/o_proj, added only when active

  @nn.compact
  def __call__(self, x_BTD, positions_BT, cache_kv, mask_BTS, write_index, decode: bool, ring_slots_BT=None):
    cfg = self.cfg
    dtype, pdtype = layers.compute_dtype(cfg), layers.param_dtype(cfg)
    D, N = cfg.d_model, cfg.num_heads
    K, H = layers.attn_dims(cfg, self.kind)
    kw = dict(dtype=dtype, param_dtype=pdtype, lora=lora_lib.for_target(cfg.lora, "attn"),
              lora_active=self.lora_active)
    q_BTNH = layers.Einsum((D, N, H), "btd,dnh->btnh", ("embed", "heads", "head_dim"), name="q_proj", **kw)(x_BTD)
    k_raw = layers.Einsum((D, K, H), "btd,dkh->btkh", ("embed", "kv_heads", "head_dim"), name="k_proj", **kw)(x_BTD)
    if self.kind == GLOBAL and cfg.global_k_eq_v:
      v_raw = k_raw
    else:
      v_raw = layers.Einsum((D, K, H), "btd,dkh->btkh", ("embed", "kv_heads", "head_dim"), name="v_proj",
                            **kw)(x_BTD)
    inv_freq = layers.rope_inv_freq(cfg, self.kind)
    q_BTNH = layers.apply_rope(layers.RMSNorm(cfg.rms_eps, param_dtype=pdtype, name="q_norm")(q_BTNH),
                               positions_BT, inv_freq)
    k_BTKH = layers.apply_rope(layers.RMSNorm(cfg.rms_eps, param_dtype=pdtype, name="k_norm")(k_raw),
                               positions_BT, inv_freq)
    v_BTKH = layers.rms_norm(v_raw, cfg.rms_eps).astype(dtype)  # v_norm: no scale

    cache_k, cache_v = cache_kv
    if decode:
      keys = jnp.concatenate([cache_k.astype(dtype), k_BTKH], axis=1)
      values = jnp.concatenate([cache_v.astype(dtype), v_BTKH], axis=1)
      new_kv = None
    elif ring_slots_BT is not None:  # a sliding layer's ring (transformer.KVCache): attend, then write
      keys = jnp.concatenate([cache_k.astype(dtype), k_BTKH], axis=1)
      values = jnp.concatenate([cache_v.astype(dtype), v_BTKH], axis=1)
      rows_B1 = jnp.arange(cache_k.shape[0])[:, None]
      new_kv = (cache_k.at[rows_B1, ring_slots_BT].set(k_BTKH.astype(cache_k.dtype), mode="drop"),
                cache_v.at[rows_B1, ring_slots_BT].set(v_BTKH.astype(cache_v.dtype), mode="drop"))
    else:
      zero = write_index.dtype.type(0)  # indices of one integer type (a Python 0 is int64 under x64)
      idx = (zero, write_index, zero, zero)
      cache_k = jax.lax.dynamic_update_slice(cache_k, k_BTKH.astype(cache_k.dtype), idx)
      cache_v = jax.lax.dynamic_update_slice(cache_v, v_BTKH.astype(cache_v.dtype), idx)
      keys, values, new_kv = cache_k.astype(dtype), cache_v.astype(dtype), (cache_k, cache_v)

    q_BTNH = constrain(q_BTNH, ("batch", "act_length", "act_heads", "head_dim"))
    attend_fn = attend_tokamax if not decode and resolve_impl(cfg.attention_impl) == "tokamax" else attend
    out_BTNH = constrain(attend_fn(q_BTNH, keys, values, mask_BTS, dtype),
                         ("batch", "act_length", "act_heads", "head_dim"))
    out_BTD = layers.Einsum((N, H, D), "btnh,nhd->btd", ("heads", "head_dim", "embed"), name="o_proj",
                            **kw)(out_BTNH)
    return out_BTD, new_kv
