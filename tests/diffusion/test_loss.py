"""dgemma/diffusion/loss.py: the next-token losses (the encoder's, and objective='ar') on given logits, against
a plain float64 loop over the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_test
from dgemma import settings as settings_lib
from dgemma.diffusion import loss

EPS = float(np.finfo(np.float32).eps)
V = 96


def _rows(L: int):
  """Two packed rows [2, L]: row 0 holds two documents (no target across the boundary), row 1 ends in
  padding (scored by nothing)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, V, (2, L)).astype(np.int32)
  seg = np.ones((2, L), np.int32)
  seg[0, L // 3:] = 2
  seg[1, L - 5:] = 0
  positions = np.tile(np.arange(L, dtype=np.int32), (2, 1))
  positions[0, L // 3:] = np.arange(L - L // 3)
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(positions)}


def _logits(B: int, T: int):
  return jnp.asarray(np.random.default_rng(1).normal(scale=3.0, size=(B, T, V)).astype(np.float32))


def _reference(logits_BTV, tokens_BT, seg_BT):
  """Per row and position i: -log softmax(logits[i])[tokens[i+1]] where i and i+1 are in one (non-padding)
  document, in float64. (ce, weight) [B, T-1]."""
  logits = np.asarray(logits_BTV, np.float64)
  m = logits.max(-1)
  lse = np.log(np.sum(np.exp(logits - m[..., None]), -1)) + m
  B, T = tokens_BT.shape
  ce, w = np.zeros((B, T - 1)), np.zeros((B, T - 1))
  for b in range(B):
    for i in range(T - 1):
      w[b, i] = float(seg_BT[b, i] == seg_BT[b, i + 1] != 0)
      ce[b, i] = lse[b, i] - logits[b, i, tokens_BT[b, i + 1]]
  return ce, w, np.abs(lse).max()


def _bound(ce, w, lse_max):
  """fp32 error of sum(w ce) / sum(w): each CE is off by at most (V + 2) eps (1 + |lse|) (a V-term sum of
  positive terms, its log, one subtraction), and the N-term sum by N eps sum|w ce| (Higham)."""
  n = np.sum(w)
  return ((V + 2) * EPS * (1 + lse_max) * n + 2 * n * EPS * np.sum(np.abs(ce * w))) / n


def test_encoder_next_token_loss_equals_a_loop_over_the_logits():
  ctx = _rows(24)
  logits = _logits(2, 24)
  totals = {"encoder_tokens": jnp.sum(loss.next_token_weights(ctx["segment_ids"]).astype(jnp.float32))}
  got = float(jax.jit(loss.encoder_next_token_loss)(logits, ctx, totals))
  ce, w, lse_max = _reference(logits, np.asarray(ctx["tokens"]), np.asarray(ctx["segment_ids"]))
  assert np.sum(w) < w.size  # the boundary and the padding are scored by nothing
  want = np.sum(ce * w) / np.sum(w)
  assert abs(got - want) <= _bound(ce, w, lse_max)
  # a target off by one position is far outside the bound
  shifted = np.sum(np.asarray([[ce[b, i + 1] if i + 1 < ce.shape[1] else 0 for i in range(ce.shape[1])]
                               for b in range(2)]) * w) / np.sum(w)
  assert abs(shifted - want) > 100 * _bound(ce, w, lse_max)


def test_ar_loss_and_canvas_metrics_equal_a_loop_over_the_logits():
  config = tiny_test.get_config()
  config.diffusion.objective = "ar"
  config.model.num_experts = 0  # no router losses: the loss is the next-token CE alone
  settings = settings_lib.from_config(config)
  model_cfg, loss_cfg = settings.model, settings.diffusion
  L, C = 24, loss_cfg.canvas_len
  assert C < L - 1
  batch = _rows(L)
  logits = _logits(2, L)
  apply = lambda *args, **kwargs: ((logits, None), {})  # the model's output, given: this tests the loss's arithmetic
  totals = loss.batch_totals(batch, loss_cfg)
  _, metrics = loss._ar_loss(apply, batch, model_cfg, loss_cfg, totals, jnp.float32(1.0), eval_metrics=True)
  ce, w, lse_max = _reference(logits, np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"]))
  assert abs(float(metrics["encoder_loss"]) - np.sum(ce * w) / np.sum(w)) <= _bound(ce, w, lse_max)
  # canvas_*: the predictions of the last C tokens (positions L-1-C .. L-2)
  cw, cce = w[:, -C:], ce[:, -C:]
  assert float(metrics["canvas_tokens"]) == np.sum(cw) > 0
  assert abs(float(metrics["canvas_ce"]) - np.sum(cce * cw) / np.sum(cw)) <= _bound(cce, cw, lse_max)
  correct = np.argmax(np.asarray(logits)[:, :-1], -1) == np.asarray(batch["tokens"])[:, 1:]
  assert float(metrics["canvas_accuracy"]) == pytest.approx(np.sum(correct[:, -C:] * cw) / np.sum(cw), abs=1e-6)
