"""Probe: a decoder blind to each position's own noisy token, trained with a plain CE at every canvas position.

The leave-one-out distribution p(x_i | z_-i) is what the uniform-state NELBO reads. A network whose output at i
cannot see z_i can learn it with a plain cross-entropy at EVERY position (kept or drawn): the target x_i given
z_-i is then an honest sample of that distribution. loo_ce's gradient at a kept token is only about
t / (N x_theta[z]); here a kept token with clean neighbours is as informative as a drawn one.

Two decoder passes over the canvas with the shared weights: a forward stream (canvas attention j <= i) and a
backward stream (j >= i); both read the whole clean context. Position p's logits combine the forward stream at
p - 1 (the encoder's logits at the last clean token for p = 0, as model.decoder_shift does) and the backward
stream at p + 1 through a position-wise MLP over both (zero output at init), so the output at p never reads z_p.
Objective `blind_ce`: plain CE at every position, output = leave-one-out logits.

  python docs/results/likelihood_small/probes_blind/blind.py train.py --config=... --workdir=...
  python docs/results/likelihood_small/probes_blind/blind.py -m eval.likelihood --checkpoint=... --data=...
(needs model.decoder_shift=True, model.decoder_right_readout=0, no self-conditioning, no decoder_head_layers)
"""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import flax.linen as nn
import jax
import jax.numpy as jnp

from dgemma.diffusion import objectives
from dgemma.model import layers, transformer as tr
from dgemma.model.attention import decoder_masks

objectives.OBJECTIVES["blind_ce"] = objectives.Objective("blind_ce", objectives.UNIFORM, objectives._base_ce,
                                                         leave_one_out=True)
HIDDEN = int(os.environ.get("BLIND_HIDDEN", "512"))

_orig_setup = tr.Transformer.setup


def setup(self):
  _orig_setup(self)
  D = self.cfg.d_model
  self.blind_in = nn.Dense(HIDDEN, name="blind_in", param_dtype=layers.param_dtype(self.cfg))
  self.blind_out = nn.Dense(D, name="blind_out", kernel_init=nn.initializers.zeros,
                            param_dtype=layers.param_dtype(self.cfg))


def decode(self, canvas_BC, positions_BC, segment_ids_BC, cache, sc_logits_BCV=None, sc_mask_B=None,
           num_canvases: int = 1, sc_embeddings_BCD=None, per_query_window: bool = False, canvas_probs_BCV=None,
           prev_logits_BKV=None):
  cfg = self.cfg
  assert cfg.decoder_shift and not cfg.decoder_right_readout and not cfg.self_conditioning
  assert not cfg.decoder_head_layers and not cache.ring and prev_logits_BKV is not None
  positions_BC = positions_BC.astype(jnp.int32)
  segment_ids_BC = segment_ids_BC.astype(jnp.int32)
  x_BCD = (self.embedder.encode(canvas_BC) if canvas_probs_BCV is None
           else self.embedder.soft_encode(canvas_probs_BCV))
  slide, glob = decoder_masks(cfg, positions_BC, segment_ids_BC, cache.positions_BS, cache.segment_ids_BS,
                              cache.length, num_canvases, per_query_window)
  B, C = canvas_BC.shape
  i = jnp.arange(C)
  streams = []
  for keep_CC in (i[None, :] <= i[:, None], i[None, :] >= i[:, None]):  # forward, backward
    keep = jnp.concatenate([jnp.ones((C, slide.shape[-1] - C), bool), keep_CC], axis=1)[None]
    ctx = tr._Ctx(positions_BC, slide & keep, glob & keep, cache.length, segment_ids_BC != 0, decode=True)
    h_BCD, (_, aux) = self.blocks(x_BCD, (cache.k, cache.v), ctx)
    self._sow_aux(aux)
    streams.append(self.final_norm(h_BCD))
  fwd_BCD, bwd_BCD = streams
  K = num_canvases
  Cc = C // K
  fwd = fwd_BCD.reshape(B, K, Cc, -1)
  bwd = bwd_BCD.reshape(B, K, Cc, -1)
  seg = segment_ids_BC.reshape(B, K, Cc)
  # u_p = forward stream at p - 1 (zero at p = 0), v_p = backward stream at p + 1 (zero past the end / segment)
  u = jnp.pad(fwd[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0)))
  v = jnp.pad(bwd[:, :, 1:], ((0, 0), (0, 0), (0, 1), (0, 0)))
  seg_next = jnp.pad(seg[:, :, 1:], ((0, 0), (0, 0), (0, 1)))
  v = jnp.where(((seg_next == seg) & (seg_next != 0))[..., None], v, 0.0)
  y = u + self.blind_out(jax.nn.gelu(self.blind_in(jnp.concatenate([u, v], axis=-1))))
  logits = self._readout(y.reshape(B, C, -1)).reshape(B, K, Cc, -1)
  first = prev_logits_BKV.astype(logits.dtype)  # p = 0 (u = 0): the encoder's next-token logits plus the MLP's
  logits = logits.at[:, :, 0].add(first)
  return logits.reshape(B, C, -1)


tr.Transformer.setup = setup
tr.Transformer.decode = decode

if __name__ == "__main__":
  if sys.argv[1] == "-m":
    mod = sys.argv[2]
    sys.argv = [mod] + sys.argv[3:]
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
  else:
    path = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
