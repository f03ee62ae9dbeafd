"""The quantized weight the model layers read, and the dequantizing helpers the layers call where a weight is
used. The type is qwix's `QArray` (qwix 0.1.8): `qvalue` (int8 / int4, the weight's shape), `scale` (same rank;
every contracted axis reduced to its number of groups: 1 per channel, n for n groups), `zero_point` None
(symmetric), `qtype` the storage dtype. It is what tokamax's quantized kernels take, so expert weights reach
them as stored (dgemma/model/moe_kernels.py), and it is what qwix's own providers produce and consume.

Produced by `dgemma.quant.quantize_params` (the scheme is described there); consumed by
`dgemma.model.layers.Einsum`, the experts (`dgemma.model.moe`) and the embedding (`transformer.Embedder`).
A plain array passes through every helper unchanged, so the same model code runs quantized or not.
`qvalue` is the QArray's first field: flax checks a stored parameter's first leaf against the declared shape,
and `nn.scan` slices qvalue and scale alike along a leading 'layers' axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix

QArray = qwix.QArray


def is_quantized(x: Any) -> bool:
  return isinstance(x, QArray)


def make(qvalue: jax.Array, scale: jax.Array) -> QArray:
  """A symmetric QArray of `qvalue` (stored dtype = its logical type) and its `scale`."""
  return QArray(qvalue=qvalue, scale=scale, zero_point=None, qtype=qvalue.dtype)


def dequantize(w: Any, dtype=None) -> jax.Array:
  """qvalue * scale in `dtype` (default: the original weight dtype, the scale's), by `qwix.dequantize`;
  plain arrays are only cast."""
  if not isinstance(w, QArray):
    return w if dtype is None else w.astype(dtype)
  return qwix.dequantize(w if dtype is None else w.astype(dtype))


def take_rows(w: Any, index: jax.Array) -> jax.Array:
  """w[index] along axis 0 (an embedding lookup, one scale row per vocabulary entry), dequantizing only the
  rows taken."""
  if not isinstance(w, QArray):
    return w[index]
  return dequantize(make(w.qvalue[index], w.scale[index]))
