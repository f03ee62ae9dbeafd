"""Mixture-of-experts branch: router (HF `DiffusionGemmaTextRouter`) and GeGLU experts.

Two interchangeable expert implementations (`cfg.moe_impl`):
  'ragged': dropless. The T*k (token, slot) pairs are sorted by expert id and run through
            `jax.lax.ragged_dot` with per-expert group sizes, then unsorted and combined.
  'dense':  every expert on every token, combined with a dense [T, E] weight matrix (test reference).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dgemma import quant
from dgemma.model.config import ModelConfig
from dgemma.model import layers


class Router(nn.Module):
  """Routing weights from the residual stream, all in fp32.

  HF: RMSNorm without scale, * scale * d^-0.5, linear to E logits, softmax (fp32) over all experts,
  top-k by probability, renormalised to sum 1, * per_expert_scale[idx].
  Returns (logits_TE, probs_TE, weights_Tk, index_Tk).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_TD: jax.Array):
    cfg = self.cfg
    D, E = cfg.d_model, cfg.num_experts
    pdtype = layers.param_dtype(cfg)
    scale = self.param("scale", layers.ones_init(("norm",)), (D,), pdtype)
    per_expert_scale = self.param("per_expert_scale", layers.ones_init(("expert",)), (E,), pdtype)
    h_TD = layers.rms_norm(x_TD, cfg.rms_eps) * scale.astype(jnp.float32) * (D ** -0.5)
    logits_TE = layers.Einsum((D, E), "td,de->te", ("embed", "expert"), dtype=jnp.float32,
                              param_dtype=pdtype, name="proj")(h_TD)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    top_Tk, index_Tk = jax.lax.top_k(probs_TE, cfg.experts_per_token)
    weights_Tk = top_Tk / jnp.sum(top_Tk, axis=-1, keepdims=True)
    weights_Tk = weights_Tk * per_expert_scale.astype(jnp.float32)[index_Tk]
    return logits_TE, probs_TE, weights_Tk, index_Tk


def experts_dense(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype):
  """Reference: all experts for all tokens, combined with dense [T, E] weights."""
  E = gate_EDF.shape[0]
  x_TD = x_TD.astype(dtype)
  g_TEF = jnp.einsum("td,edf->tef", x_TD, gate_EDF.astype(dtype))
  u_TEF = jnp.einsum("td,edf->tef", x_TD, up_EDF.astype(dtype))
  y_TED = jnp.einsum("tef,efd->ted", layers.gelu(g_TEF) * u_TEF, down_EFD.astype(dtype))
  comb_TE = jnp.sum(jax.nn.one_hot(index_Tk, E, dtype=jnp.float32) * weights_Tk[..., None], axis=1)
  return jnp.einsum("te,ted->td", comb_TE, y_TED.astype(jnp.float32)).astype(dtype)


def experts_ragged(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype):
  """Dropless sorted grouped matmuls (`jax.lax.ragged_dot`)."""
  T, D = x_TD.shape
  E, k = gate_EDF.shape[0], index_Tk.shape[1]
  expert_M = index_Tk.reshape(-1)  # M = T * k (token, slot) pairs, row-major
  order_M = jnp.argsort(expert_M, stable=True)
  group_sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
  xs_MD = x_TD.astype(dtype)[order_M // k]
  g_MF = jax.lax.ragged_dot(xs_MD, gate_EDF.astype(dtype), group_sizes_E)
  u_MF = jax.lax.ragged_dot(xs_MD, up_EDF.astype(dtype), group_sizes_E)
  y_MD = jax.lax.ragged_dot(layers.gelu(g_MF) * u_MF, down_EFD.astype(dtype), group_sizes_E)
  y_TkD = y_MD[jnp.argsort(order_M)].reshape(T, k, D)  # unsort (gather by the inverse permutation)
  return jnp.sum(y_TkD.astype(jnp.float32) * weights_Tk[..., None], axis=1).astype(dtype)


class Experts(nn.Module):
  """E GeGLU experts; weights are plain arrays gate_proj/up_proj [E, D, Fe], down_proj [E, Fe, D]
  (or `quant.QArray`s, dequantized here to the compute dtype)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_TD, weights_Tk, index_Tk):
    cfg = self.cfg
    E, D, F = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    pdtype = layers.param_dtype(cfg)
    gate = self.param("gate_proj", layers.matrix_init(("expert", "embed", "expert_mlp")), (E, D, F), pdtype)
    up = self.param("up_proj", layers.matrix_init(("expert", "embed", "expert_mlp")), (E, D, F), pdtype)
    down = self.param("down_proj", layers.matrix_init(("expert", "expert_mlp", "embed")), (E, F, D), pdtype)
    dtype = layers.compute_dtype(cfg)
    gate, up, down = (quant.dequantize(w, dtype) for w in (gate, up, down))
    fn = experts_ragged if cfg.moe_impl == "ragged" else experts_dense
    return fn(x_TD, gate, up, down, weights_Tk, index_Tk, dtype)


def router_losses(logits_TE, probs_TE, index_Tk, valid_T):
  """Unweighted (Switch load-balancing loss, router z-loss) over valid tokens.

  load balance = E * sum_e f_e * P_e, f_e = fraction of the T*k routing slots sent to e, P_e = mean
  router probability of e; z = mean_t logsumexp(logits_t)^2.
  """
  E, k = probs_TE.shape[-1], index_Tk.shape[-1]
  w_T = valid_T.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(w_T), 1.0)
  counts_TE = jnp.sum(jax.nn.one_hot(index_Tk, E, dtype=jnp.float32), axis=1)
  f_E = jnp.sum(counts_TE * w_T[:, None], axis=0) / (n * k)
  p_E = jnp.sum(probs_TE * w_T[:, None], axis=0) / n
  balance = E * jnp.sum(f_E * p_E)
  z = jnp.sum(jax.nn.logsumexp(logits_TE, axis=-1) ** 2 * w_T) / n
  return balance, z


class MoE(nn.Module):
  """Router reads the residual `x_BTD`; experts read `xn_BTD` (= moe_pre_norm(x), HF
  `pre_feedforward_layernorm_2`). Returns (out_BTD, aux) where aux is {} unless a router loss weight
  is non-zero, then {'router_aux_loss', 'router_z_loss'} (unweighted scalars for this layer)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, xn_BTD, valid_BT):
    cfg = self.cfg
    B, T, D = x_BTD.shape
    logits_TE, probs_TE, weights_Tk, index_Tk = Router(cfg, name="router")(x_BTD.reshape(B * T, D))
    out_TD = Experts(cfg, name="experts")(xn_BTD.reshape(B * T, D), weights_Tk, index_Tk)
    aux = {}
    if cfg.router_aux_loss_weight or cfg.router_z_loss_weight:
      balance, z = router_losses(logits_TE, probs_TE, index_Tk, valid_BT.reshape(B * T))
      aux = {"router_aux_loss": balance, "router_z_loss": z}
    return out_TD.reshape(B, T, D), aux
