"""LoRA / head-only fine-tuning: adapter params, exact start, merge, decoder-only adapters, both MoE paths.

Model-level facts share two compiled programs (encode, decode) per model config (base, lora, head_only)
on the tiny preset with random weights and random non-zero adapters (B != 0, so the adapters act).
"""

import dataclasses
import functools
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import base as base_config
from configs.models import tiny
from dgemma import finetune
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import params as params_ckpt
from dgemma.model import ModelConfig, Transformer, param_shapes
from dgemma.model import lora, moe
from dgemma.errors import ConfigError
from dgemma.model.transformer import init_cache
from dgemma.tools import merge_lora
from tests.model_utils import EPS32, f64_config, float64, random_params, to_f64

B, T, C = 2, 12, 8
_shapes = functools.cache(param_shapes)  # tracing the model is slow on 2 cores; shapes are reused


def _finetune(mode, **kw) -> ml_collections.ConfigDict:
  group = base_config.get_config().finetune
  group.mode = mode
  group.update(kw)
  return group


def _cfg(mode="full", moe_impl="ragged", **kw) -> ModelConfig:
  cfg = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), moe_impl=moe_impl)
  return dataclasses.replace(cfg, lora=finetune.lora_config(_finetune(mode, **kw)))


def _with_adapters(cfg: ModelConfig, seed=1, zero_b=False):
  """Base random params (same for every cfg) plus random adapter factors for cfg's layout."""
  base = random_params(dataclasses.replace(cfg, lora=None, moe_impl="ragged"))
  g = np.random.default_rng(seed)
  flat = flax.traverse_util.flatten_dict(_shapes(cfg))
  flat_base = flax.traverse_util.flatten_dict(base)
  out = {}
  for k, s in flat.items():
    if k in flat_base:
      out[k] = flat_base[k]
    elif zero_b and k[-1].endswith(lora.LORA_B):
      out[k] = jnp.zeros(s.shape, s.dtype)
    else:
      out[k] = jnp.asarray(g.normal(0.0, 0.1, s.shape), s.dtype)  # scale 2: A B ~ 0.06, weights ~ 0.15
  return flax.traverse_util.unflatten_dict(out)


def _inputs():
  g = np.random.default_rng(0)
  tokens = jnp.asarray(g.integers(0, 512, (B, T)), jnp.int32)
  canvas = jnp.asarray(g.integers(0, 512, (B, C)), jnp.int32)
  pos = jnp.tile(jnp.arange(T, dtype=jnp.int32)[None], (B, 1))
  cpos = jnp.tile(jnp.arange(T, T + C, dtype=jnp.int32)[None], (B, 1))
  sc = jnp.asarray(g.normal(0.0, 3.0, (B, C, 512)), jnp.float32)
  return tokens, pos, canvas, cpos, sc


_RUNS = {}


def _run(cfg: ModelConfig, params):
  """(encoder logits, KV cache, decoder logits with self-conditioning) from separately jitted
  encode / decode programs (one pair per cfg, reused)."""
  if cfg not in _RUNS:
    model = Transformer(cfg)

    def enc(p, tokens, pos):
      cache = init_cache(cfg, B, T)
      return model.apply({"params": p}, tokens, pos, jnp.ones_like(tokens), cache, method=Transformer.encode)

    def dec(p, canvas, cpos, cache, sc):
      return model.apply({"params": p}, canvas, cpos, jnp.ones_like(canvas), cache, sc_logits_BCV=sc,
                         method=Transformer.decode)
    _RUNS[cfg] = (jax.jit(enc), jax.jit(dec))
  enc, dec = _RUNS[cfg]
  tokens, pos, canvas, cpos, sc = _inputs()
  enc_logits, cache = enc(params, tokens, pos)
  return jax.device_get((enc_logits, cache, dec(params, canvas, cpos, cache, sc)))


def test_adapter_tree_axes_and_config_errors():
  cfg = _cfg("lora")
  base_flat = flax.traverse_util.flatten_dict(_shapes(_cfg()))
  flat = flax.traverse_util.flatten_dict(_shapes(cfg))
  extra = {k: v for k, v in flat.items() if k not in base_flat}
  assert set(base_flat) < set(flat) and all(lora.is_adapter(k[-1]) for k in extra)
  # one (A, B) pair per kernel of every target kind over the 2 layers of the period: q/k/o (+ v on the
  # sliding layer), 3 dense MLP,
  # 3 expert weights, router proj, per layer of the period (2), plus 3 self-conditioning projections
  per_period = (4 + 3) + 2 * 3 + 2 * 3 + 2 * 1
  assert len(extra) == 2 * (per_period + 3)
  a, b = flat[("blocks", "layer_0", "attn", "o_proj", "lora_a")], flat[("blocks", "layer_0", "attn", "o_proj", "lora_b")]
  assert a.shape == (2, 4, 16, 8) and b.shape == (2, 8, 64)  # [layers, N, H, r], [layers, r, D]
  assert flat[("blocks", "layer_0", "moe", "experts", "down_proj_lora_b")].shape == (2, 4, 8, 64)  # per expert
  tok = jnp.zeros((1, 1), jnp.int32)
  boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tok, tok, tok, tok, tok, tok))
  specs = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed)["params"])
  assert tuple(specs[("blocks", "layer_0", "moe", "experts", "gate_proj_lora_a")]) == (
      "layers", "expert", "embed", lora.RANK_AXIS)
  assert tuple(specs[("self_conditioning", "down_proj", "lora_b")]) == (lora.RANK_AXIS, "embed")
  # full mode creates no adapters; head_only trains self-conditioning in full (no adapters there);
  # freeze_router drops router adapters; targets select module kinds
  assert _cfg().lora is None
  head = _cfg("head_only", freeze_router=True)
  assert head.lora.decoder_only and set(head.lora.targets) == {"attn", "mlp", "experts"}
  assert _cfg("lora", lora_targets=("attn", "router")).lora.targets == ("attn", "router")
  for kw, field in [(dict(mode="qlora"), "finetune.mode"), (dict(lora_rank=0), "finetune.lora_rank"),
                    (dict(lora_targets=("attn", "embedding")), "finetune.lora_targets"),
                    (dict(lora_alpha=-1.0), "finetune.lora_alpha"),
                    (dict(lora_targets=("router",), freeze_router=True), "finetune.lora_targets")]:
    group = _finetune("lora")
    group.update(kw)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      finetune.lora_config(group)


@pytest.mark.slow  # the fast tier's budget (~5 s)
def test_lora_starts_at_base_and_merged_weights_give_same_logits():
  # In float64 (tests/model_utils.py): each comparison is between different programs (B = 0 adapters
  # vs none; (x A) B vs x (A B)), whose fp32 round-off the random trunk amplifies to ~1e-4..1e-3,
  # CPU-dependent. In float64 it is ~1e-13, so atol 1e-9 holds anywhere; the adapters move the logits by > 0.1.
  base_cfg, cfg = f64_config(_cfg()), f64_config(_cfg("lora"))
  with float64():
    base = to_f64(random_params(_cfg()))
    enc0, cache0, dec0 = _run(base_cfg, base)
    # B = 0 at the start: the base model
    start = _run(cfg, to_f64(_with_adapters(_cfg("lora"), zero_b=True)))
    np.testing.assert_allclose(start[0], enc0, atol=1e-9, rtol=0)
    np.testing.assert_allclose(start[2], dec0, atol=1e-9, rtol=0)
    # random adapters: they change both modes; the merged weights give the same logits
    params = to_f64(_with_adapters(_cfg("lora")))
    enc1, _, dec1 = _run(cfg, params)
    assert enc1.dtype == np.float64
    assert np.abs(enc1 - enc0).max() > 0.1 and np.abs(dec1 - dec0).max() > 0.1
    adapters = finetune.trained_leaves(params, _finetune("lora"))
    assert all(lora.is_adapter(k[-1]) for k in flax.traverse_util.flatten_dict(adapters))
    merged = lora.merge(base, adapters, cfg.lora.scale)
    enc_m, _, dec_m = _run(base_cfg, merged)
  np.testing.assert_allclose(enc_m, enc1, atol=1e-9, rtol=0)
  np.testing.assert_allclose(dec_m, dec1, atol=1e-9, rtol=0)


def test_expert_adapters_dense_ragged_and_merged_agree():
  """Per-expert low-rank pairs: the ragged_dot path (ragged_dot of the factors) equals the dense
  reference, and both equal the experts with the adapters folded into their weights."""
  g = np.random.default_rng(3)
  T, D, F, E, k, r = 10, 16, 8, 4, 2, 3
  arr = lambda *shape: jnp.asarray(g.normal(0.0, 0.5, shape), jnp.float32)
  x, w = arr(T, D), {"gate_proj": arr(E, D, F), "up_proj": arr(E, D, F), "down_proj": arr(E, F, D)}
  adapters = {n: lora.LowRank(arr(*v.shape[:2], r), arr(E, r, v.shape[2]), 0.7) for n, v in w.items()}
  index = jnp.asarray(np.stack([g.permutation(E)[:k] for _ in range(T)]), jnp.int32)
  weights = jnp.asarray(g.uniform(0.1, 1.0, (T, k)), jnp.float32)
  args = lambda ws: (x, ws["gate_proj"], ws["up_proj"], ws["down_proj"], weights, index, jnp.float32)
  dense = moe.experts_dense(*args(w), adapters=adapters)
  ragged = moe.experts_ragged(*args(w), adapters=adapters)
  folded = {n: v + lora.delta_weight(adapters[n].a, adapters[n].b, v.shape, 0.7) for n, v in w.items()}
  merged = moe.experts_dense(*args(folded))
  # fp32 round-off of one expert layer (dots of D = 16, F = 8, r = 3, k = 2 terms; folding rounds each
  # weight once): measured ~1 eps * max|dense|; 50 eps * max|dense| is far below the adapters' effect (> 0.1).
  tol = 50 * EPS32 * float(np.abs(dense).max())
  np.testing.assert_allclose(ragged, dense, atol=tol, rtol=0)
  np.testing.assert_allclose(merged, dense, atol=tol, rtol=0)
  assert np.abs(dense - moe.experts_dense(*args(w))).max() > 0.1


def test_head_only_adapters_act_only_in_decoder():
  base_cfg, cfg = _cfg(), _cfg("head_only")
  enc0, cache0, dec0 = _run(base_cfg, random_params(base_cfg))
  enc1, cache1, dec1 = _run(cfg, _with_adapters(cfg))
  np.testing.assert_array_equal(enc1, enc0)  # encoder logits: bit-identical
  for x, y in zip(jax.tree.leaves(cache1), jax.tree.leaves(cache0)):
    np.testing.assert_array_equal(x, y)       # KV cache: bit-identical
  assert np.abs(dec1 - dec0).max() > 0.1      # the decoder is adapted


def test_merge_cli_writes_merged_checkpoint_and_refuses_head_only(tmp_path):
  base_cfg, cfg = _cfg(), _cfg("lora")
  base = jax.device_get(random_params(base_cfg))
  params_ckpt.save_params(tmp_path / "base", base, base_cfg.to_dict(), extra_json={"hf_config.json": {"x": 1}})
  params = jax.device_get(_with_adapters(cfg))
  group = _finetune("lora")
  adapter_ckpt.save_adapter(tmp_path / "adapter", params, cfg, group, base=str(tmp_path / "base"), step=3)
  merge_lora.FLAGS([sys.argv[0], f"--adapter={tmp_path / 'adapter'}", f"--out={tmp_path / 'merged'}"])
  try:
    merge_lora.main(["merge_lora"])  # the CLI, in-process (base from the adapter's record)
  finally:
    merge_lora.FLAGS.unparse_flags()
  merged, merged_cfg = params_ckpt.load_params(tmp_path / "merged")
  assert merged_cfg == base_cfg.to_dict()
  assert params_ckpt.read_extra_json(tmp_path / "merged", "hf_config.json") == {"x": 1}
  expected = lora.merge(base, finetune.trained_leaves(params, group), cfg.lora.scale)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
  w = ("blocks", "layer_1", "moe", "experts", "down_proj")
  fb, fm = flax.traverse_util.flatten_dict(base), flax.traverse_util.flatten_dict(merged)
  assert np.abs(fm[w] - fb[w]).max() > 1e-3  # expert weights did change
  with pytest.raises(FileExistsError, match="--out"):
    merge_lora.merge_checkpoints(str(tmp_path / "adapter"), str(tmp_path / "merged"))

  head_cfg, head = _cfg("head_only"), _finetune("head_only")
  head_params = jax.device_get(_with_adapters(head_cfg))
  adapter_ckpt.save_adapter(tmp_path / "head", head_params, head_cfg, head, base=str(tmp_path / "base"), step=3)
  saved, _, meta = adapter_ckpt.load_adapter(tmp_path / "head")
  assert meta["mode"] == "head_only" and "self_conditioning" in saved and "embedder" not in saved
  with pytest.raises(ValueError, match="only 'lora' adapters can be merged"):
    merge_lora.merge_checkpoints(str(tmp_path / "head"), str(tmp_path / "merged2"))
  with pytest.raises(FileNotFoundError, match="--adapter"):
    merge_lora.merge_checkpoints(str(tmp_path / "base"), str(tmp_path / "merged3"))


def test_merge_into_a_hugging_face_base(tmp_path):
  """merge_lora with an HF directory as the base (read by the cross-kind reader, as train.init_from reads it): the
  merged weights are the direct fold of the HF weights as dgemma reads them, bit for bit; the HF config is kept."""
  from dgemma import checkpoints
  from tests.model_utils import save_random_hf
  base_cfg, cfg = _cfg(), _cfg("lora")
  save_random_hf(base_cfg, tmp_path / "hf")
  base = {k: np.asarray(v) for k, v in
          flax.traverse_util.flatten_dict(checkpoints.load(str(tmp_path / "hf"), dtype="float32").params).items()}
  adapters = {k: v for k, v in flax.traverse_util.flatten_dict(jax.device_get(_with_adapters(cfg))).items()
              if lora.is_adapter(k[-1])}
  full = flax.traverse_util.unflatten_dict({**base, **adapters})
  adapter_ckpt.save_adapter(tmp_path / "adapter", full, cfg, _finetune("lora"), base=str(tmp_path / "hf"), step=1,
                            base_identity=checkpoints.identity(str(tmp_path / "hf")))
  merge_lora.merge_checkpoints(str(tmp_path / "adapter"), str(tmp_path / "merged"))
  merged, _ = params_ckpt.load_params(tmp_path / "merged")
  expected = flax.traverse_util.flatten_dict(lora.merge(flax.traverse_util.unflatten_dict(base),
                                                        flax.traverse_util.unflatten_dict(adapters), cfg.lora.scale))
  got = flax.traverse_util.flatten_dict(merged)
  assert set(got) == set(expected)
  for k, want in expected.items():
    np.testing.assert_array_equal(got[k], want, err_msg="/".join(k))
  assert params_ckpt.read_extra_json(tmp_path / "merged", params_ckpt.HF_CONFIG) == \
      checkpoints.header(str(tmp_path / "hf")).hf_config
