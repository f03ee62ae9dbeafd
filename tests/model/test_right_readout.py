"""model.decoder_right_readout = R (dgemma/model/config.py): canvas position p's logits plus the readouts of the
decoder's outputs at p + 1 .. p + R, each through its [D, D] projection `right_readout[r - 1]`. With those
projections the identity, the readout at p + r is the plain model's own logits at p + r, so the option's logits
must equal the plain (or shifted) logits at p plus the plain logits at each p + r that is inside the canvas, not
padding and in the same document. In float64 (tests/model_utils.py): both sides agree to round-off (~1e-13), atol 1e-9
holds on any CPU, and a readout taken from the wrong neighbour moves the logits by O(1)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import diffusion
from dgemma.checkpoints import hf
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from dgemma.model import Transformer, param_shapes
from dgemma.tools import model_size
from tests.diffusion.test_block_causal import B, C, CFG, K, P, _batch, encoded_rows
from tests.model_utils import f64_config, float64, random_params, to_f64

PLAIN = f64_config(CFG)


def _decode(cfg, params, batch, noisy_BKC, prev_BKV):
  apply, cache, can = encoded_rows(cfg, params, batch)
  return apply(noisy_BKC, can["positions"], can["segment_ids"], cache, num_canvases=K, prev_logits_BKV=prev_BKV,
               method=Transformer.decode)


def _with_readout(params, matrix):
  return {**params, "right_readout": jnp.asarray(matrix)}


@pytest.mark.parametrize("shift,R", [(False, 1), (True, 1), (True, 2)])
def test_logits_are_the_left_readout_plus_the_right_neighbours(shift, R):
  left_cfg = dataclasses.replace(PLAIN, decoder_shift=shift)
  both_cfg = dataclasses.replace(left_cfg, decoder_right_readout=R)
  batch = _batch()
  seg = np.asarray(batch["segment_ids"])[:, P:]  # the K canvases' columns
  eye = np.stack([np.eye(CFG.d_model)] * R)
  with float64():
    params = to_f64(random_params(CFG))
    g = np.random.default_rng(0)
    noisy = jnp.asarray(g.integers(0, CFG.vocab_size, (B, K * C)), jnp.int32)
    prev = jnp.asarray(g.normal(0, 2, (B, K, CFG.vocab_size))) if shift else None
    run = jax.jit(_decode, static_argnums=0)
    plain = np.asarray(run(PLAIN, params, batch, noisy, None))
    left = np.asarray(run(left_cfg, params, batch, noisy, prev))
    both = np.asarray(run(both_cfg, _with_readout(params, eye), batch, noisy, prev))
    zero = np.asarray(run(both_cfg, _with_readout(params, 0 * eye), batch, noisy, prev))
  np.testing.assert_allclose(zero, left, atol=1e-12, rtol=0)  # the zero init is the one-sided model
  dropped = 0
  for b in range(B):
    for i in range(K * C):
      want = left[b, i].copy()
      for r in range(1, R + 1):
        inside = i % C + r < C and seg[b, i + r] == seg[b, i] and seg[b, i + r] != 0
        want += plain[b, i + r] if inside else 0.0
        dropped += (i % C + r < C) and not inside
      np.testing.assert_allclose(both[b, i], want, atol=1e-9, rtol=0, err_msg=f"row {b} column {i}")
  # terms dropped inside a canvas, all in row 1: a document ends after column 3 of canvas 0 (R = 1: 1 term;
  # R = 2: 3) and padding fills columns 5-7 of canvas 2 (R = 1: columns 4-6 lose their term; R = 2: 6 terms)
  assert dropped == {1: 1 + 3, 2: 3 + 6}[R]


def test_readout_count_is_checked():
  with pytest.raises(ConfigError, match="model.decoder_right_readout: must be >= 0"):
    dataclasses.replace(CFG, decoder_right_readout=-1)


@pytest.mark.slow  # the fast tier's budget: a few train steps (~4 s)
def test_trains_from_zero_and_is_counted():
  cfg = dataclasses.replace(CFG, decoder_shift=True, decoder_right_readout=1)
  params = random_params(cfg)
  params["right_readout"] = jnp.zeros_like(params["right_readout"])
  loss_cfg = DiffusionSettings(canvas_len=C, canvases_per_row=K, objective="loo_ce")
  grads = jax.jit(jax.grad(lambda p: diffusion.diffusion_loss(p, _batch(), jax.random.PRNGKey(0), model_cfg=cfg,
                                                              loss_cfg=loss_cfg)[0]))(params)
  g = np.asarray(grads["right_readout"])
  assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-4  # a zero start still gets a gradient
  # parameters: one [D, D] matrix, its own component; FLOPs: decoder tokens only
  assert param_shapes(cfg)["right_readout"].shape == (1, CFG.d_model, CFG.d_model)
  assert model_size.components(cfg)["right_readout"] == (CFG.d_model ** 2,) * 2
  base = dataclasses.replace(cfg, decoder_right_readout=0)
  D, V = CFG.d_model, CFG.vocab_size
  assert (model_size.forward_flops(cfg, 10, 20, decoder=True, sc_signal=False)
          - model_size.forward_flops(base, 10, 20, decoder=True, sc_signal=False)) == 10 * (2 * D * D + 2 * V * D)
  assert model_size.forward_flops(cfg, 10, 20, decoder=False, sc_signal=False) == model_size.forward_flops(
      base, 10, 20, decoder=False, sc_signal=False)
  extra = model_size.train_step_flops(cfg, loss_cfg, 2, 40) - model_size.train_step_flops(base, loss_cfg, 2, 40)
  # 2 rows x the K C canvas tokens x (6: forward and backward, + 2: the self-conditioning forward) x (the
  # projection + the vocabulary readout); the encoder's 32 tokens do not run it
  assert CFG.self_conditioning and extra == 2 * K * C * (6 + 2) * (D * D + V * D)


def test_hf_export_refuses_it(tmp_path):
  cfg = dataclasses.replace(CFG, decoder_right_readout=1)
  with pytest.raises(hf.HFCheckpointError, match="decoder_right_readout"):
    hf.export_hf_checkpoint(cfg, random_params(cfg), tmp_path / "out")
  assert not (tmp_path / "out").exists()
