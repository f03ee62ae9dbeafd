"""train.py with a shifted decoder output (a probe, not in the library): the logits that score canvas position p
are the decoder's output at p - 1 (inside the canvas), and for the canvas's first position the encoder's causal
logits at the last clean token before it. So each canvas position is predicted where the token to its left sits,
as the encoder's next-token head does (Dream and DiffuLLaMA shift this way). The decoder's output at the canvas's
last position is unused. The objective, its eval metrics (canvas_nelbo) and everything else are the configured
ones, read on the shifted logits; canvas_nelbo is then an unbiased estimate of the shifted model's diffusion bound
per canvas token (its x_theta at p is a distribution computed from the clean context and the noisy canvas).
Needs diffusion.encoder_loss_weight > 0 (the encoder's logits) and no self-conditioning.

  python docs/results/likelihood_small/probes_shift/train_shifted.py \
      --config=configs/likelihood_small.py:data_cache/markov/train.txt --workdir=/tmp/probe/shift
"""
import os, sys
sys.path.insert(0, os.getcwd())
import jax.numpy as jnp
from dgemma.diffusion import loss as loss_lib

_orig_encode, _orig_denoise = loss_lib.encode_context, loss_lib.denoise
_stash = {}


def encode_context(apply, ctx, *, model_cfg, want_enc_logits=False):
  out = _orig_encode(apply, ctx, model_cfg=model_cfg, want_enc_logits=want_enc_logits)
  _stash["enc_logits_BTV"] = out[0]
  return out


def denoise(apply, cache, canvas, noisy_BC, sc_keys_B, *, model_cfg, loss_cfg, num_canvases, probs_BCV=None,
            self_condition=True):
  logits_BCV, dec_vars = _orig_denoise(apply, cache, canvas, noisy_BC, sc_keys_B, model_cfg=model_cfg,
                                       loss_cfg=loss_cfg, num_canvases=num_canvases, probs_BCV=probs_BCV,
                                       self_condition=self_condition)
  enc_BTV = _stash["enc_logits_BTV"]
  assert enc_BTV is not None, "the probe needs diffusion.encoder_loss_weight > 0"
  B, KC, V = logits_BCV.shape
  K = num_canvases
  C = KC // K
  T = enc_BTV.shape[1]  # context = the row up to the last canvas: canvas k starts at T - (K - 1 - k) * C
  first_BKV = jnp.stack([enc_BTV[:, T - (K - 1 - k) * C - 1] for k in range(K)], axis=1)
  dec_BKCV = logits_BCV.reshape(B, K, C, V)
  shifted = jnp.concatenate([first_BKV[:, :, None].astype(logits_BCV.dtype), dec_BKCV[:, :, :-1]], axis=2)
  return shifted.reshape(B, KC, V), dec_vars


loss_lib.encode_context, loss_lib.denoise = encode_context, denoise
import runpy
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
