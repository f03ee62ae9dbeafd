"""Attention masks seen through gradients w.r.t. the layer-0 inputs of both modes.

d(output at one position) / d(input embedding at every position), taken through flax `perturb`:
exactly zero where attention must not reach, non-zero where it must.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from dgemma.model import ModelConfig, Transformer

T, C = 12, 6  # context and canvas lengths


def _model(**overrides):
  c = tiny.get_config()
  c.update(dict(vocab_size=64, moe_impl="dense", **overrides))
  cfg = ModelConfig.from_config_dict(c)
  return cfg, Transformer(cfg)


def _inputs():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (1, T)), jnp.int32)
  canvas = jnp.asarray(rng.integers(0, 64, (1, C)), jnp.int32)
  pos = jnp.arange(T, dtype=jnp.int32)[None]
  return tokens, pos, jnp.ones((1, T), jnp.int32), canvas, pos[:, :C] + T, jnp.ones((1, C), jnp.int32)


def _input_grads(model, variables, inputs, pick):
  """Gradient norms per input position of pick(enc_logits, dec_logits) (a scalar)."""
  perts = jax.tree.map(jnp.zeros_like, variables["perturbations"])

  def f(perts):
    enc, dec = model.apply({"params": variables["params"], "perturbations": perts}, *inputs)
    return pick(enc, dec)

  g = jax.jit(jax.grad(f))(perts)  # one compiled program, not one dispatch per operation of the model
  norm = lambda x: np.asarray(jnp.sqrt(jnp.sum(jnp.square(x), axis=-1)))[0]
  return norm(g["encoder_inputs"]), norm(g["decoder_inputs"])


@pytest.fixture(scope="module")
def tiny_model():
  cfg, model = _model()
  inputs = _inputs()
  return model, jax.jit(model.init)(jax.random.PRNGKey(0), *inputs), inputs


def test_canvas_token_depends_on_every_canvas_token_and_the_context(tiny_model):
  model, variables, inputs = tiny_model
  g_ctx, g_canvas = _input_grads(model, variables, inputs, lambda enc, dec: dec[0, 2].sum())
  assert np.all(g_canvas > 1e-6), g_canvas   # bidirectional inside the canvas
  assert np.all(g_ctx > 1e-6), g_ctx         # reads the whole context through the cache


def test_context_token_never_depends_on_canvas_or_later_context(tiny_model):
  model, variables, inputs = tiny_model
  j = 5
  g_ctx, g_canvas = _input_grads(model, variables, inputs, lambda enc, dec: enc[0, j].sum())
  assert np.all(g_canvas == 0.0)
  assert np.all(g_ctx[j + 1:] == 0.0) and np.all(g_ctx[:j + 1] > 1e-6), g_ctx


def test_sliding_layers_ignore_context_beyond_the_window():
  window = 4
  # One layer: with more, encoder states in the window carry information from older context.
  cfg, model = _model(num_layers=1, layer_types=("sliding",), sliding_window=window)
  inputs = _inputs()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), *inputs)
  g_ctx, g_canvas = _input_grads(model, variables, inputs, lambda enc, dec: dec[0, 0].sum())
  # Decoder sliding layers see the last window - 1 context slots (HF's dynamic sliding cache), the
  # same for every canvas query; nothing older.
  assert np.all(g_ctx[:T - (window - 1)] == 0.0), g_ctx
  assert np.all(g_ctx[T - (window - 1):] > 1e-6), g_ctx
  assert np.all(g_canvas > 1e-6)
