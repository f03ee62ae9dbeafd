"""MoE branch: router semantics, ragged (sorted + ragged_dot) == dense == per-expert loop, grads."""

import dataclasses
import os

# See test_model.py: halves XLA CPU compile time when set before JAX creates its CPU client.

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs.models import tiny
from dgemma.model import ModelConfig
from dgemma.model.moe import MoE, Router, router_losses

B, T = 2, 5




def _cfg(**kw):
  d = tiny.get_config()
  d.update(dict(num_experts=6, experts_per_token=3, expert_hidden=8, d_model=16))
  d.update(kw)
  return ModelConfig.from_config_dict(d)


def _params(cfg, seed=0):
  """Random MoE params; router scales != 1 so their use is tested, logits spread (no near-ties)."""
  x = jnp.zeros((B, T, cfg.d_model))
  shapes = jax.eval_shape(lambda: nn.unbox(MoE(cfg).init(jax.random.key(0), x, x, jnp.ones((B, T), bool))["params"]))
  g = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.asarray(g.uniform(0.5, 1.5, s.shape), s.dtype)
    std = 3.0 if "proj" in name and "router" in name else 0.3
    return jnp.asarray(g.normal(0.0, std, s.shape), s.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _inputs(cfg, seed=1):
  g = np.random.default_rng(seed)
  x = jnp.asarray(g.normal(size=(B, T, cfg.d_model)), jnp.float32)
  xn = jnp.asarray(g.normal(size=(B, T, cfg.d_model)), jnp.float32)
  return x, xn


def _loop_reference(cfg, p, x_BTD, xn_BTD):
  """Slow per-token, per-selected-expert numpy loop from the router's (weights, index)."""
  route = jax.jit(lambda p, x: Router(cfg).apply({"params": p}, x))
  _, _, w_Tk, idx_Tk = route(p["router"], x_BTD.reshape(-1, cfg.d_model))
  w_Tk, idx_Tk = np.asarray(w_Tk), np.asarray(idx_Tk)
  e = {k: np.asarray(v, np.float64) for k, v in p["experts"].items()}
  xn = np.asarray(xn_BTD, np.float64).reshape(-1, cfg.d_model)
  gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
  out = np.zeros_like(xn)
  for t in range(xn.shape[0]):
    for slot in range(cfg.experts_per_token):
      j = idx_Tk[t, slot]
      h = gelu(xn[t] @ e["gate_proj"][j]) * (xn[t] @ e["up_proj"][j])
      out[t] += w_Tk[t, slot] * (h @ e["down_proj"][j])
  return out.reshape(x_BTD.shape)


def test_router_topk_renormalised_and_scaled():
  cfg = _cfg()
  p = _params(cfg)["router"]
  x, _ = _inputs(cfg)
  x_TD = x.reshape(-1, cfg.d_model)
  logits, probs, w, idx = jax.jit(lambda p, x: Router(cfg).apply({"params": p}, x))(p, x_TD)
  chex.assert_shape(w, (B * T, cfg.experts_per_token))
  logits, probs, w, idx = map(np.asarray, (logits, probs, w, idx))
  pn = jax.tree.map(np.asarray, p)
  x_TD = np.asarray(x_TD)
  # Reference: RMSNorm without scale, * scale * d^-0.5, linear, fp32 softmax.
  h = x_TD / np.sqrt(np.mean(x_TD ** 2, -1, keepdims=True) + cfg.rms_eps)
  ref_logits = (h * pn["scale"] * cfg.d_model ** -0.5) @ pn["proj"]["kernel"]
  ref_probs = np.exp(ref_logits - ref_logits.max(-1, keepdims=True))
  ref_probs /= ref_probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(probs, ref_probs, rtol=1e-5, atol=1e-6)
  # Top-k are the k most probable experts; weights renormalised to 1, then * per_expert_scale[idx].
  top = np.sort(np.argsort(-probs, axis=-1)[:, :cfg.experts_per_token], -1)
  np.testing.assert_array_equal(np.sort(idx, -1), top)
  unscaled = w / pn["per_expert_scale"][idx]
  np.testing.assert_allclose(unscaled.sum(-1), 1.0, rtol=1e-5)
  sel = np.take_along_axis(probs, idx, -1)
  np.testing.assert_allclose(unscaled, sel / sel.sum(-1, keepdims=True), rtol=1e-5)


def _one_device_mesh_context():
  """A 1-device mesh with all four axes installed, so moe_impl='expert_parallel' runs its shard_map /
  all_to_all code (over an expert axis of size 1) rather than falling back to 'ragged'."""
  from configs.mesh import cpu_host
  from dgemma import trainer
  config = ml_collections.ConfigDict(dict(mesh=cpu_host.get_config()))
  return trainer.mesh_context(trainer.make_mesh(config.mesh, devices=jax.devices()[:1]), config)


def test_ragged_equals_dense_equals_loop_with_grads():
  cfg_r, cfg_d, cfg_e = _cfg(moe_impl="ragged"), _cfg(moe_impl="dense"), _cfg(moe_impl="expert_parallel")
  p = _params(cfg_r)
  x, xn = _inputs(cfg_r)
  valid = jnp.ones((B, T), bool)

  def run(cfg):
    return jax.jit(lambda p, x, xn: MoE(cfg).apply({"params": p}, x, xn, valid)[0])

  out_r, out_d = run(cfg_r)(p, x, xn), run(cfg_d)(p, x, xn)
  ref = _loop_reference(cfg_r, p, x, xn)
  np.testing.assert_allclose(out_r, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out_d, ref, rtol=1e-5, atol=1e-5)
  # Expert-parallel dispatch (send buffer, all_to_all, ragged_dot over received rows, return) on one
  # device: the same tokens as the loop; multi-device expert meshes are in test_train.py.
  with _one_device_mesh_context():
    out_e = run(cfg_e)(p, x, xn)
  np.testing.assert_allclose(out_e, ref, rtol=1e-5, atol=1e-5)

  proj = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, cfg_r.d_model)), jnp.float32)

  def grads(cfg):
    loss = lambda p, x, xn: jnp.sum(MoE(cfg).apply({"params": p}, x, xn, valid)[0] * proj)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(p, x, xn)

  g_r, g_d = grads(cfg_r), grads(cfg_d)
  chex.assert_trees_all_close(g_r, g_d, rtol=1e-4, atol=1e-5)
  with _one_device_mesh_context():
    g_e = grads(cfg_e)
  chex.assert_trees_all_close(g_e, g_d, rtol=1e-4, atol=1e-5)
  # Every parameter and both inputs receive gradient (router through the top-k weights).
  for leaf in jax.tree.leaves(g_r):
    assert float(jnp.abs(leaf).max()) > 0


def test_router_losses():
  E, k, n = 4, 2, 6
  losses = jax.jit(router_losses)
  valid = jnp.array([True] * n + [False] * 3)
  pad_idx = jnp.tile(jnp.array([[2, 3]]), (3, 1))

  def run(logits_nE, idx_nk):  # n valid tokens + 3 padding tokens with other routing
    logits = jnp.concatenate([logits_nE, jnp.full((3, E), 5.0).at[:, 2].set(20.0)])
    return losses(logits, jax.nn.softmax(logits), jnp.concatenate([idx_nk, pad_idx]), valid)

  # Uniform router: load-balance loss is exactly 1 whatever the assignment; z = log(E)^2.
  idx = jnp.tile(jnp.array([[0, 1]]), (n, 1))
  bal, z = run(jnp.zeros((n, E)), idx)
  np.testing.assert_allclose(bal, 1.0, rtol=1e-6)
  np.testing.assert_allclose(z, np.log(E) ** 2, rtol=1e-6)
  # Collapsed router: all mass and assignments on expert 0 -> E * (1/k) * 1.
  bal, _ = run(jnp.tile(jnp.array([[30.0, 0, 0, 0]]), (n, 1)), idx)
  np.testing.assert_allclose(bal, E / k * (1 - 3 * np.exp(-30)), rtol=1e-4)


def test_moe_aux_only_when_enabled():
  x, xn = _inputs(_cfg())
  valid = jnp.ones((B, T), bool)
  p = _params(_cfg())
  _, aux = jax.eval_shape(lambda: MoE(_cfg()).apply({"params": p}, x, xn, valid))
  assert aux == {}
  cfg = dataclasses.replace(_cfg(), router_aux_loss_weight=0.01)
  _, aux = jax.jit(lambda p: MoE(cfg).apply({"params": p}, x, xn, valid))(p)
  assert set(aux) == {"router_aux_loss", "router_z_loss"}
  assert np.isfinite(float(aux["router_aux_loss"])) and float(aux["router_aux_loss"]) > 0
  assert float(aux["router_z_loss"]) > 0


def test_capacity_slabs_equal_dense_and_fall_back_to_ragged_on_overflow():
  """moe_impl='capacity' (experts_capacity): balanced routing stays in the slabs and matches the dense
  reference; routing that overloads an expert would lose pairs in the slabs (fallback=False shows it)
  and is exact through the ragged fallback. Gradients too."""
  from dgemma.model.moe import expert_capacity, experts_capacity, experts_dense
  T_, E, k, D, F = 32, 4, 2, 8, 16
  C = expert_capacity(T_, k, E, 1.0)
  assert C == 16 < T_ and expert_capacity(T_, k, E, 4.0) == T_ and expert_capacity(3, 2, 4, 1.0) == 3
  g = np.random.default_rng(3)
  x = jnp.asarray(g.normal(size=(T_, D)), jnp.float32)
  gate, up = (jnp.asarray(g.normal(0, 0.3, (E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(g.normal(0, 0.3, (E, F, D)), jnp.float32)
  w = jnp.asarray(g.uniform(0.1, 1.0, (T_, k)), jnp.float32)
  t = np.arange(T_)
  balanced = jnp.asarray(np.stack([t % E, (t + 1) % E], 1), jnp.int32)        # 16 pairs per expert
  skewed = jnp.asarray(np.stack([np.where(t < 24, 0, t % E), np.where(t < 24, 1 + t % 3, (t + 1) % E)], 1),
                       jnp.int32)                                                # expert 0: 24 + pairs
  assert np.bincount(np.asarray(balanced).ravel()).max() == C
  assert np.bincount(np.asarray(skewed).ravel()).max() > C

  def fn(impl, idx, **kw):
    if impl == "dense":
      return jax.jit(lambda x, gt, u, d, w: experts_dense(x, gt, u, d, w, idx, jnp.float32))
    return jax.jit(lambda x, gt, u, d, w: experts_capacity(x, gt, u, d, w, idx, jnp.float32, 1.0, **kw))

  args = (x, gate, up, down, w)
  for idx in (balanced, skewed):
    ref = fn("dense", idx)(*args)
    np.testing.assert_allclose(fn("capacity", idx)(*args), ref, rtol=1e-5, atol=1e-5)
    slabs_only = fn("capacity", idx, fallback=False)(*args)
    if idx is balanced:
      np.testing.assert_allclose(slabs_only, ref, rtol=1e-5, atol=1e-5)
    else:  # the overflowing pairs are missing from the slab-only result
      assert float(jnp.abs(slabs_only - ref).max()) > 1e-2
    proj = jnp.asarray(g.normal(size=(T_, D)), jnp.float32)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * proj), argnums=(0, 1, 2, 3, 4)))(*args)
    chex.assert_trees_all_close(grad(fn("capacity", idx)), grad(fn("dense", idx)), rtol=1e-4, atol=1e-5)


def test_capacity_impl_in_the_moe_layer():
  """MoE(cfg) with moe_impl='capacity' at factors whose slabs hold every token (C = T) and fewer
  (C < T, the cond between slabs and ragged) gives the per-expert loop's numbers."""
  from dgemma.model.moe import expert_capacity
  x, xn = _inputs(_cfg())
  valid = jnp.ones((B, T), bool)
  assert expert_capacity(B * T, 1, 6, 8.0) == B * T and expert_capacity(B * T, 1, 6, 0.5) < B * T
  for factor in (8.0, 0.5):
    cfg = _cfg(moe_impl="capacity", moe_capacity_factor=factor, num_experts=6, experts_per_token=1)
    p_c = _params(cfg)
    out = jax.jit(lambda p, x, xn: MoE(cfg).apply({"params": p}, x, xn, valid)[0])(p_c, x, xn)
    np.testing.assert_allclose(out, _loop_reference(cfg, p_c, x, xn), rtol=1e-5, atol=1e-5)
  with pytest.raises(Exception, match="moe_capacity_factor"):
    _cfg(moe_capacity_factor=0.0)
