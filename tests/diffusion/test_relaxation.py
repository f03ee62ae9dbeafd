"""Duo's Gaussian relaxation (dgemma/diffusion/relaxation.py) and its curriculum in the training loss.

References: the closed form at N = 2 (the difference of two Gaussians), Monte Carlo argmax draws for
larger N, the uniform-state marginal alpha onehot(x) + (1 - alpha) / N, and the discrete loss itself
(after the curriculum the loss is the ordinary one, checked in float64).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from configs.models import tiny
from dgemma.diffusion import loss, relaxation
from dgemma.model import ModelConfig
from dgemma.diffusion.config import DiffusionSettings
from tests.model_utils import f64_config, float64, random_params, random_rows, to_f64


def test_transformation_operator_matches_the_closed_form_at_two_tokens():
  # N = 2: the clean token wins iff eps_other - eps_x < r, eps_other - eps_x ~ N(0, 2): P = Phi(r / sqrt 2),
  # alpha = 2 P - 1. The quadrature (trapezoid rule on a smooth Gaussian integrand, spacing 0.005) is
  # accurate far below 1e-12; 1 - alpha is compared relatively, down to 1e-8.
  r = np.array([0.0, 0.3, 1.0, 2.5, 5.0, 8.0])
  np.testing.assert_allclose(relaxation.alpha_of_snr(r, 2), 2 * special.ndtr(r / np.sqrt(2)) - 1, atol=1e-12)
  np.testing.assert_allclose(relaxation.one_minus_alpha_of_snr(r, 2), 2 * special.ndtr(-r / np.sqrt(2)),
                             rtol=1e-9)


@pytest.mark.parametrize("snr", [0.5, 2.0, 3.5])
def test_transformation_operator_matches_monte_carlo_argmax(snr):
  n, draws = 16, 200_000
  g = np.random.default_rng(0)
  w = g.standard_normal((draws, n))
  w[:, 0] += snr
  p_hat = np.mean(np.argmax(w, axis=1) == 0)
  p = relaxation.alpha_of_snr(snr, n)[0] * (1 - 1 / n) + 1 / n  # q(z = x) = alpha + (1 - alpha) / N
  assert abs(p_hat - p) < 5 * np.sqrt(p * (1 - p) / draws)  # 5 binomial standard deviations


@pytest.mark.parametrize("vocab_size", [2, 27, 2048, 262144])
def test_snr_of_alpha_inverts_the_operator(vocab_size):
  alpha = np.array([0.0, 0.01, 0.1, 0.5, 0.9, 0.999, 0.9999])
  snr = np.asarray(relaxation.snr_of_alpha(alpha, vocab_size), np.float64)
  assert abs(snr[0]) < 1e-6 and np.all(np.diff(snr) > 0)  # alpha = 0: no signal
  # Linear interpolation of r on a 0.01 grid of r: the error in r is O(0.01^2) (r is smooth in the table's
  # variable -log(1 - alpha)), and |d alpha / d r| < 1, so alpha comes back to well within 1e-4; near
  # alpha = 1 the relative error of 1 - alpha is what matters.
  # the host inversion (float64) against the traced one (fp32 table and log1p: ~1e-5 relative near alpha = 1)
  np.testing.assert_allclose([relaxation.snr_of_alpha_host(a, vocab_size) for a in alpha], snr, rtol=1e-4, atol=1e-6)
  back = relaxation.alpha_of_snr(snr, vocab_size)
  np.testing.assert_allclose(back, alpha, atol=1e-4)
  np.testing.assert_allclose(1 - back[-2:], 1 - alpha[-2:], rtol=1e-2)


def test_relaxed_rows_have_the_uniform_state_marginal():
  vocab, length = 8, 20_000
  alpha_B = jnp.array([0.0, 0.3, 0.8, 0.97])
  clean_BC = jnp.tile((jnp.arange(length) % vocab)[None], (4, 1)).astype(jnp.int32)
  keys_B = jax.random.split(jax.random.PRNGKey(0), 4)
  z_BC, probs_BCV = relaxation.relaxed_rows(keys_B, clean_BC, alpha_B, vocab, jnp.float32(0.5))
  z, clean = np.asarray(z_BC), np.asarray(clean_BC)
  np.testing.assert_allclose(np.asarray(probs_BCV).sum(-1), 1.0, rtol=1e-5)
  for b, a in enumerate(np.asarray(alpha_B)):
    p_keep = a + (1 - a) / vocab
    kept = np.mean(z[b] == clean[b])
    assert abs(kept - p_keep) < 5 * np.sqrt(p_keep * (1 - p_keep) / length)
    # every wrong token equally likely: (1 - alpha) / N each
    offset = (z[b] - clean[b]) % vocab
    p_each = (1 - a) / vocab
    for k in range(1, vocab):
      share = np.mean(offset == k)
      assert abs(share - p_each) < 5 * np.sqrt(p_each * (1 - p_each) / length) + 1e-12


def test_relaxed_probs_tend_to_the_argmax_one_hot_as_tau_falls():
  vocab, keys = 16, jax.random.split(jax.random.PRNGKey(1), 2)
  clean = jnp.zeros((2, 64), jnp.int32)
  alpha = jnp.array([0.5, 0.5])
  z_sharp, p_sharp = relaxation.relaxed_rows(keys, clean, alpha, vocab, jnp.float32(1e-6))
  z_soft, p_soft = relaxation.relaxed_rows(keys, clean, alpha, vocab, jnp.float32(1.0))
  np.testing.assert_array_equal(z_sharp, z_soft)  # the same latent, only the temperature differs
  np.testing.assert_array_equal(np.asarray(p_sharp).argmax(-1), z_sharp)
  # at tau = 1e-6 a runner-up within 1e-5 of the winner would keep mass: a measure-zero event for 128 draws
  np.testing.assert_allclose(p_sharp, jax.nn.one_hot(z_sharp, vocab), atol=1e-6)
  entropy = lambda p: -np.sum(p * np.log(np.maximum(p, 1e-30)), -1).mean()
  assert entropy(np.asarray(p_soft)) > 1.0  # a soft input: nats, against ~0 for the sharp one


def test_curriculum_tau_is_geometric_between_its_ends():
  cfg = DiffusionSettings(canvas_len=8, curriculum_steps=11, curriculum_tau_start=0.1, curriculum_tau_end=0.001)
  taus = np.asarray([relaxation.curriculum_tau(jnp.asarray(s), cfg) for s in range(11)])
  np.testing.assert_allclose(taus, np.geomspace(0.1, 0.001, 11), rtol=1e-5)


@pytest.mark.parametrize("vocab_size", [27, 2048])
def test_curriculum_times_are_uniform_in_log_snr_between_the_window_levels(vocab_size):
  cfg = DiffusionSettings(canvas_len=8, curriculum_steps=10, curriculum_alpha_range=(0.05, 0.9))
  t = np.linspace(0.0, 1.0, 201)
  # under jit, as the train step calls it (the window's ends are host constants)
  alpha, dalpha = (np.asarray(x, np.float64) for x in jax.jit(
      lambda t: relaxation.curriculum_alpha(t, cfg, vocab_size))(t))
  # the ends are the window's levels (to the inversion's ~1e-5), alpha falls monotonically between them
  assert alpha[0] == pytest.approx(0.9, abs=1e-4) and alpha[-1] == pytest.approx(0.05, abs=1e-4)
  assert np.all(np.diff(alpha) < 0) and np.all(dalpha < 0)
  # alpha' is d alpha / dt: against central differences of alpha itself (both from the interpolated table:
  # the table's derivative is a second-order difference on a 0.01 grid of r, so they agree to ~1e-3 of
  # alpha's range per unit t)
  np.testing.assert_allclose(dalpha[1:-1], (alpha[2:] - alpha[:-2]) / (t[2:] - t[:-2]), rtol=2e-2, atol=2e-3)
  # log-SNR uniform in t: r = exp(-gamma / 2) is geometric in t, checked through alpha(r) in float64
  r_ends = [float(relaxation.snr_of_alpha(a, vocab_size)) for a in (0.9, 0.05)]
  r = r_ends[0] * (r_ends[1] / r_ends[0]) ** t
  np.testing.assert_allclose(alpha, relaxation.alpha_of_snr(r, vocab_size), atol=1e-4)


@pytest.mark.slow  # 14 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_the_curriculum_window_sets_the_training_alpha():
  # Inside the curriculum every example's alpha lies in the window. At alpha >= 0.999 a token is wrong with
  # probability < 1e-3, so the 16 canvas tokens of this seed come out clean; at alpha <= 0.01 it is right
  # with probability < 0.01 + 1/64, so nearly all are wrong; the schedule's two times lie between.
  plain = DiffusionSettings(canvas_len=C, objective="loo_ce", self_cond_prob=0.0)
  window = dataclasses.replace(plain, curriculum_steps=5, curriculum_alpha_range=(0.999, 0.9999))
  params, batch, rng = random_params(CFG), _batch(), jax.random.PRNGKey(3)
  _, m_window = loss.diffusion_loss(params, batch, rng, model_cfg=CFG, loss_cfg=window, step=jnp.asarray(0))
  _, m_after = loss.diffusion_loss(params, batch, rng, model_cfg=CFG, loss_cfg=window, step=jnp.asarray(5))
  _, m_plain = loss.diffusion_loss(params, batch, rng, model_cfg=CFG, loss_cfg=plain)
  noisy = dataclasses.replace(window, curriculum_alpha_range=(0.0, 0.01))
  _, m_noisy = loss.diffusion_loss(params, batch, rng, model_cfg=CFG, loss_cfg=noisy, step=jnp.asarray(0))
  assert float(m_window["corrupted_fraction"]) == 0.0 and float(m_noisy["corrupted_fraction"]) >= 0.75
  assert 0.0 < float(m_plain["corrupted_fraction"]) < 0.75
  # after the curriculum: the schedule's times again. The two programs differ only in the embedding (exact
  # for one-hot rows) and in how XLA fuses the rest, i.e. by fp32 round-off (~1e-7 relative per op)
  assert float(m_after["canvas_loss"]) == pytest.approx(float(m_plain["canvas_loss"]), rel=1e-5)
  assert float(m_after["corrupted_fraction"]) == float(m_plain["corrupted_fraction"])


# ---- the curriculum in diffusion_loss ------------------------------------------------------------------

CFG = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), vocab_size=64, num_experts=0)
B, L, C = 2, 24, 8


def _batch():
  return random_rows(CFG.vocab_size, B, L)


def _loss_and_grads(loss_cfg, step, params, model_cfg):
  fn = jax.jit(jax.value_and_grad(lambda p, s: loss.diffusion_loss(
      p, _batch(), jax.random.PRNGKey(3), model_cfg=model_cfg, loss_cfg=loss_cfg, step=s)[0]))
  value, grads = fn(params, jnp.asarray(step))
  return float(value), to_f64(grads)


@pytest.mark.slow  # two float64 compiles of the loss and its gradient (kept out of the fast tier's budget)
def test_after_the_curriculum_the_loss_is_the_discrete_one():
  # From step curriculum_steps on, the noise is the discrete draw and the decoder reads one-hot rows:
  # probs @ table picks the token's row exactly, so loss and gradients equal the run without a
  # curriculum up to reassociation (the table's gradient is summed by a matmul instead of a scatter):
  # in float64 that is ~1e-16 relative, and 1e-9 is robust yet far below any real difference.
  plain = DiffusionSettings(canvas_len=C, objective="loo_nelbo_ce", self_cond_prob=0.5)
  curriculum = dataclasses.replace(plain, curriculum_steps=5, curriculum_tau_start=0.5,
                                   curriculum_alpha_range=(0.04, 0.93))  # (jitted: the traced window too)
  with float64():
    cfg64 = f64_config(CFG)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), random_params(CFG))
    want_value, want_grads = _loss_and_grads(plain, 7, params, cfg64)
    got_value, got_grads = _loss_and_grads(curriculum, 7, params, cfg64)
    relaxed_value, relaxed_grads = _loss_and_grads(curriculum, 2, params, cfg64)
  assert got_value == pytest.approx(want_value, rel=1e-9)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12), got_grads, want_grads)
  # ... and during it the loss differs (other noise, a soft input) while gradients stay finite
  assert relaxed_value != pytest.approx(want_value, rel=1e-3)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(relaxed_grads))


@pytest.mark.slow  # 14 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_relaxed_input_is_what_the_decoder_reads():
  # During the curriculum at a vanishing temperature the soft input is one-hot(argmax w): the loss then
  # equals the discrete loss at that same z, computed here by hand from the relaxed draw.
  cfg = DiffusionSettings(canvas_len=C, objective="loo_ce", self_cond_prob=0.0, curriculum_steps=10,
                          curriculum_tau_start=1e-7, curriculum_tau_end=1e-7)
  params = random_params(CFG)
  batch = _batch()
  rng = jax.random.PRNGKey(3)
  value, metrics = loss.diffusion_loss(params, batch, rng, model_cfg=CFG, loss_cfg=cfg, step=jnp.asarray(0))
  assert float(metrics["relaxation_tau"]) == pytest.approx(1e-7)
  # the draw diffusion_loss makes: per-example keys as in loss.diffusion_loss
  rng_examples, rng_batch = jax.random.split(rng)
  keys_B3 = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(rng_examples, i), 3))(jnp.arange(B))
  t_B = loss.sample_times(keys_B3[:, 0], jnp.arange(B), rng_batch, jnp.float32(B), cfg)
  z_BC, _ = relaxation.relaxed_rows(keys_B3[:, 1], jnp.asarray(batch["tokens"][:, -C:]), 1.0 - t_B,
                                    CFG.vocab_size, jnp.float32(1e-7))
  # the same loss with that z as an ordinary discrete canvas: a forced "corruption" through the public path
  from dgemma.diffusion import objectives
  from dgemma.model import Transformer, init_cache
  model = Transformer(CFG)
  cache = init_cache(CFG, B, L - C, dtype=jnp.float32)
  (_, cache) = model.apply({"params": params}, batch["tokens"][:, :-C], batch["positions"][:, :-C],
                           batch["segment_ids"][:, :-C], cache, return_logits=False, method=Transformer.encode)
  logits = model.apply({"params": params}, z_BC, batch["positions"][:, -C:], batch["segment_ids"][:, -C:], cache,
                       method=Transformer.decode)
  alpha_BC = jnp.repeat((1.0 - t_B)[:, None], C, axis=1)
  canvas = objectives.get("loo_ce").loss(logits, batch["tokens"][:, -C:], z_BC, alpha_BC, -jnp.ones_like(alpha_BC),
                                          reweight_cap=cfg.reweight_cap, mask_id=cfg.mask_id)
  assert float(metrics["canvas_loss"]) == pytest.approx(float(jnp.mean(canvas)), rel=1e-5)


def test_curriculum_settings_are_validated():
  from configs import tiny_test
  from dgemma import settings as settings_lib
  from dgemma.errors import ConfigError
  config = tiny_test.get_config()
  config.diffusion.curriculum_steps = 100
  config.diffusion.objective = "mdlm"
  with pytest.raises(ConfigError, match="diffusion.curriculum_steps"):
    settings_lib.from_config(config)
  config.diffusion.objective = "nelbo"
  config.diffusion.curriculum_tau_start = 0.0
  with pytest.raises(ConfigError, match="diffusion.curriculum_tau_start"):
    settings_lib.from_config(config)
  config.diffusion.curriculum_tau_start = 0.1
  assert settings_lib.from_config(config).diffusion.curriculum_steps == 100
  for bad in ((0.9, 0.1), (0.1,), (0.1, 1.0), ("a", "b")):
    config.diffusion.curriculum_alpha_range = bad
    with pytest.raises(ConfigError, match="diffusion.curriculum_alpha_range"):
      settings_lib.from_config(config)
  config.diffusion.curriculum_alpha_range = (0.04, 0.93)
  assert settings_lib.from_config(config).diffusion.curriculum_alpha_range == (0.04, 0.93)
