"""dgemma.sampling: acceptance rule, schedule, stopping, loop forms, batching, cache commits, jit.

Rules come from ../shared/reference/diffusiongemma.md ("Sampler (released defaults)"); token-exact
parity with HF transformers 5.24 is in test_sampler_parity.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import settings as settings_lib
from dgemma.errors import ConfigError

from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.sampling import (FixedNoise, JaxNoise, SamplerConfig, accept_confidence, accept_entropy_bound,
                             accept_fixed_k, alpha, canvas_result, cut_after_end, denoise_canvas, entropy, generate,
                             initial_canvas,
                             masked_posterior, row_keys, shape_logits, temperature, trajectory_steps,
                             uniform_posterior)


def _sampler_of(config) -> SamplerConfig:
  """The SamplerConfig a config's settings give, checked against its training objective."""
  return settings_lib.from_config(config).canvas_sampler


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
  np.testing.assert_allclose(temps, expected, rtol=1e-6)  # <= 4 fp32 roundings (< 3 eps); 1e-6 = 8 eps
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
  # fp32 log-softmax and a 4-term sum of |p log p| <= 0.4 terms: a few eps of H ~ 1.1; 1e-5 = 84 eps
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


def test_automatic_end_ids_come_from_the_tokenizer_file(tmp_path):
  """kind='file': EOS and `<turn|>` are read from the SentencePiece file, so a foreign model (EOS at 2, an
  ordinary piece at 106) does not stop at 106; a Gemma-like file stops at its EOS and its <turn|>."""
  import sentencepiece as spm
  from configs import base
  lines = [f"user {i} says hello to the model and the model answers {i * 7}" for i in range(200)]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "foreign"),
                                 vocab_size=150, pad_id=3, hard_vocab_limit=False, minloglevel=2)  # unk 0 bos 1 eos 2
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "gemma_like"),
                                 vocab_size=150, pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False,
                                 control_symbols=["<|turn>", "<turn|>"], minloglevel=2)
  config = base.get_config()
  config.data.tokenizer.kind = "file"
  config.model.vocab_size = 256
  config.data.tokenizer.path = str(tmp_path / "foreign.model")
  foreign = spm.SentencePieceProcessor(model_file=config.data.tokenizer.path)
  assert foreign.eos_id() == 2 and foreign.id_to_piece(106) not in ("<turn|>", "</s>")
  assert _sampler_of(config).end_ids == (2,)
  config.data.tokenizer.path = str(tmp_path / "gemma_like.model")
  assert _sampler_of(config).end_ids == (1, spm.SentencePieceProcessor(
      model_file=config.data.tokenizer.path).piece_to_id("<turn|>"))


def test_sampler_config_from_config_and_validation():
  from configs import base, tiny_test
  config = base.get_config()
  cfg = _sampler_of(config)
  released = SamplerConfig()
  for name in ("canvas_len", "max_denoising_steps", "entropy_bound", "t_max", "t_min",
               "stability_threshold", "confidence_threshold", "acceptance", "renoise"):
    assert getattr(cfg, name) == getattr(released, name), name
  assert cfg.end_ids == (1,)                       # trained SentencePiece: no <turn|> piece
  config.data.tokenizer.kind = "file"
  assert _sampler_of(config).end_ids == (1, 106)  # no file yet: Gemma 4's ids
  tiny = tiny_test.get_config()                     # byte tokenizer: id 106 is the letter 'f'
  assert _sampler_of(tiny).end_ids == (1,)
  assert _sampler_of(tiny).canvas_len == tiny.diffusion.canvas_len
  tiny.sample.end_ids = (1, 7, 9999)               # explicit ids; outside the vocabulary dropped
  assert _sampler_of(tiny).end_ids == (1, 7)
  tiny.sample.t_min = 0.9
  with pytest.raises(ConfigError, match=r"sample.t_min must be <= sample.t_max"):
    _sampler_of(tiny)
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
  assert np.all(st.sc_BCX[1] == 0) and st.num_forwards_B[1] == 0
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
  assert traj.accepted_SBC[:, :, 2].all()
  if acceptance == "fixed_k":  # infilled positions are outside the budget: k open positions per step
    assert (traj.accepted_SBC[:, :, [0, 1, 3, 4, 5]].sum(-1) == 2).all()
  if renoise == "none":  # non-accepted positions keep their token
    nxt, cur, acc = traj.canvas_SBC[1:], traj.canvas_SBC[:-1], traj.accepted_SBC[:-1]
    np.testing.assert_array_equal(np.where(acc, cur, nxt), cur)
  # held tokens are what the next step reads
  np.testing.assert_array_equal(np.where(traj.accepted_SBC[:-1], traj.canvas_SBC[1:], -1),
                                np.where(traj.accepted_SBC[:-1], traj.shown_SBC[:-1], -1))
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
  # one fp32 division of the same two integers (<= 0.5 ulp)
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
  # Step 0 (no self-conditioning yet): one decoder pass with another cache layout and batch size, so
  # another fp32 reduction order. For this model a step's fp32 entropies are within 4e-6 of a float64
  # run (measured, logits within 2e-5 of |logits| <= 23), so two layouts differ by < 1e-5 on this CPU
  # but not with margin on any: 1e-4; attending the prompt padding moves them by > 0.8.
  # Later steps: self-conditioning feeds each step's logits into the next, amplifying it: 2e-2.
  alone_ent, batch_ent = np.asarray(alone.trajectory.entropy_SBC)[0, :, 0], out.trajectory.entropy_SBC[0, :, b]
  np.testing.assert_allclose(alone_ent[0], batch_ent[0], atol=1e-4)
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
    # another cache layout: fp32 round-off only, each within 4e-6 of float64 (measured; see test_batch_invariance)
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


# ---- renoise='low_confidence': accepted tokens stay until their confidence falls ------------------

V_LC, C_LC, S_LC = 16, 4, 3


def _low_confidence_decode(canvas_BC, sc_logits_BCV, sc_mask_B):
  """Step 0 (no self-conditioning signal): position 0 sure of 7. Later steps: position 0 prefers 9
  (p = 0.9, so p(7) < 0.01), position 1 is sure of 3 unless it already holds 3 (then p(3) = 0.6)."""
  del sc_logits_BCV
  later_B11 = sc_mask_B[:, None, None]
  one = lambda tok, scale: scale * jax.nn.one_hot(jnp.full(canvas_BC.shape[:1], tok), V_LC)[:, None, :]
  zeros = jnp.zeros((canvas_BC.shape[0], 1, V_LC))
  pos0 = jnp.where(later_B11, one(9, np.log(135.0)), one(7, 40.0))
  holds3_B11 = (canvas_BC[:, 1] == 3)[:, None, None]
  pos1 = jnp.where(later_B11, jnp.where(holds3_B11, one(3, np.log(22.5)), one(3, 40.0)), zeros)
  return jnp.concatenate([pos0, pos1, zeros, zeros], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _denoise_fixed(decode_fn, cfg, noise, init_BC):
  return denoise_canvas(decode_fn, cfg, noise, init_BC, noise.gumbel_NSBCV.shape[-1], record=True)


def test_low_confidence_renoises_accepted_tokens_below_threshold():
  noise = FixedNoise(init_canvas_NBC=jnp.full((1, 1, C_LC), 12, jnp.int32),
                     gumbel_NSBCV=jnp.zeros((1, S_LC, 1, C_LC, V_LC)),          # sample = argmax
                     renoise_NSBC=jnp.broadcast_to((13 + jnp.arange(S_LC))[None, :, None, None], (1, S_LC, 1, C_LC)))
  base = dict(canvas_len=C_LC, max_denoising_steps=S_LC, end_ids=(1,), acceptance="fixed_k", accept_k=1,
              renoise_confidence=0.5, t_max=1.0, t_min=1.0, confidence_threshold=0.0, early_exit=False)
  run = lambda renoise: jax.tree.map(np.asarray, _denoise_fixed(
      _low_confidence_decode, SamplerConfig(renoise=renoise, **base), noise, noise.init_canvas_NBC[0]))
  low = run("low_confidence")
  # step 0 accepts 7 at position 0; at step 1 p(7) < 0.5: re-noised (13 + 1), and position 1 accepts 3;
  # at step 2 p(3) = 0.6 >= 0.5: 3 stays held (outside the budget) while position 0 is accepted again
  np.testing.assert_array_equal(low.traj.canvas_SBC[:, 0], [[12] * 4, [7, 13, 13, 13], [14, 3, 14, 14]])
  np.testing.assert_array_equal(low.traj.accepted_SBC[:, 0], [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(low.canvas_BC[0], [9, 3, 15, 15])
  np.testing.assert_array_equal(low.held_BC[0], [True, True, False, False])
  # released re-noising: the same run re-predicts position 1 at step 2 and, not accepted, re-noises it
  released = run("non_accepted")
  np.testing.assert_array_equal(released.traj.canvas_SBC[:, 0], low.traj.canvas_SBC[:, 0])
  np.testing.assert_array_equal(released.canvas_BC[0], [9, 15, 15, 15])
  assert not released.held_BC.any()


# ---- uniform-state ancestral sampling ---------------------------------------------------------------

_posterior = jax.jit(uniform_posterior)


def _posterior_numpy(x_V, z, alpha_t, alpha_s):
  """The reference doc's formula term by term, float64, one-hot vectors."""
  n = len(x_V)
  z_V = np.eye(n)[z]
  q = (n * alpha_t * x_V * z_V + (alpha_t / alpha_s - alpha_t) * z_V + (alpha_s - alpha_t) * x_V
       + (1 - alpha_t / alpha_s) * (1 - alpha_s) / n)
  assert np.isclose(q.sum(), n * alpha_t * x_V[z] + 1 - alpha_t)  # the normaliser
  return q / q.sum()


def test_uniform_posterior_matches_formula_and_limits():
  rs = np.random.RandomState(0)
  B, Cp, V = 2, 3, 7
  x = rs.dirichlet(np.full(V, 0.5), size=(B, Cp)).astype(np.float32)
  z = rs.randint(0, V, size=(B, Cp))
  for alpha_t, alpha_s in ((0.0, 0.3), (0.2, 0.5), (0.6, 0.61), (0.9, 1.0), (1e-3, 0.02)):
    got = np.asarray(_posterior(x, z, alpha_t, alpha_s))
    # float64 reference at the fp32-rounded alphas the function sees (0.61 - 0.6 would otherwise carry
    # their rounding x60): ~10 fp32 roundings, measured <= 2.1 eps relative; rtol 1e-5 = 84 eps
    a32 = lambda a: float(np.float32(a))
    want = np.array([[_posterior_numpy(x[b, c].astype(np.float64), z[b, c], a32(alpha_t), a32(alpha_s))
                      for c in range(Cp)] for b in range(B)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)  # a V = 7 term sum: <= 3 eps (measured 1 eps)
  # s = 0 (alpha_s = 1) with the exact clean token gives it back, whatever z_t is
  clean = rs.randint(0, V, size=(B, Cp))
  exact = np.eye(V, dtype=np.float32)[clean]
  for zt in (z, clean):
    np.testing.assert_allclose(np.asarray(_posterior(exact, zt, 0.4, 1.0)), exact, atol=1e-7)
  # no time passes (alpha_s == alpha_t): z_t stays (in both limits the other terms vanish exactly: 1e-7 is slack)
  np.testing.assert_allclose(np.asarray(_posterior(x, z, 0.5, 0.5)), np.eye(V)[z], atol=1e-7)


def test_alpha_schedules():
  t = jnp.linspace(0.0, 1.0, 5)
  lin = SamplerConfig(sampler="ancestral")
  loglin = SamplerConfig(sampler="ancestral", alpha_schedule="loglinear", schedule_eps=1e-3)
  np.testing.assert_allclose(np.asarray(jax.jit(lambda t: alpha(lin, t))(t)), 1 - np.asarray(t), atol=1e-7)  # exact
  sigma = -np.log1p(-(1 - 1e-3) * np.asarray(t, np.float64))
  # fp32 log / exp of O(1) values: measured <= 0.6 eps relative; 1e-5 = 84 eps
  np.testing.assert_allclose(np.asarray(jax.jit(lambda t: alpha(loglin, t))(t)), np.exp(-sigma), rtol=1e-5)
  assert float(alpha(loglin, 1.0)) == pytest.approx(1e-3, rel=1e-4)


def test_ancestral_steps_draw_from_the_posterior():
  """Each step's z_s is the Gumbel-max draw from q(. | z_t, softmax(proc)) at t = 1 - s/S -> 1 - (s+1)/S;
  the last step is greedy; no early stopping; the result is the final canvas."""
  S_A = 4
  rs = np.random.RandomState(1)
  noise = FixedNoise(init_canvas_NBC=jnp.asarray(rs.randint(0, V_SYN, (1, B_SYN, C_SYN))),
                     gumbel_NSBCV=jnp.asarray(rs.gumbel(size=(1, S_A, B_SYN, C_SYN, V_SYN)), jnp.float32),
                     renoise_NSBC=jnp.zeros((1, S_A, B_SYN, C_SYN), jnp.int32))
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="ancestral",
                      alpha_schedule="loglinear", confidence_threshold=1e9)  # would stop at once if it applied
  st = jax.tree.map(np.asarray, _denoise_fixed(_synthetic_decode, cfg, noise, noise.init_canvas_NBC[0]))
  traj = st.traj
  assert traj.active_SB.all() and (st.num_forwards_B == S_A).all()
  eps = 1e-3
  alpha_np = lambda t: 1 - (1 - eps) * t
  for s in range(S_A):
    logits = np.asarray(_synthetic_decode(jnp.asarray(traj.canvas_SBC[s]), None, None), np.float64)
    proc = logits / (0.4 + 0.4 * (S_A - s) / S_A)
    x = np.exp(proc - proc.max(-1, keepdims=True))
    x /= x.sum(-1, keepdims=True)
    if s == S_A - 1:
      want = proc.argmax(-1)
    else:
      q = np.array([[_posterior_numpy(x[b, c], traj.canvas_SBC[s, b, c], alpha_np(1 - s / S_A),
                                      alpha_np(1 - (s + 1) / S_A)) for c in range(C_SYN)] for b in range(B_SYN)])
      with np.errstate(divide="ignore"):
        want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"step {s}")
    if s + 1 < S_A:
      np.testing.assert_array_equal(traj.canvas_SBC[s + 1], want)
  np.testing.assert_array_equal(canvas_result(st, cfg), st.canvas_BC)
  np.testing.assert_array_equal(st.canvas_BC, traj.argmax_SBC[-1])
  np.testing.assert_array_equal(st.canvas_BC[0], 5)   # the confident row lands on its token


def _gumbel_noise(seed, steps, init_BC):
  rs = np.random.RandomState(seed)
  return FixedNoise(init_canvas_NBC=jnp.asarray(init_BC)[None],
                    gumbel_NSBCV=jnp.asarray(rs.gumbel(size=(1, steps, B_SYN, C_SYN, V_SYN)), jnp.float32),
                    renoise_NSBC=jnp.zeros((1, steps, B_SYN, C_SYN), jnp.int32))


def _softmax64(proc):
  x = np.exp(proc - proc.max(-1, keepdims=True))
  return x / x.sum(-1, keepdims=True)


def test_ancestral_loo_model_samples_from_the_shifted_x0():
  """A loo-trained model's x0 prediction is softmax(f + delta(alpha_t) onehot(z_t)): the ancestral
  sampler applies the shift at the step's alpha_t before the temperature (objectives.loo_logits)."""
  S_A = 3
  rs = np.random.RandomState(2)
  noise = _gumbel_noise(3, S_A, rs.randint(0, V_SYN, (B_SYN, C_SYN)))
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="ancestral",
                      loo_logits=True, greedy_last_step=False)
  traj = jax.tree.map(np.asarray, _denoise_fixed(_synthetic_decode, cfg, noise, noise.init_canvas_NBC[0])).traj
  for s in range(S_A):
    z = traj.canvas_SBC[s]
    a_t, a_s = s / S_A, (s + 1) / S_A          # alpha = 1 - t on the grid t = 1 - s / S
    f = np.asarray(_synthetic_decode(jnp.asarray(z), None, None), np.float64)
    delta = np.log1p(V_SYN * a_t / (1 - a_t))   # 0 at t = 1
    shifted = f + delta * np.eye(V_SYN)[z]
    x = _softmax64(shifted / (0.4 + 0.4 * (S_A - s) / S_A))
    q = np.array([[_posterior_numpy(x[b, c], z[b, c], a_t, a_s) for c in range(C_SYN)] for b in range(B_SYN)])
    with np.errstate(divide="ignore"):
      want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"step {s}")
  # the shift matters: without it the same noise gives a different trajectory
  plain = dataclasses.replace(cfg, loo_logits=False)
  traj_plain = jax.tree.map(np.asarray, _denoise_fixed(_synthetic_decode, plain, noise, noise.init_canvas_NBC[0])).traj
  assert not np.array_equal(traj_plain.sampled_SBC, traj.sampled_SBC)


_masked_post = jax.jit(masked_posterior, static_argnums=2)


def test_masked_posterior_matches_mdlm_formula():
  rs = np.random.RandomState(0)
  mask = 4
  x = rs.dirichlet(np.full(V_SYN, 0.5), size=(B_SYN, C_SYN))
  x[..., mask] = 0.0
  x /= x.sum(-1, keepdims=True)
  z = np.where(rs.rand(B_SYN, C_SYN) < 0.5, mask, rs.randint(5, V_SYN, (B_SYN, C_SYN)))
  for a_t, a_s in ((0.0, 0.25), (0.3, 0.7), (0.9, 1.0)):
    got = np.asarray(_masked_post(jnp.asarray(x, jnp.float32), jnp.asarray(z), mask, a_t, a_s))
    for b in range(B_SYN):
      for c in range(C_SYN):
        if z[b, c] == mask:  # MDLM: q = ((a_s - a_t) x + (1 - a_s) m) / (1 - a_t)
          want = ((a_s - a_t) * x[b, c] + (1 - a_s) * np.eye(V_SYN)[mask]) / (1 - a_t)
        else:
          want = np.eye(V_SYN)[z[b, c]]
        np.testing.assert_allclose(got[b, c], want, rtol=1e-5, atol=1e-7)  # a few fp32 roundings: < 10 eps


def test_masked_sampler_reveals_and_never_changes_revealed_tokens():
  """sampler='masked' (MDLM baseline): starts all-mask, each step is the Gumbel-max draw from the MDLM
  posterior with the mask token excluded from x_theta, revealed tokens stay, nothing is masked at the end."""
  S_A, mask = 4, 4
  init = np.full((B_SYN, C_SYN), mask)
  noise = _gumbel_noise(5, S_A, init)
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="masked", mask_id=mask,
                      confidence_threshold=1e9)  # would stop at once if early stopping applied
  # the decoder strongly prefers the mask token: the sampler must still never produce it
  decode = lambda c, sc, m: _synthetic_decode(c, sc, m) + 50.0 * jax.nn.one_hot(mask, V_SYN)
  st = jax.tree.map(np.asarray, _denoise_fixed(decode, cfg, noise, jnp.asarray(init)))
  traj = st.traj
  assert traj.active_SB.all() and (st.num_forwards_B == S_A).all()
  np.testing.assert_array_equal(traj.canvas_SBC[0], mask)
  for s in range(S_A):
    z = traj.canvas_SBC[s]
    f = np.asarray(decode(jnp.asarray(z), None, None), np.float64)
    f[..., mask] = -np.inf
    x = _softmax64(f / (0.4 + 0.4 * (S_A - s) / S_A))
    a_t, a_s = s / S_A, (s + 1) / S_A
    if s == S_A - 1:
      want = np.where(z == mask, x.argmax(-1), z)
    else:
      reveal = (a_s - a_t) / (1 - a_t)
      q = np.where((z == mask)[..., None], reveal * x + (1 - reveal) * np.eye(V_SYN)[mask], np.eye(V_SYN)[z])
      with np.errstate(divide="ignore"):
        want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"step {s}")
    if s + 1 < S_A:
      nxt = traj.canvas_SBC[s + 1]
      np.testing.assert_array_equal(nxt[z != mask], z[z != mask])  # revealed tokens never change
  assert (st.canvas_BC != mask).all()
  np.testing.assert_array_equal(canvas_result(st, cfg), st.canvas_BC)
  revealed_per_step = [(traj.canvas_SBC[s] != mask).sum() for s in range(S_A)] + [(st.canvas_BC != mask).sum()]
  assert revealed_per_step == sorted(revealed_per_step) and revealed_per_step[0] == 0
  # generate starts every canvas of a masked run from all-mask (uniform tokens otherwise)
  jnoise = JaxNoise(row_keys(jax.random.key(0), B_SYN))
  np.testing.assert_array_equal(initial_canvas(cfg, jnoise, 1, C_SYN, V_SYN), np.full((B_SYN, C_SYN), mask))
  uniform = np.asarray(initial_canvas(dataclasses.replace(cfg, sampler="released"), jnoise, 1, C_SYN, V_SYN))
  np.testing.assert_array_equal(uniform, jnoise.init_canvas(1, C_SYN, V_SYN))
  assert len(np.unique(uniform)) > 2


def test_sampler_must_fit_the_training_objective():
  from configs import tiny_test
  config = tiny_test.get_config()
  config.diffusion.objective = "mdlm"
  config.diffusion.mask_id, config.model.vocab_size = 260, 261  # an added id (the byte tokenizer uses 0..259)
  with pytest.raises(ConfigError, match="sample.sampler='released' does not fit diffusion.objective='mdlm'"):
    _sampler_of(config)
  config.sample.sampler = "masked"
  cfg = _sampler_of(config)
  assert cfg.mask_id == config.diffusion.mask_id and not cfg.loo_logits
  config.diffusion.objective = "base_ce"
  with pytest.raises(ConfigError, match="'masked' does not fit diffusion.objective='base_ce'"):
    _sampler_of(config)
  config.sample.sampler = "ancestral"
  config.diffusion.objective = "reweighted_loo_ce"
  assert _sampler_of(config).loo_logits
  config.diffusion.objective = "ar"
  with pytest.raises(ConfigError, match="ar_generate"):
    _sampler_of(config)


def test_ancestral_generate_with_live_view(tiny):
  """sampler='ancestral' through generate (the committed canvas is z_0), with show='live': the host
  callback sees every executed step, in order, with [B, C] views."""
  cfg = SamplerConfig(**{**tiny["cfg"].__dict__, "sampler": "ancestral", "show": "live"})
  views = []
  out = jax.tree.map(np.asarray, tiny["run"](cfg=cfg, step_callback=views.append))
  active_KSB = out.trajectory.active_SB
  ran_KS = active_KSB.any(-1)
  assert len(views) == ran_KS.sum() > 0
  assert [(v.canvas_idx, v.step) for v in views] == [tuple(ks) for ks in np.argwhere(ran_KS)]
  for v in views:
    assert v.tokens_BC.shape == v.accepted_BC.shape == v.result_BC.shape == (3, C) and v.active_B.shape == (3,)
    np.testing.assert_array_equal(v.active_B, active_KSB[v.canvas_idx, v.step])
    act = v.active_B
    np.testing.assert_array_equal(v.tokens_BC[act], out.trajectory.shown_SBC[v.canvas_idx, v.step][act])
  # no early stopping: every row that reaches a canvas runs all of its steps; the last one is greedy
  np.testing.assert_array_equal(out.num_forwards_B, S * active_KSB.any(1).sum(0))
  last_k = out.trajectory.active_SB[:, -1]
  np.testing.assert_array_equal(out.trajectory.sampled_SBC[:, -1][last_k], out.trajectory.argmax_SBC[:, -1][last_k])
  # the first canvas of the output is the final z_0, cut after its end token
  cut, _, _ = cut_after_end(jnp.asarray(views[S - 1].result_BC), (1, 106), 0)
  np.testing.assert_array_equal(out.tokens_BN[:, :C], np.asarray(cut))


def test_live_printer_redraws_with_highlights():
  from dgemma.sampling import LivePrinter, StepView
  from dgemma.sampling import live
  from dgemma.tokenizers import ByteTokenizer
  tok = ByteTokenizer()
  stream = __import__("io").StringIO()
  printer = LivePrinter(tok.decode, ["Q: "], stream=stream, total_steps=2, end_ids=(1,))
  ids = lambda text: np.array([tok.encode(text)], np.int32)
  act = np.array([True])
  printer(StepView(0, 0, ids("ab"), np.array([[True, False]]), ids("ab"), act))
  printer(StepView(0, 1, ids("cd"), np.array([[True, True]]), ids("cd"), act))
  end = np.array([[tok.encode("e")[0], 1]], np.int32)
  printer(StepView(1, 0, ids("xy"), np.array([[False, True]]), end, act))
  frames = stream.getvalue().split(live.CLEAR_HOME)[1:]
  assert printer.frames == len(frames) == 3
  assert f"Q: {live.ACCEPTED}a{live.RESET}{live.NOISE}b{live.RESET}" in frames[0]
  assert "step 2/2" in frames[1]
  assert f"Q: cd{live.NOISE}x{live.RESET}{live.ACCEPTED}y{live.RESET}" in frames[2]  # canvas 1 committed


# ---- bad requests fail before anything is compiled --------------------------------------------------


@pytest.fixture
def no_compile(monkeypatch):
  """jax.jit and the compiled generate program raise if reached; yields the compile-log messages."""
  from dgemma.sampling import generation

  def reached(*args, **kwargs):
    raise AssertionError("reached jax.jit / the compiled generate program")

  monkeypatch.setattr(jax, "jit", reached)
  monkeypatch.setattr(generation, "_generate_jit", reached)
  handler, logger = _Messages(), logging.getLogger("jax")
  logger.addHandler(handler)
  with jax.log_compiles(True):
    yield handler.messages
  logger.removeHandler(handler)
  assert [m for m in handler.messages if m.startswith("Compiling")] == []


def test_bad_requests_fail_before_compilation(no_compile):
  from dgemma.sampling import check_request, infill_arrays
  model, params = _BARE_MODEL
  cfg = SamplerConfig(canvas_len=8, max_denoising_steps=4, end_ids=(1,), max_context=32)
  ones = lambda b, p: np.ones((b, p), np.int32)
  gen = lambda prompts, n=16, cfg=cfg, **kw: generate(model, params, prompts, [prompts.shape[1]] * len(prompts), cfg,
                                                      0, n, **kw)
  # context rule: prompt + max_new_tokens rounded up to whole canvases <= max_context
  with pytest.raises(ConfigError, match=r"20 prompt tokens .* need 36 positions > sample.max_context=32"):
    gen(ones(2, 20))
  check_request(cfg, batch=1, prompt_len=16, max_new_tokens=16)   # exactly fits
  with pytest.raises(ConfigError, match="sample.max_context"):
    check_request(cfg, batch=1, prompt_len=17, max_new_tokens=9)  # 9 tokens -> 2 canvases of 8
  with pytest.raises(ConfigError, match="sample.max_context"):
    SamplerConfig(canvas_len=8, max_context=8)
  with pytest.raises(ConfigError, match="sample.num_samples"):
    gen(ones(0, 4))
  with pytest.raises(ConfigError, match="sample.max_new_tokens"):
    gen(ones(2, 4), n=0)
  # sampler settings
  for bad, field in ((dict(max_denoising_steps=0), "max_denoising_steps"),
                     (dict(max_denoising_steps=-2), "max_denoising_steps"),
                     (dict(entropy_bound=0.0), "entropy_bound"), (dict(entropy_bound=-0.1), "entropy_bound"),
                     (dict(sampler="greedy"), "sampler"), (dict(acceptance="top"), "acceptance"),
                     (dict(renoise="all"), "renoise"), (dict(alpha_schedule="sqrt"), "alpha_schedule"),
                     (dict(schedule_eps=0.0), "schedule_eps"), (dict(show="tty"), "show")):
    with pytest.raises(ConfigError, match=rf"sample\.{field}"):
      SamplerConfig(**bad)
  # infilling outside the response / the vocabulary
  for pairs, pattern in ((((16, 5),), "position 16 is outside the response"), (((-1, 5),), "position -1"),
                         (((3, 128),), "token id 128"), (((3,),), r"expected \(position, token_id\) pairs")):
    with pytest.raises(ConfigError, match="sample.infill: " + pattern):
      infill_arrays(pairs, 2, 16, 128)
  tokens, mask = infill_arrays(((0, 7), (15, 9)), 2, 16, 128)
  assert mask.sum() == 4 and (tokens[:, 15] == 9).all()
  with pytest.raises(ValueError, match=r"infill_tokens_BN: expected shape \(2, 16\)"):
    gen(ones(2, 4), infill_tokens_BN=np.zeros((2, 17)), infill_mask_BN=np.zeros((2, 17), bool))
  tokens[1, 15] = 500
  with pytest.raises(ValueError, match="infill_tokens_BN: token 500 at row 1, position 15"):
    gen(ones(2, 4), infill_tokens_BN=tokens, infill_mask_BN=mask)
  with pytest.raises(ValueError, match="show='live'"):
    gen(ones(2, 4), step_callback=print)


_BARE_MODEL = _tiny_model()
