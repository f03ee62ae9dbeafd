"""dgemma/diffusion/loss.py training times: diffusion.t_power, diffusion.t_mixture and the weight that undoes them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion import loss
from dgemma.diffusion.config import DiffusionSettings


@pytest.mark.parametrize("power", [1.0, 2.0, 3.0])
def test_times_follow_u_to_the_power_and_the_weight_restores_uniform_t(power):
  cfg = DiffusionSettings(canvas_len=8, t_eps=1e-3, antithetic_t=True, t_power=power)
  n = 4096
  ids = jnp.arange(n, dtype=jnp.int32)
  t = np.asarray(loss.sample_times(jax.random.split(jax.random.key(0), n), ids, jax.random.key(1),
                                   jnp.float32(n), cfg), np.float64)
  # antithetic: u_b = frac(u0 + b / n) is a shifted grid, so sorted t is t_eps + (1 - t_eps) grid^p exactly
  u = np.sort((t - cfg.t_eps) / (1 - cfg.t_eps)) ** (1.0 / power)
  # fp32 t has an absolute error ~ulp(t) <= 6e-8, which inverting u^p amplifies by 1 / (p u^(p-1)): at
  # u > 0.05 that is <= 6e-8 / (3 * 0.0025) = 8e-6 for p <= 3, below atol 2e-5 (a wrong power is off by O(1/n))
  np.testing.assert_allclose(np.diff(u)[u[1:] > 0.05], 1.0 / n, atol=2e-5)
  w = np.asarray(loss.uniform_time_weight(jnp.asarray(t, jnp.float32), cfg), np.float64)
  # E_train[w(t) g(t)] = E_uniform[g(t)] for smooth g: midpoint-rule error O(1/n) plus the grid's random
  # shift (at most one cell, 1/n of the integrand's range), so 1e-2 relative is loose for n = 4096 ...
  for g, exact in ((lambda x: x, (1 + cfg.t_eps) / 2), (lambda x: np.log(x), None)):
    want = exact if exact is not None else float(np.mean(g(cfg.t_eps + (1 - cfg.t_eps) * (np.arange(n) + 0.5) / n)))
    assert np.mean(w * g(t)) == pytest.approx(want, rel=1e-2)
  if power > 1:  # ... and these times are not uniform: the unweighted mean of t is (1 + p)^-1 off 1/2
    assert np.mean(t) == pytest.approx(cfg.t_eps + (1 - cfg.t_eps) / (1 + power), rel=1e-2)
  else:
    np.testing.assert_array_equal(w, 1.0)


def test_t_power_is_validated():
  from configs import tiny_test
  from dgemma import settings as settings_lib
  from dgemma.errors import ConfigError
  config = tiny_test.get_config()
  config.diffusion.t_power = 0.0
  with pytest.raises(ConfigError, match="diffusion.t_power"):
    settings_lib.from_config(config)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_mixture_puts_its_share_in_the_window_and_the_weight_restores_uniform_t(power):
  weight, lo, hi = 0.5, 0.1, 0.5
  cfg = DiffusionSettings(canvas_len=8, t_eps=1e-3, t_power=power, t_mixture=(weight, lo, hi))
  n = 1 << 16
  t = np.asarray(loss.sample_times(jax.random.split(jax.random.key(0), n), jnp.arange(n, dtype=jnp.int32),
                                   jax.random.key(1), jnp.float32(n), cfg), np.float64)
  assert t.min() >= cfg.t_eps and t.max() <= 1.0
  # the window's share: weight from the mixture plus (1 - weight) of the power law's mass there. n Bernoulli draws
  # have standard error sqrt(q (1 - q) / n) <= 0.002; 5 of them (0.01) would not hide a missing or doubled weight
  v = lambda x: (x - cfg.t_eps) / (1 - cfg.t_eps)
  share = weight + (1 - weight) * (v(hi) ** (1 / power) - v(lo) ** (1 / power))
  assert np.mean((t >= lo) & (t <= hi)) == pytest.approx(share, abs=5 * np.sqrt(share * (1 - share) / n))
  w = np.asarray(loss.uniform_time_weight(jnp.asarray(t, jnp.float32), cfg), np.float64)
  # E_train[w(t) g(t)] = E_uniform[g(t)]: a Monte Carlo mean, so the tolerance is 5 of its standard errors
  # (sample std / sqrt(n)); dropping the window's term or the (1 - weight) factor moves it by 10-50 of them
  for g in (lambda x: x, lambda x: x ** 2, lambda x: np.log(x)):
    grid = cfg.t_eps + (1 - cfg.t_eps) * (np.arange(n) + 0.5) / n
    want = float(np.mean(g(grid)))
    wg = w * g(t)
    assert np.mean(wg) == pytest.approx(want, abs=5 * np.std(wg) / np.sqrt(n))
  # and the weight is bounded: at least (1 - weight) of the power law's density is everywhere
  if power == 1.0:
    np.testing.assert_allclose(w[(t < lo) | (t > hi)], 1 / (1 - weight), rtol=1e-6)


def test_without_a_mixture_the_draws_are_unchanged():
  n = 256
  keys, ids = jax.random.split(jax.random.key(3), n), jnp.arange(n, dtype=jnp.int32)
  base = DiffusionSettings(canvas_len=8, t_eps=1e-3)
  mixed = dataclasses.replace(base, t_mixture=(0.25, 0.2, 0.3))
  t0 = np.asarray(loss.sample_times(keys, ids, jax.random.key(1), jnp.float32(n), base))
  t1 = np.asarray(loss.sample_times(keys, ids, jax.random.key(1), jnp.float32(n), mixed))
  moved = t0 != t1  # an example either keeps the recipe's draw or takes one in the window
  assert 0 < moved.sum() < n
  assert np.all((t1[moved] >= 0.2) & (t1[moved] <= 0.3))


@pytest.mark.parametrize("value", [(0.0, 0.1, 0.5), (1.0, 0.1, 0.5), (0.5, 0.5, 0.1), (0.5, 0.1, 1.5),
                                   (0.5, 0.1), ("a", 0.1, 0.5)])
def test_t_mixture_is_validated(value):
  from configs import tiny_test
  from dgemma import settings as settings_lib
  from dgemma.errors import ConfigError
  config = tiny_test.get_config()
  config.diffusion.t_mixture = value
  with pytest.raises(ConfigError, match="diffusion.t_mixture"):
    settings_lib.from_config(config)
