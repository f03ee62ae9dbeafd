"""Weight-only int8 / int4 quantization of a dgemma parameter tree, applied at load time.

  qcfg = settings.sample.quant                    # sample.quantize / quant_group_size / quantize_embedding
  qparams = quantize_params(params, qcfg)         # a whole tree (sampling, eval, benchmarks)
  Quantizer(qcfg, only)(key_path, w)              # one tensor: the transform a checkpoint reader streams with
  chain(base_quantizer, Quantizer(qcfg))          # the first that quantizes a weight does (dgemma.load)
  Transformer(cfg).apply({'params': qparams}, ...)  # the model dequantizes each weight where it is used

Scheme (symmetric, round-to-nearest, no zero point):
  int8: one scale per output channel: scale = max|w| / 127 over the contracted (input) axes.
  int4: one scale per group of `group_size` consecutive input elements of an output channel:
        scale = max|w| / 7 over the group (group_size 0 = per output channel, like int8).
  q = clip(round(w / scale), -qmax, qmax), stored as jnp.int8 / jnp.int4 (XLA packs int4 two per byte
  on CPU and GPU: a [64, 1024, 1024] int4 argument is 32 MiB in `memory_analysis()`); scales are stored
  in the weight's own dtype (bf16 for a bf16 checkpoint) and q is computed from the stored scale.
  Dequantized weight = q * scale, in the compute dtype.

What is quantized (`contracted_axes`): the embedding table [V, D] (one scale / group row per vocabulary
entry, so a looked-up row is dequantized alone), attention q/k/v [D, K, H] (contract D) and o [N, H, D]
(contract N, H; groups along H), dense and self-conditioning GeGLU kernels [D, F] / [F, D], and the
stacked experts [E, D, F] / [E, F, D] (contract the middle axis). Router kernels, norm scales, router
scales and layer scalars stay in their dtype. Stacked `blocks` leaves keep their leading 'layers' axis
in q and scale alike, so `nn.scan` slices a `QArray` like any weight and each layer is dequantized
inside the scanned block: full-precision weights of more than one layer never exist at once. Their int4 values
are packed two to a byte along their group axis (`PackedInt4`, dgemma/model/qarray.py) and unpacked one layer at a
time inside each layer, so XLA's GPU compiler never lays out a second copy of the whole stack.

Presets (`sample.quantize`): 'int8', 'int4' (every quantizable weight), 'int4_experts' (the stacked expert
weights int4 in groups of `group_size`, every other quantizable weight int8 per channel: the experts are
most of the parameters, the rest is read by every token).

The stored type is qwix's `QArray` (dgemma/model/qarray.py). The values are computed here rather than by
`qwix.quantize`, which divides by the scale in the weight's dtype: for a bf16 checkpoint we divide in fp32 by
the scale as stored, so q is the nearest level to w under the scale the model multiplies by.

Expert kernels: with model.moe_impl='tokamax' the expert `QArray`s are not dequantized by the model: they
reach `tokamax.ragged_dot` as they are, for its quantized kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dgemma.errors import ConfigError
from dgemma.model import lora, param_shapes, qarray, sharding
from dgemma.model.qarray import PackedInt4, QArray, dequantize, is_quantized, take_rows

# The quantized weight type and its helpers live beside the layers that read them (dgemma/model/qarray.py).
__all__ = ["Chain", "PackedInt4", "Plan", "QArray", "QuantConfig", "Quantizer", "SCHEMES", "chain", "check",
           "contracted_axes",
           "dequantize", "is_quantized", "leaf_plan", "quantize_array", "quantize_boxed", "quantize_leaf", "quantize_params", "same_layout", "stack",
           "take_rows", "tree_bytes"]

SCHEMES = ("none", "int8", "int4", "int4_experts")
_QMAX = {"int8": 127, "int4": 7}
_QDTYPE = {"int8": jnp.int8, "int4": jnp.int4}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """How weights are quantized: a runtime record of the keys that describe it (sample.quantize /
  sample.quant_group_size / sample.quantize_embedding for sampling, `SampleSettings.quant`; finetune.base_quant /
  base_quant_group_size for a QLoRA run's frozen base, `dgemma.finetune.base_quantizer`). `group_field`: the key a
  group size that does not divide a weight is reported under."""
  scheme: str = "none"
  group_size: int = 64
  embedding: bool = True
  group_field: str = dataclasses.field(default="sample.quant_group_size", compare=False)
  scale_dtype: str = ""  # the scales' dtype; "" = the weight's (finetune.base_quant_scale_dtype)

  def __post_init__(self):
    if self.scheme not in SCHEMES or not (isinstance(self.group_size, int) and self.group_size >= 0):
      raise ValueError(f"QuantConfig: scheme must be one of {SCHEMES} and group_size an integer >= 0, got "
                       f"{self.scheme!r}, {self.group_size!r}")


def contracted_axes(path: tuple[str, ...], ndim: int, embedding: bool = True) -> tuple[int, ...] | None:
  """Negative axes a weight is contracted over (its input axes), or None if it stays unquantized.

  `path`: the parameter's key path (strings); `ndim` counts a leading 'layers' axis if any.
  """
  leaf = path[-2] if path[-1] == "kernel" else path[-1]
  if lora.is_adapter(path[-1]):       # LoRA factors stay in full precision (QLoRA-style)
    return None
  if path[0] == "embedder":
    return (-1,) if embedding else None
  if "router" in path or ndim < 2:
    return None
  if "experts" in path:
    return (-2,)                      # [E, D, F] / [E, F, D]
  if path[-1] != "kernel":
    return None
  if leaf == "o_proj":
    return (-3, -2)                   # [N, H, D]
  if leaf in ("q_proj", "k_proj", "v_proj"):
    return (-3,)                      # [D, K, H]
  if leaf in ("gate_proj", "up_proj", "down_proj"):
    return (-2,)                      # [D, F] / [F, D]
  return None


def leaf_scheme(scheme: str, path: tuple[str, ...]) -> str:
  """The per-weight scheme ('int8' / 'int4') of a preset for the weight at key path `path`."""
  if scheme == "int4_experts":
    return "int4" if "experts" in path else "int8"
  return scheme


def _num_groups(size: int, group_size: int, scheme: str, name: str, field: str = "sample.quant_group_size") -> int:
  if scheme == "int8" or group_size == 0 or group_size >= size:
    return 1
  if size % group_size:
    raise ConfigError(f"{field}: {group_size} does not divide the input size {size} of {name}; "
                      f"pick a divisor (or 0 = per output channel)")
  return size // group_size


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def quantize_array(w: jax.Array, axes: tuple[int, ...], scheme: str, group_size: int = 0,
                   name: str = "weight", packed: bool = False, scale_dtype: str = "") -> QArray | PackedInt4:
  """Quantizes one weight over its contracted `axes` (negative); groups along the last of them; `packed` (int4
  only): two values to a byte along that axis (`PackedInt4`); the scales in `scale_dtype` ("" = w's dtype). Jitted
  (one compile per shape and setting); `name` only labels errors."""
  ndim = w.ndim
  axes = tuple(sorted(a % ndim for a in axes))
  ax = axes[-1]
  n = _num_groups(w.shape[ax], group_size, scheme, name)
  qmax = _QMAX[scheme]
  w32 = jnp.asarray(w).astype(jnp.float32)
  w_g = w32.reshape(w.shape[:ax] + (n, w.shape[ax] // n) + w.shape[ax + 1:])
  red = tuple(a for a in axes if a != ax) + (ax + 1,)  # group axis ax+1 in the split layout
  amax = jnp.max(jnp.abs(w_g), axis=red, keepdims=True)
  # the stored (possibly bf16) scale is what q is computed against; all-zero groups get scale 1
  scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(scale_dtype or w.dtype)
  q = jnp.clip(jnp.round(w_g / scale.astype(jnp.float32)), -qmax, qmax).astype(_QDTYPE[scheme]).reshape(w.shape)
  out = qarray.make(q, jnp.squeeze(scale, axis=ax + 1))
  return qarray.pack(out, ax - ndim) if packed else out


def _path_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


class Plan(NamedTuple):
  """How one weight is quantized: over its contracted `axes` (negative), 'int8' | 'int4', and whether its int4
  values are packed two to a byte (a stacked layer weight under `blocks`: `PackedInt4`)."""
  axes: tuple[int, ...]
  scheme: str
  packed: bool


def leaf_plan(names: tuple[str, ...], shape: tuple[int, ...], qcfg: QuantConfig,
              only: Optional[Callable[[tuple[str, ...]], bool]] = None) -> Optional[Plan]:
  """The `Plan` of the weight at key path `names` under `qcfg`, or None when it stays unquantized. `shape` may lack
  a stacked leading 'layers' axis (one layer's slice quantizes as its slice of the stacked weight would). Raises
  ConfigError naming qcfg.group_field (the group size's key) for a group that does not divide."""
  if qcfg.scheme == "none" or (only is not None and not only(tuple(names))):
    return None
  axes = contracted_axes(tuple(names), len(shape), qcfg.embedding)
  if axes is None:
    return None
  scheme = leaf_scheme(qcfg.scheme, tuple(names))
  _num_groups(shape[axes[-1]], qcfg.group_size, scheme, "/".join(names), qcfg.group_field)
  packed = scheme == "int4" and names[0] == "blocks" and shape[axes[-1]] % 2 == 0
  return Plan(axes, scheme, packed)


def quantize_leaf(names: tuple[str, ...], w: Any, qcfg: QuantConfig,
                  only: Optional[Callable[[tuple[str, ...]], bool]] = None) -> Any:
  """One weight (or one layer's slice of a stacked weight) as `quantize_params` quantizes it: a `QArray`, or `w`
  itself when it stays unquantized."""
  plan = leaf_plan(names, np.shape(w), qcfg, only)
  return w if plan is None else quantize_array(w, plan.axes, plan.scheme, int(qcfg.group_size), "/".join(names),
                                                plan.packed, qcfg.scale_dtype)


def quantize_params(params: Any, qcfg: QuantConfig, only: Optional[Callable[[tuple[str, ...]], bool]] = None) -> Any:
  """The params tree with every quantizable weight replaced by a `QArray` (others unchanged). `only(key path)`
  picks the weights that may be quantized (a fine-tuning run's frozen base: `dgemma.finetune.frozen_base`);
  leaves that are already `QArray`s stay as they are.

  Leaves may be numpy (e.g. `dgemma.checkpoints.params.load_params`) or jax arrays; each weight is quantized by
  its own jitted call, so peak memory is the input tree plus one weight's temporaries. Under
  `jax.eval_shape` it gives the quantized tree's shapes without allocating (dgemma.tools.memory).
  Bad group sizes raise ConfigError naming qcfg.group_field before any weight is touched.
  """
  if qcfg.scheme == "none":
    return params
  plans = {}  # every weight's Plan, validated before any work
  for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized):
    names = _path_names(path)
    plan = None if is_quantized(leaf) else leaf_plan(names, np.shape(leaf), qcfg, only)
    if plan is not None:
      plans[names] = plan

  def convert(path, leaf):
    names = _path_names(path)
    if names not in plans:
      return leaf
    plan = plans[names]
    return quantize_array(leaf, plan.axes, plan.scheme, int(qcfg.group_size), "/".join(names), plan.packed,
                          qcfg.scale_dtype)

  return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_quantized)


def quantize_boxed(boxed: Any, qcfg: QuantConfig, only: Optional[Callable[[tuple[str, ...]], bool]] = None) -> Any:
  """`quantize_params` of a boxed params tree (nn.Partitioned leaves holding arrays or jax.ShapeDtypeStructs:
  a model's init, `boxed_param_shapes`): a quantized weight becomes a `QArray` whose qvalue and scale are each
  boxed with the weight's logical axis names, so they are placed like the weight (`dgemma.model.sharding.place`
  replicates the scale's reduced axes, which no mesh axis divides)."""
  if qcfg.scheme == "none":
    return boxed
  is_box = lambda x: isinstance(x, nn.Partitioned)
  values = sharding.unbox(boxed)
  abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(values))
  quantize = lambda p: quantize_params(p, qcfg, only)
  quantized = jax.eval_shape(quantize, values) if abstract else quantize(values)

  def rebox(box, value):
    if not is_box(box):
      return value
    return jax.tree.map(box.replace_boxed, value)  # a quantized weight: each of its arrays, boxed

  return jax.tree.map(rebox, boxed, quantized, is_leaf=is_box)


def check(model_cfg, qcfg: QuantConfig) -> None:
  """Raises ConfigError (naming qcfg.group_field, the group size's key) if `qcfg` cannot quantize this
  architecture; shapes only, nothing is allocated: call it before reading a checkpoint."""
  if qcfg.scheme != "none":
    jax.eval_shape(lambda p: quantize_params(p, qcfg), param_shapes(model_cfg))


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """A per-tensor transform: the weights `only(key path)` picks (all when None) quantized as `config` says, the
  others returned as they are. What a checkpoint reader applies to each tensor as it streams (so the float tree
  never exists) and what a train state applies to its frozen base (QLoRA, `dgemma.finetune.base_quantizer`)."""
  config: QuantConfig
  only: Optional[Callable[[tuple[str, ...]], bool]] = None

  def __call__(self, names: tuple[str, ...], w: Any) -> Any:
    """One weight, or one layer's slice of a stacked weight (`quantize_leaf`)."""
    return quantize_leaf(tuple(names), w, self.config, self.only)

  def plan(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], str]]:
    """`leaf_plan`: None for a weight this transform leaves as it is."""
    return leaf_plan(tuple(names), shape, self.config, self.only)

  def params(self, params: Any) -> Any:
    """A whole params tree (`quantize_params`)."""
    return quantize_params(params, self.config, self.only)

  def boxed(self, boxed: Any) -> Any:
    """A boxed params tree or its shapes (`quantize_boxed`): the layout a model's quantized tree is placed as."""
    return quantize_boxed(boxed, self.config, self.only)


@dataclasses.dataclass(frozen=True)
class Chain:
  """Quantizers tried in order, as one per-tensor transform (`Quantizer`'s methods): each weight is quantized by the
  first that quantizes it. `dgemma.load` reads with a QLoRA run's frozen base (finetune.base_quant) first, then
  sample.quant for the rest, so the sampled model's float weights never exist at once."""
  parts: tuple[Quantizer, ...]

  def _first(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Optional[Quantizer]:
    return next((q for q in self.parts if q.plan(names, shape) is not None), None)

  def __call__(self, names: tuple[str, ...], w: Any) -> Any:
    q = self._first(tuple(names), np.shape(w))
    return w if q is None else q(names, w)

  def plan(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Optional[Plan]:
    q = self._first(tuple(names), shape)
    return None if q is None else q.plan(names, shape)

  def params(self, params: Any) -> Any:
    return functools.reduce(lambda tree, q: q.params(tree), self.parts, params)  # a quantized leaf stays as it is

  def boxed(self, boxed: Any) -> Any:
    return functools.reduce(lambda tree, q: q.boxed(tree), self.parts, boxed)


def chain(*quantizers: Optional[Quantizer | Chain]) -> Optional[Quantizer | Chain]:
  """The quantizers given (None, or a 'none' scheme, left out; a Chain's in its order) as one transform; None when
  none is left."""
  parts = []
  for q in quantizers:
    if isinstance(q, Chain):
      parts.extend(q.parts)
    elif q is not None and q.config.scheme != "none":
      parts.append(q)
  return None if not parts else parts[0] if len(parts) == 1 else Chain(tuple(parts))


def stack(pieces: list[Any]) -> Any:
  """Quantized weights (`QArray`s or `PackedInt4`s) of the same shape and grouping stacked along a new leading axis
  (one weight's layers)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *pieces)


def same_layout(a: Any, b: Any) -> bool:
  """Whether two (possibly abstract) quantized weights quantize the same shape the same way: their storage (the
  type, packed or not, and the values' dtype) and scale grouping."""
  return (type(a) is type(b) and jnp.dtype(a.qtype) == jnp.dtype(b.qtype) and tuple(a.shape) == tuple(b.shape)
          and jax.tree.leaves(a)[0].dtype == jax.tree.leaves(b)[0].dtype
          and tuple(a.scale.shape) == tuple(b.scale.shape))


def tree_bytes(tree: Any) -> int:
  """Storage bytes of a (possibly quantized, possibly abstract) tree: int4 counts half a byte."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    dt = jnp.dtype(leaf.dtype)
    bits = 4 if dt == jnp.dtype(jnp.int4) else 8 * dt.itemsize
    total += math.prod(leaf.shape) * bits // 8
  return total
