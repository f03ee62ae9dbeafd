"""Randomness sources for the sampler: where every random draw of a generation comes from.

The sampler draws three things (reference doc, "Sampler (released defaults)"): the initial uniform
canvas (1.), a token at every canvas position from the tempered distribution (4.) and fresh uniform
tokens for re-noising (6.). A source is a pytree (it travels through `jax.jit` as an argument) with
one method per draw, indexed by (canvas, step), so a test can swap the PRNG for fixed arrays:

  JaxNoise    per-row PRNG keys; draws use fold_in(key_b, canvas / purpose / step). Row b's draws do
              not depend on the batch it is in (batch invariance: a prompt gives the same tokens
              alone or batched, given the same row key). Categorical draws by inverse CDF
              (`categorical_inverse_cdf`): two uniforms per position instead of V Gumbel variates.
  FixedNoise  precomputed arrays (initial canvases, Gumbel noise, re-noise tokens); the test-only
              path used for token-exact parity with the Hugging Face sampler.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from dgemma import reductions

_INIT, _SAMPLE, _RENOISE = 0, 1, 2


def _block_size(vocab_size: int) -> int:
  """The power of two nearest above sqrt(V): blocks and block count both about sqrt(V)."""
  return 1 << max(0, math.ceil(math.log2(max(vocab_size, 1)) / 2))


def categorical_inverse_cdf(key: jax.Array, logits_CV: jax.Array) -> jax.Array:
  """One draw per row of logits_CV [C, V] from softmax(logits) (-inf allowed), by inverse CDF in two levels.

  The Gumbel-max draw (`jax.random.categorical`) needs C*V random variates and two logs each: on a CPU
  that was 44 ms for a [256, 8192] canvas against a 56 ms decoder pass (docs/benchmarks.md). This needs
  2C uniforms: the vocabulary is cut into blocks of b ~ sqrt(V) ids; the first uniform picks a block by
  the cumulative block masses, the second an id inside it by the cumulative masses of its entries (the
  first index whose cumulative mass exceeds u * total). Same distribution; the draws themselves differ
  from Gumbel-max's for the same key.
  fp32 round-off: each cumulative sum runs over about sqrt(V) terms, so an interval's length is off by
  at most about sqrt(V) * 2^-24 of its level's total: total variation <= 2 * sqrt(V) * 2^-24 (3e-5 at
  V = 262,144; a one-level cumsum over V terms would allow V * 2^-24 = 0.016). Zero-mass ids are never
  drawn (their intervals are empty).
  """
  num_rows, vocab = logits_CV.shape
  blk = _block_size(vocab)
  nb = -(-vocab // blk)
  logits_CV = logits_CV.astype(jnp.float32)
  p_CV = jnp.exp(logits_CV - jnp.max(logits_CV, axis=-1, keepdims=True))  # unnormalised; the max entry is 1
  p_CNb = jnp.pad(p_CV, ((0, 0), (0, nb * blk - vocab))).reshape(num_rows, nb, blk)
  cdf_CN = jnp.cumsum(jnp.sum(p_CNb, axis=-1), axis=-1)
  u_2C = jax.random.uniform(key, (2, num_rows), jnp.float32)
  block_C = jnp.sum(cdf_CN <= (u_2C[0] * cdf_CN[:, -1])[:, None], axis=-1, dtype=jnp.int32)
  block_C = jnp.minimum(block_C, nb - 1)
  p_Cb = jnp.take_along_axis(p_CNb, block_C[:, None, None], axis=1)[:, 0]
  cdf_Cb = jnp.cumsum(p_Cb, axis=-1)
  inner_C = jnp.sum(cdf_Cb <= (u_2C[1] * cdf_Cb[:, -1])[:, None], axis=-1, dtype=jnp.int32)
  return block_C * blk + jnp.minimum(inner_C, blk - 1)


def row_keys(rng: jax.Array, batch_size: int) -> jax.Array:
  """Per-row typed keys [B] from one key (row b = fold_in(rng, b)) or from per-row keys [B]."""
  if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))
  if rng.ndim == 0:
    return jax.vmap(lambda b: jax.random.fold_in(rng, b))(jnp.arange(batch_size))
  if rng.shape != (batch_size,):
    raise ValueError(f"rng: expected one key or {batch_size} per-row keys, got key shape {rng.shape}")
  return rng


@struct.dataclass
class JaxNoise:
  """PRNG randomness: one key per batch row (see `row_keys`)."""

  keys_B: jax.Array

  def _keys(self, canvas_idx, purpose, step=None):
    def one(key):
      key = jax.random.fold_in(jax.random.fold_in(key, canvas_idx), purpose)
      return key if step is None else jax.random.fold_in(key, step)
    return jax.vmap(one)(self.keys_B)

  def init_canvas(self, canvas_idx, canvas_len: int, vocab_size: int) -> jax.Array:
    """Step 1: a canvas of uniform random vocabulary tokens [B, C]."""
    keys = self._keys(canvas_idx, _INIT)
    return jax.vmap(lambda k: jax.random.randint(k, (canvas_len,), 0, vocab_size, jnp.int32))(keys)

  def sample(self, canvas_idx, step, logits_BCV: jax.Array) -> jax.Array:
    """Step 4: one categorical draw per position from softmax(logits) (`categorical_inverse_cdf`), [B, C]."""
    keys = self._keys(canvas_idx, _SAMPLE, step)
    return jax.vmap(categorical_inverse_cdf)(keys, logits_BCV).astype(jnp.int32)

  def renoise(self, canvas_idx, step, canvas_len: int, vocab_size: int) -> jax.Array:
    """Step 6: fresh uniform tokens [B, C] (used where the re-noising policy says so)."""
    keys = self._keys(canvas_idx, _RENOISE, step)
    return jax.vmap(lambda k: jax.random.randint(k, (canvas_len,), 0, vocab_size, jnp.int32))(keys)


@struct.dataclass
class FixedNoise:
  """Caller-supplied randomness, for parity tests and exact replays.

  init_canvas_NBC [num_canvases, B, C] int: initial canvases.
  gumbel_NSBCV [num_canvases, steps, B, C, V] float: the sampled token is
    argmax(log(softmax(logits)) + gumbel), i.e. Gumbel-max on the fp32 probabilities.
  renoise_NSBC [num_canvases, steps, B, C] int: re-noise tokens.
  """

  init_canvas_NBC: jax.Array
  gumbel_NSBCV: jax.Array
  renoise_NSBC: jax.Array

  def init_canvas(self, canvas_idx, canvas_len: int, vocab_size: int) -> jax.Array:
    del canvas_len, vocab_size
    return self.init_canvas_NBC[canvas_idx].astype(jnp.int32)

  def sample(self, canvas_idx, step, logits_BCV: jax.Array) -> jax.Array:
    logp_BCV = jnp.log(jax.nn.softmax(logits_BCV.astype(jnp.float32), axis=-1))
    return reductions.argmax(logp_BCV + self.gumbel_NSBCV[canvas_idx, step])

  def renoise(self, canvas_idx, step, canvas_len: int, vocab_size: int) -> jax.Array:
    del canvas_len, vocab_size
    return self.renoise_NSBC[canvas_idx, step].astype(jnp.int32)


def as_noise(rng, batch_size: int):
  """A noise source from a PRNG key, per-row keys [B], or an existing source (returned as is)."""
  if isinstance(rng, (JaxNoise, FixedNoise)):
    return rng
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  return JaxNoise(keys_B=row_keys(jnp.asarray(rng) if not hasattr(rng, "dtype") else rng, batch_size))
