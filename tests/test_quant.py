"""dgemma.quant: weight-only int8 / int4 against a slow numpy reference, the model on quantized weights,
the sampler end to end, and the bf16 checkpoint load path."""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import base, tiny_test
from configs.models import tiny
from dgemma import api, quant
from dgemma import settings as settings_lib
from dgemma.checkpoints import params as params_ckpt
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer, param_shapes, sharding
from dgemma.model.transformer import boxed_param_shapes
from dgemma.model import lora as lora_lib
from dgemma.model.lora import LoraConfig
from dgemma.sampling import SamplerConfig, generate
from tests.model_utils import random_params

TINY = ModelConfig.from_config_dict(tiny.get_config())
TINY_SHAPES = param_shapes(TINY)  # traced once for the module


def _numpy_reference(w, axes, qmax, group_size):
  """Slow obvious quantize-dequantize: loop over every output channel (and group), numpy float64."""
  w = np.asarray(w, np.float64)
  axes = sorted(a % w.ndim for a in axes)
  gax = axes[-1]
  out = np.empty_like(w)
  other = [d for d in range(w.ndim) if d not in axes]
  n = w.shape[gax] // group_size if group_size and group_size < w.shape[gax] else 1
  size = w.shape[gax] // n
  for idx in itertools.product(*(range(w.shape[d]) for d in other)):
    for g in range(n):
      sl = [slice(None)] * w.ndim
      for d, i in zip(other, idx):
        sl[d] = i
      sl[gax] = slice(g * size, (g + 1) * size)
      block = w[tuple(sl)]
      scale = np.float32(np.abs(block).max() / qmax)  # stored as float32 like the fp32 weights
      out[tuple(sl)] = np.clip(np.round(block / scale), -qmax, qmax) * scale
  return out


@pytest.mark.parametrize("shape,axes,scheme,group", [
    ((3, 8, 2, 16), (-3,), "int8", 0),         # stacked q_proj [L, D, K, H]
    ((3, 2, 16, 8), (-3, -2), "int4", 4),      # stacked o_proj [L, N, H, D], groups along H
    ((4, 32, 6), (-2,), "int4", 8),            # experts [E, D, F]
    ((10, 32), (-1,), "int4", 0),              # embedding [V, D], per row
    ((10, 32), (-1,), "int8", 16),             # int8 ignores the group size
])
def test_roundtrip_matches_numpy_reference(shape, axes, scheme, group):
  w = np.random.default_rng(0).normal(0.0, 0.3, shape).astype(np.float32)
  qa = quant.quantize_array(jnp.asarray(w), axes, scheme, group)
  qmax = {"int8": 127, "int4": 7}[scheme]
  assert qa.qvalue.dtype == {"int8": jnp.int8, "int4": jnp.int4}[scheme] and qa.qvalue.shape == shape
  assert qa.dtype == jnp.float32 and qa.shape == shape
  q = np.asarray(qa.qvalue.astype(jnp.int32))
  assert np.abs(q).max() == qmax  # the largest |w| of every group maps to qmax
  ref = _numpy_reference(w, axes, qmax, group if scheme == "int4" else 0)
  deq = np.asarray(jax.jit(quant.dequantize)(qa))
  # q * scale with an fp32 scale within an ulp of the reference's (XLA may divide by a reciprocal):
  # |error| <= |q| ulp(scale) + ulp(w) / 2 ~ 2 eps |w| (measured <= 12% of this); rtol 1e-6 = 8 eps
  np.testing.assert_allclose(deq, ref, rtol=1e-6, atol=1e-7)
  # error bound: half a quantization step of the element's own group
  step = np.asarray(jax.jit(quant.dequantize)(quant.QArray(qvalue=jnp.ones(shape, jnp.int8), scale=qa.scale)))
  assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-5))
  # rows taken from the table are the rows of the dequantized table
  if len(shape) == 2:
    rows = jax.jit(quant.take_rows)(qa, jnp.array([3, 0, 3]))
    np.testing.assert_array_equal(np.asarray(rows), deq[[3, 0, 3]])


def test_bad_settings_name_the_key():
  for key, value in (("quantize", "int3"), ("quant_group_size", -1)):
    config = base.get_config()
    config.sample[key] = value
    with pytest.raises(ConfigError, match=f"sample.{key}"):
      settings_lib.from_config(config)
  for bad in (dict(scheme="int3"), dict(scheme="int4", group_size=-1)):  # the record itself, built directly
    with pytest.raises(ValueError, match="QuantConfig"):
      quant.QuantConfig(**bad)
  # head_dim 16 is not a multiple of 12: refused before any weight is quantized
  with pytest.raises(ConfigError, match=r"sample.quant_group_size: 12 .*attn/[kqv]_proj"):
    quant.quantize_params(TINY_SHAPES, quant.QuantConfig("int4", group_size=12))
  config = base.get_config()
  config.sample.quantize, config.sample.quant_group_size = "int4", 16
  assert settings_lib.from_config(config).sample.quant == quant.QuantConfig("int4", 16, True)


def test_what_is_quantized_and_bytes():
  abstract = jax.eval_shape(lambda p: quant.quantize_params(p, quant.QuantConfig("int4", 16)), TINY_SHAPES)
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(
      abstract, is_leaf=quant.is_quantized)}
  quantized = {k for k, v in flat.items() if quant.is_quantized(v)}
  assert "['embedder']['embedding']" in quantized
  assert "['blocks']['layer_1']['moe']['experts']['down_proj']" in quantized
  assert "['self_conditioning']['gate_proj']['kernel']" in quantized
  assert "['blocks']['layer_0']['moe']['router']['proj']['kernel']" not in quantized
  assert not any("norm" in k or "scalar" in k or "scale" in k for k in quantized)
  o = flat["['blocks']['layer_0']['attn']['o_proj']['kernel']"]  # [L, N, H, D] groups of 16 along H=16
  assert o.qvalue.shape == (2, 4, 16, 64) and o.scale.shape == (2, 1, 1, 64)
  e = flat["['blocks']['layer_0']['moe']['experts']['gate_proj']"]  # [L, E, D=64, F]: 4 groups along D
  assert e.scale.shape == (2, 4, 4, 32)
  # int4 bytes: half a byte per quantized weight plus the fp32 scales, everything else unchanged
  fp32 = quant.tree_bytes(TINY_SHAPES)
  n_q = sum(int(np.prod(v.shape)) for v in flat.values() if quant.is_quantized(v))
  n_scales = sum(int(np.prod(v.scale.shape)) for v in flat.values() if quant.is_quantized(v))
  assert quant.tree_bytes(abstract) == fp32 - 4 * n_q + n_q // 2 + 4 * n_scales
  # LoRA adapters stay in full precision next to quantized kernels (the model reads them as arrays)
  lora_cfg = dataclasses.replace(TINY, lora=LoraConfig(rank=2, alpha=4.0, targets=lora_lib.TARGETS))
  q_lora = jax.eval_shape(lambda p: quant.quantize_params(p, quant.QuantConfig("int4", 16)), param_shapes(lora_cfg))
  leaves = jax.tree_util.tree_leaves_with_path(q_lora, is_leaf=quant.is_quantized)
  adapters = {jax.tree_util.keystr(p): x for p, x in leaves if lora_lib.is_adapter(str(p[-1].key))}
  assert any("experts" in k for k in adapters) and any("o_proj" in k for k in adapters)
  assert not any(quant.is_quantized(x) for x in adapters.values())
  assert {k for k, x in leaves if quant.is_quantized(x)} == {k for k, x in jax.tree_util.tree_leaves_with_path(
      abstract, is_leaf=quant.is_quantized) if quant.is_quantized(x)}


def test_chain_quantizes_each_weight_by_the_first_that_plans_it():
  """quant.chain: a QLoRA base's quantizer (here: the experts only, int4) first, then sample.quant (int8) for the
  rest; the whole-tree methods agree with the per-tensor one; None and 'none' schemes are left out."""
  experts = quant.Quantizer(quant.QuantConfig("int4", 16), only=lambda names: "experts" in names)
  int8 = quant.Quantizer(quant.QuantConfig("int8"))
  assert quant.chain(None, quant.Quantizer(quant.QuantConfig("none"))) is None
  assert quant.chain(None, int8) is int8
  both = quant.chain(experts, int8)
  assert quant.chain(both, None).parts == both.parts == (experts, int8)
  tree = jax.eval_shape(both.params, TINY_SHAPES)
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_quantized)}
  schemes = {k: jnp.dtype(x.qtype).name for k, x in flat.items() if quant.is_quantized(x)}
  assert schemes.pop("['blocks']['layer_0']['moe']['experts']['gate_proj']") == "int4"
  assert "int4" not in {v for k, v in schemes.items() if "experts" not in k} and "int8" in schemes.values()
  for path, shape in jax.tree_util.tree_leaves_with_path(TINY_SHAPES):
    names = tuple(str(k.key) for k in path)
    one = jax.eval_shape(functools.partial(both, names), shape)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), one) == jax.tree.map(
        lambda a: (a.shape, a.dtype), flat[jax.tree_util.keystr(path)]), names
    assert (both.plan(names, shape.shape) is None) == (not quant.is_quantized(one))
  # the boxed tree a reader places against (the second quantizer meets the first's boxed QArrays): unboxed, the
  # same quantized tree as the per-tensor path, and every array of a quantized weight keeps its logical axes
  boxed = both.boxed(boxed_param_shapes(TINY))
  assert jax.tree.structure(sharding.unbox(boxed)) == jax.tree.structure(tree)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(sharding.unbox(boxed))] == [
      (a.shape, a.dtype) for a in jax.tree.leaves(tree)]
  assert all(isinstance(b, nn.Partitioned) for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)))


def _smooth_params():
  """random_params with softer attention (q/k norm scales x 0.25) and router (x 0.2): the raw random
  tiny model is chaotic (a 1e-4 relative weight perturbation moves its logits by 1%), this one moves
  them by about 0.6% for 1e-3, so logit errors measure the quantization, not the chaos."""
  def soften(path, w):
    name = jax.tree_util.keystr(path)
    if "q_norm" in name or "k_norm" in name:
      return w * 0.25
    if "router" in name and "proj" in name:
      return w * 0.2
    return w
  return jax.tree_util.tree_map_with_path(soften, random_params(TINY))


def _rel_err(a, b):
  return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b ** 2)))


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_logits_on_quantized_weights():
  """Decoder logits [3, 8, V] (12 context tokens encoded, 8 canvas tokens): int8 close to fp32, int4
  (groups of 16) closer than a random perturbation of one int4 step, and the model's in-layer
  dequantization equal to dequantizing the whole tree up front."""
  model = Transformer(TINY)
  g = np.random.default_rng(1)
  tok = jnp.asarray(g.integers(0, TINY.vocab_size, (3, 12)), jnp.int32)
  can = jnp.asarray(g.integers(0, TINY.vocab_size, (3, 8)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (3, 20))
  logits_of = jax.jit(lambda p: model.apply({"params": p}, tok, pos[:, :12], jnp.ones_like(tok), can, pos[:, 12:],
                                            jnp.ones_like(can), return_enc_logits=False)[1])
  params = _smooth_params()
  ref = logits_of(params)
  deq = jax.jit(lambda qp: jax.tree.map(lambda x: quant.dequantize(x), qp, is_leaf=quant.is_quantized))
  q8 = quant.quantize_params(params, quant.QuantConfig("int8"))
  q4 = quant.quantize_params(params, quant.QuantConfig("int4", group_size=16))
  err8 = _rel_err(logits_of(deq(q8)), ref)       # fp32 tree: no extra compile
  out4 = logits_of(q4)                           # QArray leaves through the model
  # the same dequantized values in both programs, dequantized inside vs outside the scanned layer: only
  # fusion can differ (measured 0.0 here; |logits| ~ 4.6, fp32 model round-off ~1e-4 at most)
  np.testing.assert_allclose(np.asarray(out4), np.asarray(logits_of(deq(q4))), rtol=1e-4, atol=1e-4)
  err4 = _rel_err(out4, ref)
  # baseline: every quantized weight moved by uniform noise of up to one int4 step of its group
  # (rounding moves it by at most half a step)
  rng = np.random.default_rng(2)

  def perturb(w, qa, u):
    if not quant.is_quantized(qa):
      return w
    step = quant.dequantize(quant.QArray(qvalue=jnp.ones(qa.shape, jnp.int8), scale=qa.scale))
    return w + step * u

  uniform = jax.tree.map(lambda w: jnp.asarray(rng.uniform(-1.0, 1.0, w.shape), w.dtype), params)
  noisy = jax.jit(lambda p, q, u: jax.tree.map(perturb, p, q, u, is_leaf=quant.is_quantized))(params, q4, uniform)
  err_noise = _rel_err(logits_of(noisy), ref)
  print(f"relative RMS logit error: int8 {err8:.4f}, int4/16 {err4:.4f}, one-step noise {err_noise:.4f}")
  assert err8 < 0.08, err8   # measured 0.040
  assert err8 < err4 < err_noise, (err8, err4, err_noise)


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_sampler_on_int8_from_bf16_checkpoint(tmp_path):
  """bf16 params checkpoint -> dgemma.load(quantize='int8') -> generate end to end."""
  params = _smooth_params()
  bf16 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
  cfg_dict = dict(TINY.to_dict(), param_dtype="bfloat16")
  params_ckpt.save_params(tmp_path / "ckpt", bf16, cfg_dict)
  # The checkpoint's own dtypes (bf16 params, fp32 compute from its model_config.json): dgemma.load's
  # dtype= would set both. No tokenizer is stored beside the weights: tiny_test's byte tokenizer.
  loaded = api.load(str(tmp_path / "ckpt"), quantize="int8", config=tiny_test.get_config())  # = dgemma.load
  cfg, qparams = loaded.model_cfg, loaded.params
  assert cfg.param_dtype == "bfloat16" and cfg.dtype == "float32"
  emb = qparams["embedder"]["embedding"]
  assert emb.qvalue.dtype == jnp.int8 and emb.scale.dtype == jnp.bfloat16 and emb.scale.shape == (TINY.vocab_size, 1)
  np.testing.assert_allclose(np.asarray(jax.jit(quant.dequantize, static_argnums=1)(emb, jnp.float32)),
                             np.asarray(params["embedder"]["embedding"]), atol=0.01 * 0.15 * 5)
  # (quantization, not round-off: half an int8 step amax / 254 <= 0.003 for |w| <= 5 * 0.15, plus the bf16
  # rounding of the weights and of the scale, 2^-8 relative each: <= 0.0075)
  # low temperature, no early stop: the argmax canvas is the output
  scfg = SamplerConfig(canvas_len=16, max_denoising_steps=4, t_max=0.05, t_min=0.05, confidence_threshold=0.0,
                       early_exit=False, end_ids=(), max_context=64)
  prompts = np.asarray(np.random.default_rng(3).integers(2, TINY.vocab_size, (2, 6)), np.int32)
  lengths = np.array([6, 4], np.int32)
  key = jax.random.key(0)
  model = Transformer(cfg)
  out = generate(model, qparams, prompts, lengths, scfg, key, 16)
  again = generate(model, qparams, prompts, lengths, scfg, key, 16)
  np.testing.assert_array_equal(np.asarray(out.tokens_BN), np.asarray(again.tokens_BN))  # deterministic
  assert np.asarray(out.num_forwards_B).tolist() == [4, 4]
  tokens = np.asarray(out.tokens_BN)
  assert tokens.shape == (2, 16) and tokens.min() >= 0 and tokens.max() < TINY.vocab_size
  # (agreement with the bf16 model's tokens is not asserted: random tiny weights give near-flat logits,
  # RMS 1.2 over 512 tokens, so the 4% int8 logit error (test above) flips argmaxes and the re-noised
  # trajectories drift apart; measured once: 0.000 of 32 tokens, i.e. chance level)


def test_sample_config_keys_defined():
  s = base.get_config().sample
  assert (s.quantize, s.quant_group_size, s.quantize_embedding) == ("none", 64, True)
  assert isinstance(s, ml_collections.ConfigDict)


def test_scales_in_another_dtype_are_the_ones_the_values_are_rounded_against():
  """quantize_array(scale_dtype='bfloat16') of a float32 weight (int4, groups of 16): bf16 scales, and each value
  rounded against the stored (rounded) scale, so |w - q s| <= s / 2 per element (+ float32 round-off of w / s and
  q s: 2 eps |w|; the bf16 scale may be 2^-9 below amax / 7, so no value leaves [-7.5, 7.5] to be clipped)."""
  w = jnp.asarray(np.random.default_rng(7).normal(size=(64, 48)), jnp.float32)
  q = quant.quantize_array(w, (-2,), "int4", 16, "w", False, "bfloat16")
  assert q.scale.dtype == jnp.bfloat16 and q.scale.shape == (4, 48)
  scale = np.repeat(np.asarray(q.scale, np.float32), 16, axis=0)  # groups of 16 along the contracted axis
  err = np.abs(np.asarray(w) - np.asarray(q.qvalue, np.float32) * scale)
  assert np.all(err <= scale / 2 + 2 * np.finfo(np.float32).eps * np.abs(np.asarray(w))), err.max()
  assert quant.quantize_array(w, (-2,), "int4", 16).scale.dtype == jnp.float32  # default: the weight's dtype
