"""The policy's log-likelihood of its own samples (dgemma/rl/policy.py) against independent recomputations.

The reference recomputes each step of a recorded trajectory with the model's training forward (`Transformer.__call__`:
its own cache, encode and decode, the prompt's padding as segment 0) one step at a time, the self-conditioning
signal carried by hand, in float64, and takes log softmax(logits / T_s) in numpy at the draws the sampler put on
the canvas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.rl import policy
from dgemma.sampling import SamplerConfig, generate, rules
from tests.model_utils import f64_config, float64, to_f64
from tests.sampling.helpers import tiny_model

C, S = 8, 6
PROMPTS = [[2, 40, 41, 42, 43, 44], [2, 50], [2, 60, 61, 62], [2, 70, 71]]
P = max(map(len, PROMPTS))


@pytest.fixture(scope="module")
def sampled():
  model, params = tiny_model()  # self-conditioning on: the replay must carry the signal step to step
  prompts = np.array([p + [0] * (P - len(p)) for p in PROMPTS], np.int32)
  lengths = np.array([len(p) for p in PROMPTS], np.int32)
  cfg = SamplerConfig(canvas_len=C, max_denoising_steps=S, end_ids=(), confidence_threshold=0.05)
  out = generate(model, params, prompts, lengths, cfg, jax.random.key(3), C, return_trajectory="first")
  traj = jax.tree.map(lambda x: np.asarray(x[0]), out.trajectory)
  draws = np.asarray(policy.kept_draws(traj))
  rollout = policy.Rollout(prompt_NP=jnp.asarray(prompts), lengths_N=jnp.asarray(lengths),
                           canvas_SNC=jnp.asarray(traj.canvas_SBC), sampled_SNC=jnp.asarray(traj.sampled_SBC),
                           draws_SNC=jnp.asarray(draws), tokens_NC=out.tokens_BN,
                           valid_NC=jnp.ones((len(PROMPTS), C), bool), advantages_N=jnp.zeros((len(PROMPTS),)),
                           elbo_key=jax.random.key(0))
  return dict(model=model, params=params, cfg=cfg, traj=traj, draws=draws, rollout=rollout, prompts=prompts,
              lengths=lengths)


def sampler_temperature(cfg, step: int) -> float:
  """T_s exactly as the sampler computes it: an fp32 value (as HF's), from its traced step (fp32 division of the
  compiled program, whose last bit depends on XLA's flags: the tests' disable most optimizations)."""
  return float(jax.jit(lambda s: rules.temperature(cfg, s))(jnp.int32(step)))


def float64_log_probs(model, params, cfg, prompts, lengths, traj, draws, sc_inputs=None):
  """[S, N, C] log-probabilities of the draws, recomputed step by step in float64 (module docstring); 0 where no
  draw. The self-conditioning signal of step s is the previous step's tempered logits of this recomputation, or
  `sc_inputs[s]` when given (the stored states)."""
  model64 = type(model)(f64_config(model.cfg))
  batch, prompt_len = prompts.shape
  out = np.zeros(draws.shape)
  with float64():
    p64 = jax.tree.map(jnp.asarray, to_f64(params))
    iota = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
    segments = (iota < jnp.asarray(lengths)[:, None]).astype(jnp.int32)  # the padding is never attended
    canvas_pos = jnp.asarray(lengths)[:, None] + jnp.arange(C)[None]
    forward = jax.jit(lambda canvas, sc, mask: model64.apply(
        {"params": p64}, jnp.asarray(prompts), iota, segments, canvas, canvas_pos, jnp.ones_like(canvas),
        sc_logits_BCV=sc, sc_mask_B=mask, return_enc_logits=False)[1])
    sc = jnp.zeros((batch, C, model.cfg.vocab_size))
    for s in range(S):
      signal = sc if sc_inputs is None else jnp.asarray(np.asarray(sc_inputs[s], np.float64))
      logits = np.asarray(forward(jnp.asarray(traj.canvas_SBC[s]), signal, jnp.full((batch,), s > 0)))
      proc = logits / sampler_temperature(cfg, s)
      top = proc.max(-1, keepdims=True)
      logp = proc - top - np.log(np.sum(np.exp(proc - top), -1, keepdims=True))
      for n, i in zip(*np.nonzero(draws[s])):
        out[s, n, i] = logp[n, i, traj.sampled_SBC[s, n, i]]
      sc = jnp.asarray(proc)
  return out


def test_draws_are_what_reached_the_canvas(sampled):
  """The draws counted are exactly the tokens the next canvas took from the step's samples (re-noising sent the
  rest to fresh tokens), and every step that ran drew at least one."""
  traj, draws = sampled["traj"], sampled["draws"]
  for s in range(S - 1):
    for n in range(len(PROMPTS)):
      if traj.active_SB[s, n] and traj.active_SB[s + 1, n]:
        np.testing.assert_array_equal(traj.canvas_SBC[s + 1, n][draws[s, n]], traj.sampled_SBC[s, n][draws[s, n]])
  assert (draws.sum(-1)[traj.active_SB] >= 1).all()
  assert draws.sum() > len(PROMPTS) * 2  # several draws per row: the sums below compare something


def test_trajectory_log_prob_equals_float64_recomputation(sampled):
  """`replay` (fp32, the sampler's own program pieces) gives each draw's log-probability as the float64 reference
  does from the stored states (each step's canvas, draws and self-conditioning input: with its own float64 chain of
  signals the reference would drift from the fp32 one step by step, as sharp softmaxes amplify round-off; the
  chain itself is checked exactly in float64 below). Bound: log p = proc_i - logsumexp(proc); fp32 forward passes of this 2-layer model carry a relative error of
  a few hundred ulps (2^-24 each) of the logits, so each log-probability is off by at most about
  2 max|proc| * 2^-14 (1000 ulps of the largest tempered logit: a generous bound, ~1e4 times below the effect of a
  wrong temperature step or a draw read at the wrong position)."""
  model, params, cfg, traj, draws = (sampled[k] for k in ("model", "params", "cfg", "traj", "draws"))
  lp, sc = jax.jit(lambda p, r: policy.replay(model, p, r, cfg))(params, sampled["rollout"])
  lp = np.asarray(lp)
  ref = float64_log_probs(model, params, cfg, sampled["prompts"], sampled["lengths"], traj, draws, np.asarray(sc))
  assert np.all(lp[~draws] == 0) and np.all(ref[draws] < 0)
  max_proc = 60.0  # |logits| of this model stay below 25 (final_norm x 6), over T >= 0.4
  np.testing.assert_allclose(lp, ref, rtol=0, atol=2 * max_proc * 2.0**-14)
  # the trajectory's log-probability: per row, the sum over steps and accepted positions
  np.testing.assert_allclose(lp.sum((0, 2)), ref.sum((0, 2)), rtol=0, atol=draws.sum() * 2 * max_proc * 2.0**-14)
  assert sc is not None and sc.shape == (S, len(PROMPTS), C, model.cfg.vocab_size)


@pytest.mark.slow  # the fast tier's budget: a float64 replay (~5 s)
def test_replay_in_float64_is_the_reference(sampled):
  """The same comparison with `replay` itself run in float64: the two computations then agree to float64 round-off
  (tests/model_utils.py), so `replay`'s cache path, temperature schedule and self-conditioning chain are the
  reference's exactly."""
  model, params, cfg, traj, draws = (sampled[k] for k in ("model", "params", "cfg", "traj", "draws"))
  ref = float64_log_probs(model, params, cfg, sampled["prompts"], sampled["lengths"], traj, draws)
  model64 = type(model)(f64_config(model.cfg))
  with float64():
    lp64, _ = policy.replay(model64, jax.tree.map(jnp.asarray, to_f64(params)), sampled["rollout"], cfg)
    lp64 = np.asarray(lp64)
  np.testing.assert_allclose(lp64, ref, rtol=1e-9, atol=1e-9)


def test_stored_signal_steps_equal_the_replay(sampled):
  """Scoring one step at a time from the replay's stored self-conditioning inputs (what an update that scores a
  subset of steps does) gives the replay's log-probabilities at every step."""
  model, params, cfg = sampled["model"], sampled["params"], sampled["cfg"]
  rollout = sampled["rollout"]

  @jax.jit
  def per_step(p, r):
    lp, sc = policy.replay(model, p, r, cfg)
    r = r.replace(sc_SNCV=sc)
    decode = policy.prompt_decoder(model, p, r.prompt_NP, r.lengths_N, C)
    steps = [jnp.where(r.draws_SNC[s], policy.step_draws(decode, r, cfg, jnp.int32(s))[1], 0.0)
             for s in range(S)]
    return lp, jnp.stack(steps)

  lp, stepwise = per_step(params, rollout)
  np.testing.assert_allclose(np.asarray(stepwise), np.asarray(lp), rtol=0, atol=1e-5)
