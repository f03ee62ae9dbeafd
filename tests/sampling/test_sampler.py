"""dgemma.sampling.sampler / generation: the denoising loop (stopping, loop forms, finished rows,
ablation options) with a synthetic decoder; generate with a tiny random model (consistency, one
compilation, batch invariance, cache commits, infilling); bad requests fail before compiling.
Token-exact parity with HF transformers 5.24 is in tests/sampling/test_parity.py."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.errors import ConfigError
from dgemma.model import Transformer, init_cache
from dgemma.sampling import (SamplerConfig, cut_after_end, entropy, generate, temperature,
                             trajectory_steps)
from tests.sampling.helpers import (C_SYN, B_SYN, run_synthetic, C, S, N, PROMPTS, P, tiny_model, Messages,
                                    check_first_steps, continuation_entropy, count_compiles)


def test_stopping_and_loop_forms_agree():
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=7, end_ids=(1,))
  st_while, _ = run_synthetic(cfg)
  st_scan, _ = run_synthetic(SamplerConfig(**{**cfg.__dict__, "early_exit": False}))
  # row 0: not stable at step 0 (no previous argmax), stable and confident at step 1 -> done
  assert st_while.num_forwards_B.tolist() == [2, 7, 7]
  np.testing.assert_array_equal(st_while.argmax_BC[0], 5)
  assert st_while.traj.active_SB[:, 0].tolist() == [True, True] + [False] * 5
  for a, b in zip(jax.tree.leaves(st_while.replace(step=0)), jax.tree.leaves(st_scan.replace(step=0))):
    np.testing.assert_array_equal(a, b)


def test_finished_rows_stop_changing():
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=7, end_ids=(1,), early_exit=False)
  done = jnp.array([False, True, False])
  st, init = run_synthetic(cfg, done=done)
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
  st, _ = run_synthetic(cfg, fixed_BC=fixed, fixed_mask_BC=fixed_mask)
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
  out, compiles = count_compiles(lambda: tiny["run"](rng=other_keys))
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
  reference_entropy = continuation_entropy(tiny["model"], tiny["params"], temperature(tiny["cfg"], 0))
  # (each canvas padded to one shape at the end; fp32 round-off only, each within 4e-6 of float64: measured)
  _, second = check_first_steps(tiny["out"], reference_entropy)
  assert second > 0, "no row reached the second canvas"


@pytest.mark.slow  # its own model and generate compile
def test_decoder_head_layers_in_generate(tiny):
  """model.decoder_head_layers: generate's decoder passes run the canvas-only layers (which read and write no
  cache), and a committed canvas is encoded by the shared stack alone. Each row's first canvas and, where the row
  got there, its second: the first step's entropies against `decode` on a fresh contiguous cache of the context
  (the reference of test_committed_canvas_continues_the_context). The head is live: the same weights without it
  give other entropies."""
  model, params = tiny_model(decoder_head_layers=1)
  assert "decoder_head_0" in params
  out = jax.tree.map(np.asarray, generate(model, params, tiny["prompts"], tiny["lengths"], tiny["cfg"], tiny["keys"],
                                           N, return_trajectory="all"))
  traj = out.trajectory
  _, second = check_first_steps(out, continuation_entropy(model, params, temperature(tiny["cfg"], 0)))
  assert second > 0, "no row reached the second canvas"
  headless = Transformer(dataclasses.replace(model.cfg, decoder_head_layers=0))
  without = continuation_entropy(headless, {k: v for k, v in params.items() if not k.startswith("decoder_head")},
                                 temperature(tiny["cfg"], 0))
  ctx = np.pad(np.asarray(PROMPTS[0]), (0, P + C - len(PROMPTS[0])))[None]
  assert np.abs(np.asarray(without(ctx, len(PROMPTS[0]), traj.canvas_SBC[0, 0, 0][None]))
                - traj.entropy_SBC[0, 0, 0]).max() > 1e-2


def test_decoder_shift_scores_each_position_from_the_one_before(tiny):
  """model.decoder_shift in generate: at every canvas's first step, position 0 is scored by the encoder's logits at
  the row's last valid token (the prompt's, then canvas 1's), positions 1.. by the decoder's output one position
  to their left. Reference: the unshifted model on a fresh contiguous cache, shifted by hand; compared through
  the tempered entropies the sampler records (fp32 round-off of another cache layout, as above: atol 1e-4)."""
  model, params = tiny["model"], tiny["params"]
  shifted = Transformer(dataclasses.replace(model.cfg, decoder_shift=True))
  out = jax.tree.map(np.asarray, generate(shifted, params, tiny["prompts"], tiny["lengths"], tiny["cfg"],
                                          tiny["keys"], N, return_trajectory="all"))
  traj = out.trajectory
  t0 = temperature(tiny["cfg"], 0)

  @jax.jit
  def reference_entropy(ctx_1L, length, canvas_1C):
    L = ctx_1L.shape[1]
    iota = jnp.arange(L)[None]
    enc_1LV, cache = model.apply({"params": params}, ctx_1L, iota, (iota < length).astype(jnp.int32),
                                 init_cache(model.cfg, 1, L), return_logits=True, method="encode")
    dec_1CV = model.apply({"params": params}, canvas_1C, length + jnp.arange(C)[None], jnp.ones_like(canvas_1C),
                          cache, method="decode")
    logits_1CV = jnp.concatenate([enc_1LV[:, length - 1][:, None], dec_1CV[:, :-1]], axis=1)
    return entropy(logits_1CV / t0)[0][0]

  checked, _ = check_first_steps(out, reference_entropy)
  assert checked >= 4
  # The unshifted run's first-step entropies differ (the option is not a no-op).
  assert np.abs(tiny["out"].trajectory.entropy_SBC[0, 0] - traj.entropy_SBC[0, 0]).max() > 1e-2


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


# ---- bad requests fail before anything is compiled --------------------------------------------------


@pytest.fixture
def no_compile(monkeypatch):
  """jax.jit and the compiled generate program raise if reached; yields the compile-log messages."""
  from dgemma.sampling import generation

  def reached(*args, **kwargs):
    raise AssertionError("reached jax.jit / the compiled generate program")

  monkeypatch.setattr(jax, "jit", reached)
  monkeypatch.setattr(generation, "_generate_jit", reached)
  handler, logger = Messages(), logging.getLogger("jax")
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


_BARE_MODEL = tiny_model()
