"""The kernel side of moe_impl='tokamax' (dgemma/model/moe.py `experts_tokamax`): `tokamax.ragged_dot`
and the expert-width padding its Pallas kernels need.

tokamax 0.0.12 (`tokamax._src.ops.ragged_dot.api`): `tokamax.ragged_dot(lhs [M, K], rhs [G, K, N],
group_sizes [G], precision, preferred_element_type, ..., implementation=None)` has the signature of
`jax.lax.ragged_dot`; rhs may be a `qwix.QArray` (weight-only quantized). implementation=None tries
('mosaic', 'triton', 'xla') in order and takes the first that does not raise NotImplementedError:
'mosaic' is Mosaic GPU (sm90 / sm100 kernels, bf16 / f16 inputs; a QArray rhs runs the in-kernel
dequantizing kernels) on NVIDIA devices and Mosaic TPU elsewhere; 'triton' is the Pallas Triton kernel
(GPU); 'xla' is `jax.lax.ragged_dot_general` (a QArray is dequantized whole first, `qwix.dequantize`),
the one that runs on CPU (Mosaic TPU and Triton report 'not supported on cpu'). Gradients: the XLA
implementation is wrapped in a custom_vjp whose backward is `jax.vjp` of the same ragged_dot_general,
so on CPU this path computes what moe_impl='ragged' does; the Mosaic GPU one defines its own VJP
(dlhs, drhs as Mosaic ragged dots, `base.vjp`). On CPU we pass implementation='xla' (the other two
would only fail at trace time).

Shape constraints of the Mosaic GPU kernels at their sm90 heuristic config (block_m 64, block_n 64,
block_k 128, or min(scale tile along K, 256) for a QArray rhs; pallas_mosaic_gpu.py), against our
expert widths (d_model D = 2816, expert_hidden F = 704; gate+up fused 2F = 1408):
  - quantized kernels (sm90_quant_ws*): N % (2 * block_n) = N % 128 == 0, scale tile along K a
    multiple of block_k, output dtype with 128-byte swizzle == block_n (bf16 yes, fp32 no):
    gate/up N = F = 704: 704 % 128 = 64, fails; fused 1408 = 11 * 128 passes; down N = D = 2816 passes.
    down K = F = 704 with int8 per channel: scale tile 704, block_k 256, 704 % 256 = 192, fails.
  - non-quantized sm90 kernel: pipelines k // block_k blocks of K: K = F = 704 is 5.5 blocks of 128.
  - Mosaic TPU: every non-expert dimension >= 128, tiles of 128.
So F is padded with zeros to a multiple of `KERNEL_WIDTH_MULTIPLE` = 256 on GPU / TPU: 704 -> 768
(768 = 6 * 128 = 3 * 256; gate+up fused 1536 = 12 * 128), which meets all of the above, and int4 groups
of 64 (or any divisor of 256) stay whole. Zero columns of gate / up give h = gelu(0) * 0 = 0 and zero rows
of down add nothing, so the padding is exact; it costs 768 / 704 = 1.09x the expert FLOPs, and since the
weights are padded inside the step (params keep their [E, D, F] shapes), one copy of each layer's expert
weights per call. Neither the padding nor the fallbacks above have been run on a GPU yet (issue #17).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.model import qarray

KERNEL_WIDTH_MULTIPLE = 256


def pad_axis(w: Any, axis: int, size: int) -> Any:
  """`w` zero-padded at the end of `axis` to `size` (plain arrays and `QArray`s; padded weights are 0).

  QArray: q is padded with 0 and the scale where it has the axis: along an output (channel) axis one
  scale per new channel, along a grouped contracted axis one per new group (the padding must be whole
  groups), a per-channel contracted axis (one scale over the axis) keeps its scale (q = 0 there).
  The scales padded in are 1 (any value would do: they multiply q = 0)."""
  ax = axis % len(w.shape)
  pad = size - w.shape[ax]
  if pad < 0:
    raise ValueError(f"pad_axis: axis {axis} of {tuple(w.shape)} is longer than {size}")
  if pad == 0:
    return w
  widths = lambda n: [(0, 0)] * ax + [(0, n)] + [(0, 0)] * (len(w.shape) - ax - 1)
  if not isinstance(w, qarray.QArray):
    return jnp.pad(w, widths(pad))
  n, length = w.scale.shape[ax], w.qvalue.shape[ax]
  if n == length:          # an output channel axis
    scale_pad = pad
  elif n == 1:             # contracted, one scale over the whole axis
    scale_pad = 0
  elif pad % (length // n) == 0:  # contracted in groups of length // n
    scale_pad = pad // (length // n)
  else:
    raise ValueError(f"pad_axis: padding {pad} is not whole groups of {length // n} along axis {axis}")
  return qarray.make(jnp.pad(w.qvalue, widths(pad)), jnp.pad(w.scale, widths(scale_pad), constant_values=1))


def concatenate(ws, axis: int) -> Any:
  """Concatenation along an output (channel) axis of plain arrays or of `QArray`s with the same grouping
  (a fused gate+up projection [E, D, 2F])."""
  if not any(isinstance(w, qarray.QArray) for w in ws):
    return jnp.concatenate(ws, axis)
  if not all(isinstance(w, qarray.QArray) and w.scale_tile_shape == ws[0].scale_tile_shape
             and w.scale.shape[axis] == w.qvalue.shape[axis] for w in ws):
    raise ValueError("concatenate: QArrays must share their grouping and be joined along an output channel axis")
  return qarray.make(jnp.concatenate([w.qvalue for w in ws], axis), jnp.concatenate([w.scale for w in ws], axis))


def width_multiple(backend: str | None = None) -> int:
  """The multiple the expert hidden width is padded to for tokamax on `backend` (default: JAX's default
  backend): 1 (no padding) on CPU, where the XLA implementation has no constraint, else 256."""
  backend = backend or jax.default_backend()
  return 1 if backend == "cpu" else KERNEL_WIDTH_MULTIPLE


def padded_width(width: int, multiple: int) -> int:
  """`width` rounded up to a multiple of `multiple` (e.g. 704 -> 768 for 256)."""
  return multiple * math.ceil(width / multiple)


def pad_experts(gate_EDF, up_EDF, down_EFD, adapters, multiple: int):
  """(gate, up, down, adapters) with the expert hidden width F zero-padded to `padded_width(F, multiple)`:
  gate / up [E, D, Fp], down [E, Fp, D] (plain arrays or `qarray.QArray`s), and the LoRA factors that
  touch F (gate / up B [E, r, Fp], down A [E, Fp, r]). Unchanged when F is already a multiple."""
  F = gate_EDF.shape[-1]
  Fp = padded_width(F, multiple)
  if Fp == F:
    return gate_EDF, up_EDF, down_EFD, adapters
  adapters = dict(adapters or {})
  for name in ("gate_proj", "up_proj"):
    if name in adapters:
      adapters[name] = adapters[name]._replace(b=pad_axis(adapters[name].b, -1, Fp))
  if "down_proj" in adapters:
    adapters["down_proj"] = adapters["down_proj"]._replace(a=pad_axis(adapters["down_proj"].a, -2, Fp))
  return (pad_axis(gate_EDF, -1, Fp), pad_axis(up_EDF, -1, Fp), pad_axis(down_EFD, -2, Fp),
          adapters)


def absl_flags_parsed():
  """tokamax reads its options (tokamax._src.config) from absl flags and, when absl's FLAGS are not
  parsed yet, parses sys.argv itself: under pytest, in a notebook or any program not started by
  `absl.app.run` that raises UnrecognizedFlagError for the program's own arguments. Mark them parsed
  (defaults) in that case; a later `app.run` still parses its argv."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


# dims of lhs [M, N] x rhs [G, K, N] -> [M, K] (the input gradient of lhs [M, K] x rhs [G, K, N])
_TRANS_RHS_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def default_implementation(implementation=None):
  """A tokamax `implementation` argument: None becomes 'xla' on CPU (tokamax's other implementations are GPU / TPU
  kernels), and stays None (tokamax's own order) elsewhere."""
  return "xla" if implementation is None and jax.default_backend() == "cpu" else implementation


def ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, implementation=None):
  """`tokamax.ragged_dot` with the output in lhs's dtype. `rhs` a plain array, or a `qwix.QArray` (`qarray`):
  passed as it is, its scale in lhs's dtype (the quantized kernels), through `_frozen_quantized_dot`.
  implementation None: 'xla' on CPU, tokamax's own choice elsewhere. Imports tokamax (about 1 s)."""
  import tokamax  # pylint: disable=g-import-not-at-top
  absl_flags_parsed()
  fwd_impl = default_implementation(implementation)
  if not isinstance(rhs_GKN, qarray.QArray):
    return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=lhs_MK.dtype,
                              implementation=fwd_impl)
  dlhs_impl = implementation
  if implementation is None:
    dlhs_impl = ("triton", "xla") if jax.default_backend() == "gpu" else default_implementation()
  return _frozen_quantized_dot(lhs_MK, rhs_GKN.astype(lhs_MK.dtype), group_sizes_G, fwd_impl, dlhs_impl)


def _frozen_quantized_dot(lhs_MK, rhs_q, group_sizes_G, fwd_impl, dlhs_impl):
  """lhs x a quantized (frozen) rhs with our own VJP: the input gradient is the transposed product
  dout [M, N] x rhs [G, K, N] (tokamax with `dlhs_impl`), the weight's cotangent is zero. tokamax's
  own VJP for a qwix.QArray rhs (`ragged_dot.base.vjp`, the one Mosaic GPU uses) returns a dense weight
  gradient where the QArray was and fails (pytree mismatch; seen on CPU with that VJP on the XLA op).
  On GPU the transposed product skips Mosaic (`('triton', 'xla')`): its sm90 quantized kernels want
  the scales tiled along the contracted axis, here N, which has one scale per channel."""
  import tokamax  # pylint: disable=g-import-not-at-top
  call = lambda impl, x, w, gs, dims: tokamax.ragged_dot_general(
      x, w, gs, dims, preferred_element_type=x.dtype, implementation=impl)
  default_dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                                   lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

  @jax.custom_vjp
  def dot(lhs, rhs, gs):
    return call(fwd_impl, lhs, rhs, gs, default_dims)

  def fwd(lhs, rhs, gs):
    return dot(lhs, rhs, gs), (rhs, gs)

  def bwd(res, dout):
    rhs, gs = res
    zero = lambda a: (jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.inexact)
                      else np.zeros(a.shape, jax.dtypes.float0))
    return call(dlhs_impl, dout, rhs, gs, _TRANS_RHS_DIMS), jax.tree.map(zero, rhs), zero(gs)

  dot.defvjp(fwd, bwd)
  return dot(lhs_MK, rhs_q, group_sizes_G)
