"""dgemma.sampling.noise: the inverse-CDF categorical draw against a float64 reading of the same
uniforms and against the exact distribution; JaxNoise rows independent of their batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.sampling import JaxNoise, row_keys
from dgemma.sampling.noise import _block_size, categorical_inverse_cdf

V = 300  # not a multiple of the block (32): the last block is padded


def _logits(seed, rows, vocab=V, masked=()):
  rs = np.random.RandomState(seed)
  p = rs.dirichlet(np.full(vocab, 0.3), size=rows)
  logits = np.log(p).astype(np.float32)
  logits[:, list(masked)] = -np.inf
  return logits


def _reference(u_2C, logits_CV):
  """The two-level inverse CDF of the docstring, in float64 with numpy."""
  num_rows, vocab = logits_CV.shape
  blk = _block_size(vocab)
  nb = -(-vocab // blk)
  lg = logits_CV.astype(np.float64)
  p = np.exp(lg - lg.max(-1, keepdims=True))
  p = np.pad(p, ((0, 0), (0, nb * blk - vocab))).reshape(num_rows, nb, blk)
  cdf = np.cumsum(p.sum(-1), -1)
  out, margin = np.zeros(num_rows, np.int64), np.zeros(num_rows)
  for r in range(num_rows):
    t = u_2C[0, r] * cdf[r, -1]
    j = min(int(np.sum(cdf[r] <= t)), nb - 1)
    inner = np.cumsum(p[r, j])
    t2 = u_2C[1, r] * inner[-1]
    i = min(int(np.sum(inner <= t2)), blk - 1)
    out[r] = j * blk + i
    # distance of each target from the nearest boundary, relative to its level's total
    margin[r] = min(np.min(np.abs(cdf[r] - t)) / cdf[r, -1], np.min(np.abs(inner - t2)) / inner[-1])
  return out, margin


def test_block_size_is_about_sqrt_vocab():
  assert [_block_size(v) for v in (1, 2, 300, 8192, 262144)] == [1, 2, 32, 128, 512]


def test_inverse_cdf_equals_a_float64_reading_of_the_same_uniforms():
  logits = _logits(0, 512, masked=(0, 7, 299))
  key = jax.random.key(11)
  got = np.asarray(jax.jit(categorical_inverse_cdf)(key, jnp.asarray(logits)))
  u = np.asarray(jax.random.uniform(key, (2, logits.shape[0]), jnp.float32), np.float64)
  want, margin = _reference(u, logits)
  # fp32 cumulative sums over <= 32 terms are off by at most 32 * 2^-24 ~ 2e-6 of their total (plus the
  # product u * total's half ulp): rows whose targets lie farther than 1e-5 from every boundary must
  # agree exactly; nearer ones may fall either side.
  clear = margin > 1e-5
  assert clear.mean() > 0.95
  np.testing.assert_array_equal(got[clear], want[clear])
  assert not np.isin(got, [0, 7, 299]).any() and got.max() < V


@pytest.mark.slow  # 9 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_inverse_cdf_draws_follow_softmax():
  logits = _logits(1, 1, masked=(3, 150))[0]
  keys = jax.random.split(jax.random.key(5), 800)
  rows = jnp.broadcast_to(jnp.asarray(logits), (256, V))
  draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical_inverse_cdf(k, rows)))(keys)).ravel()
  n = draws.size
  freq = np.bincount(draws, minlength=V) / n
  assert freq.size == V and freq[3] == 0 and freq[150] == 0
  p = np.exp(logits.astype(np.float64))
  p /= p.sum()
  # each id's count is binomial(n, p): within 5 standard deviations (P(any of 300 outside) ~ 2e-4 where
  # the normal approximation holds), plus 5 counts for the ids of tiny p (a p of 1e-7 is drawn once in
  # 2e5 draws 2% of the time: 6 "sd" though nothing is wrong), plus the fp32 interval error
  # (<= 2 * 32 * 2^-24 of the mass, far below one count here)
  sd = np.sqrt(p * (1 - p) / n)
  assert np.all(np.abs(freq - p) <= 5 * sd + 5 / n), np.max(np.abs(freq - p) / (sd + 1e-12))
  # and the same draws are not a copy of the Gumbel-max ones: a different method, one distribution
  gumbel = np.asarray(jax.vmap(lambda k: jax.random.categorical(k, rows))(keys)).ravel()
  assert np.mean(gumbel == draws) < 0.5


def test_jax_noise_rows_do_not_depend_on_the_batch():
  logits = jnp.asarray(_logits(2, 4 * 16).reshape(4, 16, V))
  keys = row_keys(jax.random.key(0), 4)
  batched = np.asarray(JaxNoise(keys).sample(1, 3, logits))
  alone = np.stack([np.asarray(JaxNoise(keys[b:b + 1]).sample(1, 3, logits[b:b + 1]))[0] for b in range(4)])
  np.testing.assert_array_equal(batched, alone)
  assert not np.array_equal(batched, np.asarray(JaxNoise(keys).sample(1, 4, logits)))  # steps differ
