"""The prompt encoded a chunk at a time (sample.prompt_chunk, dgemma/sampling/generation.py `encode_prompt`): the
cache (keys, values, positions, segments, the sliding layers' ring) and the decoder-shift logits equal the whole
prompt's pass, and generate gives the same tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.model.transformer import init_cache
from dgemma.sampling import SamplerConfig, generate, generation
from tests.model_utils import f64_config, float64, to_f64
from tests.sampling.helpers import tiny_model


def test_prompt_chunks_split_the_prompt():
  assert generation.prompt_chunks(40, 0) == (40, 0) and generation.prompt_chunks(40, 64) == (40, 0)
  assert generation.prompt_chunks(40, 16) == (8, 2) and generation.prompt_chunks(48, 16) == (0, 3)
  assert generation.prompt_chunks(40, 7) == (5, 5)


@pytest.mark.slow  # the fast tier's budget: two cache-writing encodes and their references (~20 s)
@pytest.mark.parametrize("shift", [False, True])
def test_a_chunked_prompt_encode_writes_the_whole_prompts_cache(shift):
  """In float64: a chunk's queries read the slots the earlier chunks wrote plus their own, the keys the whole pass
  reads, only with the products summed in other groupings, so the two agree to float64 round-off through the
  tiny model's 2 layers (each value a sum of <= 64 products of O(1) terms, a softmax and a norm per layer: |error|
  <= ~64 * 2^-52 ~ 1.4e-14 relative per sum, a few such per layer; bound 1e-12 of the values' scale). The
  decoder-shift logits are returned in float32 (as generate carries them): equal to one float32 rounding (2^-24
  relative, bound 2^-23 of their scale). The prompt (40 tokens) is longer than the sliding window (6): the ring wraps
  inside a chunk and across chunks; the rows end inside a chunk (9: the first, 23) and on a chunk's last token (24 =
  8 + 16 with chunks of 16)."""
  with float64():
    model, params = tiny_model(decoder_shift=shift)
    model = type(model)(f64_config(model.cfg))
    params = jax.tree.map(jnp.asarray, to_f64(params))
    cfg = model.cfg
    assert cfg.sliding_window < 7
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(2, cfg.vocab_size, (3, 40)), jnp.int32)
    lengths = jnp.asarray([40, 24, 9], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (3, 40))
    seg = (pos < lengths[:, None]).astype(jnp.int32)
    apply = functools.partial(model.apply, {"params": params})
    run = lambda chunk: generation.encode_prompt(apply, prompt, pos, seg, init_cache(cfg, 3, 56, jnp.float64,
                                                                                        sliding_ring=True),
                                                 chunk=chunk, shift=shift, vocab=cfg.vocab_size)
    whole_cache, whole_logits = run(0)
    for chunk in (16, 8, 7):  # 8 divides the prompt: every chunk in the scan
      cache, logits = run(chunk)
      for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(whole_cache)):
        if jnp.issubdtype(a.dtype, jnp.integer):
          np.testing.assert_array_equal(a, b)
        else:
          np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(b))))
      if shift:
        np.testing.assert_allclose(logits, whole_logits, rtol=0, atol=2**-23 * float(jnp.max(jnp.abs(whole_logits))))
      else:
        assert logits is None and whole_logits is None


@pytest.mark.slow  # three generate programs compiled (about 10 s on 2 cores): over the fast tier's budget
def test_generate_with_a_chunked_prompt_gives_the_same_tokens():
  """float64 (round-off ~1e-14 cannot flip a sampled token): the same tokens with the prompt in chunks of 16 and 7."""
  with float64():
    model, params = tiny_model()
    model = type(model)(f64_config(model.cfg))
    params = to_f64(params)
    prompts = np.asarray(np.random.default_rng(5).integers(2, model.cfg.vocab_size, (2, 40)), np.int32)
    lengths = np.array([40, 23], np.int32)
    out = {chunk: np.asarray(generate(model, params, prompts, lengths, SamplerConfig(
        canvas_len=8, max_denoising_steps=4, max_context=64, prompt_chunk=chunk), jax.random.key(0), 16).tokens_BN)
           for chunk in (0, 16, 7)}
    np.testing.assert_array_equal(out[16], out[0])
    np.testing.assert_array_equal(out[7], out[0])
