"""Bucketed request shapes (dgemma/sampling/generation.py `bucketed_shape`): a request padded to a larger batch
(padding rows inactive) and a longer prompt buffer generates the tokens of the unpadded request, and requests of
nearby sizes share one compiled program."""

import jax
import numpy as np
import pytest

from dgemma.sampling import SamplerConfig, generate
from dgemma.sampling import generation
from tests.model_utils import f64_config, float64, to_f64
from tests.sampling.helpers import PROMPTS, tiny_model


def test_bucketed_shape_rounds_batch_and_prompt_up_and_keeps_what_would_not_fit():
  shape = lambda b, p, n=20, c=8, ctx=262_144: generation.bucketed_shape(batch=b, prompt_len=p, max_new_tokens=n,
                                                                          canvas_len=c, max_context=ctx)
  assert shape(1, 1) == (1, 32) and shape(3, 6) == (4, 32) and shape(5, 33) == (8, 64)
  assert shape(64, 64) == (64, 64) and shape(65, 1000) == (128, 1024) and shape(200, 1) == (256, 32)
  assert shape(2, 40, n=20, c=8, ctx=70) == (2, 40)  # 64 + 3 canvases of 8 > 70: the exact length is kept
  assert shape(2, 40, n=20, c=8, ctx=88) == (2, 64)  # 64 + 24 = 88 fits


def test_a_padded_request_generates_the_tokens_of_the_unpadded_one():
  # In float64: the padded program adds masked keys and rows, which only reorders float sums; in float64 such
  # round-off (~1e-16) cannot flip a sampled token, so the tokens must be identical (tests/model_utils.py).
  cfg = SamplerConfig(canvas_len=8, max_denoising_steps=6, end_ids=(1, 106), confidence_threshold=0.05)
  with float64():
    model, params = tiny_model()
    model = type(model)(f64_config(model.cfg))
    params = to_f64(params)
    rows, length = len(PROMPTS), max(map(len, PROMPTS))
    lengths = np.asarray([len(p) for p in PROMPTS], np.int32)

    def run(batch, prompt_len):
      prompts = np.zeros((batch, prompt_len), np.int32)
      prompts[:, 0] = 2
      for b, p in enumerate(PROMPTS):
        prompts[b, :len(p)] = p
      out = generate(model, params, prompts, np.concatenate([lengths, np.ones(batch - rows, np.int32)]), cfg,
                     jax.random.key(3), 20, row_active_B=np.arange(batch) < rows)
      return jax.tree.map(np.asarray, out)

    exact, padded = run(rows, length), run(*generation.bucketed_shape(batch=rows, prompt_len=length, max_new_tokens=20,
                                                                       canvas_len=8, max_context=cfg.max_context))
  assert padded.tokens_BN.shape[0] == 4
  np.testing.assert_array_equal(padded.tokens_BN[:rows], exact.tokens_BN)
  np.testing.assert_array_equal(padded.lengths_B[:rows], exact.lengths_B)
  np.testing.assert_array_equal(padded.num_forwards_B[:rows], exact.num_forwards_B)
  assert padded.num_forwards_B[rows:].tolist() == [0] and padded.lengths_B[rows:].tolist() == [0]  # padding idles
  assert len(set(map(tuple, exact.tokens_BN.tolist()))) == rows  # the rows differ: a mixed-up row would show


def test_prompts_of_new_lengths_reuse_the_compiled_program(tiny_run):
  import dgemma
  model = dgemma.load(str(tiny_run[0]))
  jitted = generation._generate_jit.jitted  # pylint: disable=protected-access
  model.generate("a", max_new_tokens=16, steps=2)
  before = jitted._cache_size()  # pylint: disable=protected-access
  outs = [model.generate(p, max_new_tokens=16, steps=2) for p in ("the", "the king", "the king of all")]
  model.generate(["a", "bb", "ccc"], max_new_tokens=16, steps=2)  # a batch of 3 is padded to 4: one more program
  assert jitted._cache_size() == before + 1  # pylint: disable=protected-access
  assert all(o.num_forwards > 0 for o in outs)


@pytest.mark.slow  # a float64 load and generate compile (the padding itself: the float64 test above)
def test_the_api_returns_the_unpadded_requests_rows(tiny_run, batch=3):
  # Model.generate (bucketed) against the low-level generate with the request's exact shapes, in float64
  import dgemma
  from dgemma.model import Transformer
  prompts = ["the king", "a", "thou art"][:batch]
  with float64():
    model = dgemma.load(str(tiny_run[0]), dtype="float64")
    outs = model.generate(prompts, max_new_tokens=16, steps=3, seed=4)
    ids = [model.prompt_ids(p) for p in prompts]
    prompts_BP = np.zeros((batch, max(map(len, ids))), np.int32)
    for b, x in enumerate(ids):
      prompts_BP[b, :len(x)] = x
    ref = jax.device_get(generate(Transformer(model.model_cfg), model.params, prompts_BP,
                                  np.asarray([len(x) for x in ids], np.int32),
                                  model.call_settings(max_new_tokens=16, steps=3).canvas_sampler, jax.random.key(4), 16))
  for b, out in enumerate(outs):
    assert out.token_ids == ref.tokens_BN[b, :ref.lengths_B[b]].tolist()
    assert out.num_forwards == int(ref.num_forwards_B[b])
