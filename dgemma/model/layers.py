"""Small building blocks of the trunk: dtypes, RMSNorm, projections, RoPE and the GeGLU MLP.

Numerics follow Hugging Face `transformers` 5.24 `models/diffusion_gemma/modeling_diffusion_gemma.py`
(the parity reference): norms in fp32, `scale` multiplied directly (Gemma 4, not 1 + scale), GELU with
the tanh approximation, rotate-half RoPE with cos/sin built in fp32.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from dgemma.model import lora as lora_lib
from dgemma.model import qarray
from dgemma.model.config import GLOBAL, ModelConfig
from dgemma.model.sharding import constrain

Dtype = Any

# HF `initializer_range` (normal init of every linear / embedding matrix).
INIT_STD = 0.02

# 'float64' is for numerical tests only (run under `jax.enable_x64(True)`: tests/model_utils.py).
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}


def dtype_of(name: str) -> Dtype:
  """'float32' | 'bfloat16' | 'float16' | 'float64' -> jnp dtype."""
  if name == "float64" and not jax.config.x64_enabled:  # JAX would silently truncate to fp32
    raise ValueError("dtype 'float64' needs 64-bit JAX: run under `with jax.enable_x64(True):`")
  return _DTYPES[name]


def at_least_f32(dtype: Dtype) -> Dtype:
  """The dtype of the model's "fp32" computations (norms, router, softmax, RoPE, logits): float32
  for bf16 / fp16 / fp32 inputs, float64 for a float64 model (numerical tests)."""
  return jnp.promote_types(dtype, jnp.float32)


def compute_dtype(cfg: ModelConfig) -> Dtype:
  return dtype_of(cfg.dtype)


def param_dtype(cfg: ModelConfig) -> Dtype:
  return dtype_of(cfg.param_dtype)


def attn_dims(cfg: ModelConfig, kind: str) -> tuple[int, int]:
  """(num_kv_heads, head_dim) of a 'sliding' or 'global' layer (HF `per_layer_config`)."""
  if kind == GLOBAL:
    return cfg.global_num_kv_heads, cfg.global_head_dim
  return cfg.num_kv_heads, cfg.head_dim


def matrix_init(axes: Sequence[str]):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev=INIT_STD), tuple(axes))


def ones_init(axes: Sequence[str]):
  return nn.with_logical_partitioning(nn.initializers.ones, tuple(axes))


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """x * (mean(x^2) + eps)^-0.5 over the last axis, in fp32 (HF `DiffusionGemmaRMSNorm._norm`)."""
  x32 = x.astype(at_least_f32(x.dtype))
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis; `scale` (init ones) multiplies directly. Output has the input dtype."""

  eps: float
  with_scale: bool = True
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = rms_norm(x, self.eps)
    if self.with_scale:
      scale = self.param("scale", ones_init(("norm",)), (x.shape[-1],), self.param_dtype)
      y = y * scale.astype(y.dtype)
    return y.astype(x.dtype)


@jax.custom_vjp
def matmul_last(x_ND, w_DF):
  """x @ w over x's last dim ("...d,df->...f"), whose backward forms the weight gradient [D, F] by
  transposing the narrower of x [.., D] and the output gradient [.., F]: x^T g when D <= F, else (g^T x)^T.
  Autodiff's form made XLA CPU transpose the wider one, fused into the GeGLU backward, at a fifth of the
  Sudoku train step (docs/benchmarks.md, "Training"). Same numbers: each entry is one dot over the rows."""
  return jnp.einsum("...d,df->...f", x_ND, w_DF)


def _matmul_last_fwd(x_ND, w_DF):
  return matmul_last(x_ND, w_DF), (x_ND, w_DF)


def _matmul_last_bwd(res, g_NF):
  x_ND, w_DF = res
  D, F = w_DF.shape
  dx_ND = jnp.einsum("...f,df->...d", g_NF, w_DF)
  x_RD, g_RF = x_ND.reshape(-1, D), g_NF.reshape(-1, F)
  if D <= F:
    dw_DF = jnp.einsum("rd,rf->df", x_RD, g_RF)
  else:
    dw_DF = jnp.einsum("rf,rd->fd", g_RF, x_RD).T
  return dx_ND, dw_DF.astype(w_DF.dtype)


matmul_last.defvjp(_matmul_last_fwd, _matmul_last_bwd)


def _is_matmul_last(eqn: str) -> bool:
  """'...d,df->...f' for any two distinct letters: a 2-D kernel contracted with x's last dim."""
  lhs, out = eqn.replace(" ", "").split("->")
  x_sub, w_sub = lhs.split(",")
  return (len(w_sub) == 2 and x_sub.startswith("...") and out.startswith("...") and w_sub[0] != w_sub[1]
          and x_sub[3:] == w_sub[0] and out[3:] == w_sub[1])


class Einsum(nn.Module):
  """A bias-free projection with a `kernel` of explicit shape / logical axes, applied by `eqn`.

  With `lora`, the kernel also gets LoRA factors lora_a / lora_b (dgemma/model/lora.py), which are
  always created but added only when `lora_active` (head_only: decoder mode only).
  The kernel may be a `qarray.QArray` (weight-only int8 / int4, dgemma/model/qarray.py): it is dequantized
  here, inside the (scanned) layer that uses it.
  """

  shape: tuple[int, ...]
  eqn: str
  axes: tuple[str, ...]
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  lora: lora_lib.LoraConfig | None = None
  lora_active: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.param("kernel", matrix_init(self.axes), self.shape, self.param_dtype)
    x = x.astype(self.dtype)
    w_dense = qarray.dequantize(w, self.dtype)
    y = matmul_last(x, w_dense) if _is_matmul_last(self.eqn) else jnp.einsum(self.eqn, x, w_dense)
    if self.lora is not None:
      x_sub, w_sub = self.eqn.split("->")[0].split(",")
      n_in = sum(c in x_sub for c in w_sub)  # kernel dims contracted with x come first
      if any(c not in x_sub for c in w_sub[:n_in]):
        raise ValueError(f"LoRA needs the kernel's input dims first in {self.eqn!r}")
      factors = lora_lib.factor_params(self, "", self.lora, self.shape[:n_in], self.axes[:n_in],
                                       self.shape[n_in:], self.axes[n_in:], self.param_dtype)
      if self.lora_active:
        y = y + lora_lib.einsum_delta(self.eqn, x, factors, self.dtype)
    return y


def gelu(x: jax.Array) -> jax.Array:
  # HF hidden_activation 'gelu_pytorch_tanh'.
  return jax.nn.gelu(x, approximate=True)


class GeGLU(nn.Module):
  """down(gelu(gate(x)) * up(x)) (HF `DiffusionGemmaText4MLP`, also the self-conditioning MLP)."""

  d_model: int
  hidden: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  lora: lora_lib.LoraConfig | None = None  # adapters on the three projections (see Einsum)
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    D, F = self.d_model, self.hidden
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, lora=self.lora, lora_active=self.lora_active)
    gate_BTF = Einsum((D, F), "...d,df->...f", ("embed", "mlp"), name="gate_proj", **kw)(x_BTD)
    up_BTF = Einsum((D, F), "...d,df->...f", ("embed", "mlp"), name="up_proj", **kw)(x_BTD)
    h_BTF = constrain(gelu(gate_BTF) * up_BTF, ("batch", "act_length", "act_mlp"))
    return Einsum((F, D), "...f,fd->...d", ("mlp", "embed"), name="down_proj", **kw)(h_BTF)


# ---- RoPE ---------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, kind: str) -> jax.Array:
  """Inverse frequencies [head_dim // 2] (fp32; float64 for a float64 model) of a layer kind.

  Sliding layers: HF 'default' RoPE on all dims, inv_freq[i] = base^(-2i / H).
  Global layers: HF 'proportional' RoPE (`modeling_rope_utils._compute_proportional_rope_parameters`):
  rope_angles = int(fraction * H // 2); inv_freq[i] = base^(-2i / H) for i < rope_angles (exponent over
  the FULL head dim) and 0 for the remaining H/2 - rope_angles entries, so those dims get cos=1, sin=0.
  With rotate-half this rotates dims [0, rope_angles) paired with [H/2, H/2 + rope_angles).
  """
  f32 = at_least_f32(compute_dtype(cfg))
  if kind == GLOBAL:
    H, base, frac = cfg.global_head_dim, cfg.global_rope_base, cfg.global_rope_fraction
    angles = int(frac * H // 2)
    rotated = 1.0 / (base ** (jnp.arange(0, 2 * angles, 2, dtype=f32) / H))
    return jnp.concatenate([rotated, jnp.zeros((H // 2 - angles,), f32)])
  H, base = cfg.head_dim, cfg.rope_base
  return 1.0 / (base ** (jnp.arange(0, H, 2, dtype=f32) / H))


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """x * cos + rotate_half(x) * sin; cos/sin computed in fp32 then cast to x's dtype (HF)."""
  freqs_BTh = positions_BT[..., None].astype(inv_freq.dtype) * inv_freq
  emb_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
  cos = jnp.cos(emb_BTH).astype(x_BTNH.dtype)[:, :, None, :]
  sin = jnp.sin(emb_BTH).astype(x_BTNH.dtype)[:, :, None, :]
  x1, x2 = jnp.split(x_BTNH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BTNH * cos + rotated * sin
