"""Transformer: parameter contract, masks (by perturbation), cache chunking, self-conditioning,
scan / remat equivalence, bf16. Numerical parity with HF lives in tests/model/test_hf_parity.py."""

import dataclasses
import functools

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from tests.model_utils import f64_config, float64, random_params, to_f64
from dgemma.checkpoints import layout
from dgemma.model import ModelConfig, Transformer, count_params, init_cache, param_shapes

B, T, C = 2, 8, 4
TINY = ModelConfig.from_config_dict(tiny.get_config())
# One sliding layer, window 3: dependencies are exactly the attention mask.
SLIDING = dataclasses.replace(TINY, num_layers=1, layer_types=("sliding",), sliding_window=3)
# Two sliding layers: scanned as 2 blocks of 1 layer (or 1 block of 2); cheap to compile.
TWO = dataclasses.replace(TINY, num_layers=2, layer_types=("sliding", "sliding"))




_params = random_params


def _batch(seed=0, ctx_seg=None, ctx_pos=None, can_seg=None, can_pos=None, V=TINY.vocab_size):
  g = np.random.default_rng(seed)
  tokens = jnp.asarray(g.integers(0, V, (B, T)), jnp.int32)
  canvas = jnp.asarray(g.integers(0, V, (B, C)), jnp.int32)
  ctx_seg = np.ones((B, T), np.int32) if ctx_seg is None else np.asarray(ctx_seg, np.int32)
  ctx_pos = np.tile(np.arange(T), (B, 1)) if ctx_pos is None else np.asarray(ctx_pos)
  can_seg = np.ones((B, C), np.int32) if can_seg is None else np.asarray(can_seg, np.int32)
  can_pos = np.tile(T + np.arange(C), (B, 1)) if can_pos is None else np.asarray(can_pos)
  return tuple(map(jnp.asarray, (tokens, ctx_pos, ctx_seg, canvas, can_pos, can_seg)))


@functools.cache
def _run(cfg):
  model = Transformer(cfg)
  return jax.jit(lambda p, *batch: model.apply({"params": p}, *batch))


@functools.cache
def _enc_dec(cfg):
  model = Transformer(cfg)
  enc = jax.jit(lambda p, *a: model.apply({"params": p}, *a, method=Transformer.encode))
  dec = jax.jit(lambda p, *a, **k: model.apply({"params": p}, *a, **k, method=Transformer.decode))
  return enc, dec


def _dependencies(cfg, batch, tol=1e-9):
  """Which outputs depend on which inputs, by perturbation: {out: {inp: bool [B, n_out, B, n_inp]}}.

  Input token j of each row is replaced in turn; output i depends on it iff its logits move. An
  independent output is unchanged up to float noise (masked keys get probability exactly 0, but
  the ragged MoE may regroup other tokens' rows), a dependent one moves by orders of magnitude more.
  Run in float64 (tests/model_utils.py): the noise is then ~1e-14 on any CPU, where in fp32 it is
  round-off amplified by the model (up to ~1e-4, CPU-dependent) and could reach the threshold.
  (Jacobians would need a vmap of jax.lax.ragged_dot, which has no batching rule, and a second
  compile; perturbing reuses the one compiled forward.)
  """
  with float64():
    return _dependencies_f64(f64_config(cfg), to_f64(_params(cfg)), batch, tol)


def _dependencies_f64(cfg, p, batch, tol):
  run = _run(cfg)
  tokens, pos, seg, canvas, cpos, cseg = batch
  base = [np.asarray(x) for x in run(p, *batch)]
  deps = {"ctx": {}, "can": {}}
  for inp, arr in (("ctx", tokens), ("can", canvas)):
    n = arr.shape[1]
    d = {out: np.zeros((B, base[k].shape[1], B, n), bool) for k, out in enumerate(("ctx", "can"))}
    for b in range(B):
      for j in range(n):
        new = arr.at[b, j].set((arr[b, j] + 1 + j) % cfg.vocab_size)
        outs = run(p, new, pos, seg, canvas, cpos, cseg) if inp == "ctx" else run(p, tokens, pos, seg, new, cpos, cseg)
        for k, out in enumerate(("ctx", "can")):
          delta = np.abs(np.asarray(outs[k]) - base[k]).max(-1)  # [B, n_out]
          assert not ((delta > tol) & (delta < 1e3 * tol)).any(), "ambiguous dependency"
          d[out][:, :, b, j] = delta > tol
    for out in ("ctx", "can"):
      deps[out][inp] = d[out]
  return deps


def _deps(J, out, inp, b):
  """Boolean [n_out, n_inp] dependency matrix of batch row b (and checks rows don't interact)."""
  j = J[out][inp]
  assert not j[b, :, 1 - b].any(), "batch rows interact"
  return j[b, :, b]


# ---- parameter contract -----------------------------------------------------------------------
def test_param_tree_contract():
  model = Transformer(TINY)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *_batch()))["params"]
  shapes = flax.traverse_util.flatten_dict(nn.unbox(boxed), sep="/")
  D, N, nb = TINY.d_model, TINY.num_heads, TINY.num_blocks
  E, F, Fe, V = TINY.num_experts, TINY.mlp_hidden, TINY.expert_hidden, TINY.vocab_size
  want = {"embedder/embedding": (V, D), "final_norm/scale": (D,),
          "self_conditioning/pre_norm/scale": (D,), "self_conditioning/gate_proj/kernel": (D, F),
          "self_conditioning/up_proj/kernel": (D, F), "self_conditioning/down_proj/kernel": (F, D)}
  for i in range(TINY.block_period):
    glob = TINY.layer_types[i] == "global"
    K, H = (TINY.global_num_kv_heads, TINY.global_head_dim) if glob else (TINY.num_kv_heads, TINY.head_dim)
    layer = {"pre_attn_norm/scale": (D,), "attn/q_proj/kernel": (D, N, H), "attn/k_proj/kernel": (D, K, H),
             "attn/o_proj/kernel": (N, H, D), "attn/q_norm/scale": (H,), "attn/k_norm/scale": (H,),
             "post_attn_norm/scale": (D,), "mlp_pre_norm/scale": (D,), "mlp/gate_proj/kernel": (D, F),
             "mlp/up_proj/kernel": (D, F), "mlp/down_proj/kernel": (F, D), "mlp_post_norm/scale": (D,),
             "moe_pre_norm/scale": (D,), "moe/router/proj/kernel": (D, E), "moe/router/scale": (D,),
             "moe/router/per_expert_scale": (E,), "moe/experts/gate_proj": (E, D, Fe),
             "moe/experts/up_proj": (E, D, Fe), "moe/experts/down_proj": (E, Fe, D),
             "moe_post_norm/scale": (D,), "ffw_post_norm/scale": (D,), "layer_scalar": (1,)}
    if not glob:
      layer["attn/v_proj/kernel"] = (D, K, H)
    want.update({f"blocks/layer_{i}/{k}": (nb,) + v for k, v in layer.items()})
  assert {k: v.shape for k, v in shapes.items()} == want

  # Logical partitioning metadata, with the scanned 'layers' axis in front.
  specs = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed), sep="/")
  assert specs["embedder/embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
  assert specs["blocks/layer_0/attn/q_proj/kernel"] == jax.sharding.PartitionSpec(
      "layers", "embed", "heads", "head_dim")
  assert specs["blocks/layer_0/moe/experts/down_proj"] == jax.sharding.PartitionSpec(
      "layers", "expert", "expert_mlp", "embed")

  # Without experts / self-conditioning those branches have no parameters.
  bare = dataclasses.replace(TINY, num_experts=0, self_conditioning=False)
  names = flax.traverse_util.flatten_dict(param_shapes(bare), sep="/")
  assert not any("moe" in k or "self_conditioning" in k for k in names)


def test_param_shapes_are_traced_once_per_architecture_and_each_call_gets_its_own_tree():
  from dgemma.model import transformer
  first = transformer.boxed_param_shapes(TINY)
  # The same tree as a fresh trace of the model's init, boxes (logical axis names) included.
  fresh = transformer._traced_param_shapes.__wrapped__(TINY, False)
  assert jax.tree.structure(first) == jax.tree.structure(fresh)
  assert jax.tree.leaves(first) == jax.tree.leaves(fresh)
  assert nn.get_partition_spec(first) == nn.get_partition_spec(fresh)
  # Asked again: no new trace, and a tree of its own that a caller may change without touching the next one's.
  traces = transformer._traced_param_shapes.cache_info().misses
  second = transformer.boxed_param_shapes(TINY)
  assert transformer._traced_param_shapes.cache_info().misses == traces
  assert second is not first and second == first
  del first["embedder"]
  assert "embedder" in transformer.boxed_param_shapes(TINY)
  # Another architecture is traced for itself.
  wider = dataclasses.replace(TINY, d_model=2 * TINY.d_model)
  assert param_shapes(wider)["embedder"]["embedding"].shape == (TINY.vocab_size, 2 * TINY.d_model)


def test_count_params_26b():
  counts = count_params(ModelConfig())  # the released 26B-A4B trunk, shapes only
  assert abs(counts["total"] / 1e9 - 25.2) < 0.1, counts
  assert abs(counts["active"] / 1e9 - 3.8) < 0.1, counts
  tiny_counts = count_params(TINY)
  experts = TINY.num_layers * TINY.num_experts * 3 * TINY.d_model * TINY.expert_hidden
  assert tiny_counts["experts"] == experts
  assert tiny_counts["active"] == tiny_counts["total"] - experts // 2  # top-2 of 4


def test_router_losses_are_sown():
  cfg = dataclasses.replace(TINY, router_aux_loss_weight=0.01, router_z_loss_weight=0.001)
  model, params, batch = Transformer(cfg), _params(TINY), _batch()
  (_, _), state = jax.eval_shape(lambda: model.apply({"params": params}, *batch, mutable=["intermediates"]))
  inter = state["intermediates"]
  # One weighted scalar per pass (encode, decode) for each loss.
  assert {k: [x.shape for x in v] for k, v in inter.items()} == {
      "router_aux_loss": [(), ()], "router_z_loss": [(), ()]}


# ---- masks --------------------------------------------------------------------------------------
def test_dependencies_causal_encoder_bidirectional_decoder():
  J = _dependencies(TINY, _batch())
  causal = np.tril(np.ones((T, T), bool))
  for b in range(B):
    np.testing.assert_array_equal(_deps(J, "ctx", "ctx", b), causal)  # never a later token
    assert not _deps(J, "ctx", "can", b).any()  # the encoder never sees the canvas
    assert _deps(J, "can", "can", b).all()  # bidirectional canvas
    assert _deps(J, "can", "ctx", b).all()  # the canvas reads the whole context


def test_dependencies_segments_and_padding():
  # Row 0: two packed documents (context segs 1 | 2), canvas tokens of each.
  # Row 1: left-padded prompt (2 pads, segment 0) and a padded last canvas token.
  ctx_seg = [[1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]]
  ctx_pos = [[0, 1, 2, 0, 1, 2, 3, 4], [0, 0, 0, 1, 2, 3, 4, 5]]
  can_seg = [[1, 1, 2, 2], [1, 1, 1, 0]]
  can_pos = [[3, 4, 5, 6], [6, 7, 8, 9]]
  batch = _batch(1, ctx_seg, ctx_pos, can_seg, can_pos)
  J = _dependencies(TINY, batch)
  cs, ks = np.asarray(ctx_seg), np.asarray(can_seg)
  causal = np.tril(np.ones((T, T), bool))
  for b in range(B):  # (a padding token still depends on itself through its own residual stream)
    same_cc = (cs[b][:, None] == cs[b][None]) & (cs[b][:, None] != 0)
    np.testing.assert_array_equal(_deps(J, "ctx", "ctx", b), (same_cc & causal) | np.eye(T, dtype=bool))
    same_kc = (ks[b][:, None] == cs[b][None]) & (ks[b][:, None] != 0)
    np.testing.assert_array_equal(_deps(J, "can", "ctx", b), same_kc)
    same_kk = (ks[b][:, None] == ks[b][None]) & (ks[b][:, None] != 0)
    np.testing.assert_array_equal(_deps(J, "can", "can", b), same_kk | np.eye(C, dtype=bool))
  enc, dec = _run(TINY)(_params(TINY), *batch)
  assert np.isfinite(np.asarray(enc)).all() and np.isfinite(np.asarray(dec)).all()


def test_padded_prompt_rows_match_unpadded():
  # The same 6-token prompt right-padded (row 0) and left-padded (row 1), same canvas/positions.
  g = np.random.default_rng(3)
  prompt, canvas = g.integers(0, TINY.vocab_size, 6), g.integers(0, TINY.vocab_size, C)
  tokens = np.stack([np.concatenate([prompt, [5, 9]]), np.concatenate([[7, 11], prompt])])
  ctx_seg = [[1] * 6 + [0, 0], [0, 0] + [1] * 6]
  ctx_pos = [list(range(6)) + [0, 0], [0, 0] + list(range(6))]
  batch = list(_batch(0, ctx_seg, ctx_pos, None, np.tile(6 + np.arange(C), (B, 1))))
  batch[0], batch[3] = jnp.asarray(tokens, jnp.int32), jnp.asarray(np.stack([canvas, canvas]), jnp.int32)
  # In float64: the two rows reduce over differently placed keys, and in fp32 that round-off, amplified
  # ~150x by the random tiny model (logits ~4), is up to ~7e-5 and CPU-dependent. In float64 it is
  # ~1e-13, so 1e-9 holds anywhere, while attending one padding slot moves the logits by ~1e-1.
  with float64():
    enc, dec = map(np.asarray, _run(f64_config(TINY))(to_f64(_params(TINY)), *batch))
  assert dec.dtype == np.float64
  np.testing.assert_allclose(dec[0], dec[1], rtol=0, atol=1e-9)
  np.testing.assert_allclose(enc[0, :6], enc[1, 2:], rtol=0, atol=1e-9)
  assert np.isfinite(enc).all()


def test_float64_scope_does_not_leak():
  # tests/model_utils.float64 (jax.enable_x64 as a context manager): the same jitted fp32 function gives
  # bit-identical fp32 results before and after a float64 run, and a float64 model outside it raises
  # instead of silently running in fp32.
  batch = _batch(0)
  before = [np.asarray(x) for x in _run(TINY)(_params(TINY), *batch)]
  with float64():
    assert jnp.zeros(()).dtype == jnp.float64
    enc64, _ = _run(f64_config(TINY))(to_f64(_params(TINY)), *batch)
    assert enc64.dtype == jnp.float64
  assert jnp.zeros(()).dtype == jnp.float32 and not jax.config.x64_enabled
  after = [np.asarray(x) for x in _run(TINY)(_params(TINY), *batch)]
  for a, b in zip(before, after):
    assert a.dtype == np.float32 and np.array_equal(a, b)
  with pytest.raises(ValueError, match="float64"):
    _run(f64_config(TINY))(to_f64(_params(TINY)), *batch)


def test_sliding_window():
  # One sliding layer, window W=3: encoder query i sees keys with 0 <= pos_i - pos_j < W; the
  # canvas sees context positions p with canvas_start - p < W (HF DynamicCache keeps W - 1) and
  # the whole canvas. Row 1 is right-padded (positions != slots after the pad).
  W = SLIDING.sliding_window
  ctx_seg = [[1] * T, [1] * 6 + [0, 0]]
  ctx_pos = [list(range(T)), list(range(6)) + [0, 0]]
  can_pos = [T + np.arange(C), 6 + np.arange(C)]
  J = _dependencies(SLIDING, _batch(2, ctx_seg, ctx_pos, None, can_pos))
  for b in range(B):
    pos, seg, start = np.asarray(ctx_pos[b]), np.asarray(ctx_seg[b]), can_pos[b][0]
    valid = (seg[:, None] == seg[None]) & (seg[:, None] != 0)
    d = pos[:, None] - pos[None]
    np.testing.assert_array_equal(_deps(J, "ctx", "ctx", b), (valid & (d >= 0) & (d < W)) | np.eye(T, dtype=bool))
    want = np.broadcast_to((seg != 0) & (start - pos < W), (C, T))
    np.testing.assert_array_equal(_deps(J, "can", "ctx", b), want)
    assert want[0].sum() == W - 1
    assert _deps(J, "can", "can", b).all()


# ---- cache --------------------------------------------------------------------------------------
def test_encode_in_chunks_matches_one_pass():
  # In float64 (see test_padded_prompt_rows_match_unpadded): the two programs differ in reduction
  # order, a fp32 difference of ~3e-5 here; in float64 ~3e-14, so atol 1e-9 holds on any CPU.
  cfg = f64_config(TINY)
  tokens, pos, seg, canvas, cpos, cseg = _batch(4)
  seg = seg.at[0, :3].set(0)  # a left-padded row
  with float64():
    p = to_f64(_params(TINY))
    # One pass: __call__ encodes all T tokens into a fresh cache of size T, then decodes.
    full_logits, dec_full = map(np.asarray, _run(cfg)(p, tokens, pos, seg, canvas, cpos, cseg))
    # Two chunks appended to a fixed-size cache (traced `length`: one compile serves both).
    enc_fn, dec_fn = _enc_dec(cfg)
    h = T // 2
    cache = init_cache(cfg, B, T)
    l1, cache = enc_fn(p, tokens[:, :h], pos[:, :h], seg[:, :h], cache)
    assert int(cache.length) == h
    l2, cache = enc_fn(p, tokens[:, h:], pos[:, h:], seg[:, h:], cache)
    assert int(cache.length) == T
    np.testing.assert_array_equal(cache.segment_ids_BS, seg)
    np.testing.assert_array_equal(cache.positions_BS, pos)
    assert cache.k[0].dtype == jnp.float64
    valid = np.asarray(seg)[..., None] != 0
    np.testing.assert_allclose(np.concatenate([l1, l2], 1) * valid, full_logits * valid, rtol=0, atol=1e-9)
    dec_chunks = np.asarray(dec_fn(p, canvas, cpos, cseg, cache))
  np.testing.assert_allclose(dec_chunks, dec_full, rtol=0, atol=1e-9)
  # Decode never modifies the cache; with return_logits=False encode returns no logits.
  model = Transformer(TINY)
  none, _ = jax.eval_shape(lambda: model.apply({"params": _params(TINY)}, tokens, pos, seg, init_cache(TINY, B, T),
                                               return_logits=False, method=Transformer.encode))
  assert none is None


def test_self_conditioning():
  # In float64: `off` / `half` and `base` are separately compiled programs (fp32 difference ~4e-6
  # here, CPU-dependent); in float64 ~1e-14, so atol 1e-9 holds anywhere.
  cfg = f64_config(TINY)
  tokens, pos, seg, canvas, cpos, cseg = _batch(5)
  sc = np.random.default_rng(0).normal(0, 3, (B, C, TINY.vocab_size))
  with float64():
    p = to_f64(_params(TINY))
    enc_fn, dec_fn = _enc_dec(cfg)
    _, cache = enc_fn(p, tokens, pos, seg, init_cache(cfg, B, T))
    base = np.asarray(dec_fn(p, canvas, cpos, cseg, cache))
    off = np.asarray(dec_fn(p, canvas, cpos, cseg, cache, sc_logits_BCV=sc, sc_mask_B=jnp.array([False, False])))
    half = np.asarray(dec_fn(p, canvas, cpos, cseg, cache, sc_logits_BCV=sc, sc_mask_B=jnp.array([True, False])))
  np.testing.assert_allclose(off, base, rtol=0, atol=1e-9)
  assert np.abs(half[0] - base[0]).max() > 1e-3
  np.testing.assert_allclose(half[1], base[1], rtol=0, atol=1e-9)


# ---- scan / remat / dtype -----------------------------------------------------------------------
def test_scan_matches_unscanned():
  cfg_flat = dataclasses.replace(TWO, scan_layers=False)
  assert (TWO.block_period, TWO.num_blocks) == (1, 2)
  assert (cfg_flat.block_period, cfg_flat.num_blocks) == (2, 1)
  assert (TINY.block_period, TINY.num_blocks) == (2, 2)
  p = to_f64(_params(TWO))
  p_flat = layout.relayout(p, TWO, cfg_flat)  # layer b * period + i = row b of the stacked layer_i
  chex.assert_trees_all_equal_shapes(p_flat, param_shapes(cfg_flat))
  batch = _batch(6)
  # In float64: the same math, but XLA may fuse / block a scan body and straight-line layers
  # differently, which in fp32 is CPU-dependent round-off; in float64 it is ~1e-14, so 1e-9 holds.
  cfg_flat, two = f64_config(cfg_flat), f64_config(TWO)
  with float64():
    flat, scanned = (jax.tree.map(np.asarray, out) for out in (_run(cfg_flat)(p_flat, *batch), _run(two)(p, *batch)))
  assert flat[0].dtype == np.float64
  chex.assert_trees_all_close(flat, scanned, rtol=0, atol=1e-9)


def test_remat_gives_identical_gradients():
  # Decode-only loss (the same scanned, rematerialised blocks as encode) keeps the three grad
  # compiles small; the cache comes from an encode pass and is differentiated through as well.
  # In float64: remat recomputes the forward in a differently fused backward program, which in fp32
  # moves gradients (max ~2.4) by ~8e-6, CPU-dependent; in float64 by ~1e-14, so atol 1e-9 holds.
  two = f64_config(TWO)
  tokens, pos, seg, canvas, cpos, cseg = _batch(7)
  g = np.random.default_rng(1)
  r, sc = g.normal(size=TWO.vocab_size), g.normal(size=(B, C, TWO.vocab_size))
  p = to_f64(_params(TWO))

  def grads(remat):
    model = Transformer(dataclasses.replace(two, remat=remat))

    def loss(p, k, v):
      c = dataclasses.replace(cache, k=k, v=v)
      dec = model.apply({"params": p}, canvas, cpos, cseg, c, sc_logits_BCV=sc, method=Transformer.decode)
      return jnp.mean(jnp.tanh(dec @ r))

    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(p, cache.k, cache.v))

  with float64():
    enc_fn, _ = _enc_dec(two)
    _, cache = enc_fn(p, tokens, pos, seg, init_cache(two, B, T))
    ref = grads("none")
    others = {remat: grads(remat) for remat in ("full", "dots")}
  for path, x in jax.tree_util.tree_leaves_with_path(ref[0]):
    assert x.dtype == np.float64 and float(np.abs(x).max()) > 0, jax.tree_util.keystr(path)
  for remat in ("full", "dots"):
    chex.assert_trees_all_close(others[remat], ref, rtol=0, atol=1e-9)


def test_bf16_close_to_fp32():
  batch = _batch(8)
  # Softer attention than the default random scales: with q/k norm scales ~1 and attention scale
  # 1.0, random weights give near-argmax attention (and near-tied routing) that bf16 rounding
  # flips, which says nothing about the implementation.
  soften = lambda path, x: x * 0.3 if "_norm']['scale" in jax.tree_util.keystr(path) and (
      "q_norm" in jax.tree_util.keystr(path) or "k_norm" in jax.tree_util.keystr(path)) else x
  p = jax.tree_util.tree_map_with_path(soften, _params(TINY))
  enc32, dec32 = map(np.asarray, _run(TINY)(p, *batch))
  cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
  enc16, dec16 = _run(cfg16)(p, *batch)
  assert enc16.dtype == dec16.dtype == jnp.float32  # logits are soft-capped in fp32
  for a, b in ((enc16, enc32), (dec16, dec32)):
    a = np.asarray(a)
    assert np.isfinite(a).all()
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel < 0.05, rel
    assert np.mean(a.argmax(-1) == b.argmax(-1)) > 0.9


@pytest.mark.slow  # float64 whole-model runs of five cache layouts (about 35 s): make test runs it
def test_ring_cache_equals_the_full_cache():
  """Sliding layers' window-sized ring (init_cache(sliding_ring=True), as generation uses it) against the
  full cache, through what the samplers do: a right-padded prompt longer than the window (one encode of
  more tokens than the ring holds, and the same prompt in two chunks), decodes with the HF and the
  per-query window, a committed canvas with a padded tail, then one-token encodes (AR decoding).
  In float64 (tests/model_utils.py): both caches attend the same keys in another order, ~1e-15 apart;
  1e-9 is far below one key too many or too few (window 4 of a few dozen logits, ~1e-1)."""
  cfg = f64_config(dataclasses.replace(TINY, sliding_window=4))
  model = Transformer(cfg)
  g = np.random.default_rng(5)
  P, Cv, V = 9, 4, cfg.vocab_size
  lengths = np.array([9, 3])
  prompt = g.integers(0, V, (2, P))
  seg_P = (np.arange(P)[None] < lengths[:, None]).astype(np.int32)
  pos_P = np.tile(np.arange(P), (2, 1))
  canvas = g.integers(0, V, (2, Cv))
  commit_seg = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
  ones = np.ones((2, Cv), np.int32)

  # Jitted as the samplers run them (one compile per call signature; eager calls re-trace the scanned blocks)
  encode = jax.jit(lambda p, *a: model.apply({"params": p}, *a, method="encode"))
  decode = jax.jit(lambda p, *a, per_query_window=False: model.apply(
      {"params": p}, *a, per_query_window=per_query_window, method="decode"), static_argnames="per_query_window")

  def run(ring: bool, chunks):
    with float64():
      params = to_f64(_params(TINY))
      cache = init_cache(cfg, 2, P + 2 * Cv + 3, jnp.float64, sliding_ring=ring)
      outs = []
      for a, b in chunks:
        logits, cache = encode(params, prompt[:, a:b], pos_P[:, a:b], seg_P[:, a:b], cache)
        outs.append(np.asarray(logits) * seg_P[:, a:b, None])
      pos_C = lengths[:, None] + np.arange(Cv)[None]
      for per_query in (False, True):
        outs.append(np.asarray(decode(params, canvas, pos_C, ones, cache, per_query_window=per_query)))
      _, cache = encode(params, canvas, pos_C, commit_seg, cache)
      pos_C = pos_C + commit_seg.sum(1)[:, None]
      outs.append(np.asarray(decode(params, canvas, pos_C, ones, cache)))
      nxt = pos_C[:, :1]
      for t in range(3):  # AR: one token at a time
        logits, cache = encode(params, canvas[:, t:t + 1], nxt + t, ones[:, :1], cache)
        outs.append(np.asarray(logits))
      shapes = [k.shape[2] for k in cache.k]
    return outs, shapes

  full, full_slots = run(False, [(0, P)])
  ring, ring_slots = run(True, [(0, P)])
  chunked, _ = run(True, [(0, 5), (5, P)])
  assert full_slots == [P + 2 * Cv + 3] * 2  # one array per layer slot of the (sliding, global) block
  assert ring_slots == [4, P + 2 * Cv + 3]  # the sliding layers keep W slots
  for a, b in zip(full, ring):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-9)
  np.testing.assert_allclose(np.concatenate(chunked[:2], axis=1), full[0], rtol=0, atol=1e-9)
  for a, b in zip(full[1:], chunked[2:]):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-9)
  # and the window matters here: without it (W >= every position) the decode logits move
  wide = f64_config(dataclasses.replace(TINY, sliding_window=64))
  with float64():
    params = to_f64(_params(TINY))
    cache = init_cache(wide, 2, P + Cv, jnp.float64)
    _, cache = Transformer(wide).apply({"params": params}, prompt, pos_P, seg_P, cache, method="encode")
    wide_dec = np.asarray(Transformer(wide).apply({"params": params}, canvas, lengths[:, None] + np.arange(Cv)[None],
                                                  ones, cache, method="decode"))
  assert np.max(np.abs(wide_dec[0] - full[1][0])) > 1e-3


def test_tied_logits_gradient_equals_the_einsum_gradient():
  """transformer.tied_logits (x @ table^T through layers.matmul_last, whose backward forms the table's gradient
  as (x^T g)^T) gives the einsum's value and gradients: fp32 against the einsum's own autodiff in float64 on
  the same fp32 inputs, within the fp32 error bound of each quantity (Higham: a length-n dot is off by at
  most n u sum|terms|, u = eps / 2; here 4 n eps, and tanh within a few ulps), propagated through tanh."""
  from dgemma.model.transformer import tied_logits
  eps = float(np.finfo(np.float32).eps)
  g = np.random.default_rng(0)
  B, T, D, V = 2, 5, 16, 96
  x = g.normal(size=(B, T, D)).astype(np.float32)
  table = g.normal(size=(V, D)).astype(np.float32)
  w = g.normal(size=(B, T, V)).astype(np.float32)  # a fixed weighting: loss = sum(w * tanh(logits))
  loss = lambda f: (lambda x, t: jnp.sum(jnp.tanh(f(x, t)) * w))
  val32, (dx32, dt32) = jax.jit(jax.value_and_grad(loss(tied_logits), argnums=(0, 1)))(x, table)
  with jax.enable_x64(True):
    x64, t64, w64 = (np.asarray(a, np.float64) for a in (x, table, w))
    plain = lambda x, t: jnp.einsum("btd,vd->btv", x, t)
    val64, (dx64, dt64) = jax.value_and_grad(lambda x, t: jnp.sum(jnp.tanh(plain(x, t)) * w64), argnums=(0, 1))(x64, t64)
  th = np.tanh(np.einsum("btd,vd->btv", x64, t64))
  gl = (1 - th ** 2) * w64                                            # d loss / d logits
  err_l = 4 * D * eps * np.einsum("btd,vd->btv", np.abs(x64), np.abs(t64))  # fp32 logits
  err_g = np.abs(w64) * (2 * np.abs(th) * err_l + 8 * eps)             # fp32 d loss / d logits
  bound_dx = np.einsum("btv,vd->btd", err_g + 4 * V * eps * (np.abs(gl) + err_g), np.abs(t64))
  bound_dt = np.einsum("btv,btd->vd", err_g + 4 * B * T * eps * (np.abs(gl) + err_g), np.abs(x64))
  bound_val = np.sum(np.abs(w64) * (err_l + 4 * eps)) + 4 * B * T * V * eps * np.sum(np.abs(th * w64))
  assert np.asarray(dx32).dtype == np.float32 and np.asarray(dt32).shape == (V, D)
  assert np.all(np.abs(np.asarray(dx32) - np.asarray(dx64)) <= bound_dx)
  assert np.all(np.abs(np.asarray(dt32) - np.asarray(dt64)) <= bound_dt)
  assert abs(float(val32) - float(val64)) <= bound_val
  # a wrong backward (the table's gradient left untransposed, or x's dropped) is far outside these bounds
  assert np.abs(np.asarray(dt64)).max() > 100 * bound_dt.max()
