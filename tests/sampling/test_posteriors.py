"""dgemma.sampling.posteriors: the uniform-state and masked (MDLM) posteriors against their formulas,
schedules, and ancestral / masked sampling through the loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.errors import ConfigError
from dgemma.sampling import (FixedNoise, JaxNoise, SamplerConfig, alpha, canvas_result,
                             initial_canvas, masked_posterior, row_keys, uniform_posterior)
from tests.sampling.helpers import V_SYN, C_SYN, B_SYN, synthetic_decode, denoise_fixed


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
  """Each step's z_s is the Gumbel-max draw from q(. | z_t, x_theta) at t = 1 - s/S -> 1 - (s+1)/S, x_theta
  the tempered leave-one-out prior of the (posterior) output; the last step is greedy; no early stopping;
  the result is the final canvas."""
  S_A = 4
  rs = np.random.RandomState(1)
  noise = FixedNoise(init_canvas_NBC=jnp.asarray(rs.randint(0, V_SYN, (1, B_SYN, C_SYN))),
                     gumbel_NSBCV=jnp.asarray(rs.gumbel(size=(1, S_A, B_SYN, C_SYN, V_SYN)), jnp.float32),
                     renoise_NSBC=jnp.zeros((1, S_A, B_SYN, C_SYN), jnp.int32))
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="ancestral",
                      alpha_schedule="loglinear", confidence_threshold=1e9)  # would stop at once if it applied
  st = jax.tree.map(np.asarray, denoise_fixed(synthetic_decode, cfg, noise, noise.init_canvas_NBC[0]))
  traj = st.traj
  assert traj.active_SB.all() and (st.num_forwards_B == S_A).all()
  eps = 1e-3
  alpha_np = lambda t: 1 - (1 - eps) * t
  for s in range(S_A):
    z = traj.canvas_SBC[s]
    logits = np.asarray(synthetic_decode(jnp.asarray(z), None, None), np.float64)
    a_t = alpha_np(1 - s / S_A)
    delta = np.log1p(V_SYN * a_t / (1 - a_t))
    proc = (logits - delta * np.eye(V_SYN)[z]) / (0.4 + 0.4 * (S_A - s) / S_A)  # the loo prior, tempered
    x = np.exp(proc - proc.max(-1, keepdims=True))
    x /= x.sum(-1, keepdims=True)
    q = np.array([[_posterior_numpy(x[b, c], z[b, c], a_t, alpha_np(1 - (s + 1) / S_A)) for c in range(C_SYN)]
                  for b in range(B_SYN)])
    # the reported argmax is the posterior's, softmax(proc + delta onehot(z))
    np.testing.assert_array_equal(traj.argmax_SBC[s], np.argmax(proc + delta * np.eye(V_SYN)[z], -1))
    if s == S_A - 1:  # greedy: q at alpha_s = 1 is that posterior
      want = traj.argmax_SBC[s]
      np.testing.assert_array_equal(want, q.argmax(-1))
    else:
      with np.errstate(divide="ignore"):
        want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"step {s}")
    if s + 1 < S_A:
      np.testing.assert_array_equal(traj.canvas_SBC[s + 1], want)
  np.testing.assert_array_equal(canvas_result(st, cfg), st.canvas_BC)
  np.testing.assert_array_equal(st.canvas_BC, traj.argmax_SBC[-1])
  np.testing.assert_array_equal(st.canvas_BC[0], 5)   # the confident row lands on its token


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_pc_passes_alternate_posterior_and_corrector_draws(fraction):
  """sampler='pc' with one corrector, n = S/2 rounds: round i < n-1 is a predictor draw from q(. | z, x)
  from t = 1 - i/n to 1 - (i+1)/n and a corrector draw from alpha post + (1 - alpha)/N at the new level
  (post = the posterior softmax(log x + delta onehot z)); the last round's corrector comes first, at
  t = 1/n, then the greedy predictor to t = 0. x is the tempered leave-one-out prior. S passes in all,
  no early stopping; the result is the final canvas. With pc_corrector_fraction < 1 a corrector re-draws
  only the positions whose re-noise id is below round(fraction * N); the rest keep their token."""
  S_A = 6
  renoise_SBC = np.random.RandomState(7).randint(0, V_SYN, (S_A, B_SYN, C_SYN))
  noise = _gumbel_noise(5, S_A, np.random.RandomState(4).randint(0, V_SYN, (B_SYN, C_SYN)), renoise_SBC)
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="pc",
                      pc_corrector_steps=1, pc_corrector_fraction=fraction, alpha_schedule="loglinear",
                      confidence_threshold=1e9)
  cut = round(fraction * V_SYN)
  st = jax.tree.map(np.asarray, denoise_fixed(synthetic_decode, cfg, noise, noise.init_canvas_NBC[0]))
  traj = st.traj
  assert traj.active_SB.all() and (st.num_forwards_B == S_A).all()
  n, eps = S_A // 2, 1e-3
  alpha_np = lambda t: 1 - (1 - eps) * t
  delta_of = lambda a: np.log1p(V_SYN * a / (1 - a))
  kinds = []
  for s in range(S_A):
    z = traj.canvas_SBC[s]
    i, j = divmod(s, 2)
    last_round = i == n - 1
    corrector = (j == 0) if last_round else (j == 1)
    level = alpha_np(1 - i / n) if last_round else alpha_np(1 - (i + 1) / n)
    a_in = level if corrector else alpha_np(1 - i / n)
    a_out = level if corrector else alpha_np(1 - (i + 1) / n)
    logits = np.asarray(synthetic_decode(jnp.asarray(z), None, None), np.float64)
    proc = (logits - delta_of(a_in) * np.eye(V_SYN)[z]) / (0.4 + 0.4 * (S_A - s) / S_A)
    x = _softmax64(proc)
    post = _softmax64(proc + delta_of(a_in) * np.eye(V_SYN)[z])
    if s == S_A - 1:
      assert not corrector
      want = post.argmax(-1)
    elif corrector:
      with np.errstate(divide="ignore"):
        want = np.argmax(np.log(a_out * post + (1 - a_out) / V_SYN) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
      redraw = renoise_SBC[s] < cut
      assert redraw.all() == (fraction == 1.0) and (fraction == 1.0 or redraw.any())
      want = np.where(redraw, want, z)
    else:
      q = np.array([[_posterior_numpy(x[b, c], z[b, c], a_in, a_out) for c in range(C_SYN)]
                    for b in range(B_SYN)])
      with np.errstate(divide="ignore"):
        want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    kinds.append("corrector" if corrector else "predictor")
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"pass {s} ({kinds[-1]})")
    if s + 1 < S_A:
      np.testing.assert_array_equal(traj.canvas_SBC[s + 1], want)
  assert kinds == ["predictor", "corrector", "predictor", "corrector", "corrector", "predictor"]
  np.testing.assert_array_equal(canvas_result(st, cfg), st.canvas_BC)
  np.testing.assert_array_equal(st.canvas_BC[0], 5)   # the confident row lands on its token
  # a corrector draw is not the predictor's: on the same noise, ancestral over the same passes differs
  anc = dataclasses.replace(cfg, sampler="ancestral")
  traj_anc = jax.tree.map(np.asarray, denoise_fixed(synthetic_decode, anc, noise, noise.init_canvas_NBC[0])).traj
  assert not np.array_equal(traj_anc.sampled_SBC[1:], traj.sampled_SBC[1:])


def test_pc_settings_are_checked():
  with pytest.raises(ConfigError, match="pc_corrector_steps"):
    SamplerConfig(sampler="pc", max_denoising_steps=6, pc_corrector_steps=0)
  with pytest.raises(ConfigError, match=r"sample.max_denoising_steps: 7 with sample.sampler='pc' must be a multiple of 1 \+ sample.pc_corrector_steps = 2"):
    SamplerConfig(sampler="pc", max_denoising_steps=7, pc_corrector_steps=1)
  SamplerConfig(sampler="pc", max_denoising_steps=9, pc_corrector_steps=2)
  SamplerConfig(sampler="ancestral", max_denoising_steps=7)  # the multiple applies to 'pc' only
  for bad in (0.0, 1.5):
    with pytest.raises(ConfigError, match="pc_corrector_fraction"):
      SamplerConfig(sampler="pc", max_denoising_steps=6, pc_corrector_fraction=bad)


def _gumbel_noise(seed, steps, init_BC, renoise_SBC=None):
  rs = np.random.RandomState(seed)
  renoise_SBC = np.zeros((steps, B_SYN, C_SYN)) if renoise_SBC is None else renoise_SBC
  return FixedNoise(init_canvas_NBC=jnp.asarray(init_BC)[None],
                    gumbel_NSBCV=jnp.asarray(rs.gumbel(size=(1, steps, B_SYN, C_SYN, V_SYN)), jnp.float32),
                    renoise_NSBC=jnp.asarray(renoise_SBC, jnp.int32)[None])


def _softmax64(proc):
  x = np.exp(proc - proc.max(-1, keepdims=True))
  return x / x.sum(-1, keepdims=True)


@pytest.mark.parametrize("loo_model", [False, True])
def test_ancestral_reads_the_leave_one_out_prior(loo_model):
  """q(z_s | z_t, x_theta) wants x_theta = p(x_i | z_t without i) (objectives.py docstring): a posterior
  model's output f has delta(alpha_t) onehot(z_t) taken off at the step's alpha_t, a leave-one-out model's
  is read as it is, both before the temperature."""
  S_A = 3
  rs = np.random.RandomState(2)
  noise = _gumbel_noise(3, S_A, rs.randint(0, V_SYN, (B_SYN, C_SYN)))
  cfg = SamplerConfig(canvas_len=C_SYN, max_denoising_steps=S_A, end_ids=(1,), sampler="ancestral",
                      loo_logits=loo_model, greedy_last_step=False)
  traj = jax.tree.map(np.asarray, denoise_fixed(synthetic_decode, cfg, noise, noise.init_canvas_NBC[0])).traj
  for s in range(S_A):
    z = traj.canvas_SBC[s]
    a_t, a_s = s / S_A, (s + 1) / S_A          # alpha = 1 - t on the grid t = 1 - s / S
    f = np.asarray(synthetic_decode(jnp.asarray(z), None, None), np.float64)
    delta = np.log1p(V_SYN * a_t / (1 - a_t))   # 0 at t = 1
    prior = f if loo_model else f - delta * np.eye(V_SYN)[z]
    x = _softmax64(prior / (0.4 + 0.4 * (S_A - s) / S_A))
    q = np.array([[_posterior_numpy(x[b, c], z[b, c], a_t, a_s) for c in range(C_SYN)] for b in range(B_SYN)])
    with np.errstate(divide="ignore"):
      want = np.argmax(np.log(q) + np.asarray(noise.gumbel_NSBCV[0, s]), axis=-1)
    np.testing.assert_array_equal(traj.sampled_SBC[s], want, err_msg=f"step {s}")
  # the reading matters: the other one gives a different trajectory from the same noise
  other = dataclasses.replace(cfg, loo_logits=not loo_model)
  traj_other = jax.tree.map(np.asarray, denoise_fixed(synthetic_decode, other, noise, noise.init_canvas_NBC[0])).traj
  assert not np.array_equal(traj_other.sampled_SBC, traj.sampled_SBC)


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
  decode = lambda c, sc, m: synthetic_decode(c, sc, m) + 50.0 * jax.nn.one_hot(mask, V_SYN)
  st = jax.tree.map(np.asarray, denoise_fixed(decode, cfg, noise, jnp.asarray(init)))
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
