"""dgemma.sampling.rules: temperature schedule, acceptance rules (against slow references), entropy and
logit shaping, the end cut, and renoise='low_confidence'. Rules come from ../shared/reference/diffusiongemma.md
("Sampler (released defaults)")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.sampling import (FixedNoise, SamplerConfig, accept_confidence, accept_entropy_bound,
                             accept_fixed_k, cut_after_end, entropy, shape_logits, temperature)
from tests.sampling.helpers import denoise_fixed


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


def test_low_confidence_renoises_accepted_tokens_below_threshold():
  noise = FixedNoise(init_canvas_NBC=jnp.full((1, 1, C_LC), 12, jnp.int32),
                     gumbel_NSBCV=jnp.zeros((1, S_LC, 1, C_LC, V_LC)),          # sample = argmax
                     renoise_NSBC=jnp.broadcast_to((13 + jnp.arange(S_LC))[None, :, None, None], (1, S_LC, 1, C_LC)))
  base = dict(canvas_len=C_LC, max_denoising_steps=S_LC, end_ids=(1,), acceptance="fixed_k", accept_k=1,
              renoise_confidence=0.5, t_max=1.0, t_min=1.0, confidence_threshold=0.0, early_exit=False)
  run = lambda renoise: jax.tree.map(np.asarray, denoise_fixed(
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
