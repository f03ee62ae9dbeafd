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

`PackedInt4`: how a stacked layer weight (under `blocks`) is held in int4: two values to a byte (uint8) along its
group axis. XLA's GPU compiler lays a stacked int4 operand out anew before the layer loop (a second copy of every
int4 weight: 10.6 GiB for the released model's experts, docs/finetuning.md); a byte array keeps its layout, and a
packed weight is unpacked where a layer reads it (`dequantize`, `unpack`), inside the layer's rematerialisation, so
neither that copy nor the unpacked stack ever exists. In a layer it carries a `like` leaf of its unpacked shape
(`with_shape_leaf`) for flax's parameter shape check.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix

QArray = qwix.QArray


@flax.struct.dataclass
class PackedInt4:
  """int4 values two to a byte along `axis` (negative; uint8, the even index in the low nibble) and their scales
  (module docstring). `shape` is the weight's; `unpack` gives the QArray."""
  # `like`: None as stored; inside a layer (`with_shape_leaf`) an unused int8 array of the weight's shape, the first
  # leaf, which flax checks against the declared shape (XLA drops it: nothing reads it)
  like: Any = flax.struct.field(default=None, kw_only=True)
  packed: jax.Array
  scale: jax.Array
  axis: int = flax.struct.field(pytree_node=False, default=-2)

  qtype = jnp.int4
  dtype = property(lambda self: self.scale.dtype)
  ndim = property(lambda self: self.packed.ndim)

  @property
  def shape(self) -> tuple[int, ...]:
    shape = list(self.packed.shape)
    shape[self.axis] *= 2
    return tuple(shape)

  @property
  def qvalue(self) -> jax.Array:
    """The int4 values (as int8), unpacked (a ShapeDtypeStruct for an abstract weight)."""
    if isinstance(self.packed, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(self.shape, jnp.int8)
    return unpack(self).qvalue


def pack(q: QArray, axis: int) -> PackedInt4:
  """An int4 QArray's values two to a byte along `axis` (negative; its size even)."""
  values = jnp.moveaxis(q.qvalue.astype(jnp.int8), axis, -1)
  lo, hi = (values[..., i::2].astype(jnp.uint8) & 0xF for i in (0, 1))
  return PackedInt4(packed=jnp.moveaxis(lo | (hi << 4), -1, axis), scale=q.scale, axis=axis)


def stored(w: Any) -> Any:
  """A weight without its `like` leaf (PackedInt4), as stored."""
  return dataclasses.replace(w, like=None) if isinstance(w, PackedInt4) and w.like is not None else w


def unpack(w: PackedInt4) -> QArray:
  """The QArray of a packed weight: its int4 values as int8 (what the layers dequantize; tokamax's kernels read int8
  as they read int4)."""
  p = jnp.moveaxis(w.packed, w.axis, -1)
  nibbles = jnp.stack([p & 0xF, p >> 4], axis=-1).astype(jnp.int8)
  values = jnp.where(nibbles > 7, nibbles - 16, nibbles).reshape(p.shape[:-1] + (2 * p.shape[-1],))
  return make(jnp.moveaxis(values, -1, w.axis), w.scale)


def with_shape_leaf(tree: Any) -> Any:
  """`tree` with every PackedInt4 given its `like` leaf: a layer's parameters as the layer reads them
  (`transformer.Block`), still packed, each unpacked where it is used."""
  return jax.tree.map(lambda x: dataclasses.replace(x, like=jnp.zeros(x.shape, jnp.int8))
                      if isinstance(x, PackedInt4) and x.like is None else x, tree,
                      is_leaf=lambda x: isinstance(x, (PackedInt4, QArray)))


def is_quantized(x: Any) -> bool:
  return isinstance(x, (QArray, PackedInt4))


def make(qvalue: jax.Array, scale: jax.Array) -> QArray:
  """A symmetric QArray of `qvalue` (stored dtype = its logical type) and its `scale`."""
  return QArray(qvalue=qvalue, scale=scale, zero_point=None, qtype=qvalue.dtype)


def dequantize(w: Any, dtype=None) -> jax.Array:
  """qvalue * scale in `dtype` (default: the original weight dtype, the scale's), by `qwix.dequantize`;
  plain arrays are only cast."""
  if isinstance(w, PackedInt4):
    w = unpack(w)
  if not isinstance(w, QArray):
    return w if dtype is None else w.astype(dtype)
  return qwix.dequantize(w if dtype is None else w.astype(dtype))


def frozen_product(f, x: jax.Array, w: Any, dtype) -> jax.Array:
  """f(x, dequantize(w, dtype)) for a frozen quantized weight `w` (QArray or PackedInt4) and an `f` linear in x,
  differentiated in x only (a frozen weight has no gradient; its cotangent is zero). The dequantized weight is
  formed where it is used and not kept: after x is known in the forward pass and after the output's gradient
  in the backward (an optimization barrier ties it to each), so a compiler that schedules ahead (XLA's TPU
  compiler) cannot form every layer's dequantized weights at once. The gradient is f's own vjp in x: the
  same products as differentiating f(x, dequantize(w)) directly."""
  return _frozen_product(f, dtype, x, stored(w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _frozen_product(f, dtype, x, w):
  w, x = jax.lax.optimization_barrier((w, x))
  return f(x, dequantize(w, dtype))


def _frozen_product_fwd(f, dtype, x, w):
  return _frozen_product(f, dtype, x, w), (x, w)


def _zero_cotangent(leaf):
  if jnp.issubdtype(leaf.dtype, jnp.inexact):
    return jnp.zeros_like(leaf)
  return np.zeros(leaf.shape, jax.dtypes.float0)


def _frozen_product_bwd(f, dtype, residuals, g):
  x, w = residuals
  w, g = jax.lax.optimization_barrier((w, g))
  _, pull = jax.vjp(lambda x: f(x, dequantize(w, dtype)), x)
  return pull(g)[0], jax.tree.map(_zero_cotangent, w)


_frozen_product.defvjp(_frozen_product_fwd, _frozen_product_bwd)


# Rows of a quantized table dequantized at a time by `table_logits` / `table_mix` (88 MiB of bf16 rows of the
# released 2816-wide table: 16 chunks of its 262,144-row vocabulary).
TABLE_CHUNK_ROWS = 16384


def _row_chunks(table: QArray, chunk_rows: int):
  """(chunk, number of whole chunks, remainder rows) of a [V, D] table read `chunk_rows` rows at a time."""
  V = table.qvalue.shape[0]
  chunk = min(chunk_rows, V)
  return chunk, V // chunk, V % chunk


def _rows(table: QArray, start, size: int, dtype) -> jax.Array:
  """Rows [start, start + size) of a quantized table, dequantized to `dtype` (a slice of qvalue and of scale)."""
  take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)
  return dequantize(make(take(table.qvalue), take(table.scale)), dtype)


def table_logits(x_ND: jax.Array, table: QArray, chunk_rows: int = TABLE_CHUNK_ROWS) -> jax.Array:
  """x @ dequantize(table)^T ([.., D] x [V, D] -> [.., V], in x's dtype) a chunk of `chunk_rows` table rows at a
  time, each chunk dequantized inside a rematerialised scan step: the dequantized table never exists whole, in the
  forward pass or the backward (which dequantizes each chunk again for x's gradient). Each logit is the same
  dot product of D terms as in the unchunked product."""
  chunk, n, rem = _row_chunks(table, chunk_rows)

  @functools.partial(jax.checkpoint, static_argnums=1)
  def part(start, size):
    return jnp.einsum("...d,vd->...v", x_ND, _rows(table, start, size, x_ND.dtype))

  parts = jax.lax.map(lambda start: part(start, chunk), jnp.arange(n, dtype=jnp.int32) * chunk)  # [n, .., chunk]
  logits = jnp.moveaxis(parts, 0, -2).reshape(x_ND.shape[:-1] + (n * chunk,))
  if rem:
    logits = jnp.concatenate([logits, part(jnp.int32(n * chunk), rem)], axis=-1)
  return logits


def table_mix(p_NV: jax.Array, table: QArray, chunk_rows: int = TABLE_CHUNK_ROWS) -> jax.Array:
  """p @ dequantize(table) ([.., V] x [V, D] -> [.., D], in p's dtype; self-conditioning's soft embeddings) summed
  over chunks of `chunk_rows` table rows, each dequantized inside a rematerialised scan step (`table_logits`). The
  sum runs in at least fp32 over the chunks (each chunk's product in p's dtype)."""
  chunk, n, rem = _row_chunks(table, chunk_rows)
  sum_dtype = jnp.promote_types(p_NV.dtype, jnp.float32)

  @functools.partial(jax.checkpoint, static_argnums=1)
  def part(start, size):
    p_chunk = jax.lax.dynamic_slice_in_dim(p_NV, start, size, axis=-1)
    return jnp.einsum("...v,vd->...d", p_chunk, _rows(table, start, size, p_NV.dtype)).astype(sum_dtype)

  zeros = jnp.zeros(p_NV.shape[:-1] + table.qvalue.shape[1:], sum_dtype)
  total, _ = jax.lax.scan(lambda acc, start: (acc + part(start, chunk), None), zeros,
                          jnp.arange(n, dtype=jnp.int32) * chunk)
  if rem:
    total = total + part(n * chunk, rem)
  return total.astype(p_NV.dtype)


def take_rows(w: Any, index: jax.Array) -> jax.Array:
  """w[index] along axis 0 (an embedding lookup, one scale row per vocabulary entry), dequantizing only the
  rows taken."""
  if not isinstance(w, QArray):
    return w[index]
  return dequantize(make(w.qvalue[index], w.scale[index]))
