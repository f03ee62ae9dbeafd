"""The quantized weight the model layers read: `QArray` (int8 / int4 values and their scales) and the
dequantizing helpers the layers call where a weight is used.

Produced by `dgemma.quant.quantize_params` (the scheme is described there); consumed by
`dgemma.model.layers.Einsum`, the experts (`dgemma.model.moe`) and the embedding (`transformer.Embedder`).
A plain array passes through every helper unchanged, so the same model code runs quantized or not.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class QArray:
  """A quantized weight: `q` (int8 / int4, the weight's shape) and `scale` (q's shape with every
  contracted axis reduced to its number of groups: 1 per channel, n for n groups along `group_axis`).

  `q` is the first field: flax checks a stored parameter's first leaf against the declared shape.
  `group_axis` is negative so it stays valid when `nn.scan` strips the leading 'layers' axis.
  """

  q: jax.Array
  scale: jax.Array
  group_axis: int = struct.field(pytree_node=False, default=-1)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  @property
  def dtype(self):
    """The dtype of the weight it replaces (the scale's)."""
    return self.scale.dtype


def is_quantized(x: Any) -> bool:
  return isinstance(x, QArray)


def dequantize(w: Any, dtype=None) -> jax.Array:
  """q * scale as `dtype` (default: the original weight dtype); plain arrays are only cast."""
  if not isinstance(w, QArray):
    return w if dtype is None else w.astype(dtype)
  dtype = w.dtype if dtype is None else dtype
  q, scale = w.q, w.scale
  ax = w.group_axis % q.ndim
  n = scale.shape[ax]
  # split the grouped axis into [n groups, group size]; the scale broadcasts over the group
  q_g = q.reshape(q.shape[:ax] + (n, q.shape[ax] // n) + q.shape[ax + 1:])
  s_g = jnp.expand_dims(scale, ax + 1)
  return (q_g.astype(dtype) * s_g.astype(dtype)).reshape(q.shape)


def take_rows(w: Any, index: jax.Array) -> jax.Array:
  """w[index] along axis 0 (an embedding lookup), dequantizing only the rows taken."""
  if not isinstance(w, QArray):
    return w[index]
  return dequantize(QArray(q=w.q[index], scale=w.scale[index], group_axis=w.group_axis))
