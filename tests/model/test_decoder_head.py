"""model.decoder_head_layers = N (dgemma/model/config.py): N layers of the sliding kind with their own weights run
after the shared stack in decoder mode only, attending bidirectionally inside each canvas (same document, not
padding) and to nothing else. The reference runs the same layer on each (row, canvas) alone, with a mask built by
hand from the segment ids, so a mask that let a canvas read another canvas, another document or padding, or a
head that read the context cache, would change its output by O(1). In float64 (tests/model_utils.py) the
one-forward and per-canvas computations differ only in summation order (~1e-13), so atol 1e-9 holds on any CPU."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.checkpoints import hf
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from dgemma.model import Transformer
from dgemma.model.config import SLIDING
from dgemma.model.transformer import Layer, _Ctx
from dgemma.model import layers
from dgemma.tools import model_size
from tests.diffusion.test_block_causal import B, C, CFG, K, P, _batch, encoded_rows
from tests.model_utils import f64_config, float64, random_params, to_f64

HEAD = dataclasses.replace(f64_config(CFG), decoder_head_layers=2)


def _decode_recording_the_head(params, noisy_BKC):
  """The decoder's logits, and each head layer's (input, output) hidden states."""
  batch = _batch()
  apply, cache, can = encoded_rows(HEAD, params, batch)
  seen = {}

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and context.module.name.startswith("decoder_head_"):
      seen[context.module.name] = (args[0], out[0])
    return out

  with nn.intercept_methods(record):
    logits = apply(noisy_BKC, can["positions"], can["segment_ids"], cache, num_canvases=K,
                   method=Transformer.decode)
  return logits, seen, can


@jax.jit
def _layer_alone(layer_params, x_TD, positions_T, allowed_TT):
  """One head layer on one canvas of one row, with the pairs that may attend given."""
  K_, H = layers.attn_dims(HEAD, SLIDING)
  empty = jnp.zeros((1, 0, K_, H), x_TD.dtype)
  mask = allowed_TT[None]
  ctx = _Ctx(positions_T[None], mask, mask, jnp.int32(0), jnp.any(allowed_TT, axis=1)[None], decode=True)
  out, _, _ = Layer(HEAD, SLIDING).apply({"params": layer_params}, x_TD[None], (empty, empty), ctx)
  return out[0]


@pytest.mark.slow  # the fast tier's budget: per-layer gradient probes (~9 s)
def test_each_head_layer_reads_its_own_canvas_only_and_feeds_the_readout():
  with float64():
    params = to_f64(random_params(HEAD))
    noisy = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (B, K * C)), jnp.int32)
    logits, seen, can = _decode_recording_the_head(params, noisy)
    assert sorted(seen) == ["decoder_head_0", "decoder_head_1"]
    x_in, x_mid = seen["decoder_head_0"]
    np.testing.assert_array_equal(seen["decoder_head_1"][0], x_mid)  # the layers run in order
    for name, (x, got) in seen.items():
      for b in range(B):
        for k in range(K):
          cols = slice(k * C, (k + 1) * C)
          seg = np.asarray(can["segment_ids"][b, cols])
          allowed = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0)  # same document, not padding
          want = _layer_alone(params[name], x[b, cols], jnp.asarray(can["positions"][b, cols]), jnp.asarray(allowed))
          valid = seg != 0  # padding rows' outputs are not read
          np.testing.assert_allclose(np.asarray(got[b, cols])[valid], np.asarray(want)[valid], atol=1e-9, rtol=0,
                                     err_msg=f"{name} row {b} canvas {k}")
    # the vocabulary readout is of the last head layer's output
    readout = Transformer(HEAD).apply({"params": params}, seen["decoder_head_1"][1], method=Transformer._logits)
    np.testing.assert_allclose(logits, readout, atol=1e-12, rtol=0)
  # the head changes the logits (it is not skipped): the plain model's are O(1) away
  with float64():
    plain_cfg = dataclasses.replace(HEAD, decoder_head_layers=0)
    plain_params = {k: v for k, v in params.items() if not k.startswith("decoder_head_")}
    batch = _batch()
    apply, cache, can = encoded_rows(plain_cfg, plain_params, batch)
    plain = apply(noisy, can["positions"], can["segment_ids"], cache, num_canvases=K, method=Transformer.decode)
    assert float(np.max(np.abs(np.asarray(plain) - np.asarray(logits)))) > 1e-2


def test_head_count_is_checked():
  with pytest.raises(ConfigError, match="model.decoder_head_layers: must be >= 0"):
    dataclasses.replace(CFG, decoder_head_layers=-1)


@pytest.mark.slow  # 7 s on 2 cores (it initialises and traces two models): over the fast tier's budget
def test_head_is_counted_as_its_own_component_and_only_in_the_decoder():
  cfg = dataclasses.replace(CFG, decoder_head_layers=1)
  comps = model_size.components(cfg)
  head = jax.tree_util.tree_leaves_with_path(random_params(cfg)["decoder_head_0"])
  layer_params = sum(x.size for _, x in head)
  assert comps["decoder_head"] == (layer_params, layer_params)  # CFG has no experts: every weight is active
  # the plain model's components are unchanged by the head
  plain = model_size.components(CFG)
  assert {c: v for c, v in comps.items() if c != "decoder_head"} == {c: v for c, v in plain.items()
                                                                   if c != "decoder_head"}
  # a training step pays the head's 6 FLOPs per weight on the canvas tokens, never on the encoder's
  loss_cfg = DiffusionSettings(canvas_len=C, canvases_per_row=K, objective="loo_ce", self_cond_prob=0.0)
  rows, seq = 4, P + K * C
  extra = model_size.train_step_flops(cfg, loss_cfg, rows, seq) - model_size.train_step_flops(CFG, loss_cfg, rows,
                                                                                                   seq)
  assert extra == rows * 6 * layer_params * K * C
  # one decoder pass over T canvas tokens: 2 FLOPs per matmul weight (norm scales aside) and attention over the T
  matmul = sum(x.size for path, x in head if not any(w in jax.tree_util.keystr(path) for w in ("norm", "scalar")))
  assert model_size.decoder_head_matmul_params(cfg) == matmul
  T = 16
  _, H = layers.attn_dims(cfg, SLIDING)
  assert (model_size.forward_flops(cfg, T, 40, True, False) - model_size.forward_flops(CFG, T, 40, True, False)
          == T * (2 * matmul + 4 * cfg.num_heads * H * T))
  assert model_size.forward_flops(cfg, T, 40, False, False) == model_size.forward_flops(CFG, T, 40, False, False)


def test_hf_export_refuses_the_head(tmp_path):
  cfg = dataclasses.replace(CFG, decoder_head_layers=1)
  with pytest.raises(hf.HFCheckpointError, match="model.decoder_head_layers is a dgemma research option"):
    hf.export_hf_checkpoint(cfg, random_params(cfg), tmp_path / "out")
