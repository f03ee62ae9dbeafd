"""dgemma.model.attention.attend against a float64 reference written with numpy (HF's repeat_kv, a masked
softmax), values and gradients within per-entry fp32 bounds, including a query row with no allowed key (zeros)."""

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.model import attention

EPS32 = float(np.finfo(np.float32).eps)


def _probs(q, k, mask):
  """float64 probabilities [B, N, T, S], scale 1.0, HF's repeat_kv (zeros where masked; an empty row is zeros)."""
  G = q.shape[2] // k.shape[2]
  scores = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2))
  scores = np.where(mask[:, None], scores, -np.inf)
  top = np.max(scores, -1, keepdims=True)
  e = np.where(mask[:, None], np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return e / np.where(den > 0, den, 1.0)


def _reference(q, k, v, mask):
  """float64: each query head n reads kv head n // G through a softmax over its allowed keys (`_probs`)."""
  G = q.shape[2] // k.shape[2]
  return np.einsum("bnts,bsnh->btnh", _probs(q, k, mask), np.repeat(v, G, axis=2))


def _inputs(seed=0, B=2, T=5, S=7, N=4, K=2, H=8):
  rng = np.random.default_rng(seed)
  # float32 values (exact in float64 too), so the fp32 and float64 runs start from the same numbers
  q, k, v = (rng.standard_normal(shape).astype(np.float32).astype(np.float64)
             for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  mask = rng.random((B, T, S)) < 0.7
  mask[0, 0] = False   # a row with no allowed key
  mask[1, 2, :] = True
  return q, k, v, mask


def _prob_rel_error(q, k, mask):
  """Per query row [B, N, T, 1]: the relative fp32 error of its probabilities. A score is an H-term dot, so it
  errs by at most 2 H eps sum|q k| (Higham's n u sum|terms|, u = eps / 2, with a factor 2); the softmax turns an
  absolute score error d into a relative probability error of at most 2d (numerator and denominator), plus a few
  eps for exp and the division."""
  H, G = q.shape[-1], q.shape[2] // k.shape[2]
  err_s = 2 * H * EPS32 * np.einsum("btnh,bsnh->bnts", np.abs(q), np.abs(np.repeat(k, G, axis=2)))
  return 2 * np.max(np.where(mask[:, None], err_s, 0), -1, keepdims=True) + 4 * EPS32


def test_attend_matches_the_float64_reference():
  q, k, v, mask = _inputs()
  got = attention.attend(jnp.float32(q), jnp.float32(k), jnp.float32(v), jnp.asarray(mask), jnp.float32)
  want = _reference(q, k, v, mask)
  assert got.shape == want.shape
  # The output is an S-term dot of the probabilities with v: 2 S eps sum p|v| for its own rounding plus the
  # probabilities' relative error times the same sum; a factor 2 for the second-order terms.
  G, S = q.shape[2] // k.shape[2], k.shape[1]
  size = np.einsum("bnts,bsnh->btnh", (2 * S * EPS32 + _prob_rel_error(q, k, mask)) * _probs(q, k, mask),
                   np.abs(np.repeat(v, G, axis=2)))
  atol = 2 * size + 1e-30
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= atol)
  assert np.abs(want).max() > 100 * atol.max()  # not vacuous
  assert np.all(np.asarray(got)[0, 0] == 0.0)  # no allowed key: zeros, exactly


def test_attend_gradients_match_float64_autodiff():
  q, k, v, mask = _inputs(seed=1)
  g = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32).astype(np.float64)

  def loss(q, k, v):
    return jnp.sum(attention.attend(q, k, v, jnp.asarray(mask), q.dtype) * g.astype(q.dtype))

  with jax.enable_x64():
    want = jax.grad(loss, argnums=(0, 1, 2))(jnp.float64(q), jnp.float64(k), jnp.float64(v))
    np.testing.assert_allclose(np.asarray(attention.attend(jnp.float64(q), jnp.float64(k), jnp.float64(v),
                                                            jnp.asarray(mask), jnp.float64)),
                               _reference(q, k, v, mask), rtol=0, atol=1e-12)  # float64 is the reference's
  got = jax.grad(loss, argnums=(0, 1, 2))(jnp.float32(q), jnp.float32(k), jnp.float32(v))

  # Per-entry fp32 bounds from the float64 quantities (Higham: an n-term dot errs by <= 2 n eps sum|terms|).
  # Backward of o = p v, p = softmax(s), s = q k^T: dp = g v^T (H terms), ds = p (dp - sum_s p dp),
  # dq = ds k (S terms), dk = ds^T q (T*G terms), dv = p^T g (T*G terms).
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  k_n, v_n = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)             # [B, S, N, H]
  p = _probs(q, k, mask)                                                   # [B, N, T, S]
  rel_p = _prob_rel_error(q, k, mask)                                      # [B, N, T, 1]
  dp = np.einsum("btnh,bsnh->bnts", g, v_n)
  err_dp = 2 * H * EPS32 * np.einsum("btnh,bsnh->bnts", np.abs(g), np.abs(v_n))
  size_ds = p * (np.abs(dp) + np.sum(p * np.abs(dp), -1, keepdims=True))
  err_ds = (rel_p + 4 * EPS32) * size_ds + p * (err_dp + np.sum(p * err_dp, -1, keepdims=True))
  ds = p * (dp - np.sum(p * dp, -1, keepdims=True))

  def per_kv_head(x_BSNH):  # sum the G query heads of each kv head: [B, S, N, H] -> [B, S, K, H]
    return x_BSNH.reshape(x_BSNH.shape[0], x_BSNH.shape[1], K, G, -1).sum(3)

  bound = {
      "q": 2 * S * EPS32 * np.einsum("bnts,bsnh->btnh", np.abs(ds), np.abs(k_n))
           + np.einsum("bnts,bsnh->btnh", err_ds, np.abs(k_n)),
      "k": per_kv_head(2 * T * G * EPS32 * np.einsum("bnts,btnh->bsnh", np.abs(ds), np.abs(q))
                       + np.einsum("bnts,btnh->bsnh", err_ds, np.abs(q))),
      "v": per_kv_head(np.einsum("bnts,btnh->bsnh", (2 * T * G * EPS32 + rel_p) * p, np.abs(g))),
  }
  for name, a, b in zip("qkv", got, want):
    b = np.asarray(b)
    atol = 2 * bound[name] + 1e-30  # a factor 2 for the second-order terms
    assert np.all(np.abs(np.asarray(a, np.float64) - b) <= atol), name
    # not vacuous: a gradient through a wrong transpose is off by O(|gradient|), far outside the bound
    assert np.abs(b).max() > 100 * atol.max(), (name, atol.max(), np.abs(b).max())
