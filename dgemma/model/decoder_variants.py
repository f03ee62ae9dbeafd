"""Research decoder variants: options of the decoder that the released DiffusionGemma does not have, kept out of
the released path of dgemma/model/transformer.py. Each is a record of `VARIANTS` (its ModelConfig field, the
parameters it adds, where it acts) and off by default; the Transformer calls `setup` and the hooks below, which
do nothing for the released model. The likelihood study (docs/experiments/likelihood_small.md) measured them.

  decoder_shift: canvas position p is scored by the decoder's output at p - 1, and a canvas's first position by
    the encoder's causal logits at the clean token before it, so each position is predicted where the token to
    its left sits, as the encoder's next-token head predicts (Dream and DiffuLLaMA shift the same way). Callers
    of `Transformer.decode` pass those encoder logits (`prev_logits_BKV`). No parameters.
  decoder_right_readout = R: position p's logits also get, for r = 1..R, a readout of the decoder's output at
    p + r, each through its own [D, D] projection (`right_readout[r - 1]`, zero at init, so training starts from
    the one-sided model) before the tied, softcapped vocabulary matmul; a term is dropped where p + r is past the
    canvas's end, padding or another document. The logits are a product of experts, left x right readouts: for
    a Markov source the exact posterior of x_p factors this way (p(x_p | left) p(right | x_p) up to a constant).
  decoder_head_layers = N: N more layers of the sliding kind, with their own weights (`decoder_head_{i}`), after
    the shared stack in decoder mode only, attending bidirectionally inside the canvas (same canvas, same
    document, not padding) and reading no context cache; the encoder never runs them.
  decoder_two_stream (needs decoder_shift, and no right readout, decoder-only layers or self-conditioning): two
    passes over the canvas with the shared weights, a forward stream (canvas attention to positions <= its own)
    and a backward stream (>= its own), both reading the whole clean context. Position p's logits come from the
    forward stream at p - 1 (the encoder's logits before the canvas for p = 0) plus a position-wise MLP of width
    4 D over [forward at p - 1, backward at p + 1] (`two_stream_in` / `two_stream_out`, output zero at init), so
    they never read the noisy token at p: a leave-one-out distribution by construction, which
    `diffusion.objective=blind_ce` trains with a plain cross-entropy at every canvas position.

Parameters (logical axes): right_readout [R, D, D] ('readout', 'embed', 'embed_out'); two_stream_in [2D, 4D]
('embed', 'mlp'), two_stream_in_bias [4D] ('mlp',), two_stream_out [4D, D] ('mlp', 'embed_out'),
two_stream_out_bias [D] ('embed_out',); decoder_head_{i}/... as a sliding layer of the stack.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from dgemma.model import layers, qarray
from dgemma.model.config import SLIDING, ModelConfig


@dataclasses.dataclass(frozen=True)
class Variant:
  """A research option: its ModelConfig field and what it adds (a one-line summary; the module docstring)."""
  field: str
  adds: str


VARIANTS: dict[str, Variant] = {v.field: v for v in (
    Variant("decoder_shift", "scores p at p - 1, the canvas's first position by the encoder"),
    Variant("decoder_right_readout", "R readouts of the outputs at p + 1 .. p + R"),
    Variant("decoder_head_layers", "N decoder-only layers over the canvas"),
    Variant("decoder_two_stream", "forward and backward streams: logits blind to their own token"),
)}


def enabled(cfg: ModelConfig) -> list[str]:
  """The research options `cfg` turns on (none for the released model)."""
  return [name for name in VARIANTS if getattr(cfg, name)]


def setup(module: nn.Module, layer_cls: Callable) -> None:
  """Declares the options' parameters on the Transformer `module` (called from its setup; names at its root)."""
  cfg = module.cfg
  pd = layers.param_dtype(cfg)
  if cfg.decoder_right_readout:  # zero at init: training starts from the one-sided readout
    module.right_readout = module.param("right_readout", nn.with_logical_partitioning(
        nn.initializers.zeros, ("readout", "embed", "embed_out")), (cfg.decoder_right_readout, cfg.d_model,
                                                                 cfg.d_model), pd)
  if cfg.decoder_two_stream:  # the combining MLP over [forward at p - 1, backward at p + 1]; output zero at init
    F = 4 * cfg.d_model
    module.two_stream_in = module.param("two_stream_in", nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")), (2 * cfg.d_model, F), pd)
    module.two_stream_in_bias = module.param("two_stream_in_bias", nn.with_logical_partitioning(
        nn.initializers.zeros, ("mlp",)), (F,), pd)
    module.two_stream_out = module.param("two_stream_out", nn.with_logical_partitioning(
        nn.initializers.zeros, ("mlp", "embed_out")), (F, cfg.d_model), pd)
    module.two_stream_out_bias = module.param("two_stream_out_bias", nn.with_logical_partitioning(
        nn.initializers.zeros, ("embed_out",)), (cfg.d_model,), pd)
  module.decoder_head = [layer_cls(cfg, SLIDING, name=f"decoder_head_{i}") for i in range(cfg.decoder_head_layers)]


def check_prev_logits(cfg: ModelConfig, prev_logits_BKV, num_canvases: int) -> None:
  if cfg.decoder_shift:
    if prev_logits_BKV is None:
      raise ValueError("decode: model.decoder_shift needs prev_logits_BKV, the encoder's logits at the token "
                       "before each canvas")
    if prev_logits_BKV.shape[1] != num_canvases:
      raise ValueError(f"decode: prev_logits_BKV holds {prev_logits_BKV.shape[1]} canvases' logits, the decoder "
                       f"input {num_canvases}")


def decoder_head(module: nn.Module, x_BCD, ctx, canvas_mask_BCC):
  """decoder_head_layers: the decoder-only layers, attending bidirectionally inside the canvas only (the decoder's
  canvas-to-canvas mask; no cache). `ctx` is the decoder's layer context (transformer._Ctx)."""
  K, H = layers.attn_dims(module.cfg, SLIDING)
  empty_BSKH = jnp.zeros((x_BCD.shape[0], 0, K, H), x_BCD.dtype)
  head_ctx = ctx.replace(mask_sliding=canvas_mask_BCC, mask_global=canvas_mask_BCC)
  for layer in module.decoder_head:
    x_BCD, _, aux = layer(x_BCD, (empty_BSKH, empty_BSKH), head_ctx)
    module.sow_aux(aux)
  return x_BCD


def adjust_logits(module: nn.Module, x_BCD, logits_BCV, segment_ids_BC, num_canvases: int, prev_logits_BKV):
  """decoder_shift and decoder_right_readout applied to the decoder's logits (the released model's unchanged)."""
  cfg = module.cfg
  if cfg.decoder_shift:
    logits_BCV = shift_canvas_logits(logits_BCV, prev_logits_BKV)
  if cfg.decoder_right_readout:
    logits_BCV = logits_BCV + _right_logits(module, x_BCD, segment_ids_BC, num_canvases)
  return logits_BCV


def _right_logits(module: nn.Module, x_BCD, segment_ids_BC, num_canvases: int):
  """decoder_right_readout = R: at each canvas position p, the sum over r = 1..R of the readout of the decoder's
  output at p + r through `right_readout[r - 1]`; a term is zero where p + r is past the canvas's end, padding or
  another document."""
  dtype = layers.compute_dtype(module.cfg)
  right_BRCD = jnp.einsum("bcd,rde->brce", module.final_norm(x_BCD).astype(dtype),
                          qarray.dequantize(module.right_readout, dtype))
  logits_BRCV = module.readout(right_BRCD)
  B, R, KC, V = logits_BRCV.shape
  C = KC // num_canvases
  logits_BRKCV = logits_BRCV.reshape(B, R, num_canvases, C, V)
  seg_BKC = segment_ids_BC.reshape(B, num_canvases, C)
  total_BKCV = jnp.zeros((B, num_canvases, C, V), logits_BRCV.dtype)
  for r in range(1, min(R, C - 1) + 1):  # position p reads p + r: drop r columns on the left, pad r on the right
    shifted_BKCV = jnp.pad(logits_BRKCV[:, r - 1, :, r:], ((0, 0), (0, 0), (0, r), (0, 0)))
    same_BKC = _same_document_ahead(seg_BKC, r)
    total_BKCV = total_BKCV + jnp.where(same_BKC[..., None], shifted_BKCV, 0.0)
  return total_BKCV.reshape(B, KC, V)


def two_stream_logits(module: nn.Module, x_BCD, ctx, cache, segment_ids_BC, num_canvases: int, prev_logits_BKV):
  """decoder_two_stream: the forward stream (canvas keys j <= i) and the backward stream (j >= i) over the canvas
  with the shared weights, both reading the whole context in `ctx`'s masks; position p's logits read the forward
  stream at p - 1 and the backward one at p + 1 (zero where that is past the canvas's end, padding or another
  document), never the token at p. p = 0 has no forward term: the encoder's logits at the token before the canvas
  (`prev_logits_BKV`) stand in for it, as with decoder_shift."""
  B, C, D = x_BCD.shape
  K = num_canvases
  i_C = jnp.arange(C)
  streams = []
  for keep_CC in (i_C[None, :] <= i_C[:, None], i_C[None, :] >= i_C[:, None]):  # forward, backward
    def restrict(mask_BCS):  # the last C keys are the canvas (attention.decoder_masks)
      keep_CS = jnp.concatenate([jnp.ones((C, mask_BCS.shape[-1] - C), bool), keep_CC], axis=1)
      return mask_BCS & keep_CS[None]
    stream_ctx = ctx.replace(mask_sliding=restrict(ctx.mask_sliding), mask_global=restrict(ctx.mask_global))
    h_BCD, (_, aux) = module.blocks(x_BCD, (cache.k, cache.v), stream_ctx)
    module.sow_aux(aux)
    streams.append(module.final_norm(h_BCD).reshape(B, K, C // K, D))
  fwd_BKCD, bwd_BKCD = streams
  seg_BKC = segment_ids_BC.reshape(B, K, C // K)
  left_BKCD = jnp.pad(fwd_BKCD[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0)))  # forward at p - 1 (0 at p = 0)
  right_BKCD = jnp.pad(bwd_BKCD[:, :, 1:], ((0, 0), (0, 0), (0, 1), (0, 0)))  # backward at p + 1
  right_BKCD = jnp.where(_same_document_ahead(seg_BKC, 1)[..., None], right_BKCD, 0.0)
  dtype = layers.compute_dtype(module.cfg)
  both_BCD2 = jnp.concatenate([left_BKCD, right_BKCD], axis=-1).reshape(B, C, 2 * D).astype(dtype)
  hidden_BCF = jax.nn.gelu(layers.matmul_last(both_BCD2, module.two_stream_in.astype(dtype))
                           + module.two_stream_in_bias.astype(dtype))
  mixed_BCD = (layers.matmul_last(hidden_BCF, module.two_stream_out.astype(dtype))
               + module.two_stream_out_bias.astype(dtype))
  logits_BKCV = module.readout(left_BKCD.reshape(B, C, D).astype(dtype) + mixed_BCD).reshape(B, K, C // K, -1)
  logits_BKCV = logits_BKCV.at[:, :, 0].add(prev_logits_BKV.astype(logits_BKCV.dtype))
  return logits_BKCV.reshape(B, C, -1)


def _same_document_ahead(seg_BKC: jax.Array, r: int) -> jax.Array:
  """[B, K, C] bool: canvas position p + r is inside its canvas, not padding, and in p's document."""
  seg_ahead_BKC = jnp.pad(seg_BKC[:, :, r:], ((0, 0), (0, 0), (0, r)))  # 0 past the canvas's end
  return (seg_ahead_BKC == seg_BKC) & (seg_ahead_BKC != 0)


def shift_canvas_logits(dec_logits_BCV: jax.Array, prev_logits_BKV: jax.Array) -> jax.Array:
  """decoder_shift: the logits scoring each of K canvases of C = (columns / K) positions are [the encoder's logits
  at the token before the canvas, the decoder's outputs at positions 0 .. C - 2] (position p predicted from
  p - 1; the decoder's output at the canvas's last position is dropped)."""
  B, KC, V = dec_logits_BCV.shape
  K = prev_logits_BKV.shape[1]
  dec_BKCV = dec_logits_BCV.reshape(B, K, KC // K, V)
  first_BK1V = prev_logits_BKV[:, :, None].astype(dec_logits_BCV.dtype)
  return jnp.concatenate([first_BK1V, dec_BKCV[:, :, :-1]], axis=2).reshape(B, KC, V)


__all__ = ["VARIANTS", "Variant", "enabled", "setup", "decoder_head", "adjust_logits", "two_stream_logits",
           "shift_canvas_logits", "check_prev_logits"]
