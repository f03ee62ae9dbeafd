"""train.py with the Markov source's exact leave-one-out posteriors as the canvas targets (a diagnostic, not a recipe).

The recipe's `blind_ce` trains position p on the one-hot clean token x_p. This probe trains it instead on the
distribution that target is a draw of: the exact p(x_p | clean prefix, z of the canvas's other positions) of the
chain in TRUTH (truth.json of dgemma.tools.markov_text), by forward-backward over the canvas as
`dgemma.data.markov.canvas_posteriors` computes it, here in JAX inside the train step, at each canvas's own alpha.
Both losses have the same minimiser (the exact leave-one-out distribution); the soft one has no sampling noise in
its target. A canvas whose clean tokens or two prefix tokens are not all letters of the chain's alphabet in one
document (a document boundary, BOS/EOS) keeps the one-hot target. The evaluation pass is unchanged.

  TRUTH=data_cache/markov/truth.json python docs/results/likelihood_small/exact_targets/train_exact.py \
      --config=configs/likelihood_small.py:data_cache/markov/train.txt --workdir=/tmp/exact
"""
import dataclasses
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import jax
import jax.numpy as jnp
import numpy as np

from dgemma.data import markov
from dgemma.diffusion import loss as loss_lib, objectives
from dgemma.tokenizers import NUM_SPECIAL

CHAIN = markov.read_chain(os.environ["TRUTH"], field="TRUTH")
S = CHAIN.num_symbols
assert CHAIN.order == 2
P_HRS = jnp.asarray(CHAIN.transitions.reshape(S, S, S), jnp.float32)  # [x_{i-2}, x_{i-1}, x_i]
SYMBOL_IDS = np.array([ord(c) + NUM_SPECIAL for c in CHAIN.alphabet])
state = {"batch": None, "canvas_len": None}
orig_loss, orig_get = loss_lib.diffusion_loss, objectives.get


def exact_loo(prefix_N2, z_NC, alpha_N, V):
  """[N, C, S] p(x_i | prefix, z_-i) for canvases whose prefix symbols are prefix_N2 (indices in the alphabet)."""
  N, C = z_NC.shape
  emit_NCS = (1.0 - alpha_N)[:, None, None] / V + alpha_N[:, None, None] * (z_NC[..., None] == jnp.arange(S))
  prev_NHR = jax.nn.one_hot(prefix_N2[:, 0], S)[:, :, None] * jax.nn.one_hot(prefix_N2[:, 1], S)[:, None, :]
  fwd = []
  for i in range(C):  # p(x_{i-1}, x_i | prefix, z_1..i), normalised
    cur_NRX = jnp.einsum("nhr,hrx->nrx", prev_NHR, P_HRS) * emit_NCS[:, i, None, :]
    prev_NHR = cur_NRX / jnp.sum(cur_NRX, axis=(1, 2), keepdims=True)
    fwd.append(prev_NHR)
  bwd = [jnp.ones((N, S, S))]
  for i in range(C - 2, -1, -1):  # p(z_{i+1..C} | x_{i-1}, x_i), normalised
    nxt_NRX = bwd[0] * emit_NCS[:, i + 1, None, :]
    b_NHR = jnp.einsum("hrx,nrx->nhr", P_HRS, nxt_NRX)
    bwd.insert(0, b_NHR / jnp.sum(b_NHR, axis=(1, 2), keepdims=True))
  full_NCS = jnp.sum(jnp.stack(fwd, 1) * jnp.stack(bwd, 1), axis=2)
  loo_NCS = full_NCS / emit_NCS
  return loo_NCS / jnp.sum(loo_NCS, axis=-1, keepdims=True)


def soft_blind_ce(logits_BNV, x0_BN, zt_BN, alpha_BN, dalpha_BN, **_):
  batch = state["batch"]
  B, KC, V = logits_BNV.shape
  C = state["canvas_len"]
  K = KC // C
  lut = jnp.full((V,), -1, jnp.int32).at[SYMBOL_IDS].set(jnp.arange(S, dtype=jnp.int32))
  tokens_BL, seg_BL = batch["tokens"], batch["segment_ids"]
  L = tokens_BL.shape[1]
  start = L - KC
  # each canvas with its two prefix tokens: [B, K, C + 2]
  idx_KW = start - 2 + jnp.arange(K)[:, None] * C + jnp.arange(C + 2)[None, :]
  win_BKW, seg_BKW = tokens_BL[:, idx_KW], seg_BL[:, idx_KW]
  sym_BKW = lut[win_BKW]
  pure_BK = jnp.all(sym_BKW >= 0, axis=-1) & jnp.all(seg_BKW == seg_BKW[..., :1], axis=-1)
  N = B * K
  z_NC = lut[zt_BN.reshape(N, C)]  # -1: an id outside the alphabet (matches no symbol)
  loo_NCS = exact_loo(jnp.maximum(sym_BKW[..., :2], 0).reshape(N, 2), z_NC, alpha_BN.reshape(N, C)[:, 0], V)
  q_BNV = jnp.zeros((B, KC, V), jnp.float32).at[..., SYMBOL_IDS].set(loo_NCS.reshape(B, KC, S))
  q_BNV = jax.lax.stop_gradient(q_BNV)
  logp_BNV = jax.nn.log_softmax(logits_BNV.astype(jnp.float32), axis=-1)
  soft_BN = -jnp.sum(q_BNV * jnp.where(q_BNV > 0, logp_BNV, 0.0), axis=-1)
  hard_BN = -jnp.take_along_axis(logp_BNV, x0_BN[..., None], axis=-1)[..., 0]
  pure_BN = jnp.repeat(pure_BK, C, axis=1)
  return jnp.where(pure_BN, soft_BN, hard_BN)


def get(name):
  objective = orig_get(name)
  if state["batch"] is not None and name == "blind_ce":
    return dataclasses.replace(objective, loss=soft_blind_ce)
  return objective


def diffusion_loss(params, batch, *a, eval_metrics=False, **kw):
  loss_cfg = kw["loss_cfg"]
  if loss_cfg.short_canvas_len:  # its second canvas loss would read these targets at the wrong shapes
    raise ValueError("train_exact.py: diffusion.short_canvas_len is not supported")
  state["batch"] = None if eval_metrics else batch  # read at trace time
  state["canvas_len"] = loss_cfg.canvas_len
  try:
    return orig_loss(params, batch, *a, eval_metrics=eval_metrics, **kw)
  finally:
    state["batch"] = None


objectives.get = get
loss_lib.diffusion_loss = diffusion_loss
if __name__ == "__main__":
  sys.argv = ["train.py"] + sys.argv[1:]
  runpy.run_path("train.py", run_name="__main__")
