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

from dgemma.model.config import ModelConfig
from dgemma.model import layers
from dgemma.model import lora as lora_lib


class Router(nn.Module):
  """Routing weights from the residual stream, all in fp32.

  HF: RMSNorm without scale, * scale * d^-0.5, linear to E logits, softmax (fp32) over all experts,
  top-k by probability, renormalised to sum 1, * per_expert_scale[idx].
  Returns (logits_TE, probs_TE, weights_Tk, index_Tk). LoRA (target 'router') adapts `proj`.
  """

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_TD: jax.Array):
    cfg = self.cfg
    D, E = cfg.d_model, cfg.num_experts
    pdtype = layers.param_dtype(cfg)
    scale = self.param("scale", layers.ones_init(("norm",)), (D,), pdtype)
    per_expert_scale = self.param("per_expert_scale", layers.ones_init(("expert",)), (E,), pdtype)
    h_TD = layers.rms_norm(x_TD, cfg.rms_eps) * scale.astype(jnp.float32) * (D ** -0.5)
    logits_TE = layers.Einsum((D, E), "td,de->te", ("embed", "expert"), dtype=jnp.float32,
                              param_dtype=pdtype, lora=lora_lib.for_target(cfg.lora, "router"),
                              lora_active=self.lora_active, name="proj")(h_TD)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    top_Tk, index_Tk = jax.lax.top_k(probs_TE, cfg.experts_per_token)
    weights_Tk = top_Tk / jnp.sum(top_Tk, axis=-1, keepdims=True)
    weights_Tk = weights_Tk * per_expert_scale.astype(jnp.float32)[index_Tk]
    return logits_TE, probs_TE, weights_Tk, index_Tk


# Expert LoRA: `adapters` maps 'gate_proj' / 'up_proj' / 'down_proj' to a lora.LowRank with per-expert
# factors A [E, in, r], B [E, r, out]; each adds s (x A_e) B_e to expert e's projection.

def experts_dense(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, adapters=None):
  """Reference: all experts for all tokens, combined with dense [T, E] weights."""
  E = gate_EDF.shape[0]
  adapters = adapters or {}
  x_TD = x_TD.astype(dtype)

  def low_rank(name, eqn_a, eqn_b, h):
    lr = adapters[name]
    return jnp.einsum(eqn_b, jnp.einsum(eqn_a, h, lr.a.astype(dtype)), lr.b.astype(dtype)) * jnp.asarray(lr.scale, dtype)

  g_TEF = jnp.einsum("td,edf->tef", x_TD, gate_EDF.astype(dtype))
  u_TEF = jnp.einsum("td,edf->tef", x_TD, up_EDF.astype(dtype))
  if "gate_proj" in adapters:
    g_TEF = g_TEF + low_rank("gate_proj", "td,edr->ter", "ter,erf->tef", x_TD)
  if "up_proj" in adapters:
    u_TEF = u_TEF + low_rank("up_proj", "td,edr->ter", "ter,erf->tef", x_TD)
  h_TEF = layers.gelu(g_TEF) * u_TEF
  y_TED = jnp.einsum("tef,efd->ted", h_TEF, down_EFD.astype(dtype))
  if "down_proj" in adapters:
    y_TED = y_TED + low_rank("down_proj", "tef,efr->ter", "ter,erd->ted", h_TEF)
  comb_TE = jnp.sum(jax.nn.one_hot(index_Tk, E, dtype=jnp.float32) * weights_Tk[..., None], axis=1)
  return jnp.einsum("te,ted->td", comb_TE, y_TED.astype(jnp.float32)).astype(dtype)


def experts_ragged(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, adapters=None):
  """Dropless sorted grouped matmuls (`jax.lax.ragged_dot`); adapters as ragged_dots of the factors."""
  T, D = x_TD.shape
  E, k = gate_EDF.shape[0], index_Tk.shape[1]
  adapters = adapters or {}
  expert_M = index_Tk.reshape(-1)  # M = T * k (token, slot) pairs, row-major
  order_M = jnp.argsort(expert_M, stable=True)
  group_sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)

  def proj(name, h_MX, w_EXY):
    y = jax.lax.ragged_dot(h_MX, w_EXY.astype(dtype), group_sizes_E)
    if name in adapters:
      lr = adapters[name]
      h_Mr = jax.lax.ragged_dot(h_MX, lr.a.astype(dtype), group_sizes_E)
      y = y + jax.lax.ragged_dot(h_Mr, lr.b.astype(dtype), group_sizes_E) * jnp.asarray(lr.scale, dtype)
    return y

  xs_MD = x_TD.astype(dtype)[order_M // k]
  g_MF = proj("gate_proj", xs_MD, gate_EDF)
  u_MF = proj("up_proj", xs_MD, up_EDF)
  y_MD = proj("down_proj", layers.gelu(g_MF) * u_MF, down_EFD)
  y_TkD = y_MD[jnp.argsort(order_M)].reshape(T, k, D)  # unsort (gather by the inverse permutation)
  return jnp.sum(y_TkD.astype(jnp.float32) * weights_Tk[..., None], axis=1).astype(dtype)


class Experts(nn.Module):
  """E GeGLU experts; weights are plain arrays gate_proj/up_proj [E, D, Fe], down_proj [E, Fe, D].
  LoRA (target 'experts'): a per-expert factor pair next to each (gate_proj_lora_a, ...)."""

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_TD, weights_Tk, index_Tk):
    cfg = self.cfg
    E, D, F = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    pdtype = layers.param_dtype(cfg)
    in_axes, out_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
    gate = self.param("gate_proj", layers.matrix_init(in_axes), (E, D, F), pdtype)
    up = self.param("up_proj", layers.matrix_init(in_axes), (E, D, F), pdtype)
    down = self.param("down_proj", layers.matrix_init(out_axes), (E, F, D), pdtype)
    adapters = {}
    lora = lora_lib.for_target(cfg.lora, "experts")
    if lora is not None:
      for name, axes, (i, o) in (("gate_proj", in_axes, (D, F)), ("up_proj", in_axes, (D, F)),
                                 ("down_proj", out_axes, (F, D))):
        adapters[name] = lora_lib.factor_params(self, name, lora, (i,), axes[1:2], (o,), axes[2:], pdtype,
                                                batch_shape=(E,), batch_axes=axes[:1])
    fn = experts_ragged if cfg.moe_impl == "ragged" else experts_dense
    return fn(x_TD, gate, up, down, weights_Tk, index_Tk, layers.compute_dtype(cfg),
              adapters if self.lora_active else None)


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
  is non-zero, then {'router_aux_loss', 'router_z_loss'} (unweighted scalars for this layer).
  `lora_active` False leaves out the LoRA adapters of router and experts (head_only encoder)."""

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_BTD, xn_BTD, valid_BT):
    cfg = self.cfg
    B, T, D = x_BTD.shape
    logits_TE, probs_TE, weights_Tk, index_Tk = Router(cfg, self.lora_active, name="router")(
        x_BTD.reshape(B * T, D))
    out_TD = Experts(cfg, self.lora_active, name="experts")(xn_BTD.reshape(B * T, D), weights_Tk, index_Tk)
    aux = {}
    if cfg.router_aux_loss_weight or cfg.router_z_loss_weight:
      balance, z = router_losses(logits_TE, probs_TE, index_Tk, valid_BT.reshape(B * T))
      aux = {"router_aux_loss": balance, "router_z_loss": z}
    return out_TD.reshape(B, T, D), aux
