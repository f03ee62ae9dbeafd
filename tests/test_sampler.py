"""dgemma.sampling: acceptance rule, schedule, stopping, loop forms, batching, cache commits, jit.

Rules come from ../shared/reference/diffusiongemma.md ("Sampler (released defaults)"); token-exact
parity with HF transformers 5.24 is in test_sampler_parity.py.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.model import ConfigError, ModelConfig, Transformer, init_cache, param_shapes
from dgemma.sampling import (JaxNoise, SamplerConfig, accept_confidence, accept_entropy_bound, accept_fixed_k,
                             cut_after_end, denoise_canvas, entropy, generate, row_keys, shape_logits,
                             temperature, trajectory_steps)


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
  # Tiny models: XLA's optimisation passes cost far more compile time than they save.
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


# ---- pure pieces ---------------------------------------------------------------------------------

# One compilation per function (eager calls would compile every primitive separately).
_accept_eb = jax.jit(accept_entropy_bound, static_argnums=1)
_shape = jax.jit(shape_logits, static_argnums=1)
_entropy = jax.jit(lambda logits: entropy(logits)[0])


def test_temperature_schedule_matches_hf_indexing():
  cfg = SamplerConfig(max_denoising_steps=48, t_max=0.8, t_min=0.4)
  temps = np.asarray(jax.vmap(lambda s: temperature(cfg, s))(jnp.arange(48)))
  # HF counts steps 48..1: T = t_min + (t_max - t_min) * cur / 48, so T_0 = t_max, T_47 = t_min + 0.4/48
  expected = 0.4 + 0.4 * np.arange(48, 0, -1) / 48
  np.testing.assert_allclose(temps, expected, rtol=1e-6)
  assert temps[0] == pytest.approx(0.8) and np.all(np.diff(temps) < 0) and temps[-1] > 0.4
  const = SamplerConfig(max_denoising_steps=4, t_max=0.5, t_min=0.5)
  np.testing.assert_allclose(np.asarray(jax.vmap(lambda s: temperature(const, s))(jnp.arange(4))), 0.5)


def _accept_reference(entropy_C, bound):
  """Slow reference of the entropy-bound rule: walk positions by ascending entropy (stable ties)."""
  order = sorted(range(len(entropy_C)), key=lambda i: (entropy_C[i], i))
  accepted, total = np.zeros(len(entropy_C), bool), 0.0
  for i in order:
    total += float(entropy_C[i])
    if total - float(entropy_C[i]) <= bound + 1e-6 * (1 + total):  # fp32 cumsum slack
      accepted[i] = True
  return accepted


def test_entropy_bound_acceptance_matches_slow_reference():
  rs = np.random.RandomState(0)
  ent = rs.exponential(0.05, size=(64, 16)).astype(np.float32)
  ent[::4] *= 20                                   # high-entropy rows: only the lowest accepted
  ent[1::4, :5] = 0.0                              # exact zeros and ties
  ent[2::4] = np.round(ent[2::4], 2)               # many ties
  for bound in (0.0, 0.1, 0.5):
    got = np.asarray(_accept_eb(jnp.asarray(ent), bound))
    want = np.stack([_accept_reference(row, bound) for row in ent])
    # Away from the boundary the rule is exact; differences only where cumsum sits at the bound.
    np.testing.assert_array_equal(got, want)
    assert got.sum(-1).min() >= 1                  # the lowest-entropy token is always accepted
    # accepted positions are exactly the lowest-entropy ones
    for row, acc in zip(ent, got):
      if acc.any() and (~acc).any():
        assert row[acc].max() <= row[~acc].min()


def test_entropy_bound_accepts_prefix_of_sorted_budget():
  ent = jnp.array([[0.3, 0.01, 0.02, 2.0, 0.05]])
  # sorted: 0.01, 0.02, 0.05, 0.3, 2.0 -> cumsum before: 0, .01, .03, .08, .38
  np.testing.assert_array_equal(np.asarray(_accept_eb(ent, 0.1)), [[True, True, True, False, True]])
  np.testing.assert_array_equal(np.asarray(_accept_eb(ent, 0.0)), [[False, True, False, False, False]])


def test_fixed_k_and_confidence_acceptance():
  ent = jnp.array([[0.5, 0.1, 0.9, 0.2], [1.0, 1.0, 1.0, 1.0]])
  np.testing.assert_array_equal(np.asarray(accept_fixed_k(ent, 2)), [[False, True, False, True], [True, True, False, False]])
  top_p = jnp.array([[0.95, 0.5, 0.99, 0.2], [0.1, 0.1, 0.1, 0.1]])
  np.testing.assert_array_equal(np.asarray(accept_confidence(ent, top_p, 0.9)),
                                [[True, True, True, False], [True, False, False, False]])


def test_entropy_and_logit_shaping():
  logits = jnp.log(jnp.array([[[0.5, 0.3, 0.15, 0.05]]]))
  h = _entropy(logits)
  np.testing.assert_allclose(float(h[0, 0]), -np.sum([p * np.log(p) for p in (0.5, 0.3, 0.15, 0.05)]), rtol=1e-5)
  top2 = _shape(logits, SamplerConfig(top_k=2))
  assert np.isinf(np.asarray(top2)[0, 0, 2:]).all() and np.isfinite(np.asarray(top2)[0, 0, :2]).all()
  nucleus = np.asarray(_shape(logits, SamplerConfig(top_p=0.7)))  # 0.5 + 0.3 reach 0.7
  assert np.isfinite(nucleus[0, 0, :2]).all() and np.isinf(nucleus[0, 0, 2:]).all()
  h_top2 = _entropy(top2)  # -inf logits are fine
  assert np.isfinite(float(h_top2[0, 0]))


def test_cut_after_end():
  toks = jnp.array([[5, 1, 7, 106], [5, 6, 7, 8], [106, 9, 1, 9]])
  cut, valid, has_end = cut_after_end(toks, (1, 106), 0)
  np.testing.assert_array_equal(np.asarray(cut), [[5, 1, 0, 0], [5, 6, 7, 8], [106, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(valid.sum(-1)), [2, 4, 1])
  np.testing.assert_array_equal(np.asarray(has_end), [True, False, True])


# ---- config ----------------------------------------------------------------------------------------


def test_sampler_config_from_config_and_validation():
  from configs import base, tiny_test
  config = base.get_config()
  cfg = SamplerConfig.from_config(config)
  released = SamplerConfig()
  for name in ("canvas_len", "max_denoising_steps", "entropy_bound", "t_max", "t_min",
               "stability_threshold", "confidence_threshold", "acceptance", "renoise"):
    assert getattr(cfg, name) == getattr(released, name), name
  assert cfg.end_ids == (1,)                       # trained SentencePiece: no <turn|> piece
  config.data.tokenizer.kind = "file"
  assert SamplerConfig.from_config(config).end_ids == (1, 106)
  tiny = tiny_test.get_config()                     # byte tokenizer: id 106 is the letter 'f'
  assert SamplerConfig.from_config(tiny).end_ids == (1,)
  assert SamplerConfig.from_config(tiny).canvas_len == tiny.diffusion.canvas_len
  tiny.sample.end_ids = (1, 7, 9999)               # explicit ids; outside the vocabulary dropped
  assert SamplerConfig.from_config(tiny).end_ids == (1, 7)
  tiny.sample.t_min = 0.9
  with pytest.raises(ConfigError, match=r"sample.t_min must be <= sample.t_max"):
    SamplerConfig.from_config(tiny)
  for bad, pattern in ((dict(acceptance="greedy"), "sample.acceptance"), (dict(renoise="x"), "sample.renoise"),
                       (dict(max_denoising_steps=0), "sample.max_denoising_steps"),
                       (dict(top_p=0.0), "sample.top_p"), (dict(end_ids=(0,)), "sample.end_ids")):
    with pytest.raises(ConfigError, match=pattern):
      SamplerConfig(**bad)


# ---- the denoising loop with a synthetic decoder ---------------------------------------------------

V_SYN, C_SYN, B_SYN = 32, 6, 3


def _synthetic_decode(canvas_BC, sc_logits_BCV, sc_mask_B):
  """Row 0: one token at margin 40 (confident); rows 1, 2: flat-ish logits that follow the canvas."""
  del sc_logits_BCV, sc_mask_B
  target = jnp.full((C_SYN,), 5)
  row0 = 40.0 * jax.nn.one_hot(target, V_SYN)
  rest = 1.5 * jax.nn.one_hot(canvas_BC[1:], V_SYN) + 0.3 * jnp.sin(jnp.arange(V_SYN) * 1.7)
  return jnp.concatenate([row0[None], rest], axis=0)


@functools.partial(jax.jit, static_argnums=0)
def _denoise_synthetic(cfg, init_BC, done_B, fixed_BC, fixed_mask_BC):
  noise = JaxNoise(row_keys(jax.random.key(3), B_SYN))
  return denoise_canvas(_synthetic_decode, cfg, noise, init_BC, V_SYN, done_B=done_B, fixed_BC=fixed_BC,
                        fixed_mask_BC=fixed_mask_BC, record=True)


def _run_synthetic(cfg, done=None, fixed_BC=None, fixed_mask_BC=None):
  """(final state as numpy, initial canvas); one compilation per cfg."""
  init = JaxNoise(row_keys(jax.random.key(3), B_SYN)).init_canvas(0, C_SYN, V_SYN)
  done = jnp.zeros((B_SYN,), bool) if done is None else done
  if fixed_mask_BC is None:
    fixed_BC, fixed_mask_BC = jnp.zeros((B_SYN, C_SYN), jnp.int32), jnp.zeros((B_SYN, C_SYN), bool)
  st = _denoise_synthetic(cfg, init, done, fixed_BC, fixed_mask_BC)
  return jax.tree.map(np.asarray, st), np.asarray(init)


def test_stopping_and_loop_forms_agree():
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=7, end_ids=(1,))
  st_while, _ = _run_synthetic(cfg)
  st_scan, _ = _run_synthetic(SamplerConfig(**{**cfg.__dict__, "early_exit": False}))
  # row 0: not stable at step 0 (no previous argmax), stable and confident at step 1 -> done
  assert st_while.num_forwards_B.tolist() == [2, 7, 7]
  np.testing.assert_array_equal(st_while.argmax_BC[0], 5)
  assert st_while.traj.active_SB[:, 0].tolist() == [True, True] + [False] * 5
  for a, b in zip(jax.tree.leaves(st_while.replace(step=0)), jax.tree.leaves(st_scan.replace(step=0))):
    np.testing.assert_array_equal(a, b)


def test_finished_rows_stop_changing():
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=7, end_ids=(1,), early_exit=False)
  done = jnp.array([False, True, False])
  st, init = _run_synthetic(cfg, done=done)
  np.testing.assert_array_equal(st.canvas_BC[1], init[1])       # untouched by 7 decoder passes
  np.testing.assert_array_equal(st.argmax_BC[1], -1)
  assert np.all(st.sc_logits_BCV[1] == 0) and st.num_forwards_B[1] == 0
  assert not st.traj.active_SB[:, 1].any() and st.traj.active_SB[:, 2].all()
  assert not np.array_equal(st.canvas_BC[2], init[2])


@pytest.mark.parametrize("acceptance,renoise", [("fixed_k", "none"), ("confidence", "low_confidence")])
def test_ablation_options(acceptance, renoise):
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=4, end_ids=(1,), acceptance=acceptance, accept_k=2,
                      accept_confidence=0.5, renoise=renoise, renoise_confidence=0.05, top_k=8, top_p=0.95,
                      early_exit=False, confidence_threshold=0.0)
  fixed = jnp.zeros((B_SYN, C_SYN), jnp.int32).at[:, 2].set(17)
  fixed_mask = jnp.zeros((B_SYN, C_SYN), bool).at[:, 2].set(True)
  st, _ = _run_synthetic(cfg, fixed_BC=fixed, fixed_mask_BC=fixed_mask)
  traj = st.traj
  # infilled position: always the given token, in every input canvas and in the output
  assert (traj.canvas_SBC[:, :, 2] == 17).all() and (st.argmax_BC[:, 2] == 17).all()
  if acceptance == "fixed_k":
    assert (traj.accepted_SBC.sum(-1) == 2).all()
  if renoise == "none":  # non-accepted positions keep their token
    nxt, cur, acc = traj.canvas_SBC[1:], traj.canvas_SBC[:-1], traj.accepted_SBC[:-1]
    np.testing.assert_array_equal(np.where(acc, cur, nxt), cur)
  if renoise == "low_confidence":  # accepted -> the sampled token
    np.testing.assert_array_equal(np.where(traj.accepted_SBC[:-1], traj.canvas_SBC[1:], -1),
                                  np.where(traj.accepted_SBC[:-1], traj.sampled_SBC[:-1], -1))
  assert traj.active_SB.all()  # confidence_threshold 0: never stops early


# ---- generate with a real (tiny, random) model ------------------------------------------------------

C, S, N = 8, 6, 20         # canvas, steps, max_new_tokens (3 canvases, the last one truncated)
PROMPTS = [[2, 40, 41, 42, 43, 44], [2, 50], [2, 60, 61, 62]]
P = max(map(len, PROMPTS))


def _tiny_model():
  mcfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, layer_types=("sliding", "global"), num_heads=2,
                     num_kv_heads=1, head_dim=8, sliding_window=6, global_num_kv_heads=1, global_head_dim=16,
                     mlp_hidden=48, num_experts=0)
  rs = np.random.RandomState(0)

  def leaf(path, s):
    name = jax.tree_util.keystr(path)
    if "scale" in name or "layer_scalar" in name:
      value = rs.uniform(0.7, 1.3, s.shape)
      if "final_norm" in name:
        value *= 6.0  # sharp logits, so the sampler accepts several tokens and rows can stop
      return jnp.asarray(value, jnp.float32)
    return jnp.asarray(rs.normal(size=s.shape) / np.sqrt(mcfg.d_model), jnp.float32)

  return Transformer(mcfg), jax.tree_util.tree_map_with_path(leaf, param_shapes(mcfg))


class _Messages(logging.Handler):
  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _count_compiles(fn):
  """(fn(), the 'Compiling ...' messages JAX logged while running it)."""
  handler, logger = _Messages(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      out = jax.block_until_ready(fn())
  finally:
    logger.removeHandler(handler)
  return out, [m for m in handler.messages if m.startswith("Compiling")]


@pytest.fixture(scope="module")
def tiny():
  model, params = _tiny_model()
  prompts = np.array([p + [0] * (P - len(p)) for p in PROMPTS])
  lengths = np.array([len(p) for p in PROMPTS])
  keys = jax.random.split(jax.random.key(7), len(PROMPTS))
  cfg = SamplerConfig(canvas_len=C, max_denoising_steps=S, end_ids=(1, 106), confidence_threshold=0.05)
  run = lambda cfg=cfg, rng=keys, **kw: generate(model, params, prompts, lengths, cfg, rng, N,
                                                return_trajectory="all", **kw)
  out, compiles = _count_compiles(run)
  return dict(model=model, params=params, prompts=prompts, lengths=lengths, keys=keys, cfg=cfg, run=run,
              out=jax.tree.map(np.asarray, out), first_compiles=compiles)


def test_generate_outputs_are_consistent(tiny):
  out = tiny["out"]
  assert out.tokens_BN.shape == (3, N) and out.trajectory.active_SB.shape == (3, S, 3)
  for b in range(3):
    toks, n = out.tokens_BN[b], out.lengths_B[b]
    assert (toks[n:] == 0).all()
    ends = np.isin(toks[:n], (1, 106))
    assert ends.sum() == int(out.ended_B[b]) and (not out.ended_B[b] or ends[-1])
  # forwards: the active steps of the trajectory; tokens per forward from them
  np.testing.assert_array_equal(out.num_forwards_B, out.trajectory.active_SB.sum(axis=(0, 1)))
  np.testing.assert_allclose(out.tokens_per_forward_B, out.lengths_B / out.num_forwards_B, rtol=1e-6)
  assert out.trajectory.accepted_SBC.sum(-1).max() > 1
  tokens, accepted, ent = trajectory_steps(out.trajectory, row=0, canvas=0)   # input of the HTML report
  n_steps = int(out.trajectory.active_SB[0, :, 0].sum())
  assert tokens.shape == accepted.shape == ent.shape == (n_steps, C) and (tokens >= 0).all()


def test_whole_generate_is_one_compilation(tiny):
  compiled = [m for m in tiny["first_compiles"] if "_generate_impl" in m]
  assert len(compiled) == 1, tiny["first_compiles"]
  other_keys = jax.random.split(jax.random.key(8), 3)
  out, compiles = _count_compiles(lambda: tiny["run"](rng=other_keys))
  assert compiles == []  # new randomness (and, by shape, new prompts) reuse the program
  assert not np.array_equal(np.asarray(out.tokens_BN), tiny["out"].tokens_BN)
  again = jax.tree.map(np.asarray, tiny["run"]())  # deterministic for a seed
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tiny["out"])):
    np.testing.assert_array_equal(a, b)


def test_scan_and_while_forms_identical(tiny):
  cfg = SamplerConfig(**{**tiny["cfg"].__dict__, "early_exit": False})
  scan = jax.tree.map(np.asarray, tiny["run"](cfg=cfg))
  for a, b in zip(jax.tree.leaves(scan), jax.tree.leaves(tiny["out"])):
    np.testing.assert_array_equal(a, b)


def test_batch_invariance(tiny):
  out = tiny["out"]
  # the same prompts in another order, next to other rows: each row's tokens follow its own key
  perm = [2, 0, 1]
  permuted = generate(tiny["model"], tiny["params"], tiny["prompts"][perm], tiny["lengths"][perm], tiny["cfg"],
                      tiny["keys"][np.array(perm)], N, return_trajectory="all")
  np.testing.assert_array_equal(np.asarray(permuted.tokens_BN), out.tokens_BN[perm])
  np.testing.assert_array_equal(np.asarray(permuted.num_forwards_B), out.num_forwards_B[perm])
  # the shortest prompt alone, unpadded (a different cache layout and batch size)
  b = 1
  alone = generate(tiny["model"], tiny["params"], np.array([PROMPTS[b]]), [len(PROMPTS[b])], tiny["cfg"],
                   tiny["keys"][b:b + 1], N, return_trajectory=True)
  np.testing.assert_array_equal(np.asarray(alone.tokens_BN)[0], out.tokens_BN[b])
  assert int(alone.num_forwards_B[0]) == out.num_forwards_B[b]
  # return_trajectory=True records the first canvas: the same steps as in the batch
  for name in ("canvas_SBC", "accepted_SBC", "active_SB"):
    np.testing.assert_array_equal(np.asarray(getattr(alone.trajectory, name))[0, :, 0],
                                  getattr(out.trajectory, name)[0, :, b], err_msg=name)
  # (rounding differs between batch shapes; self-conditioning amplifies it over the steps)
  alone_ent, batch_ent = np.asarray(alone.trajectory.entropy_SBC)[0, :, 0], out.trajectory.entropy_SBC[0, :, b]
  np.testing.assert_allclose(alone_ent[0], batch_ent[0], atol=1e-5)
  np.testing.assert_allclose(alone_ent, batch_ent, atol=2e-2)


def test_committed_canvas_continues_the_context(tiny):
  """Canvas 2 of a continuing row sees exactly prompt + canvas 1 at positions len .. len + C - 1.

  Reference: a fresh cache holding prompt + the first canvas's tokens contiguously (generate's
  cache has the prompt padding between them), then the second canvas's first decoder input at
  positions len + C ...; its tempered entropies must equal the ones the sampler recorded.
  """
  out, model, params = tiny["out"], tiny["model"], tiny["params"]
  traj = out.trajectory
  rows = [b for b in range(3) if traj.active_SB[1, 0, b]]
  assert rows, "no row reached the second canvas"
  t0 = temperature(tiny["cfg"], 0)

  @jax.jit
  def reference_entropy(ctx_1L, length, canvas_1C):
    L = ctx_1L.shape[1]
    iota = jnp.arange(L)[None]
    cache = init_cache(model.cfg, 1, L)
    _, cache = model.apply({"params": params}, ctx_1L, iota, (iota < length).astype(jnp.int32), cache,
                           return_logits=False, method="encode")
    logits = model.apply({"params": params}, canvas_1C, length + jnp.arange(C)[None], jnp.ones_like(canvas_1C),
                         cache, method="decode")
    return entropy(logits / t0)[0][0]

  for b in rows:
    ctx = np.concatenate([PROMPTS[b], out.tokens_BN[b, :C]])
    ctx = np.pad(ctx, (0, P + C - len(ctx)))[None]   # one shape for every row; padding at the end
    h = reference_entropy(ctx, len(PROMPTS[b]) + C, traj.canvas_SBC[1, 0, b][None])
    np.testing.assert_allclose(np.asarray(h), traj.entropy_SBC[1, 0, b], atol=1e-4, err_msg=f"row {b}")


def test_infilling_forces_tokens_and_end_cut(tiny):
  fixed = np.zeros((3, N), np.int32)
  mask = np.zeros((3, N), bool)
  fixed[0, 3], mask[0, 3] = 1, True          # row 0: EOS at response position 3 -> ends there
  fixed[2, [0, 9]], mask[2, [0, 9]] = (77, 78), True
  out = jax.tree.map(np.asarray, tiny["run"](infill_tokens_BN=fixed, infill_mask_BN=mask))
  assert out.ended_B[0] and out.lengths_B[0] == 4 and (out.tokens_BN[0, 4:] == 0).all()
  assert out.tokens_BN[0, 3] == 1
  assert not out.trajectory.active_SB[1:, :, 0].any()  # no decoder passes after the row ended
  if out.lengths_B[2] > 9:
    assert out.tokens_BN[2, 0] == 77 and out.tokens_BN[2, 9] == 78
  assert out.tokens_BN[2, 0] == 77
