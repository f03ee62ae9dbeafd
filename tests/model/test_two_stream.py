"""model.decoder_two_stream (dgemma/model/config.py): position p's logits read a forward stream (canvas keys <= its
own position) at p - 1 and a backward stream (keys >= its own) at p + 1 through a combining MLP, never the canvas
token at p, so `diffusion.objective=blind_ce` (a plain CE at every position) trains a leave-one-out distribution.

References, in float64 (tests/model_utils.py; both sides agree to round-off, ~1e-13, so atol 1e-9 holds on any
CPU, and a wrong mask or a wrong neighbour moves logits by O(1)):
- the forward stream is a causal pass: with the MLP's output zero (its initial value) the logits at p >= 1 are the
  encoder's logits at p - 1 of the row [clean text before the canvas; noisy canvas] (one `encode` per canvas,
  rows cut as in tests/diffusion/test_block_causal.py), and position 0 gets the encoder's logits passed in;
- blindness: with every weight random, changing the noisy token at p leaves p's logits exactly as they were, and
  moves the logits of exactly the positions whose forward stream (at their p - 1) or backward stream (at their
  p + 1) reads it: the same canvas, the same document (the left term reads p - 1 across a document start, as
  decoder_shift does; the right term is dropped there).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import diffusion, settings as settings_lib
from dgemma.checkpoints import hf
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from dgemma.model import Transformer, init_cache, param_shapes
from dgemma.sampling import entropy, generate, temperature
from dgemma.tools import model_size
from tests.diffusion.test_block_causal import B, C, CFG, K, L, P, _batch, _cut_rows, encoded_rows
from tests.model_utils import f64_config, float64, random_params, to_f64
from tests.sampling.helpers import N, check_first_steps, tiny_model

# The decoder's sliding window is anchored at the canvas's first position, the encoder's at each query: a window
# longer than the rows makes the forward stream and the causal encoder read the same keys.
WIDE = dataclasses.replace(f64_config(CFG), sliding_window=2 * L, decoder_shift=True, self_conditioning=False)
TWO = dataclasses.replace(WIDE, decoder_two_stream=True)


def _decode(cfg, params, batch, noisy_BKC, prev_BKV):
  apply, cache, can = encoded_rows(cfg, params, batch)
  return apply(noisy_BKC, can["positions"], can["segment_ids"], cache, num_canvases=K, prev_logits_BKV=prev_BKV,
               method=Transformer.decode)


def _setup(seed=0):
  batch = _batch()
  g = np.random.default_rng(seed)
  noisy = g.integers(5, CFG.vocab_size, (B, K * C)).astype(np.int32)
  prev = g.normal(0, 2, (B, K, CFG.vocab_size))
  return batch, noisy, prev


def test_zero_mlp_is_the_causal_encoder_one_position_back():
  batch, noisy, prev = _setup()
  seg = batch["segment_ids"][:, P:]
  with float64():
    params = to_f64(random_params(TWO))
    for name in ("two_stream_out", "two_stream_out_bias"):  # the initial state: the MLP adds nothing
      params[name] = jnp.zeros_like(params[name])
    got = np.asarray(jax.jit(_decode, static_argnums=0)(TWO, params, batch, jnp.asarray(noisy), jnp.asarray(prev)))
    # reference rows: row b cut after canvas k (clean before it), that canvas noisy, left-padded to L (one
    # encode program for all of them)
    cut = _cut_rows(batch)
    noisy_BKC = np.where(seg != 0, noisy, 0).reshape(B, K, C)
    cut["tokens"][:, L - C:] = noisy_BKC.reshape(B * K, C)
    model = Transformer(WIDE)
    enc = jax.jit(lambda w, t, p, s: model.apply({"params": w}, t, p, s, init_cache(WIDE, B * K, L),
                                                 method=Transformer.encode)[0])
    ref_BKLV = np.asarray(enc(params, cut["tokens"], cut["positions"], cut["segment_ids"])).reshape(B, K, L, -1)
  checked = 0
  for b in range(B):
    for k in range(K):
      for p in range(C):
        i = k * C + p
        if seg[b, i] == 0:
          continue
        want = prev[b, k] if p == 0 else ref_BKLV[b, k, L - C + p - 1]
        np.testing.assert_allclose(got[b, i], want, atol=1e-9, rtol=0, err_msg=f"row {b} canvas {k} position {p}")
        checked += 1
  assert checked == B * K * C - 3  # row 1's last canvas ends in 3 padding tokens


def test_logits_never_read_their_own_token():
  batch, noisy, prev = _setup(1)
  seg = batch["segment_ids"][:, P:]
  with float64():
    params = to_f64(random_params(TWO))  # the MLP's output weights random too: both streams reach the logits
    run = jax.jit(_decode, static_argnums=0)
    base = np.asarray(run(TWO, params, batch, jnp.asarray(noisy), jnp.asarray(prev)))
    for i in range(K * C):
      changed = noisy.copy()
      changed[:, i] = (changed[:, i] + 7) % CFG.vocab_size
      moved_BC = np.abs(np.asarray(run(TWO, params, batch, jnp.asarray(changed), jnp.asarray(prev))) - base).max(-1)
      for b in range(B):
        if seg[b, i] == 0:
          continue
        for j in range(K * C):
          if seg[b, j] == 0:
            continue
          p = j % C
          same_canvas = i // C == j // C
          # the forward stream at j - 1 reads its own document's tokens up to j - 1 (j - 1 may end the previous
          # document, as decoder_shift reads it); the backward stream at j + 1 its document's tokens from j + 1 on,
          # and only when j + 1 is in j's document
          left = p >= 1 and i <= j - 1 and seg[b, i] == seg[b, j - 1]
          right = p + 1 < C and i >= j + 1 and seg[b, j + 1] == seg[b, j] == seg[b, i]
          if same_canvas and (left or right):
            assert moved_BC[b, j] > 1e-6, (b, i, j)
          else:  # j == i among them: blind to its own token
            assert moved_BC[b, j] < 1e-12, (b, i, j, moved_BC[b, j])


def test_options_and_objective_are_checked(tmp_path):
  with pytest.raises(ConfigError, match="model.decoder_shift"):
    dataclasses.replace(CFG, decoder_two_stream=True, self_conditioning=False)
  with pytest.raises(ConfigError, match="model.self_conditioning"):
    dataclasses.replace(CFG, decoder_two_stream=True, decoder_shift=True)
  with pytest.raises(ConfigError, match="model.decoder_right_readout"):
    dataclasses.replace(TWO, decoder_right_readout=1)
  from proj.markov.configs import likelihood_small
  config = likelihood_small.get_config("unused.txt")
  assert settings_lib.from_config(config).objective.needs_two_stream
  config.model.decoder_two_stream = False
  with pytest.raises(ConfigError, match="diffusion.objective: 'blind_ce' is proper only"):
    settings_lib.from_config(config)
  cfg = dataclasses.replace(TWO, dtype="float32", param_dtype="float32")
  with pytest.raises(hf.HFCheckpointError, match="model.decoder_shift is a dgemma research option"):
    hf.export_hf_checkpoint(cfg, random_params(cfg), tmp_path / "out")


def test_blind_ce_trains_it_and_it_is_counted():
  cfg = dataclasses.replace(TWO, dtype="float32", param_dtype="float32")
  params = random_params(cfg)
  params["two_stream_out"] = jnp.zeros_like(params["two_stream_out"])
  loss_cfg = DiffusionSettings(canvas_len=C, canvases_per_row=K, objective="blind_ce")
  batch = _batch()
  (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: diffusion.diffusion_loss(
      p, batch, jax.random.PRNGKey(0), model_cfg=cfg, loss_cfg=loss_cfg), has_aux=True))(params)
  g = np.asarray(grads["two_stream_out"])
  assert np.isfinite(float(loss)) and np.abs(g).max() > 1e-4  # the zero start gets a gradient
  # blind_ce is the plain CE of the network's output at every scored position
  assert float(metrics["canvas_loss"]) == pytest.approx(float(metrics["canvas_ce"]), rel=1e-6)
  D, F = CFG.d_model, 4 * CFG.d_model
  assert model_size.components(cfg)["two_stream"] == (2 * D * F + F + F * D + D,) * 2
  assert param_shapes(cfg)["two_stream_in"].shape == (2 * D, F)
  one = dataclasses.replace(cfg, decoder_two_stream=False)
  comps = model_size.components(cfg)
  trunk = sum(comps[c][1] for c in ("attention", "dense_mlp", "experts", "router"))
  # train step: the backward stream is the stack once more over the 2 rows' K C canvas tokens, forward and
  # backward (6 per weight); the MLP's weights run on the canvas tokens only
  extra = model_size.train_step_flops(cfg, loss_cfg, 2, L) - model_size.train_step_flops(one, loss_cfg, 2, L)
  assert extra == 2 * 6 * (trunk * K * C + comps["two_stream"][1] * K * C)


@pytest.mark.slow  # its own model and generate compile
def test_two_stream_in_generate():
  """generate with a two-stream model: every row's first (and, where reached, second) canvas's first step against
  `decode` on a fresh contiguous cache, the canvas's first position scored by the encoder's logits at the last
  valid token (fp32 round-off of another cache layout: atol 1e-4, as check_first_steps says)."""
  from tests.sampling.helpers import PROMPTS, P as SP, C as SC, S
  from dgemma.sampling import SamplerConfig
  model, params = tiny_model(decoder_shift=True, decoder_two_stream=True, self_conditioning=False)
  prompts = np.array([p + [0] * (SP - len(p)) for p in PROMPTS])
  lengths = np.array([len(p) for p in PROMPTS])
  cfg = SamplerConfig(canvas_len=SC, max_denoising_steps=S, end_ids=(1, 106), confidence_threshold=0.05)
  out = jax.tree.map(np.asarray, generate(model, params, prompts, lengths, cfg,
                                          jax.random.split(jax.random.key(7), len(PROMPTS)), N,
                                          return_trajectory="all"))
  t0 = temperature(cfg, 0)

  @jax.jit
  def reference_entropy(ctx_1L, length, canvas_1C):
    L1 = ctx_1L.shape[1]
    iota = jnp.arange(L1)[None]
    enc_1LV, cache = model.apply({"params": params}, ctx_1L, iota, (iota < length).astype(jnp.int32),
                                 init_cache(model.cfg, 1, L1), method="encode")
    logits = model.apply({"params": params}, canvas_1C, length + jnp.arange(SC)[None], jnp.ones_like(canvas_1C),
                         cache, prev_logits_BKV=enc_1LV[:, length - 1][:, None], method="decode")
    return entropy(logits / t0)[0][0]

  checked, second = check_first_steps(out, reference_entropy)
  assert checked >= len(PROMPTS) and second > 0
