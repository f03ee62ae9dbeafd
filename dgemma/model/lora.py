"""LoRA adapters (Hu et al. 2021): a frozen kernel W plus a trained low-rank update, y = x W + s (x A) B.

The adapters live in the params tree next to the kernel they adapt:
  <proj>/kernel [in..., out...]  ->  <proj>/lora_a [in..., r], <proj>/lora_b [r, out...]
  experts/<name> [E, in, out]    ->  experts/<name>_lora_a [E, in, r], experts/<name>_lora_b [E, r, out]
(one low-rank pair per expert), with the kernel's logical axis names and 'lora_rank' for r (no mesh
rule names it, so the rank axis is replicated). A is initialised like the kernels, B to zero, so an
adapted model starts exactly at its base model. s = alpha / rank.

`LoraConfig` is carried by `ModelConfig.lora` (set from `config.finetune` by `dgemma.settings.from_config`);
None means no adapters anywhere. With `decoder_only` (finetune.mode='head_only') the adapters act
only in decoder mode: the encoder, and so the KV cache, stay exactly the base model's.
`merge` folds adapters into their kernels: W' = W + s A @ B.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

# Module kinds that can carry adapters (finetune.lora_targets); 'all' = every one of them.
TARGETS = ("attn", "mlp", "experts", "router", "self_conditioning")
LORA_A, LORA_B = "lora_a", "lora_b"
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r, scale alpha / r, the adapted module kinds (subset of TARGETS), and whether the adapters
  act only in decoder mode (head_only fine-tuning)."""

  rank: int
  alpha: float
  targets: tuple[str, ...]
  decoder_only: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def to_dict(self) -> dict[str, Any]:
    return dict(rank=self.rank, alpha=self.alpha, targets=list(self.targets), decoder_only=self.decoder_only)


def for_target(lora: LoraConfig | None, target: str) -> LoraConfig | None:
  """`lora` if it adapts modules of kind `target`, else None."""
  return lora if lora is not None and target in lora.targets else None


def is_adapter(name: str) -> bool:
  """Whether a params leaf name is a LoRA factor (lora_a / lora_b, or <expert weight>_lora_a / _b)."""
  return name.endswith(LORA_A) or name.endswith(LORA_B)


def base_name(name: str) -> str:
  """The leaf an adapter factor belongs to: lora_a -> kernel, gate_proj_lora_b -> gate_proj."""
  for suffix in (LORA_A, LORA_B):
    if name == suffix:
      return "kernel"
    if name.endswith("_" + suffix):
      return name[: -len(suffix) - 1]
  raise ValueError(f"{name} is not a LoRA factor")


class LowRank(NamedTuple):
  """One adapter's factors and scale, as passed to the expert kernels (dgemma/model/moe.py)."""

  a: Any
  b: Any
  scale: float


def factor_params(module: nn.Module, prefix: str, lora: LoraConfig, in_shape, in_axes, out_shape, out_axes,
                  param_dtype, batch_shape=(), batch_axes=()) -> LowRank:
  """Creates (or reads) the factors A [batch..., in..., r] and B [batch..., r, out...] of a weight inside
  `module` (batch = the experts axis of expert weights). `prefix` is '' for a `kernel` (names lora_a /
  lora_b) or the weight's name (gate_proj_lora_a, ...)."""
  name = lambda f: f"{prefix}_{f}" if prefix else f
  batch_shape, batch_axes = tuple(batch_shape), tuple(batch_axes)
  a_axes = batch_axes + tuple(in_axes) + (RANK_AXIS,)
  b_axes = batch_axes + (RANK_AXIS,) + tuple(out_axes)
  a = module.param(name(LORA_A), nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), a_axes),
                   batch_shape + tuple(in_shape) + (lora.rank,), param_dtype)
  b = module.param(name(LORA_B), nn.with_logical_partitioning(nn.initializers.zeros, b_axes),
                   batch_shape + (lora.rank,) + tuple(out_shape), param_dtype)
  return LowRank(a, b, lora.scale)


def _free_letter(eqn: str) -> str:
  return next(c for c in "rzyxwqponmlkjiguvs" if c not in eqn)


def einsum_delta(eqn: str, x, factors: LowRank, dtype):
  """s (x A) B for the kernel einsum `eqn` ('<x>,<w>-><y>'): A takes the kernel's input letters (those
  shared with x), B its output letters. Equals einsum(eqn, x, s A @ B) up to round-off."""
  lhs, y = eqn.split("->")
  x_sub, w_sub = lhs.split(",")
  w_in = "".join(c for c in w_sub if c in x_sub)
  w_out = "".join(c for c in w_sub if c not in x_sub)
  x_rest = x_sub
  for c in w_in:
    x_rest = x_rest.replace(c, "")
  r = _free_letter(eqn)
  h = jnp.einsum(f"{x_sub},{w_in}{r}->{x_rest}{r}", x, factors.a.astype(dtype))
  return jnp.einsum(f"{x_rest}{r},{r}{w_out}->{y}", h, factors.b.astype(dtype)) * jnp.asarray(factors.scale, dtype)


def delta_weight(a: np.ndarray, b: np.ndarray, w_shape: tuple[int, ...], scale: float) -> np.ndarray:
  """s A @ B reshaped like W, in fp32 (float64 for float64 factors). Leading axes shared by A, B and W
  (the scanned 'layers' axis, the experts axis) are batch axes: A = [batch..., in..., r], B = [batch..., r, out...]."""
  nb = a.ndim + b.ndim - 2 - len(w_shape)
  batch, r = tuple(w_shape[:nb]), a.shape[-1]
  if nb < 0 or tuple(a.shape[:nb]) != batch or tuple(b.shape[:nb]) != batch or b.shape[nb] != r:
    raise ValueError(f"LoRA factors {a.shape} and {b.shape} do not fit a weight of shape {w_shape}")
  n_in = math.prod(a.shape[nb:-1])
  acc = np.result_type(np.float32, np.asarray(a).dtype, np.asarray(b).dtype)  # fp32, or float64
  prod = np.matmul(np.asarray(a, acc).reshape(batch + (n_in, r)), np.asarray(b, acc).reshape(batch + (r, -1)))
  return scale * prod.reshape(w_shape)


def merge(params: dict, adapters: dict, scale: float) -> dict:
  """Folds every adapter pair of `adapters` (a nested dict shaped like `params`, holding only factors)
  into the matching weight of `params`: W + s A @ B, computed in fp32 (float64 for float64 weights) and
  cast to W's dtype."""
  out = dict(params)
  factor_names = [k for k in adapters if not isinstance(adapters[k], dict)]
  for key, sub in adapters.items():
    if isinstance(sub, dict):
      if key not in params or not isinstance(params[key], dict):
        raise KeyError(f"adapter subtree {key!r} has no match in the base params")
      out[key] = merge(params[key], sub, scale)
  for key in factor_names:
    if not is_adapter(key):
      raise KeyError(f"{key!r} is not a LoRA factor; only factors can be merged")
    if not key.endswith(LORA_A):
      if key[: -len(LORA_B)] + LORA_A not in adapters:
        raise KeyError(f"adapter {key!r} has no matching {LORA_A} factor")
      continue
    b_key = key[: -len(LORA_A)] + LORA_B
    w_key = base_name(key)
    if b_key not in adapters or w_key not in params:
      raise KeyError(f"adapter {key!r}: missing {b_key!r} or base weight {w_key!r}")
    w = np.asarray(params[w_key])
    acc = np.result_type(np.float32, w.dtype)
    out[w_key] = (w.astype(acc) + delta_weight(adapters[key], adapters[b_key], w.shape, scale)).astype(w.dtype)
  return out
