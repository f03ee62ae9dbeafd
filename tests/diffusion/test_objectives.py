"""Training objectives (dgemma/diffusion/objectives.py) against slow literal implementations, and the
uniform-state NELBO against the discrete-time ELBO and known entropies. No model: small arrays only."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_test
from dgemma import diffusion
from dgemma import settings as settings_lib
from dgemma.diffusion import objectives, schedules
from dgemma.errors import ConfigError


# ---- slow literal references (python loops, explicit one-hot vectors, float64) -------------------

def _softmax(f):
  e = np.exp(f - np.max(f))
  return e / e.sum()


def _onehot(i, n):
  v = np.zeros(n)
  v[i] = 1.0
  return v


def ref_ce(f, x):
  return -math.log(_softmax(f)[x])


def ref_weight(t, cap):
  return min(1.0 / (1.0 - t), cap)  # -alpha'/alpha, alpha = 1 - t, alpha' = -1


def ref_loo_ce(f, x, z, alpha):
  n = len(f)
  delta = math.log(1.0 + n * alpha / (1.0 - alpha))
  return -math.log(_softmax(f + delta * _onehot(z, n))[x])


def ref_nelbo(f, x, z, alpha, dalpha):
  """The reference doc's formula, literally."""
  n = len(f)
  x_theta = _softmax(f)
  xbar = n * alpha * _onehot(x, n) + (1.0 - alpha)
  xbar_theta = n * alpha * x_theta + (1.0 - alpha)
  total = n / xbar[z] - n / xbar_theta[z]
  for j in range(n):
    total -= (xbar[j] / xbar[z]) * (math.log(xbar_theta[z]) - math.log(xbar_theta[j])
                                    + math.log(xbar[j]) - math.log(xbar[z]))
  return dalpha / (n * alpha) * total


def ref_mdlm(f, x, z, t, mask_id):
  if z != mask_id:
    return 0.0
  g = np.array(f, np.float64)
  g[mask_id] = -np.inf
  return (1.0 / t) * -math.log(_softmax(g)[x])  # -alpha'/(1 - alpha) = 1/t


def _random_case(seed, n, num=24, scale=3.0):
  """Logits, targets x, noisy z (half equal to x), and t per token spanning (1e-4, 1)."""
  rng = np.random.default_rng(seed)
  f = (rng.normal(size=(num, n)) * scale).astype(np.float32)
  x = rng.integers(0, n, num)
  z = np.where(rng.random(num) < 0.5, x, rng.integers(0, n, num))
  t = np.concatenate([[1e-4, 1e-3, 0.5, 0.95, 0.999, 0.9999], rng.uniform(1e-4, 1.0, num - 6)]).astype(np.float32)
  return f, x, z, t


def _alpha32(t):
  # The functions receive fp32 alpha = 1 - t; the references use that same alpha in float64.
  return np.float32(1.0) - np.float32(t)


# ---- per-token objectives vs the literal references ----------------------------------------------

@pytest.mark.parametrize("n", [5, 37])
@pytest.mark.parametrize("name", ["base_ce", "reweighted_ce", "loo_ce", "reweighted_loo_ce", "nelbo", "loo_nelbo",
                                  "loo_nelbo_ce"])
def test_uniform_objectives_match_literal(name, n):
  f, x, z, t = _random_case(n, n)
  alpha, dalpha = schedules.alpha_and_derivative("linear", t)
  cap = 50.0
  got = np.asarray(objectives.per_token_loss(name, jnp.asarray(f), jnp.asarray(x), jnp.asarray(z), alpha, dalpha,
                                             reweight_cap=cap))
  want = []
  for i in range(len(x)):
    fi, a = f[i].astype(np.float64), float(_alpha32(t[i]))
    if name == "base_ce":
      want.append(ref_ce(fi, x[i]))
    elif name == "reweighted_ce":
      want.append(min(1.0 / a, cap) * ref_ce(fi, x[i]))
    elif name == "loo_ce":
      want.append(ref_loo_ce(fi, x[i], z[i], a))
    elif name == "reweighted_loo_ce":
      want.append(min(1.0 / a, cap) * ref_loo_ce(fi, x[i], z[i], a))
    elif name == "loo_nelbo":  # the network output is x_theta itself
      want.append(ref_nelbo(fi, x[i], z[i], a, -1.0))
    elif name == "loo_nelbo_ce":
      want.append(ref_nelbo(fi, x[i], z[i], a, -1.0) + ref_loo_ce(fi, x[i], z[i], a))
    else:  # nelbo: the network output is the posterior; x_theta = softmax(f - delta onehot(z))
      delta = math.log(1.0 + n * a / (1.0 - a))
      want.append(ref_nelbo(fi - delta * _onehot(z[i], n), x[i], z[i], a, -1.0))
  want = np.asarray(want)
  # fp32 evaluation vs float64 on the same fp32 inputs (alpha included): error ~ eps x the formula's
  # condition, up to ~1/alpha (t <= 0.9999, reweighting cap 50) and the NELBO's n / xbar differences;
  # measured <= 5% of this tolerance for both n, so another reduction order cannot reach it.
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)


def test_reweighting_is_minus_dalpha_over_alpha():
  # alpha = 1 - t, alpha' = -1: -alpha'/alpha = 1/(1 - t); capped at t > 1 - 1/cap.
  t = np.array([1e-4, 0.25, 0.5, 0.8, 0.9, 0.95, 0.999999], np.float32)
  alpha, dalpha = schedules.alpha_and_derivative("linear", t)
  w = np.asarray(objectives.time_weight(alpha, dalpha, cap=10.0))
  # 1 - t is exact in fp32 for t >= 1/2 (Sterbenz), else 1 rounding; then one division: <= 1 eps; 1e-5 = 84 eps
  np.testing.assert_allclose(w, [ref_weight(float(ti), 10.0) for ti in t], rtol=1e-5)
  assert np.isfinite(objectives.time_weight(jnp.zeros(1), -jnp.ones(1), 10.0)).all()


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_schedule_derivative(name):
  t = jnp.linspace(0.01, 0.99, 33)
  alpha, dalpha = schedules.alpha_and_derivative(name, t)
  alpha0, _ = schedules.alpha_and_derivative(name, jnp.zeros(()))
  alpha1, _ = schedules.alpha_and_derivative(name, jnp.ones(()))
  assert abs(float(alpha0) - 1.0) < 1e-6 and abs(float(alpha1)) < 1e-6
  h = 1e-3
  fd = (schedules.alpha_and_derivative(name, t + h)[0] - schedules.alpha_and_derivative(name, t - h)[0]) / (2 * h)
  # central difference: truncation h^2 |alpha'''| / 6 < 1e-6, fp32 cancellation ~eps |alpha| / h ~ 1.2e-4 < 1e-3
  np.testing.assert_allclose(dalpha, fd, rtol=1e-3, atol=1e-3)


def test_posterior_from_loo_consistent_with_loo_ce_and_inverted_by_loo_from_posterior():
  f, x, z, t = _random_case(1, 11)
  alpha = jnp.asarray(1.0 - t)
  post = objectives.posterior_from_loo(jnp.asarray(f), jnp.asarray(z), alpha)
  ce = objectives.cross_entropy(post, jnp.asarray(x))
  # two fp32 formulas of one value: a few roundings of logits |f + shift| <~ 20: ~eps * 20 = 2.4e-6 < 1e-5
  np.testing.assert_allclose(ce, objectives.loo_cross_entropy(jnp.asarray(f), jnp.asarray(x), jnp.asarray(z), alpha),
                             rtol=1e-5, atol=1e-5)
  # adding and taking off the same fp32 shift (|shift| <= log(1 + 11 / 1e-4) ~ 11.6): 2 roundings of ~20
  back = objectives.loo_from_posterior(post, jnp.asarray(z), alpha)
  np.testing.assert_allclose(back, f, atol=1e-5)
  for name, record in objectives.OBJECTIVES.items():
    if record.masked or record.autoregressive:
      continue
    # every record reads its output one way or the other: the two readings are one shift apart
    diff = record.posterior_logits(jnp.asarray(f), jnp.asarray(z), alpha) - record.loo_prior_logits(
        jnp.asarray(f), jnp.asarray(z), alpha)
    np.testing.assert_allclose(diff, post - jnp.asarray(f), atol=1e-5, err_msg=name)


def test_mdlm_matches_literal():
  n, mask_id = 9, 4
  f, x, _, t = _random_case(3, n)
  x = np.where(x == mask_id, 0, x)  # clean tokens are never the mask
  rng = np.random.default_rng(0)
  z = np.where(rng.random(len(x)) < 0.5, mask_id, x)
  alpha, dalpha = schedules.alpha_and_derivative("linear", t)
  got = objectives.per_token_loss("mdlm", jnp.asarray(f), jnp.asarray(x), jnp.asarray(z), alpha, dalpha, mask_id=mask_id)
  want = [ref_mdlm(f[i].astype(np.float64), x[i], z[i], 1.0 - float(_alpha32(t[i])), mask_id) for i in range(len(x))]
  # the reference uses the same fp32 alpha, so 1 - alpha is exact on both sides (Sterbenz) and the
  # 1/t weight (<= 1e4) multiplies only a few eps of CE error
  np.testing.assert_allclose(got, want, rtol=2e-4)


def test_mdlm_corruption_uses_mask_id():
  tokens = jnp.full((64, 256), 7, jnp.int32)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(64))
  p = jnp.linspace(0.0, 1.0, 64)
  noisy, replaced = diffusion.corrupt_rows(keys, tokens, p, 100, mask_id=4)
  assert set(np.unique(np.asarray(noisy))) <= {4, 7}
  np.testing.assert_array_equal(np.asarray(noisy) == 4, np.asarray(replaced))
  assert abs(float(replaced.mean()) - 0.5) < 0.02


# ---- the uniform-state NELBO ---------------------------------------------------------------------

def test_nelbo_large_vocab_extreme_t_fp32():
  """Rearranged fp32 form vs the literal float64 formula at V = 32768, t from 1e-4 to 1 - 1e-4, with
  confident, flat and wrong predictions; value and gradient finite."""
  n = 32768
  rng = np.random.default_rng(0)
  rows = []
  for t in (1e-4, 0.01, 0.5, 0.9999):
    for scale, boost in ((1.0, 0.0), (10.0, 0.0), (3.0, 40.0)):
      f = (rng.normal(size=n) * scale).astype(np.float32)
      x = int(rng.integers(0, n))
      f[x] += boost
      for z in (x, int(rng.integers(0, n))):
        rows.append((f, x, z, t))
  f = np.stack([r[0] for r in rows])
  x, z = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
  alpha = np.array([_alpha32(r[3]) for r in rows], np.float32)

  def vec_ref(fi, xi, zi, a):  # the doc formula, vectorised over j, float64
    p = _softmax(fi.astype(np.float64))
    xbar = np.full(n, 1.0 - a)
    xbar[xi] += n * a
    xbt = n * a * p + (1.0 - a)
    s = np.sum(xbar / xbar[zi] * (np.log(xbt[zi]) - np.log(xbt) + np.log(xbar) - np.log(xbar[zi])))
    return -1.0 / (n * a) * (n / xbar[zi] - n / xbt[zi] - s)

  want = np.array([vec_ref(f[i], x[i], z[i], float(alpha[i])) for i in range(len(x))])
  fn = lambda logits: objectives.uniform_nelbo_per_token(logits, jnp.asarray(x), jnp.asarray(z), jnp.asarray(alpha),
                                                         -jnp.ones(len(x)))
  got = np.asarray(fn(jnp.asarray(f)))
  assert np.all(got >= 0)
  # fp32 rearranged form vs float64 literal on the same inputs: measured <= 2% of this tolerance
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  grads = jax.grad(lambda l: jnp.sum(fn(l)))(jnp.asarray(f))
  assert np.all(np.isfinite(np.asarray(grads)))


def test_nelbo_zero_for_perfect_prediction_and_positive_otherwise():
  n = 50
  x = jnp.arange(8) % n
  z = jnp.array([0, 1, 2, 3, 9, 10, 11, 12])  # first four equal x, last four corrupted
  perfect = jax.nn.one_hot(x, n) * 200.0
  for t in (0.01, 0.5, 0.99):
    alpha = jnp.full(8, 1.0 - t)
    val = objectives.uniform_nelbo_per_token(perfect, x, z, alpha, -jnp.ones(8))
    np.testing.assert_allclose(val, 0.0, atol=1e-4)  # exp(-200) underflows: x_theta is exactly one-hot
    flat = objectives.uniform_nelbo_per_token(jnp.zeros((8, n)), x, z, alpha, -jnp.ones(8))
    assert np.all(np.asarray(flat) > 0)


def _posterior(v, zt, a_s, a_t, n):
  """q(z_s | z_t, x) from the reference doc, x replaced by the vector v (one-hot or x_theta)."""
  e = _onehot(zt, n)
  w = n * a_t * v[zt] * e + (a_t / a_s - a_t) * e + (a_s - a_t) * v + (1.0 - a_t / a_s) * (1.0 - a_s) / n
  return w / w.sum()


def _discrete_elbo(x, table, ts, n):
  """sum_i E_{z_t ~ q(z_t|x)} KL(q(z_s|z_t,x) || p_theta(z_s|z_t)), s = t_{i-1}, t = t_i, alpha = 1 - t;
  exact sums over z_t (no sampling). The prior term is 0 (alpha(1) = 0: uniform) and the last step
  (s = 0) is the reconstruction term -log p_theta(x | z_{t_1})."""
  total = 0.0
  for s, t in zip(ts[:-1], ts[1:]):
    a_s, a_t = 1.0 - s, 1.0 - t
    q_t = a_t * _onehot(x, n) + (1.0 - a_t) / n
    for zt in range(n):
      q = _posterior(_onehot(x, n), zt, a_s, a_t, n)
      p = _posterior(table(zt, t), zt, a_s, a_t, n)
      m = q > 0
      total += q_t[zt] * np.sum(q[m] * np.log(q[m] / p[m]))
  return total


def _continuous_nelbo(x, table, n, points=4000):
  """integral over t in (0, 1) of E_{z_t ~ q(z_t|x)}[uniform_nelbo_per_token], trapezoid on a grid that
  is geometric near t = 0 (the integrand grows like log(1/t) there) and linear above 0.5."""
  ts = np.concatenate([np.geomspace(1e-9, 0.5, points), np.linspace(0.5, 1.0 - 1e-6, points)[1:]])
  alpha = (1.0 - ts).astype(np.float32)
  expected = np.zeros_like(ts)
  for zt in range(n):
    logits = np.log(np.stack([table(zt, t) for t in ts])).astype(np.float32)
    vals = objectives.uniform_nelbo_per_token(jnp.asarray(logits), jnp.full(len(ts), x), jnp.full(len(ts), zt),
                                              jnp.asarray(alpha), -jnp.ones(len(ts)))
    expected += ((1.0 - ts) * (zt == x) + ts / n) * np.asarray(vals, np.float64)
  return np.trapezoid(expected, ts)


def test_nelbo_is_the_limit_of_the_discrete_time_elbo():
  n = 4
  rng = np.random.default_rng(0)
  x_theta = rng.dirichlet(np.ones(n), size=n)  # a fixed x_theta(z_t), not learned
  table = lambda zt, t: x_theta[zt]
  for x in range(n):
    cont = _continuous_nelbo(x, table, n)
    errs = [abs(_discrete_elbo(x, table, np.linspace(0.0, 1.0, steps + 1), n) / cont - 1.0) for steps in (50, 500)]
    assert errs[1] < 1e-2, (x, cont, errs)
    assert errs[1] <= errs[0] + 1e-4, errs  # converging as the steps shrink


def test_nelbo_bounds_the_entropy_of_a_toy_source():
  """i.i.d. tokens x ~ pi: E_x[NELBO] (the t = 0 reconstruction term is 0 since alpha(0) = 1) is never
  below H(pi). With x_theta = pi (the true marginal) the reverse rates xbar_theta_j / xbar_theta_z =
  q_t(j) / q_t(z) are the exact ones, so the bound is tight; other denoisers (the x0 posterior mean,
  a wrong constant) pay more."""
  n = 5
  rng = np.random.default_rng(1)
  pi = rng.dirichlet(np.full(n, 0.7))
  entropy = -np.sum(pi * np.log(pi))

  def posterior_mean(zt, t):  # p(x | z_t) for x ~ pi
    w = pi * ((1.0 - t) * _onehot(zt, n) + t / n)
    return w / w.sum()

  wrong = rng.dirichlet(np.ones(n))
  bounds = {name: sum(pi[x] * _continuous_nelbo(x, table, n, points=2000) for x in range(n))
            for name, table in [("marginal", lambda zt, t: pi), ("posterior_mean", posterior_mean),
                                ("wrong", lambda zt, t: wrong)]}
  assert bounds["marginal"] >= entropy * (1.0 - 1e-4), (bounds, entropy)
  assert abs(bounds["marginal"] / entropy - 1.0) < 1e-3, (bounds, entropy)
  for name in ("posterior_mean", "wrong"):
    assert bounds[name] > entropy * 1.01, (name, bounds, entropy)


# ---- config validation of the new keys -----------------------------------------------------------

@pytest.mark.parametrize("mutate, field", [
    (lambda c: setattr(c.diffusion, "objective", "elbo"), "diffusion.objective"),
    (lambda c: setattr(c.diffusion, "schedule", "cubic"), "diffusion.schedule"),
    (lambda c: setattr(c.diffusion, "reweight_cap", 0.5), "diffusion.reweight_cap"),
    (lambda c: (setattr(c.diffusion, "objective", "mdlm"), setattr(c.diffusion, "mask_id", 4)), "diffusion.mask_id"),
    (lambda c: (setattr(c.diffusion, "objective", "mdlm"), setattr(c.diffusion, "mask_id", 260)),
     "diffusion.mask_id"),  # byte tokenizer: ids < 260 are real tokens; 260 needs model.vocab_size > 260
    (lambda c: setattr(c.opt, "grad_accum_steps", 3), "opt.grad_accum_steps"),
    (lambda c: setattr(c.opt, "grad_accum_steps", 0), "opt.grad_accum_steps"),
    (lambda c: setattr(c.opt, "state_dtype", "float16"), "opt.state_dtype"),
])
def test_new_keys_validated(mutate, field):
  config = tiny_test.get_config()
  mutate(config)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    settings_lib.from_config(config)


def test_mdlm_config_with_added_mask_token_is_valid():
  config = tiny_test.get_config()
  config.diffusion.objective = "mdlm"
  config.model.vocab_size = 261
  config.diffusion.mask_id = 260
  settings_lib.from_config(config)


# ---- what x_theta is: exact enumeration of a correlated 3-token source ----------------------------

def _joint_source(n=3, c=3, seed=0):
  """A random distribution over all n^c sequences (correlated tokens), as (sequences [S, c], p [S])."""
  import itertools
  seqs = np.array(list(itertools.product(range(n), repeat=c)))
  rng = np.random.default_rng(seed)
  p = np.maximum(rng.dirichlet(np.full(len(seqs), 0.5)), 1e-3)
  return seqs, p / p.sum()


def _exact_posteriors(seqs, p, a, n):
  """For every noisy sequence z (rows of seqs): the posterior p(x_i | z) and the leave-one-out
  p(x_i | z_-i), float64 [Z, c, n], by summing over all clean sequences."""
  q_tok = a * (seqs[:, None, :] == seqs[None, :, :]) + (1.0 - a) / n  # [z, x, i] = q(z_i | x_i)
  joint = p[None, :] * np.prod(q_tok, axis=-1)                        # [z, x] = p(x) q(z | x)
  full, loo = np.zeros((len(seqs), seqs.shape[1], n)), np.zeros((len(seqs), seqs.shape[1], n))
  for i in range(seqs.shape[1]):
    others = p[None, :] * np.prod(np.delete(q_tok, i, axis=-1), axis=-1)
    for v in range(n):
      sel = seqs[:, i] == v
      full[:, i, v] = joint[:, sel].sum(1)
      loo[:, i, v] = others[:, sel].sum(1)
  return full / full.sum(-1, keepdims=True), loo / loo.sum(-1, keepdims=True), joint


def test_nelbo_is_exact_with_the_leave_one_out_prior_and_the_records_convert_posteriors():
  """-log p(x) = NELBO(x) when x_theta_i = p(x_i | z_-i) (the exact reverse rates; objectives.py docstring),
  for every sequence of a correlated 3-token source, integrated over t by Gauss-Legendre in log t on
  [t_eps, 1] plus the reconstruction at t_eps. A posterior-output record (base_ce, nelbo) fed the exact
  posterior p(x_i | z) gets the same number through `loo_prior_logits`; plugging the posterior in directly
  (the mistake the docstring warns about) misses by tens of percent."""
  n, t_eps, nodes = 3, 1e-3, 48
  seqs, p = _joint_source(n)
  u, w = np.polynomial.legendre.leggauss(nodes)
  log_t = np.log(t_eps) * (1.0 - (u + 1.0) / 2.0)
  ts, wts = np.exp(log_t), w * (-np.log(t_eps) / 2.0) * np.exp(log_t)
  bounds = {"loo_nelbo": np.zeros(len(seqs)), "nelbo": np.zeros(len(seqs)), "posterior_as_x_theta": np.zeros(len(seqs))}
  x_zc = np.broadcast_to(seqs[None], (len(seqs),) + seqs.shape)  # [z, x, c] with the x of each column
  for t, wt in list(zip(ts, wts)) + [(t_eps, None)]:
    a = 1.0 - t
    full, loo, joint = _exact_posteriors(seqs, p, a, n)
    q_zx = joint / p[None, :]                                       # q(z | x) [z, x]
    z_zxc = np.broadcast_to(seqs[:, None, :], x_zc.shape)
    for name, logits in (("loo_nelbo", np.log(loo)), ("nelbo", np.log(full)), ("posterior_as_x_theta", np.log(full))):
      record = objectives.get("loo_nelbo" if name == "posterior_as_x_theta" else name)
      l_zxcv = np.broadcast_to(logits[:, None], x_zc.shape + (n,)).reshape(-1, n).astype(np.float32)
      args = (jnp.asarray(l_zxcv), jnp.asarray(x_zc.reshape(-1)), jnp.asarray(z_zxc.reshape(-1)),
              jnp.full(l_zxcv.shape[0], a, jnp.float32))
      if wt is None:
        per_tok = record.reconstruction_per_token(*args, mask_id=-1)
      else:
        per_tok = wt * record.nelbo_per_token(*args, -jnp.ones(l_zxcv.shape[0]), mask_id=-1)
      per_zx = np.asarray(per_tok, np.float64).reshape(len(seqs), len(seqs), -1).sum(-1)
      bounds[name] += np.sum(q_zx * per_zx, axis=0)                 # E_{z ~ q(z | x)}
  nll = -np.log(p)
  # Quadrature: 48 Gauss-Legendre nodes of a smooth integrand in log t (error measured < 1e-6 relative);
  # fp32 integrands: ~1e-6 relative each. rtol 1e-3 leaves room for both; the wrong reading misses by > 5%.
  np.testing.assert_allclose(bounds["loo_nelbo"], nll, rtol=1e-3)
  np.testing.assert_allclose(bounds["nelbo"], nll, rtol=1e-3)
  entropy = float(np.sum(p * nll))
  assert float(np.sum(p * bounds["posterior_as_x_theta"])) > 1.05 * entropy


def test_ancestral_posterior_of_the_leave_one_out_prior_is_the_true_reverse_step():
  """posteriors.uniform_posterior(p(x_i | z_-i), z_t,i, alpha_t, alpha_s) is the exact marginal
  p(z_s,i | z_t) = sum_x p(x | z_t) q(z_s,i | z_t,i, x_i); fed the posterior p(x_i | z_t) it is not."""
  from dgemma.sampling import posteriors
  n = 3
  seqs, p = _joint_source(n, seed=1)
  a_t, a_s = 0.35, 0.7
  full, loo, joint = _exact_posteriors(seqs, p, a_t, n)
  post_x = joint / joint.sum(1, keepdims=True)                      # p(x | z_t) [z, x]
  for i in range(seqs.shape[1]):
    want = np.zeros((len(seqs), n))
    for xi in range(n):
      one_step = np.stack([_posterior(_onehot(xi, n), zt, a_s, a_t, n) for zt in seqs[:, i]])  # [z, n]
      want += post_x[:, seqs[:, i] == xi].sum(1)[:, None] * one_step
    got = np.asarray(posteriors.uniform_posterior(jnp.asarray(loo[:, i], jnp.float32),
                                                  jnp.asarray(seqs[:, i]), a_t, a_s))
    # fp32 formula of probabilities in [0, 1] against float64: a few roundings each, atol 1e-6
    np.testing.assert_allclose(got, want, atol=1e-6)
    wrong = np.asarray(posteriors.uniform_posterior(jnp.asarray(full[:, i], jnp.float32),
                                                    jnp.asarray(seqs[:, i]), a_t, a_s))
    assert np.abs(wrong - want).max() > 0.01


def test_replaced_ce_objectives_match_literal_and_need_the_draw_mask():
  n = 11
  f, x, z, t = _random_case(3, n)
  replaced = np.random.default_rng(4).random(len(x)) < 0.5
  alpha, dalpha = schedules.alpha_and_derivative("linear", t)
  args = (jnp.asarray(f), jnp.asarray(x), jnp.asarray(z), alpha, dalpha)
  only = np.asarray(objectives.per_token_loss("loo_replaced_ce", *args, replaced_N=jnp.asarray(replaced)))
  both = np.asarray(objectives.per_token_loss("loo_ce_replaced_ce", *args, replaced_N=jnp.asarray(replaced)))
  want_only = np.array([ref_ce(f[i].astype(np.float64), x[i]) if replaced[i] else 0.0 for i in range(len(x))])
  want_loo = np.array([ref_loo_ce(f[i].astype(np.float64), x[i], z[i], float(_alpha32(t[i]))) for i in range(len(x))])
  # fp32 log-softmax against float64 on the same inputs: as in test_uniform_objectives_match_literal
  np.testing.assert_allclose(only, want_only, rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(both, want_loo + want_only, rtol=2e-4, atol=1e-5)
  with pytest.raises(ValueError, match="replaced_N"):
    objectives.per_token_loss("loo_replaced_ce", *args)


@pytest.mark.parametrize("name", ["loo_replaced_ce", "loo_ce_replaced_ce", "loo_ce"])
def test_replaced_ce_is_minimised_by_the_leave_one_out_distribution(name):
  """E[loss] over the forward process of a correlated 3-token source, enumerated exactly (x, the draw mask
  of position i, z), as a function of the network output f(z)_i: its gradient vanishes at the true
  leave-one-out logits log p(x_i | z_-i) and not at the posterior's. The CE on replaced tokens is proper for
  the leave-one-out distribution because a drawn token is independent of x_i; with z != x standing in for
  the draw mask it is not (it leaves out draws that returned x_i, and learns 'never my own token')."""
  n, i, a = 3, 1, 0.6
  seqs, p = _joint_source(n, seed=2)
  full, loo, _ = _exact_posteriors(seqs, p, a, n)
  S = len(seqs)
  q_tok = a * (seqs[:, None, :] == seqs[None, :, :]) + (1.0 - a) / n         # [z, x, j] = q(z_j | x_j)
  others = p[None, :] * np.prod(np.delete(q_tok, i, axis=-1), axis=-1)    # [z, x]: every factor but position i's
  prob_drawn = others * (1.0 - a) / n                                       # position i drawn (uniform)
  prob_kept = others * a * (seqs[:, None, i] == seqs[None, :, i])         # position i kept
  z_idx, x_idx = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
  xs, zs = jnp.asarray(seqs[x_idx.ravel(), i]), jnp.asarray(seqs[z_idx.ravel(), i])
  alpha = jnp.full(S * S, a, jnp.float32)

  def expected_loss(logits_ZV, mask_rule):
    l = logits_ZV[z_idx.ravel()]
    total = 0.0
    for prob, drawn in ((prob_drawn, True), (prob_kept, False)):
      replaced = jnp.full(S * S, drawn) if mask_rule == "draw" else zs != xs
      per = objectives.per_token_loss(name, l, xs, zs, alpha, -jnp.ones_like(alpha), replaced_N=replaced)
      total = total + jnp.sum(jnp.asarray(prob.ravel(), jnp.float32) * per)
    return total

  grad = lambda logits, rule: np.asarray(jax.grad(expected_loss)(jnp.asarray(logits, jnp.float32), rule))
  at_loo, at_posterior = grad(np.log(loo[:, i]), "draw"), grad(np.log(full[:, i]), "draw")
  # Each gradient entry sums 27 products of probabilities (< 1) in fp32: round-off ~ 27 x 6e-8; 1e-5 leaves room.
  # The posterior's gradient is > 1e-3: the test can see a wrong target of that size.
  np.testing.assert_allclose(at_loo, 0.0, atol=1e-5)
  assert np.abs(at_posterior).max() > 1e-3
  if name != "loo_ce":  # loo_ce never reads the mask
    assert np.abs(grad(np.log(loo[:, i]), "z != x")).max() > 1e-3
