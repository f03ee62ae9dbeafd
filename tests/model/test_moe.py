"""MoE branch: router semantics, ragged (sorted + ragged_dot) == dense == per-expert loop, grads."""

import dataclasses
import os

# See tests/model/test_transformer.py: halves XLA CPU compile time when set before JAX creates its CPU client.

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from dgemma.model import ModelConfig
from dgemma.model.moe import MoE, Router, router_losses
from tests.model_utils import EPS32

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
  pn = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x_TD = np.asarray(x_TD, np.float64)
  # Reference: RMSNorm without scale, * scale * d^-0.5, linear, softmax, in float64 on the fp32 inputs.
  h = x_TD / np.sqrt(np.mean(x_TD ** 2, -1, keepdims=True) + cfg.rms_eps)
  ref_logits = (h * pn["scale"] * cfg.d_model ** -0.5) @ pn["proj"]["kernel"]
  ref_probs = np.exp(ref_logits - ref_logits.max(-1, keepdims=True))
  ref_probs /= ref_probs.sum(-1, keepdims=True)
  # Tolerances from fp32 round-off: a logit is a D = 16 term dot of O(1) terms (error <= D * u * sum|terms|,
  # u = eps / 2; measured ~1 eps * max|logit|): 50 eps * max|logit|. A logit error dz moves p by <= 2 p dz.
  logit_tol = 50 * EPS32 * np.abs(ref_logits).max()
  np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=logit_tol)
  np.testing.assert_allclose(probs, ref_probs, rtol=2 * logit_tol + 16 * EPS32, atol=0)
  # Top-k are the k most probable experts; weights renormalised to 1, then * per_expert_scale[idx].
  top = np.sort(np.argsort(-probs, axis=-1)[:, :cfg.experts_per_token], -1)
  np.testing.assert_array_equal(np.sort(idx, -1), top)
  unscaled = w / pn["per_expert_scale"][idx]
  np.testing.assert_allclose(unscaled.sum(-1), 1.0, rtol=16 * EPS32)  # <= 4 fp32 roundings (top/sum, * scale)
  sel = np.take_along_axis(probs, idx, -1)
  np.testing.assert_allclose(unscaled, sel / sel.sum(-1, keepdims=True), rtol=16 * EPS32)  # same roundings


def _one_device_mesh_context():
  """A 1-device mesh with all four axes installed, so moe_impl='expert_parallel' runs its shard_map /
  all_to_all code (over an expert axis of size 1) rather than falling back to 'ragged'."""
  from configs.mesh import cpu_host
  from dgemma import mesh as mesh_lib
  mesh = cpu_host.get_config()
  return mesh_lib.mesh_context(mesh_lib.make_mesh(dict(mesh.shape), devices=jax.devices()[:1]), mesh.axis_rules)


def test_ragged_equals_dense_equals_loop_with_grads():
  cfg_r, cfg_d, cfg_e = _cfg(moe_impl="ragged"), _cfg(moe_impl="dense"), _cfg(moe_impl="expert_parallel")
  p = _params(cfg_r)
  x, xn = _inputs(cfg_r)
  valid = jnp.ones((B, T), bool)

  def run(cfg):
    return jax.jit(lambda p, x, xn: MoE(cfg).apply({"params": p}, x, xn, valid)[0])

  out_r, out_d = run(cfg_r)(p, x, xn), run(cfg_d)(p, x, xn)
  ref = _loop_reference(cfg_r, p, x, xn)
  # fp32 vs the float64 loop (same routing): chains of D + Fe + k = 27 fp32 sums of O(1) terms, measured
  # ~1 eps * max|ref|; 50 eps * max|ref| (~2e-5) is ~1e4 below one token sent to a wrong expert.
  tol = 50 * EPS32 * np.abs(ref).max()
  np.testing.assert_allclose(out_r, ref, rtol=0, atol=tol)
  np.testing.assert_allclose(out_d, ref, rtol=0, atol=tol)
  # Expert-parallel dispatch (send buffer, all_to_all, ragged_dot over received rows, return) on one
  # device: the same tokens as the loop; multi-device expert meshes are in tests/train/test_loop.py.
  with _one_device_mesh_context():
    out_e = run(cfg_e)(p, x, xn)
  np.testing.assert_allclose(out_e, ref, rtol=0, atol=tol)

  proj = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, cfg_r.d_model)), jnp.float32)

  def grads(cfg):
    loss = lambda p, x, xn: jnp.sum(MoE(cfg).apply({"params": p}, x, xn, valid)[0] * proj)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(p, x, xn)

  # Two fp32 implementations: per leaf 50 eps * max|grad| (weight grads sum T*k = 30 rows; measured
  # <= 3.1 eps * max|grad|).
  close = lambda a, b: [np.testing.assert_allclose(u, v, rtol=0, atol=50 * EPS32 * np.abs(v).max())
                        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  g_r, g_d = grads(cfg_r), grads(cfg_d)
  close(g_r, g_d)
  with _one_device_mesh_context():
    g_e = grads(cfg_e)
  close(g_e, g_d)
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
  np.testing.assert_allclose(bal, 1.0, rtol=1e-6)  # exact in fp32 (sums of 0.25 and 0.5)
  np.testing.assert_allclose(z, np.log(E) ** 2, rtol=16 * EPS32)  # log, square, 6-term mean: a few roundings
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


def test_capacity_ladder_equals_dense_at_every_rung():
  """moe_impl='capacity' (experts_capacity): the slab size is the smallest rung of the ladder that holds
  the busiest expert; whichever rung runs, the result matches the dense reference, and the first rung alone
  (ladder=False) loses the overflowing pairs, so the ladder is what makes it dropless. Gradients too."""
  from dgemma.model.moe import capacity_rung, capacity_rungs, expert_capacity, experts_capacity, experts_dense
  T_, E, k, D, F = 32, 4, 2, 8, 16
  assert expert_capacity(T_, k, E, 1.0) == 16 and expert_capacity(3, 2, 4, 1.0) == 3
  rungs = capacity_rungs(T_, k, E, 0.5)  # mean load 16: 8, then doubling to T
  assert rungs == (8, 16, 32) and capacity_rungs(T_, k, E, 4.0) == (32,) and capacity_rungs(T_, k, E, 1.5) == (24, 32)
  assert capacity_rungs(2048, 2, 8, 1.5) == (768, 1536, 2048)
  for loads, want in (([8, 8, 8, 8], 0), ([9, 7, 8, 8], 1), ([16, 16, 0, 0], 1), ([17, 15, 0, 0], 2), ([32, 0, 0, 0], 2)):
    assert int(capacity_rung(jnp.asarray(loads), rungs)) == want, loads
  g = np.random.default_rng(3)
  x = jnp.asarray(g.normal(size=(T_, D)), jnp.float32)
  gate, up = (jnp.asarray(g.normal(0, 0.3, (E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(g.normal(0, 0.3, (E, F, D)), jnp.float32)
  w = jnp.asarray(g.uniform(0.1, 1.0, (T_, k)), jnp.float32)
  t = np.arange(T_)
  balanced = jnp.asarray(np.stack([t % E, (t + 1) % E], 1), jnp.int32)        # 16 pairs per expert: rung 1
  skewed = jnp.asarray(np.stack([np.where(t < 24, 0, t % E), np.where(t < 24, 1 + t % 3, (t + 1) % E)], 1),
                       jnp.int32)                                                # expert 0: 24 + pairs: rung 2
  for idx, rung in ((balanced, 1), (skewed, 2)):
    assert int(capacity_rung(jnp.bincount(idx.ravel(), length=E), rungs)) == rung

  def fn(impl, idx, **kw):
    if impl == "dense":
      return jax.jit(lambda x, gt, u, d, w: experts_dense(x, gt, u, d, w, idx, jnp.float32))
    return jax.jit(lambda x, gt, u, d, w: experts_capacity(x, gt, u, d, w, idx, jnp.float32, 0.5, **kw))

  args = (x, gate, up, down, w)
  for idx in (balanced, skewed):
    ref = fn("dense", idx)(*args)
    tol = 50 * EPS32 * np.abs(ref).max()  # two fp32 implementations (see test_ragged_equals_dense...)
    np.testing.assert_allclose(fn("capacity", idx)(*args), ref, rtol=0, atol=tol)
    first_rung_only = fn("capacity", idx, ladder=False)(*args)  # 8 rows per expert: pairs are dropped
    assert float(jnp.abs(first_rung_only - ref).max()) > 1e-2
    proj = jnp.asarray(g.normal(size=(T_, D)), jnp.float32)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * proj), argnums=(0, 1, 2, 3, 4)))(*args)
    for u, v in zip(grad(fn("capacity", idx)), grad(fn("dense", idx))):  # per input: 50 eps * max|grad|
      np.testing.assert_allclose(u, v, rtol=0, atol=50 * EPS32 * np.abs(v).max())


def test_capacity_impl_in_the_moe_layer():
  """MoE(cfg) with moe_impl='capacity' at factors whose slabs hold every token (C = T) and fewer
  (C < T, the switch over the ladder's rungs) gives the per-expert loop's numbers."""
  from dgemma.model.moe import expert_capacity
  x, xn = _inputs(_cfg())
  valid = jnp.ones((B, T), bool)
  assert expert_capacity(B * T, 1, 6, 8.0) == B * T and expert_capacity(B * T, 1, 6, 0.5) < B * T
  for factor in (8.0, 0.5):
    cfg = _cfg(moe_impl="capacity", moe_capacity_factor=factor, num_experts=6, experts_per_token=1)
    p_c = _params(cfg)
    out = jax.jit(lambda p, x, xn: MoE(cfg).apply({"params": p}, x, xn, valid)[0])(p_c, x, xn)
    ref = _loop_reference(cfg, p_c, x, xn)
    np.testing.assert_allclose(out, ref, rtol=0, atol=50 * EPS32 * np.abs(ref).max())  # fp32 vs float64 loop
  with pytest.raises(Exception, match="moe_capacity_factor"):
    _cfg(moe_capacity_factor=0.0)


# ---- moe_impl='tokamax' (tokamax.ragged_dot; its XLA implementation on CPU) ------------------------
# Tolerances: the fp32 path and a float64 reference of the same math (inputs are fp32 values, exact in
# float64) differ by fp32 round-off only. A dot of length n has error <= n * u * sum|terms| (u = eps/2),
# typically ~sqrt(n) * u * sum|terms|; here the longest chains are D = 16 and F <= 16 (forward) and
# the M = T * k = 64 rows a weight gradient sums over, with sum|terms| of the order of the largest
# reference value for these random inputs. 50 * eps * max|ref| covers that with margin and is still
# ~1e4 below what one token sent to a wrong expert changes (checked: a deliberately wrong assignment fails;
# the errors measured here use at most 1/3 of the tolerance, most under 1/15).
_EPS32 = float(np.finfo(np.float32).eps)


def _close(actual, ref, what):
  ref = np.asarray(ref, np.float64)
  tol = 50 * _EPS32 * float(np.abs(ref).max())
  err = float(np.abs(np.asarray(actual, np.float64) - ref).max())
  assert err <= tol, f"{what}: max error {err:.3g} > tolerance {tol:.3g}"


def _f64(fn, *args):
  """fn on the float64 copies of args (floating leaves), results as numpy."""
  with jax.enable_x64(True):
    is_float = lambda a: jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
    args = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)) if is_float(a) else a, args)
    return jax.tree.map(np.asarray, fn(*args))


def _expert_problem(T_=32, E=4, k=2, D=16, F=12, seed=5, lora_rank=0):
  g = np.random.default_rng(seed)
  x = jnp.asarray(g.normal(size=(T_, D)), jnp.float32)
  gate, up = (jnp.asarray(g.normal(0, 0.3, (E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(g.normal(0, 0.3, (E, F, D)), jnp.float32)
  w = jnp.asarray(g.uniform(0.1, 1.0, (T_, k)), jnp.float32)
  idx = jnp.asarray(np.stack([g.permutation(E)[:k] for _ in range(T_)]), jnp.int32)  # k distinct experts
  adapters = None
  if lora_rank:
    from dgemma.model.lora import LowRank
    adapters = {name: LowRank(jnp.asarray(g.normal(0, 0.3, (E, i, lora_rank)), jnp.float32),
                              jnp.asarray(g.normal(0, 0.3, (E, lora_rank, o)), jnp.float32), 0.5)
                for name, (i, o) in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D)))}
  return (x, gate, up, down, w), idx, adapters


@pytest.mark.parametrize("width_multiple, lora_rank", [(1, 0), (16, 0), (16, 2)])
def test_tokamax_equals_float64_reference_with_grads(width_multiple, lora_rank):
  """experts_tokamax (unpadded as on CPU, and F = 12 padded to 16 with gate+up fused as on GPU / TPU;
  with and without expert LoRA) == the dense math in float64, forward and gradients of every input."""
  from dgemma.model.moe import experts_dense, experts_tokamax
  args, idx, adapters = _expert_problem(lora_rank=lora_rank)
  ct = jnp.asarray(np.random.default_rng(9).normal(size=args[0].shape), jnp.float32)
  fn = lambda x, gt, u, d, w, ad: experts_tokamax(x, gt, u, d, w, idx, x.dtype, ad, width_multiple=width_multiple)
  ref_fn = lambda x, gt, u, d, w, ad: experts_dense(x, gt, u, d, w, idx, x.dtype, ad)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct.astype(a[0].dtype)), argnums=(0, 1, 2, 3, 4, 5)))
  out = jax.jit(fn)(*args, adapters)
  ref = _f64(jax.jit(ref_fn), *args, adapters)
  _close(out, ref, "forward")
  names = ("x", "gate", "up", "down", "weights", "adapters")
  g_out, g_ref = grad(fn)(*args, adapters), _f64(grad(ref_fn), *args, adapters)
  for name, a, r in zip(names, g_out, g_ref):
    for leaf_a, leaf_r in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
      _close(leaf_a, leaf_r, f"grad {name}")


def test_tokamax_layer_equals_loop_and_runs_xla_on_cpu():
  """MoE(cfg) with moe_impl='tokamax' gives the float64 per-expert loop's numbers; on CPU the program is
  XLA's ragged_dot_general (tokamax's 'xla' implementation), no Pallas kernel; 'auto' resolves per
  platform and runs too."""
  from dgemma.model import moe
  x, xn = _inputs(_cfg())
  valid = jnp.ones((B, T), bool)
  for impl in ("tokamax", "auto"):
    cfg = _cfg(moe_impl=impl)
    p = _params(cfg)
    run = lambda p, x, xn: MoE(cfg).apply({"params": p}, x, xn, valid)[0]
    _close(jax.jit(run)(p, x, xn), _loop_reference(cfg, p, x, xn), f"MoE {impl}")
  cfg = _cfg(moe_impl="tokamax")
  fwd_bwd = jax.grad(lambda p: jnp.sum(MoE(cfg).apply({"params": p}, x, xn, valid)[0]))
  jaxpr = str(jax.make_jaxpr(fwd_bwd)(_params(cfg)))
  assert "ragged_dot_general" in jaxpr and "pallas_call" not in jaxpr
  assert moe.resolve_impl("auto", "cpu") == "capacity"
  assert moe.resolve_impl("auto", "gpu") == "dense"  # measured on an H200, docs/benchmarks.md
  assert moe.resolve_impl("auto", "tpu") == moe.resolve_impl("auto", "metal") == "ragged"
  assert moe.resolve_impl("ragged", "gpu") == "ragged"


def test_expert_width_padding():
  """moe_kernels.pad_experts / pad_axis on their own: the widths the Mosaic kernels need for the released
  model (F = 704 -> 768), zeros in the padding and the original weights untouched, for plain arrays
  and for int8 (per channel) / int4 (groups of 4) QArrays, whose dequantized padded weight is the
  padded dequantized weight (also by hand: stored values times their tile's scale); LoRA factors along F are
  padded alike."""
  from dgemma import quant
  from dgemma.model import moe_kernels, qarray
  from dgemma.model.lora import LowRank
  assert moe_kernels.padded_width(704, 256) == 768 and moe_kernels.padded_width(768, 256) == 768
  assert moe_kernels.padded_width(704, 1) == 704 and moe_kernels.width_multiple("cpu") == 1
  Fp = moe_kernels.padded_width(704, moe_kernels.width_multiple("gpu"))
  assert Fp % 128 == 0 and (2 * Fp) % 128 == 0 and Fp % 256 == 0 and 2816 % 256 == 0  # see moe_kernels
  g = np.random.default_rng(4)
  E, D, F, r = 3, 8, 12, 2
  gate, up = (jnp.asarray(g.normal(size=(E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(g.normal(size=(E, F, D)), jnp.float32)
  ad = {"gate_proj": LowRank(jnp.ones((E, D, r)), jnp.ones((E, r, F)), 1.0),
        "down_proj": LowRank(jnp.ones((E, F, r)), jnp.ones((E, r, D)), 1.0)}
  pg, pu, pd, pad_ad = moe_kernels.pad_experts(gate, up, down, ad, 16)
  assert pg.shape == pu.shape == (E, D, 16) and pd.shape == (E, 16, D)
  np.testing.assert_array_equal(pg[..., :F], gate)
  np.testing.assert_array_equal(pd[:, :F], down)
  assert not np.any(pg[..., F:]) and not np.any(pu[..., F:]) and not np.any(pd[:, F:])
  assert pad_ad["gate_proj"].b.shape == (E, r, 16) and pad_ad["down_proj"].a.shape == (E, 16, r)
  assert not np.any(pad_ad["gate_proj"].b[..., F:]) and not np.any(pad_ad["down_proj"].a[:, F:])
  assert pad_ad["gate_proj"].a is ad["gate_proj"].a
  assert moe_kernels.pad_experts(gate, up, down, ad, 4) == (gate, up, down, ad)  # 12 is a multiple of 4
  for scheme, group in (("int8", 0), ("int4", 4)):
    qg, qd = (quant.quantize_array(w, (-2,), scheme, group) for w in (gate, down))
    pqg, _, pqd, _ = moe_kernels.pad_experts(qg, qg, qd, None, 16)
    for q, pq, ax in ((qg, pqg, -1), (qd, pqd, -2)):
      want = np.asarray(moe_kernels.pad_axis(qarray.dequantize(q), ax, 16))
      np.testing.assert_array_equal(qarray.dequantize(pq), want)
      by_hand = np.asarray(pq.scale, np.float32)  # each scale repeated over its tile, times the stored values
      for axis, tile in enumerate(pq.scale_tile_shape):
        by_hand = np.repeat(by_hand, tile, axis)
      np.testing.assert_array_equal(np.asarray(pq.qvalue, np.float32) * by_hand, want)
  with pytest.raises(ValueError, match="whole groups"):  # int4 groups of 4 along F = 12 -> 14
    moe_kernels.pad_axis(quant.quantize_array(down, (-2,), "int4", 4), -2, 14)


def _geglu_error_bound(x, gate, up, down, w, idx, deq):
  """Worst-case |MoE(quantized weights) - MoE(weights)| per output, first and second order included, in
  float64: every quantized weight is within half a step (scale / 2) of the original (round to
  nearest), so with dG = |x| @ half-steps of gate (and dU likewise) |g~ - g| <= dG, |u~ - u| <= dU,
  |gelu(g~) - gelu(g)| <= L dG (L = max |gelu'| = 1.13 for the tanh form), hence
  |h~ - h| <= L dG (|u| + dU) + |gelu(g)| dU =: dH and |y~ - y| <= dH @ |down~| + |h| @ half-steps of down,
  summed over the k slots with the routing weights."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  f = {n: np.asarray(v, np.float64) for n, v in (("gate", gate), ("up", up), ("down", down))}
  q = {n: np.asarray(_dequantize(v), np.float64) for n, v in deq.items()}
  half = {n: np.asarray(_half_step(v), np.float64) for n, v in deq.items()}
  gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
  L = 1.13
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for slot in range(idx.shape[1]):
      e = int(idx[t, slot])
      g, u = x[t] @ f["gate"][e], x[t] @ f["up"][e]
      dG, dU = np.abs(x[t]) @ half["gate"][e], np.abs(x[t]) @ half["up"][e]
      dH = L * dG * (np.abs(u) + dU) + np.abs(gelu(g)) * dU
      dY = dH @ np.abs(q["down"][e]) + np.abs(gelu(g) * u) @ half["down"][e]
      out[t] += w[t, slot] * dY
  return out


def _dequantize(w):
  from dgemma.model import qarray
  return qarray.dequantize(w)


def _half_step(w):
  """Half the quantization step of every element of a QArray (its scale, broadcast over its group, / 2)."""
  from dgemma.model import qarray
  return qarray.dequantize(qarray.QArray(qvalue=jnp.ones(w.shape, jnp.int8), scale=w.scale)) / 2


@pytest.mark.parametrize("scheme, group", [("int8", 0), ("int4", 4)])
def test_tokamax_quantized_experts(scheme, group):
  """Quantized expert weights go to tokamax.ragged_dot as qwix QArrays (no dequantization in dgemma): the
  result equals the dense math on the dequantized weights to fp32 round-off (forward, and the input
  gradient a LoRA fine-tune of a quantized model needs), and the float weights' result within the
  derived worst-case quantization error bound (`_geglu_error_bound`)."""
  from tokamax._src.ops.ragged_dot import base
  from dgemma import quant
  from dgemma.model.moe import experts_dense, experts_tokamax
  (x, gate, up, down, w), idx, _ = _expert_problem(F=16)
  qw = {n: quant.quantize_array(v, (-2,), scheme, group) for n, v in (("gate", gate), ("up", up), ("down", down))}
  ct = jnp.asarray(np.random.default_rng(9).normal(size=x.shape), jnp.float32)
  # implementation: tokamax's choice ('xla' on CPU), and the XLA op with the VJP tokamax's Mosaic GPU op
  # uses (which fails for a QArray weight: our custom VJP must be the one that runs).
  mosaic_vjp = (base.RaggedDot(vjp=base.vjp),)
  for multiple, impl in ((1, None), (32, None), (1, mosaic_vjp)):
    fn = lambda x, ws: experts_tokamax(x, ws["gate"], ws["up"], ws["down"], w, idx, x.dtype, width_multiple=multiple,
                                       implementation=impl)
    out = jax.jit(fn)(x, qw)
    deq = {n: np.asarray(_dequantize(v)) for n, v in qw.items()}
    ref_fn = lambda x, d: experts_dense(x, d["gate"], d["up"], d["down"], w.astype(x.dtype), idx, x.dtype)
    _close(out, _f64(ref_fn, x, deq), f"{scheme} forward (x{multiple}, {impl})")
    gx = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, qw) * ct)))(x)
    _close(gx, _f64(jax.grad(lambda x, d: jnp.sum(ref_fn(x, d) * ct.astype(x.dtype))), x, deq), f"{scheme} grad x")
  exact = _f64(lambda x, g, u, d: experts_dense(x, g, u, d, w.astype(x.dtype), idx, x.dtype), x, gate, up, down)
  bound = _geglu_error_bound(x, gate, up, down, w, np.asarray(idx), qw)
  err = np.abs(np.asarray(out, np.float64) - exact)
  assert np.all(err <= bound + 50 * _EPS32 * np.abs(exact).max())
  assert err.max() > 1e3 * _EPS32 * np.abs(exact).max()  # the quantization really changed the result


def test_int4_experts_preset():
  """sample.quantize='int4_experts': expert weights int4 in groups, every other quantized weight int8;
  the MoE layer on those weights gives the same numbers with moe_impl='tokamax' (quantized weights
  to tokamax) as with 'dense' (dequantized in the layer)."""
  from dgemma import quant
  cfg = _cfg()
  p = _params(cfg)
  qcfg = quant.QuantConfig(scheme="int4_experts", group_size=4)
  qp = quant.quantize_params({"moe": p, "dense": {"up_proj": {"kernel": p["experts"]["up_proj"][0]}}}, qcfg)
  assert all(qp["moe"]["experts"][n].qvalue.dtype == jnp.int4 and qp["moe"]["experts"][n].scale.shape[-2] > 1
             for n in ("gate_proj", "up_proj", "down_proj"))
  assert qp["dense"]["up_proj"]["kernel"].qvalue.dtype == jnp.int8
  assert not quant.is_quantized(qp["moe"]["router"]["proj"]["kernel"])
  x, xn = _inputs(cfg)
  valid = jnp.ones((B, T), bool)
  outs = {impl: jax.jit(lambda p, c=_cfg(moe_impl=impl): MoE(c).apply({"params": p}, x, xn, valid)[0])(qp["moe"])
          for impl in ("tokamax", "dense")}
  _close(outs["tokamax"], outs["dense"], "int4_experts tokamax vs dense")


@pytest.mark.parametrize("quantized", [False, True])
def test_dense_experts_in_blocks_equal_all_at_once(quantized):
  """experts_dense with block=2 (model.moe_dense_block: a lax.scan over two blocks of E = 4 experts, their outputs
  summed) == every expert at once, forward and the gradients of x, the routing weights and the expert LoRA factors;
  with packed int4 weights (each block dequantized on its own), the frozen weights' gradient is zero. float64: the
  same products, the sum over experts only regrouped, so they agree to float64 round-off: 1e-12 of the largest
  value (~1e-15 per term over sums of a few dozen terms)."""
  from dgemma.model import qarray
  from dgemma.model.moe import experts_dense
  (x, gate, up, down, w), idx, adapters = _expert_problem(lora_rank=2)
  g = np.random.default_rng(3)

  def weights(f64):
    if not quantized:
      return tuple(jnp.asarray(a, f64) for a in (gate, up, down))
    # int4 values, scales in groups of 4 along the contracted axis, packed two to a byte along it
    make = lambda shape, groups: qarray.pack(qarray.make(
        jnp.asarray(g.integers(-8, 8, shape), jnp.int4),
        jnp.asarray(g.uniform(0.01, 0.05, (shape[0], groups, shape[2])), f64)), -2)
    return make(gate.shape, 4), make(up.shape, 4), make(down.shape, 3)

  ct = np.random.default_rng(9).normal(size=x.shape)
  with jax.enable_x64(True):
    f64 = jnp.float64
    gt, u, d = weights(f64)
    ad = jax.tree.map(lambda a: jnp.asarray(a, f64), adapters)
    x64, w64, ct64 = jnp.asarray(x, f64), jnp.asarray(w, f64), jnp.asarray(ct, f64)

    def loss(block):
      return lambda x, w, ad: jnp.sum(experts_dense(x, gt, u, d, w, idx, f64, ad, block) * ct64)

    outs = {block: jax.tree.map(np.asarray, (experts_dense(x64, gt, u, d, w64, idx, f64, ad, block),
                                             jax.jit(jax.grad(loss(block), argnums=(0, 1, 2)))(x64, w64, ad)))
            for block in (0, 2)}
    if quantized:
      d_scale = jax.grad(lambda s: jnp.sum(experts_dense(
          x64, dataclasses.replace(gt, scale=s), u, d, w64, idx, f64, ad, 2)))(gt.scale)
      assert not np.asarray(d_scale).any()
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[2])):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * float(np.abs(a).max()))
  assert np.abs(outs[0][0]).max() > 0.1
  with pytest.raises(ValueError, match="moe_dense_block"):
    experts_dense(x, gate, up, down, w, idx, jnp.float32, None, 3)
  with pytest.raises(Exception, match="model.moe_dense_block"):
    _cfg(moe_dense_block=4)  # 6 experts
