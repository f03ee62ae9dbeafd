"""model.decoder_shift (dgemma/model/config.py): canvas position p scored by the decoder's output at p - 1 and the
first position by the encoder's logits at the token before the canvas. Checked against the unshifted model shifted
by hand: the decoder itself, and the training loss (the likelihood estimator: tests/diffusion/test_likelihood.py;
generate: tests/sampling/test_sampler.py). In float64 (tests/model_utils.py), so the two programs agree to
round-off (~1e-13) and atol 1e-9 holds on any CPU, while scoring a position from the wrong neighbour moves the
logits by O(1)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import diffusion
from dgemma.checkpoints import hf
from dgemma.diffusion import loss as loss_lib
from dgemma.diffusion.config import DiffusionSettings
from dgemma.model import Transformer
from tests.diffusion.test_block_causal import B, C, CFG, K, L, _batch, encoded_rows
from tests.model_utils import f64_config, float64, random_params, to_f64

PLAIN = f64_config(CFG)
SHIFTED = dataclasses.replace(PLAIN, decoder_shift=True)


def _decode(cfg, params, batch, noisy_BKC, prev_BKV):
  apply, cache, can = encoded_rows(cfg, params, batch)
  return apply(noisy_BKC, can["positions"], can["segment_ids"], cache, num_canvases=K, prev_logits_BKV=prev_BKV,
               method=Transformer.decode)


def test_decode_is_the_plain_decode_shifted_per_canvas():
  with float64():
    params = to_f64(random_params(CFG))
    batch = _batch()
    g = np.random.default_rng(0)
    noisy = jnp.asarray(g.integers(0, CFG.vocab_size, (B, K * C)), jnp.int32)
    prev = jnp.asarray(g.normal(0, 2, (B, K, CFG.vocab_size)))
    plain = np.asarray(jax.jit(_decode, static_argnums=0)(PLAIN, params, batch, noisy, None))
    shifted = np.asarray(jax.jit(_decode, static_argnums=0)(SHIFTED, params, batch, noisy, prev))
  prev = np.asarray(prev)
  for b in range(B):
    for k in range(K):
      np.testing.assert_allclose(shifted[b, k * C], prev[b, k], atol=1e-12, rtol=0)
      for p in range(1, C):
        np.testing.assert_allclose(shifted[b, k * C + p], plain[b, k * C + p - 1], atol=1e-9, rtol=0)


def test_decode_without_the_encoder_logits_is_an_error():
  params = random_params(CFG)
  noisy = jnp.zeros((B, K * C), jnp.int32)
  with pytest.raises(ValueError, match="prev_logits_BKV"):
    _decode(dataclasses.replace(CFG, decoder_shift=True), params, _batch(), noisy, None)
  with pytest.raises(ValueError, match="holds 1 canvases' logits, the decoder input 3"):
    _decode(dataclasses.replace(CFG, decoder_shift=True), params, _batch(), noisy,
            jnp.zeros((B, 1, CFG.vocab_size)))


def test_hf_export_refuses_the_shift(tmp_path):
  with pytest.raises(hf.HFCheckpointError, match="decoder_shift"):
    hf.export_hf_checkpoint(dataclasses.replace(CFG, decoder_shift=True), random_params(CFG), tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("short_canvas_len", [0, 2])
def test_training_loss_equals_the_plain_model_shifted_by_hand(monkeypatch, short_canvas_len):
  """The shifted model's diffusion_loss (configured and short canvases) against the plain model's, with its
  decoder logits shifted by hand from the encoder's logits (captured from its context pass)."""
  loss_cfg = DiffusionSettings(canvas_len=C, canvases_per_row=K, objective="loo_ce", encoder_loss_weight=0.5,
                               short_canvas_len=short_canvas_len)
  with float64():
    params = to_f64(random_params(CFG))
    batch = _batch()
    rng = jax.random.PRNGKey(4)
    run = lambda cfg: jax.tree.map(np.asarray, jax.jit(lambda p: diffusion.diffusion_loss(
        p, batch, rng, model_cfg=cfg, loss_cfg=loss_cfg))(params))
    loss_shifted, m_shifted = run(SHIFTED)

    captured = {}
    encode, denoise = loss_lib.encode_context, loss_lib.denoise

    def capture(apply, ctx, **kw):
      out = encode(apply, ctx, **dict(kw, want_enc_logits=True))
      captured["enc_BTV"] = out[0]
      return out

    def shift_by_hand(apply, cache, canvas, noisy_BC, sc_keys_B, *, num_canvases, **kw):
      n = num_canvases
      width = noisy_BC.shape[1] // n

      def apply_shifted(*a, **k):  # every decoder pass (the self-conditioning one too) shifted
        logits_BCV, dec_vars = apply(*a, **k)
        cols = []
        for c in range(n):  # canvas c starts at L - (n - c) * width; the token before it is the encoder's
          cols.append(captured["enc_BTV"][:, L - (n - c) * width - 1][:, None])
          cols.append(logits_BCV[:, c * width:(c + 1) * width - 1])
        return jnp.concatenate(cols, axis=1), dec_vars

      return denoise(apply_shifted, cache, canvas, noisy_BC, sc_keys_B, num_canvases=n, **kw)

    monkeypatch.setattr(loss_lib, "encode_context", capture)
    monkeypatch.setattr(loss_lib, "denoise", shift_by_hand)
    loss_plain, m_plain = run(PLAIN)
  np.testing.assert_allclose(loss_shifted, loss_plain, atol=1e-9, rtol=0)
  for key in m_plain:
    np.testing.assert_allclose(m_shifted[key], m_plain[key], atol=1e-9, rtol=0, err_msg=key)
  assert ("short_canvas_loss" in m_plain) == bool(short_canvas_len)
