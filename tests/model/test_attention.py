"""dgemma.model.attention.attend and attend_tokamax (tokamax.dot_product_attention) against a float64
reference written with numpy (HF's repeat_kv, a masked softmax), values and gradients within per-entry fp32
bounds, including a query row with no allowed key (zeros); `cfg.attention_impl` in the model."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer, attention, init_cache
from tests.model_utils import f64_config, float64, random_params, to_f64

# Both implementations of the same arithmetic (tokamax: its XLA implementation on this CPU).
ATTENDS = pytest.mark.parametrize("attend", [attention.attend, attention.attend_tokamax], ids=["xla", "tokamax"])

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


@ATTENDS
def test_attend_matches_the_float64_reference(attend):
  q, k, v, mask = _inputs()
  got = attend(jnp.float32(q), jnp.float32(k), jnp.float32(v), jnp.asarray(mask), jnp.float32)
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


@ATTENDS
def test_attend_gradients_match_float64_autodiff(attend):
  q, k, v, mask = _inputs(seed=1)
  g = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32).astype(np.float64)

  def loss(q, k, v, attend=attend):
    return jnp.sum(attend(q, k, v, jnp.asarray(mask), q.dtype) * g.astype(q.dtype))

  with jax.enable_x64():  # the reference: `attend`'s float64 autodiff, checked against numpy just below
    want = jax.grad(functools.partial(loss, attend=attention.attend), argnums=(0, 1, 2))(jnp.float64(q), jnp.float64(k), jnp.float64(v))
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


# The model's encoder with each implementation. Two sliding layers (window 3, so the window cuts) and a global.
ENC_CFG = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), num_layers=3,
                              layer_types=("sliding", "sliding", "global"), sliding_window=3)


def test_attention_impl_is_validated_and_resolved():
  with pytest.raises(ConfigError, match="model.attention_impl"):
    dataclasses.replace(ENC_CFG, attention_impl="flash")
  assert attention.resolve_impl("tokamax") == "tokamax" and attention.resolve_impl("xla", "gpu") == "xla"
  assert {attention.resolve_impl("auto", b) for b in ("cpu", "gpu", "tpu", "other")} <= {"xla", "tokamax"}


@pytest.mark.slow  # parity of another kernel library's attention (16 + 5 s on 2 cores): over the fast tier's budget
@pytest.mark.parametrize("ring", [False, True], ids=["full_cache", "ring_cache"])
def test_encoder_with_tokamax_matches_xla(ring):
  # Packed rows (two documents, padding) encoded in two chunks into a cache, then a canvas decoded against it:
  # the logits, the cache and (training's full cache) the parameter gradients with attention_impl='tokamax'
  # equal 'xla''s. In float64,
  # where the two differ only by summation order (~1e-14 here), so atol 1e-9 holds on any CPU.
  B, T, C = 2, 10, 4
  g = np.random.default_rng(0)
  tokens = jnp.asarray(g.integers(5, ENC_CFG.vocab_size, (B, T)), jnp.int32)
  canvas = jnp.asarray(g.integers(5, ENC_CFG.vocab_size, (B, C)), jnp.int32)
  if ring:  # the sampler's layout: one document per row, right-padded, a ring for the sliding layers
    seg = jnp.asarray([[1] * T, [1] * 7 + [0] * 3], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cpos = jnp.asarray([[T + i for i in range(C)], [7 + i for i in range(C)]], jnp.int32)
  else:  # training's packed rows: row 0 holds two documents, row 1 is left-padded
    seg = jnp.asarray([[1] * 6 + [2] * 4, [0] * 2 + [1] * 8], jnp.int32)
    pos = jnp.asarray([list(range(6)) + list(range(4)), [0, 0] + list(range(8))], jnp.int32)
    cpos = jnp.asarray([[4 + i for i in range(C)], [8 + i for i in range(C)]], jnp.int32)
  cseg = jnp.asarray([[2] * C, [1] * C], jnp.int32) if not ring else jnp.ones((B, C), jnp.int32)
  weights = jnp.asarray(g.standard_normal((B, T + C, ENC_CFG.vocab_size)))

  def run(impl):
    cfg = f64_config(dataclasses.replace(ENC_CFG, attention_impl=impl))
    model = Transformer(cfg)

    def forward(p):
      cache = init_cache(cfg, B, T, sliding_ring=ring)
      h = T // 2
      l1, cache = model.apply({"params": p}, tokens[:, :h], pos[:, :h], seg[:, :h], cache, method=Transformer.encode)
      l2, cache = model.apply({"params": p}, tokens[:, h:], pos[:, h:], seg[:, h:], cache, method=Transformer.encode)
      dec = model.apply({"params": p}, canvas, cpos, cseg, cache, method=Transformer.decode)
      logits = jnp.concatenate([l1, l2, dec], axis=1)
      return jnp.sum(logits * weights), (logits, cache)

    with float64():
      p = to_f64(random_params(ENC_CFG))
      if ring:  # inference only: no gradients
        logits, cache = jax.jit(lambda p: forward(p)[1])(p)
        return jax.tree.map(np.asarray, (logits, cache.k, cache.v))
      (_, (logits, cache)), grads = jax.jit(jax.value_and_grad(forward, has_aux=True))(p)
      return jax.tree.map(np.asarray, (logits, cache.k, cache.v, grads))

  got, want = run("tokamax"), run("xla")
  valid = np.concatenate([np.asarray(seg), np.asarray(cseg)], axis=1)[..., None] != 0
  np.testing.assert_allclose(got[0] * valid, want[0] * valid, rtol=0, atol=1e-9)
  assert np.abs(want[0] * valid).max() > 1.0  # not vacuous
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
