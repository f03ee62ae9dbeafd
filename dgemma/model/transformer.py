"""The DiffusionGemma trunk: one parameter tree used as causal encoder and bidirectional decoder.

Numerical reference: Hugging Face `transformers` 5.24 `DiffusionGemmaForBlockDiffusion`.

Usage:
  model = Transformer(cfg)
  cache = init_cache(cfg, batch_size, max_len)
  enc_logits_BTV, cache = model.apply({'params': p}, tokens_BT, positions_BT, segment_ids_BT, cache,
                                      method=Transformer.encode)
  logits_BCV = model.apply({'params': p}, canvas_BC, positions_BC, segment_ids_BC, cache,
                           sc_logits_BCV=None, sc_mask_B=None, method=Transformer.decode)
  variables = model.init(rng, tokens_BT, positions_BT, segment_ids_BT, canvas_BC, positions_BC,
                         segment_ids_BC)
`init` returns parameters boxed in `nn.LogicallyPartitioned` (logical axis names below); use
`nn.unbox(variables)` / `nn.get_partition_spec(variables)`. `apply` accepts boxed or plain arrays.

Parameter tree (logical axes in parentheses; every `blocks` leaf has a leading 'layers' axis of size
cfg.num_blocks; HF layer index = b * cfg.block_period + i):
  embedder/embedding [V, D] ('vocab', 'embed')            tied input / output table
  final_norm/scale [D] ('norm',)
  self_conditioning/pre_norm/scale [D] ('norm',)          (only if cfg.self_conditioning)
  self_conditioning/{gate_proj,up_proj}/kernel [D, F] ('embed', 'mlp'); down_proj/kernel [F, D] ('mlp', 'embed')
  (the research options add their own: dgemma/model/decoder_variants.py; none in the released model)
  blocks/layer_{i}/
    pre_attn_norm/scale, post_attn_norm/scale [D] ('norm',)
    attn/q_proj/kernel [D, N, H] ('embed', 'heads', 'head_dim')
    attn/k_proj/kernel [D, K, H] ('embed', 'kv_heads', 'head_dim')
    attn/v_proj/kernel [D, K, H] ('embed', 'kv_heads', 'head_dim')   (absent on global layers if global_k_eq_v)
    attn/o_proj/kernel [N, H, D] ('heads', 'head_dim', 'embed')
    attn/q_norm/scale, attn/k_norm/scale [H] ('norm',)
    mlp_pre_norm/scale, mlp_post_norm/scale [D] ('norm',)
    mlp/{gate_proj,up_proj}/kernel [D, F] ('embed', 'mlp'); mlp/down_proj/kernel [F, D] ('mlp', 'embed')
    moe_pre_norm/scale, moe_post_norm/scale [D] ('norm',)             (moe_* only if num_experts > 0)
    moe/router/proj/kernel [D, E] ('embed', 'expert'); moe/router/scale [D] ('norm',)
    moe/router/per_expert_scale [E] ('expert',)
    moe/experts/{gate_proj,up_proj} [E, D, Fe] ('expert', 'embed', 'expert_mlp')
    moe/experts/down_proj [E, Fe, D] ('expert', 'expert_mlp', 'embed')
    ffw_post_norm/scale [D] ('norm',)
    layer_scalar [1] ('norm',)
  With cfg.lora (LoRA fine-tuning, dgemma/model/lora.py): lora_a [in..., r] / lora_b [r, out...] next to
  each adapted kernel, and experts/{gate,up,down}_proj_lora_{a,b} [E, ...] (one pair per expert).
  (H, K = head_dim, num_kv_heads on sliding layers; global_head_dim, global_num_kv_heads on global.)
HF name map: pre_attn_norm=input_layernorm, post_attn_norm=post_attention_layernorm,
mlp_pre_norm=pre_feedforward_layernorm, mlp_post_norm=post_feedforward_layernorm_1,
moe_pre_norm=pre_feedforward_layernorm_2, moe_post_norm=post_feedforward_layernorm_2,
ffw_post_norm=post_feedforward_layernorm.

MoE auxiliary losses: when cfg.router_aux_loss_weight or cfg.router_z_loss_weight is non-zero, every
`encode` / `decode` call sows into the 'intermediates' collection (apply with mutable=['intermediates']):
  'router_aux_loss': weight * mean over layers of the Switch load-balancing loss,
  'router_z_loss':   weight * mean over layers of the router z-loss,
both already weighted and computed over tokens with segment id != 0; `__call__` sows once per pass, so
the total to add to the objective is `sum(jax.tree.leaves(intermediates))`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from dgemma.model.attention import Attention, decoder_masks, encoder_masks
from dgemma.model.config import GLOBAL, ModelConfig
from dgemma.model import layers
from dgemma.model import lora as lora_lib
from dgemma.model import decoder_variants, qarray
from dgemma.model.moe import MoE
from dgemma.model.sharding import constrain, place, unbox

# Logical axes of the residual stream and the logits (mesh.axis_rules; no-ops without a mesh context).
RESIDUAL_AXES = ("batch", "act_length", "act_embed")
LOGITS_AXES = ("batch", "act_length", "act_vocab")


@struct.dataclass
class KVCache:
  """Fixed-size KV cache shared by encode (writes) and decode (reads).

  k, v: one array per layer slot of the repeating block, [num_blocks, B, S, K_i, H_i]; keys post-k_norm
    post-RoPE, values post-v_norm.
  positions_BS, segment_ids_BS: int32 per slot; segment 0 = empty / padding.
  length: int32 scalar, slots written so far (the next encode writes at [length, length + T)).
  ring_positions_BR, ring_segment_ids_BR: set for a ring cache (`init_cache(..., sliding_ring=True)`):
    sliding layers then keep only R = min(W, S) slots, [num_blocks, B, R, K, H], and a token at position
    p is kept at ring slot p mod R (padding is never written). A sliding query reads only the W positions
    up to its own (decode: the W - 1 before the canvas), and a row's valid positions are consecutive
    (0, 1, ... through its prompt and committed canvases), so those W positions sit in W distinct ring
    slots that no later token of the row has overwritten yet: the ring holds every key the window allows,
    and attention over it equals attention over the full cache. For inference (one segment per row);
    training's packed rows and block-causal decoding use the full cache.
  """

  k: tuple
  v: tuple
  positions_BS: jax.Array
  segment_ids_BS: jax.Array
  length: jax.Array
  ring_positions_BR: Optional[jax.Array] = None
  ring_segment_ids_BR: Optional[jax.Array] = None

  @property
  def max_len(self) -> int:
    return self.positions_BS.shape[1]

  @property
  def ring(self) -> bool:
    return self.ring_positions_BR is not None


def ring_len(cfg: ModelConfig, max_len: int) -> int:
  """Slots a sliding layer keeps in a ring cache of `max_len` positions: min(W, max_len)."""
  return min(int(cfg.sliding_window), int(max_len))


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None, sliding_ring: bool = False) -> KVCache:
  """An empty cache: all slots invalid (segment 0), length 0. Default dtype: fp32 (float64 for a
  float64 model). sliding_ring: sliding layers keep a ring of min(W, max_len) slots (KVCache docstring)."""
  dtype = layers.at_least_f32(layers.compute_dtype(cfg)) if dtype is None else dtype
  R = ring_len(cfg, max_len)
  ks, vs = [], []
  for i in range(cfg.block_period):
    K, H = layers.attn_dims(cfg, cfg.layer_types[i])
    slots = R if sliding_ring and cfg.layer_types[i] != GLOBAL else max_len
    shape = (cfg.num_blocks, batch_size, slots, K, H)
    ks.append(jnp.zeros(shape, dtype))
    vs.append(jnp.zeros(shape, dtype))
  zeros_BS = jnp.zeros((batch_size, max_len), jnp.int32)
  ring = dict(ring_positions_BR=jnp.zeros((batch_size, R), jnp.int32),
              ring_segment_ids_BR=jnp.zeros((batch_size, R), jnp.int32)) if sliding_ring else {}
  return KVCache(k=tuple(ks), v=tuple(vs), positions_BS=zeros_BS, segment_ids_BS=zeros_BS,
                 length=jnp.zeros((), jnp.int32), **ring)


@struct.dataclass
class _Ctx:
  """Loop-invariant inputs of every block (broadcast through the scan)."""

  positions_BT: jax.Array
  mask_sliding: jax.Array
  mask_global: jax.Array
  write_index: jax.Array
  valid_BT: jax.Array
  decode: bool = struct.field(pytree_node=False, default=False)
  ring_slots_BT: Optional[jax.Array] = None  # encode into a ring cache: each new token's ring slot (R = dropped)


def ring_encode(cfg: ModelConfig, positions_BT, segment_ids_BT, cache: KVCache):
  """Encoding T new tokens into a ring cache: (sliding mask [B, T, R + T] over [ring; new tokens], each new
  token's ring slot [B, T], the updated ring positions / segment ids).

  Keys are the ring as it was (every earlier token still inside a window) followed by the new tokens
  (causal among themselves), with the encoder's rules: same segment, q_pos - k_pos < W, and no key after
  the query. A valid token goes to slot p mod R; when the chunk holds more than R of a row's positions,
  only its last R are written (the others could never be read again), so a row's slots are distinct."""
  R = cache.ring_positions_BR.shape[1]
  T = positions_BT.shape[1]
  valid_BT = segment_ids_BT != 0
  last_B = jnp.max(jnp.where(valid_BT, positions_BT, -1), axis=1)
  keep_BT = valid_BT & (positions_BT > (last_B - R)[:, None])
  ring_slots_BT = jnp.where(keep_BT, positions_BT % R, R).astype(jnp.int32)
  keys_pos_BK = jnp.concatenate([cache.ring_positions_BR, positions_BT], axis=1)
  keys_seg_BK = jnp.concatenate([cache.ring_segment_ids_BR, segment_ids_BT], axis=1)
  in_ring_K = jnp.arange(R + T) < R
  causal_TK = in_ring_K[None, :] | (jnp.arange(R + T)[None, :] - R <= jnp.arange(T)[:, None])
  seg_BTK = (segment_ids_BT[:, :, None] == keys_seg_BK[:, None, :]) & valid_BT[:, :, None]
  delta_BTK = positions_BT[:, :, None] - keys_pos_BK[:, None, :]
  slide_BTK = seg_BTK & causal_TK[None] & (delta_BTK >= 0) & (delta_BTK < cfg.sliding_window)
  rows_B1 = jnp.arange(positions_BT.shape[0])[:, None]
  ring = dict(ring_positions_BR=cache.ring_positions_BR.at[rows_B1, ring_slots_BT].set(positions_BT, mode="drop"),
              ring_segment_ids_BR=cache.ring_segment_ids_BR.at[rows_B1, ring_slots_BT].set(segment_ids_BT, mode="drop"))
  return slide_BTK, ring_slots_BT, ring


class Layer(nn.Module):
  """HF `DiffusionGemma{Encoder,Decoder}TextLayer`:

    x = x + post_attn_norm(attn(pre_attn_norm(x)))
    m = mlp_post_norm(mlp(mlp_pre_norm(x))) + moe_post_norm(experts(moe_pre_norm(x); router(x)))
    x = (x + ffw_post_norm(m)) * layer_scalar
  """

  cfg: ModelConfig
  kind: str

  @nn.compact
  def __call__(self, x_BTD, kv, ctx: _Ctx):
    cfg = self.cfg
    dtype, pdtype = layers.compute_dtype(cfg), layers.param_dtype(cfg)

    def norm(name):
      return layers.RMSNorm(cfg.rms_eps, param_dtype=pdtype, name=name)

    # LoRA adapters (cfg.lora) act in both modes, or only in decoder mode (head_only fine-tuning).
    lora_active = cfg.lora is not None and (ctx.decode or not cfg.lora.decoder_only)
    mask = ctx.mask_global if self.kind == GLOBAL else ctx.mask_sliding
    ring_slots = None if self.kind == GLOBAL else ctx.ring_slots_BT
    a_BTD, new_kv = Attention(cfg, self.kind, lora_active, name="attn")(
        norm("pre_attn_norm")(x_BTD), ctx.positions_BT, kv, mask, ctx.write_index, ctx.decode, ring_slots)
    x_BTD = x_BTD + norm("post_attn_norm")(a_BTD)

    m_BTD = layers.GeGLU(cfg.d_model, cfg.mlp_hidden, dtype=dtype, param_dtype=pdtype,
                         lora=lora_lib.for_target(cfg.lora, "mlp"), lora_active=lora_active, name="mlp")(
        norm("mlp_pre_norm")(x_BTD))
    m_BTD = norm("mlp_post_norm")(m_BTD)
    aux = {}
    if cfg.num_experts:
      e_BTD, aux = MoE(cfg, lora_active, name="moe")(x_BTD, norm("moe_pre_norm")(x_BTD), ctx.valid_BT)
      m_BTD = m_BTD + norm("moe_post_norm")(e_BTD)
    x_BTD = x_BTD + norm("ffw_post_norm")(m_BTD)
    scalar = self.param("layer_scalar", layers.ones_init(("norm",)), (1,), pdtype)
    return constrain(x_BTD * scalar.astype(x_BTD.dtype), RESIDUAL_AXES), new_kv, aux


class Block(nn.Module):
  """One period of the layer pattern (`cfg.block_period` layers named layer_{i}); scanned over blocks."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, kv, ctx: _Ctx):
    ks, vs = kv
    new_ks, new_vs, auxes = [], [], []
    # With model.remat each layer is rematerialised on its own: the backward pass recomputes one layer at a time,
    # so one layer's dequantized weights are live at once, not the block's (the scan over blocks keeps each
    # layer's input: [B, T, D] a layer). Packed int4 weights (dgemma/model/qarray.py PackedInt4) are unpacked
    # where a layer reads them (qarray.with_shape_leaf: flax checks a stored weight's shape by its first leaf).
    layer = nn.map_variables(Layer, "params", trans_in_fn=qarray.with_shape_leaf, init=True)
    if self.cfg.remat != "none":
      layer = nn.remat(layer, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
    for i in range(self.cfg.block_period):
      x_BTD, new_kv, aux = layer(self.cfg, self.cfg.layer_types[i], name=f"layer_{i}")(
          x_BTD, (ks[i], vs[i]), ctx)
      if new_kv is not None:
        new_ks.append(new_kv[0])
        new_vs.append(new_kv[1])
      auxes.append(aux)
    aux = jax.tree.map(lambda *a: sum(a), *auxes) if auxes and auxes[0] else {}
    out_kv = () if ctx.decode else (tuple(new_ks), tuple(new_vs))
    return x_BTD, (out_kv, aux)


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def tied_logits(x_BTD, table_VD):
  """x @ table^T ("btd,vd->btv") as `layers.matmul_last(x, table^T)`: its backward forms the [D, V] gradient
  as x^T g (D < V) and transposes that, so XLA CPU transposes x and the [D, V] result rather than the
  [B*T, V] logits gradient (docs/benchmarks.md, "Training")."""
  return layers.matmul_last(x_BTD, table_VD.T)


class Embedder(nn.Module):
  """Tied token table [V, D]: inputs scaled by sqrt(D) cast to the table dtype (HF
  `DiffusionGemmaTextScaledWordEmbedding`); logits = x @ table^T. The table may be a `qarray.QArray`: rows
  dequantized on lookup, and a chunk of rows at a time for the logits and the soft embeddings (`qarray.table_logits`,
  `qarray.table_mix`), so its dequantized copy never exists whole."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embedding = self.param("embedding", layers.matrix_init(("vocab", "embed")),
                                (cfg.vocab_size, cfg.d_model), layers.param_dtype(cfg))

  def _scale(self):
    return jnp.asarray(math.sqrt(self.cfg.d_model), self.embedding.dtype)

  def encode(self, tokens_BT):
    return (qarray.take_rows(self.embedding, tokens_BT) * self._scale()).astype(layers.compute_dtype(self.cfg))

  def soft_encode(self, probs_BTV):
    """probs @ table * sqrt(D) (HF decoder self-conditioning soft embeddings)."""
    dtype = layers.compute_dtype(self.cfg)
    if qarray.is_quantized(self.embedding):  # a quantized table is read a chunk of rows at a time
      soft = qarray.table_mix(probs_BTV.astype(dtype), self.embedding)
    else:
      soft = jnp.einsum("btv,vd->btd", probs_BTV.astype(dtype), self.embedding.astype(dtype))
    return soft * self._scale().astype(dtype)

  def attend(self, x_BTD):
    dtype = layers.compute_dtype(self.cfg)
    if qarray.is_quantized(self.embedding):
      return qarray.table_logits(x_BTD.astype(dtype), self.embedding)
    return tied_logits(x_BTD.astype(dtype), self.embedding.astype(dtype))


class SelfConditioning(nn.Module):
  """HF `DiffusionGemmaSelfConditioning`: post_norm_noscale(e + GeGLU(pre_norm(soft)))."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, e_BTD, soft_BTD):
    cfg = self.cfg
    dtype, pdtype = layers.compute_dtype(cfg), layers.param_dtype(cfg)
    normed = layers.RMSNorm(cfg.rms_eps, param_dtype=pdtype, name="pre_norm")(soft_BTD)
    # The projections sit directly under self_conditioning/ (contract), so the GeGLU is inlined.
    D, F = cfg.d_model, cfg.mlp_hidden
    # LoRA (target 'self_conditioning'); the module runs only in decoder mode, so always active.
    kw = dict(dtype=dtype, param_dtype=pdtype, lora=lora_lib.for_target(cfg.lora, "self_conditioning"))
    gate = layers.Einsum((D, F), "...d,df->...f", ("embed", "mlp"), name="gate_proj", **kw)(normed)
    up = layers.Einsum((D, F), "...d,df->...f", ("embed", "mlp"), name="up_proj", **kw)(normed)
    sc = layers.Einsum((F, D), "...f,fd->...d", ("mlp", "embed"), name="down_proj", **kw)(layers.gelu(gate) * up)
    return layers.RMSNorm(cfg.rms_eps, with_scale=False, name="post_norm")(e_BTD + sc)


class Transformer(nn.Module):
  """DiffusionGemma trunk; see the module docstring for the API, parameter tree and masks
  (dgemma/model/attention.py)."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embedder = Embedder(cfg)
    self.final_norm = layers.RMSNorm(cfg.rms_eps, param_dtype=layers.param_dtype(cfg))
    if cfg.self_conditioning:
      self.self_conditioning = SelfConditioning(cfg)
    decoder_variants.setup(self, Layer)  # the research options' parameters (none for the released model)
    self.blocks = nn.scan(  # each layer rematerialised inside the block (Block)
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        out_axes=0,
        length=cfg.num_blocks,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg)

  # ---- helpers --------------------------------------------------------------------------------
  def _logits(self, x_BTD):
    return self.readout(self.final_norm(x_BTD))

  def readout(self, normed_BTD):
    """Tied vocabulary logits of normed hidden states, in at least fp32, softcapped."""
    logits = self.embedder.attend(normed_BTD)
    logits = constrain(logits.astype(layers.at_least_f32(logits.dtype)), LOGITS_AXES)
    c = self.cfg.final_logit_softcap
    return c * jnp.tanh(logits / c) if c else logits

  def sow_aux(self, aux):
    if not aux:
      return
    cfg = self.cfg
    for name, w in (("router_aux_loss", cfg.router_aux_loss_weight),
                    ("router_z_loss", cfg.router_z_loss_weight)):
      if w:
        self.sow("intermediates", name, w * jnp.sum(aux[name]) / cfg.num_layers)

  # ---- modes ----------------------------------------------------------------------------------
  def encode(self, tokens_BT, positions_BT, segment_ids_BT, cache: KVCache, return_logits: bool = True):
    """Causal pass over T new tokens appended to `cache` at slots [cache.length, cache.length + T).

    The caller must leave room (length + T <= max_len). Returns (logits_BTV or None, new cache).
    """
    cfg = self.cfg
    positions_BT = positions_BT.astype(jnp.int32)
    segment_ids_BT = segment_ids_BT.astype(jnp.int32)
    start = cache.length
    zero = start.dtype.type(0)  # indices of one integer type (a Python 0 is int64 under x64)
    pos_BS = jax.lax.dynamic_update_slice(cache.positions_BS, positions_BT, (zero, start))
    seg_BS = jax.lax.dynamic_update_slice(cache.segment_ids_BS, segment_ids_BT, (zero, start))
    slide, glob = encoder_masks(cfg, positions_BT, segment_ids_BT, pos_BS, seg_BS, start)
    ring, ring_slots_BT = {}, None
    if cache.ring:
      slide, ring_slots_BT, ring = ring_encode(cfg, positions_BT, segment_ids_BT, cache)
    ctx = _Ctx(positions_BT, slide, glob, start, segment_ids_BT != 0, decode=False, ring_slots_BT=ring_slots_BT)
    x_BTD = constrain(self.embedder.encode(tokens_BT), RESIDUAL_AXES)
    # No-op unless a 'perturbations' collection is passed: lets tests take d(output)/d(input embedding).
    x_BTD = self.perturb("encoder_inputs", x_BTD)
    x_BTD, ((ks, vs), aux) = self.blocks(x_BTD, (cache.k, cache.v), ctx)
    self.sow_aux(aux)
    new_cache = KVCache(k=ks, v=vs, positions_BS=pos_BS, segment_ids_BS=seg_BS,
                        length=start + tokens_BT.shape[1], **ring)
    return (self._logits(x_BTD) if return_logits else None), new_cache

  def self_conditioning_embedding(self, logits_BCV):
    """The self-conditioning signal of `logits_BCV`: softmax(logits) @ table * sqrt(D) (the softmax in at
    least fp32, its probabilities in the logits' dtype, as the official JAX sampler forms it)."""
    probs_BCV = jax.nn.softmax(logits_BCV.astype(layers.at_least_f32(logits_BCV.dtype)), axis=-1)
    return self.embedder.soft_encode(probs_BCV.astype(logits_BCV.dtype))

  def decode(self, canvas_BC, positions_BC, segment_ids_BC, cache: KVCache, sc_logits_BCV=None,
             sc_mask_B=None, num_canvases: int = 1, sc_embeddings_BCD=None, per_query_window: bool = False,
             canvas_probs_BCV=None, prev_logits_BKV=None):
    """Bidirectional pass over the canvas reading (never writing) `cache`. Returns logits_BCV (fp32).

    sc_logits_BCV: previous step's logits for self-conditioning (None = zero signal); or
    sc_embeddings_BCD: the signal already embedded (`self_conditioning_embedding`, e.g. kept in bf16 by the
      official sampler), cast to the compute dtype;
    sc_mask_B: optional bool, per example [B] or per token [B, C]; False zeroes that signal.
    num_canvases: K > 1 decodes K canvases of C // K tokens at once, block-causally (training only;
      canvas k ends where the cache's clean canvas k + 1 begins: attention.py docstring).
    per_query_window: the official sampler's sliding window for the context (attention.decoder_masks).
    canvas_probs_BCV: distributions over the vocabulary read in place of the canvas tokens, embedded as
      probs @ table * sqrt(D) (training's Gaussian-relaxation curriculum, dgemma/diffusion/relaxation.py; a
      one-hot row embeds as its token does, exactly at fp32 compute).
    prev_logits_BKV: with `cfg.decoder_shift` (required then, ignored otherwise), the encoder's logits at the
      clean token before each of the K canvases; they score each canvas's first position (decoder_variants.py).
    """
    cfg = self.cfg
    positions_BC = positions_BC.astype(jnp.int32)
    segment_ids_BC = segment_ids_BC.astype(jnp.int32)
    if canvas_probs_BCV is None:
      x_BCD = self.embedder.encode(canvas_BC)
    else:
      x_BCD = self.embedder.soft_encode(canvas_probs_BCV)
    if cfg.self_conditioning:
      if sc_embeddings_BCD is not None:
        soft_BCD = sc_embeddings_BCD.astype(layers.compute_dtype(cfg))
      elif sc_logits_BCV is None:
        soft_BCD = jnp.zeros_like(x_BCD)
      else:
        f32 = layers.at_least_f32(layers.compute_dtype(cfg))
        soft_BCD = self.embedder.soft_encode(jax.nn.softmax(sc_logits_BCV.astype(f32), axis=-1))
      if sc_mask_B is not None:
        mask = sc_mask_B.astype(soft_BCD.dtype)
        soft_BCD = soft_BCD * (mask[:, None, None] if mask.ndim == 1 else mask[:, :, None])
      x_BCD = self.self_conditioning(x_BCD, soft_BCD)  # post norm applies even to a zero signal
    slide, glob = decoder_masks(cfg, positions_BC, segment_ids_BC, cache.positions_BS,
                                cache.segment_ids_BS, cache.length, num_canvases, per_query_window)
    if cache.ring:  # sliding layers read the ring: every ring slot was written (empty ones are segment 0)
      if num_canvases != 1:
        raise ValueError("decode: block-causal decoding (num_canvases > 1) needs the full cache, not a ring")
      R = cache.ring_positions_BR.shape[1]
      slide, _ = decoder_masks(cfg, positions_BC, segment_ids_BC, cache.ring_positions_BR,
                               cache.ring_segment_ids_BR, R, 1, per_query_window)
    ctx = _Ctx(positions_BC, slide, glob, cache.length, segment_ids_BC != 0, decode=True)
    x_BCD = constrain(self.perturb("decoder_inputs", x_BCD), RESIDUAL_AXES)
    decoder_variants.check_prev_logits(cfg, prev_logits_BKV, num_canvases)
    if cfg.decoder_two_stream:  # a research option (dgemma/model/decoder_variants.py); the released path follows
      return decoder_variants.two_stream_logits(self, x_BCD, ctx, cache, segment_ids_BC, num_canvases, prev_logits_BKV)
    x_BCD, (_, aux) = self.blocks(x_BCD, (cache.k, cache.v), ctx)
    self.sow_aux(aux)
    if cfg.decoder_head_layers:
      x_BCD = decoder_variants.decoder_head(self, x_BCD, ctx, slide[..., -x_BCD.shape[1]:])
    return decoder_variants.adjust_logits(self, x_BCD, self._logits(x_BCD), segment_ids_BC, num_canvases, prev_logits_BKV)

  def __call__(self, tokens_BT, positions_BT, segment_ids_BT, canvas_BC, positions_BC, segment_ids_BC,
               sc_logits_BCV=None, sc_mask_B=None, return_enc_logits: bool = True):
    """Training / init pass: encode the clean context into a fresh cache of size T, then decode the
    canvas against it. Returns (enc_logits_BTV or None, dec_logits_BCV)."""
    cache = init_cache(self.cfg, tokens_BT.shape[0], tokens_BT.shape[1], layers.compute_dtype(self.cfg))
    enc_logits, cache = self.encode(tokens_BT, positions_BT, segment_ids_BT, cache,
                                    return_logits=return_enc_logits or self.cfg.decoder_shift)
    prev = enc_logits[:, -1:] if self.cfg.decoder_shift else None
    dec_logits = self.decode(canvas_BC, positions_BC, segment_ids_BC, cache, sc_logits_BCV, sc_mask_B,
                             prev_logits_BKV=prev)
    return (enc_logits if return_enc_logits else None), dec_logits


def boxed_param_shapes(cfg: ModelConfig) -> Any:
  """The parameter tree with its logical axis boxes (nn.Partitioned) and jax.ShapeDtypeStruct leaves
  (`jax.eval_shape`, nothing allocated). Tracing the model's init takes about half a second on a CPU, and one
  command asks for the same architecture's tree several times (the optimizer's Muon axes, the train state, a
  checkpoint's restore target, parameter counts), so each process traces an architecture once
  (`_traced_param_shapes`); every call returns a tree of its own, which the caller may change."""
  traced = _traced_param_shapes(cfg, bool(jax.config.jax_enable_x64))
  return jax.tree.map(lambda s: s, traced)  # new containers and boxes; the ShapeDtypeStruct leaves are immutable


@functools.lru_cache(maxsize=16)
def _traced_param_shapes(cfg: ModelConfig, x64: bool) -> Any:
  """boxed_param_shapes' trace of `cfg`'s init, kept per architecture (and x64 mode, which can change dtypes)."""
  del x64  # part of the cache key only
  model = Transformer(cfg)
  tok = jnp.zeros((1, 1), jnp.int32)
  with nn.logical_axis_rules(()):  # no activation constraints while tracing init
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tok, tok, tok, tok, tok, tok))["params"]


def param_shapes(cfg: ModelConfig) -> Any:
  """The unboxed parameter tree as jax.ShapeDtypeStruct leaves (`jax.eval_shape`, nothing allocated)."""
  return unbox(boxed_param_shapes(cfg))


def abstract_params(cfg: ModelConfig, mesh, axis_rules, quantize: Optional[Callable[[Any], Any]] = None) -> Any:
  """The parameter tree as jax.ShapeDtypeStruct leaves placed on `mesh` by their logical axis names and
  `axis_rules` (what a checkpoint is restored onto). `quantize`: boxed tree -> boxed tree with `QArray`s (the
  `boxed` method of a `dgemma.quant.Quantizer`: a QLoRA run's frozen base, `dgemma.finetune.base_quantizer`)."""
  boxed = boxed_param_shapes(cfg)
  return place(boxed if quantize is None else quantize(boxed), mesh, axis_rules)[0]


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """{'total', 'active', 'embedding', 'experts'} parameter counts.

  active = parameters used per token = total - (E - k) / E of the routed expert weights; the tied
  embedding table is counted once.
  """
  shapes = param_shapes(cfg)
  flat = flax.traverse_util.flatten_dict(shapes)
  total = sum(math.prod(s.shape) for s in flat.values())
  experts = sum(math.prod(s.shape) for path, s in flat.items() if "experts" in path)
  embedding = math.prod(flat[("embedder", "embedding")].shape)
  inactive = experts * (cfg.num_experts - cfg.experts_per_token) // cfg.num_experts if cfg.num_experts else 0
  return {"total": total, "active": total - inactive, "embedding": embedding, "experts": experts}
