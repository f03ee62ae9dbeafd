"""Short canvases (diffusion.short_canvas_len, dgemma/diffusion/loss.py docstring) against the obvious reference:
two plain diffusion_loss calls, one with the configured canvases and one with the short ones as its canvases.

The mixed loss shares one encoder pass (over the row up to the last short canvas) between two decoder passes,
each reading the cache only up to its own canvases' start; the references each run their own encoder. In float64
the two agree to round-off (~1e-13 on losses of ~4), so atol 1e-9 holds on any CPU, while reading one clean token
too many or too few (a cache cut off by one) moves a loss by > 1e-3.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import demo, distill_dcd
from dgemma import diffusion, settings
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from tests.diffusion.test_block_causal import B, C, CFG, K, L, _batch
from tests.model_utils import f64_config, float64, random_params, to_f64

S = 2  # short canvas length: A = K * C / S = 12 short canvases over the row's last 24 tokens
CFG64 = f64_config(CFG)


def _cfg(**kw):
  return DiffusionSettings(canvas_len=C, canvases_per_row=K, objective="loo_ce", **kw)


def _loss(params, batch, rng, loss_cfg, eval_metrics=False):
  return jax.jit(lambda p, b, r: diffusion.diffusion_loss(p, b, r, model_cfg=CFG64, loss_cfg=loss_cfg,
                                                          eval_metrics=eval_metrics))(params, batch, rng)


@pytest.mark.slow  # the fast tier's budget: three loss programs (~7 s)
def test_mixed_loss_equals_the_two_plain_losses():
  with float64():
    params = to_f64(random_params(CFG))
    batch = _batch()
    rng = jax.random.PRNGKey(5)
    _, m_long = _loss(params, batch, rng, _cfg())
    # The short canvases as a plain run's canvases: same noise (the mixed loss draws them from fold_in(rng, 1)),
    # no self-conditioning; its encoder reads the same L - S tokens as the mixed run's.
    short_cfg = _cfg(self_cond_prob=0.0)
    short_cfg = dataclasses.replace(short_cfg, canvas_len=S, canvases_per_row=K * C // S)
    _, m_short = _loss(params, batch, jax.random.fold_in(rng, 1), short_cfg)
    mixed = {}
    for weight in (0.5, 0.2):  # the two plain losses do not depend on the weight: computed once
      mixed_cfg = _cfg(short_canvas_len=S, short_canvas_weight=weight)
      assert mixed_cfg.num_short_canvases == K * C // S
      mixed[weight] = _loss(params, batch, rng, mixed_cfg)
  m_long, m_short = (jax.tree.map(np.asarray, x) for x in (m_long, m_short))
  for weight, (loss, m) in mixed.items():
    m, loss = jax.tree.map(np.asarray, m), float(loss)
    for key in ("canvas_loss", "canvas_ce", "canvas_accuracy", "corrupted_fraction"):
      np.testing.assert_allclose(m[key], m_long[key], atol=1e-9, rtol=0, err_msg=key)
    np.testing.assert_allclose(m["short_canvas_loss"], m_short["canvas_loss"], atol=1e-9, rtol=0)
    np.testing.assert_allclose(m["short_canvas_ce"], m_short["canvas_ce"], atol=1e-9, rtol=0)
    np.testing.assert_allclose(m["encoder_loss"], m_short["encoder_loss"], atol=1e-9, rtol=0)
    expected = (1 - weight) * m_long["canvas_loss"] + weight * m_short["canvas_loss"] + m_short["encoder_loss"]
    np.testing.assert_allclose(loss, expected, atol=1e-9, rtol=0, err_msg=str(weight))
    # The encoder reads more targets than the plain run's (L - S tokens, not L - C), so its loss differs.
    assert abs(m["encoder_loss"] - m_long["encoder_loss"]) > 1e-3
    assert abs(m["short_canvas_loss"] - m["canvas_loss"]) > 1e-3


def test_evaluation_scores_the_configured_canvases_only():
  with float64():
    params = to_f64(random_params(CFG))
    batch = _batch()
    rng = jax.random.PRNGKey(2)
    _, m = _loss(params, batch, rng, _cfg(short_canvas_len=S), eval_metrics=True)
    _, m_plain = _loss(params, batch, rng, _cfg(), eval_metrics=True)
    m, m_plain = jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, m_plain)
  assert "short_canvas_loss" not in m and set(m) == set(m_plain)
  for key in m:
    np.testing.assert_allclose(m[key], m_plain[key], atol=1e-12, rtol=0, err_msg=key)


def test_micro_batches_add_up_to_the_batch():
  """batch_totals counts the short canvases' tokens, so micro-batch losses sum to the whole batch's."""
  with float64():
    params = to_f64(random_params(CFG))
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    rng = jax.random.PRNGKey(7)
    cfg = _cfg(short_canvas_len=S)
    totals = diffusion.batch_totals(batch, cfg)
    fn = jax.jit(lambda p, b, ids, t: diffusion.diffusion_loss(p, b, rng, model_cfg=CFG64, loss_cfg=cfg,
                                                               example_ids_B=ids, totals=t))
    whole, _ = fn(params, batch, jnp.arange(B, dtype=jnp.int32), totals)
    parts = [fn(params, {k: v[i:i + 1] for k, v in batch.items()}, jnp.asarray([i], jnp.int32), totals)[0]
             for i in range(B)]
    whole, parts = float(whole), [float(p) for p in parts]
    assert float(totals["short_canvas_tokens"]) == float(diffusion.target_mask(batch)[:, -K * C:].sum())
  # The losses come out in fp32 (fp32 token weights and normalisers), so each of the B + 1 values carries one
  # fp32 rounding (2^-24 relative): a few ulps of |whole|; a miscount of one token would move it by ~1%.
  np.testing.assert_allclose(sum(parts), whole, rtol=(B + 2) * 2.0 ** -24, atol=0)


def _settings(**diffusion_overrides):
  config = demo.get_config()  # seq_len 128, three canvases of 32
  for key, value in diffusion_overrides.items():
    config.diffusion[key] = value
  return settings.from_config(config)


def test_settings_check_the_short_canvas_fields():
  assert _settings(short_canvas_len=2).diffusion.num_short_canvases == 48  # the 96 canvas tokens
  assert _settings(short_canvas_len=2, short_canvases_per_row=5).diffusion.num_short_canvases == 5
  assert _settings().diffusion.num_short_canvases == 0
  with pytest.raises(ConfigError, match="diffusion.short_canvases_per_row"):
    _settings(short_canvas_len=2, short_canvases_per_row=64)  # 128 tokens: no context left
  with pytest.raises(ConfigError, match="diffusion.short_canvas_len"):
    _settings(short_canvas_len=2, objective="ar", canvases_per_row=1)
  with pytest.raises(ConfigError, match="diffusion.short_canvas_weight"):
    _settings(short_canvas_len=2, short_canvas_weight=1.5)


def test_distillation_rejects_short_canvases():
  config = distill_dcd.get_config()  # the demo, distilled
  config.train.init_from = "workdirs/teacher"  # only named: the check comes before anything is read
  config.diffusion.short_canvas_len = 2
  with pytest.raises(ConfigError, match="diffusion.short_canvas_len"):
    settings.from_config(config)
