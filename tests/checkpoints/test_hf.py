"""HF <-> dgemma checkpoint conversion: config mapping, exact round trips, errors, CLI."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from tests import hf_utils
from dgemma.checkpoints import hf
from dgemma.checkpoints import params as params_ckpt
from dgemma.tools import convert

REPO = Path(__file__).resolve().parents[2]


def _tensors(d) -> dict[str, np.ndarray]:
  """Every tensor of an HF checkpoint dir (single file or sharded)."""
  d = Path(d)
  files = sorted(p for p in d.iterdir() if p.name.endswith(".safetensors"))
  out = {}
  for p in files:
    with safe_open(str(p), framework="np") as f:
      for k in f.keys():
        out[k] = f.get_tensor(k)
  return out


def _write(d, tensors, config):
  d = Path(d)
  d.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  (d / "config.json").write_text(json.dumps(config))
  return d


@pytest.fixture(scope="module")
def dg_dirs(tmp_path_factory):
  """{pattern: (model, saved dir)} for the tiny DiffusionGemma models."""
  out = {}
  for i, pattern in enumerate(hf_utils.PATTERNS):
    model = hf_utils.diffusion_gemma(pattern, seed=i)
    out[pattern] = (model, hf_utils.save(model, tmp_path_factory.mktemp(f"dg_{pattern}")))
  return out


# ---- config mapping -------------------------------------------------------------------------

@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_config_mapping_diffusion_gemma():
  from transformers import DiffusionGemmaConfig
  hf_cfg = DiffusionGemmaConfig(text_config=hf_utils.text_config("ssgssg"),
                                vision_config=hf_utils.vision_config())
  cfg = hf.model_config_from_hf(hf_cfg.to_dict())
  assert cfg.layer_types == ("sliding", "sliding", "global") * 2
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads) == (256, 64, 6, 4)
  assert (cfg.num_kv_heads, cfg.head_dim, cfg.global_num_kv_heads, cfg.global_head_dim) == (2, 16, 1, 32)
  assert (cfg.sliding_window, cfg.rope_base, cfg.global_rope_base) == (8, 10_000.0, 1_000_000.0)
  assert cfg.global_rope_fraction == 0.25 and cfg.global_k_eq_v
  assert (cfg.mlp_hidden, cfg.num_experts, cfg.experts_per_token, cfg.expert_hidden) == (96, 4, 2, 32)
  assert cfg.final_logit_softcap == 30.0 and cfg.rms_eps == 1e-6 and cfg.self_conditioning
  assert cfg.block_period == 3 and cfg.num_blocks == 2
  # Legacy config.json form (global_* keys instead of per_layer_config) maps the same.
  legacy = hf_cfg.to_dict()
  legacy["text_config"].pop("per_layer_config")
  legacy["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
  assert hf.model_config_from_hf(legacy) == cfg
  # And the export writes a config HF parses back to the same thing.
  back = DiffusionGemmaConfig(**hf.model_config_to_hf(cfg))
  assert hf.model_config_from_hf(back.to_dict()) == cfg
  assert back.text_config.per_layer_config[2].head_dim == 32


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_config_mapping_gemma4():
  from transformers import Gemma4Config, Gemma4TextConfig
  kw = hf_utils.text_config("sgsg", final_logit_softcapping=30.0)
  text = Gemma4TextConfig(**kw, enable_moe_block=True, attention_k_eq_v=True,
                          hidden_size_per_layer_input=0)
  cfg = hf.model_config_from_hf(text.to_dict())
  assert cfg.layer_types == ("sliding", "global") * 2 and cfg.global_k_eq_v
  assert (cfg.global_num_kv_heads, cfg.global_head_dim, cfg.num_experts) == (1, 32, 4)
  assert cfg.final_logit_softcap == 30.0
  nested = Gemma4Config(text_config=text.to_dict(), vision_config=hf_utils.vision_config())
  assert hf.model_config_from_hf(nested.to_dict()) == cfg
  # Dense, K != V: global layers keep v_proj and use num_key_value_heads (HF gates the override).
  kw.pop("num_global_key_value_heads")
  kw.update(final_logit_softcapping=None)
  dense = Gemma4TextConfig(**{k: v for k, v in kw.items() if "expert" not in k},
                           enable_moe_block=False, attention_k_eq_v=False,
                           hidden_size_per_layer_input=0)
  cfg = hf.model_config_from_hf(dense.to_dict())
  assert cfg.num_experts == 0 and not cfg.global_k_eq_v and cfg.final_logit_softcap == 0.0
  assert (cfg.global_num_kv_heads, cfg.global_head_dim) == (2, 32)


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_config_sliding_window_bidirectional_all():
  from transformers import DiffusionGemmaTextConfig
  text = DiffusionGemmaTextConfig(**hf_utils.text_config("sg", sliding_window=1024),
                                  use_bidirectional_attention="all")
  assert text.sliding_window == 513  # HF halves it in __post_init__ ...
  d = text.to_dict()
  assert d["sliding_window"] == 1024  # ... and to_dict undoes it; config.json holds 1024.
  with pytest.raises(hf.HFCheckpointError, match="use_bidirectional_attention"):
    hf.model_config_from_hf({"model_type": "diffusion_gemma", "text_config": d})
  d["use_bidirectional_attention"] = "vision"  # vision-token bidirectionality: text stays causal
  assert hf.model_config_from_hf({"model_type": "diffusion_gemma",
                                  "text_config": d}).sliding_window == 1024


@pytest.mark.parametrize("change, field", [
    (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
    (dict(hidden_size_per_layer_input=None), None),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters.sliding_attention"),
    (dict(per_layer_config={"1": {"head_dim": 32, "intermediate_size": 7}}), "per_layer_config"),
])
def test_config_rejects_unsupported(change, field):
  base = dict(hf_utils.text_config("sg"), model_type="gemma4_text", enable_moe_block=True,
              hidden_size_per_layer_input=0, architectures=["Gemma4ForCausalLM"])
  base.update(change)
  if field is None:  # hidden_size_per_layer_input=None means no PLE: accepted
    assert hf.model_config_from_hf(base).num_experts == 4
    return
  with pytest.raises(hf.HFCheckpointError, match=field.replace(".", r"\.")) as e:
    hf.model_config_from_hf(base)
  assert "config.json" in str(e.value)


def test_config_missing_ple_key_means_ple():
  """Gemma4TextConfig defaults hidden_size_per_layer_input to 256: absent means PLE is on."""
  base = dict(hf_utils.text_config("sg"), model_type="gemma4_text")
  with pytest.raises(hf.HFCheckpointError, match="hidden_size_per_layer_input"):
    hf.model_config_from_hf(base)


def test_config_unknown_architecture(tmp_path):
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json.*'llama'"):
    hf.model_config_from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json.*'Gemma4ForSequenceClassification'"):
    hf.model_config_from_hf(dict(hf_utils.text_config("sg"), model_type="gemma4_text",
                                 hidden_size_per_layer_input=0,
                                 architectures=["Gemma4ForSequenceClassification"]))
  _write(tmp_path, {"x": np.zeros(1, np.float32)},
         {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: model_type 'llama'"):
    hf.load_hf_checkpoint(tmp_path)


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
@pytest.mark.parametrize("pattern", hf_utils.PATTERNS)
def test_round_trip_exact(dg_dirs, pattern, tmp_path):
  from transformers import DiffusionGemmaForBlockDiffusion
  model, src = dg_dirs[pattern]
  cfg, params = hf.load_hf_checkpoint(src)
  assert cfg.layer_types == tuple("sliding" if c == "s" else "global" for c in pattern)
  out = tmp_path / "out"
  hf.export_hf_checkpoint(cfg, params, out, base_config=hf.read_config(src), multimodal_from=src)
  a, b = _tensors(src), _tensors(out)
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert np.array_equal(a[k], b[k]), k
  assert json.loads((out / "config.json").read_text())["text_config"]["sliding_window"] == 8
  reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(out, attn_implementation="eager")
  sd0, sd1 = model.state_dict(), reloaded.state_dict()
  assert sorted(sd0) == sorted(sd1)
  for k in sd0:
    assert torch.equal(sd0[k], sd1[k]), k


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_export_without_base_loads_in_hf(dg_dirs, tmp_path):
  """No base config / vision source: HF still loads it; the text weights are exact."""
  from transformers import DiffusionGemmaForBlockDiffusion
  model, src = dg_dirs["sg"]
  cfg, params = hf.load_hf_checkpoint(src)
  hf.export_hf_checkpoint(cfg, params, tmp_path / "out")
  with pytest.raises(hf.HFCheckpointError, match="not empty.*use --overwrite"):  # the flag's name
    hf.export_hf_checkpoint(cfg, params, tmp_path / "out")
  reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "out")
  sd0, sd1 = model.state_dict(), reloaded.state_dict()
  text = [k for k in sd0 if not hf._is_multimodal(k)]
  assert text and all(torch.equal(sd0[k], sd1[k]) for k in text)


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_sharded_checkpoints(dg_dirs, tmp_path):
  from transformers import DiffusionGemmaForBlockDiffusion
  model, src = dg_dirs["ssgssg"]
  sharded = hf_utils.save(model, tmp_path / "sharded", max_shard_size="100KB")
  assert (Path(sharded) / hf.INDEX_FILE).exists()
  cfg0, p0 = hf.load_hf_checkpoint(src)
  cfg1, p1 = hf.load_hf_checkpoint(sharded)
  assert cfg0 == cfg1
  f0, f1 = hf._flatten(p0), hf._flatten(p1)
  assert sorted(f0) == sorted(f1) and all(np.array_equal(f0[k], f1[k]) for k in f0)
  # Our sharded export (from jax arrays): several files + index; HF loads it; bit-exact.
  import jax
  out = tmp_path / "out"
  hf.export_hf_checkpoint(cfg0, jax.tree.map(jax.numpy.asarray, p0), out, max_shard_bytes=100_000,
                          base_config=hf.read_config(src), multimodal_from=src)
  index = json.loads((out / hf.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 2
  a, b = _tensors(src), _tensors(out)
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
  reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(out)
  sd0, sd1 = model.state_dict(), reloaded.state_dict()
  assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_bfloat16(dg_dirs, tmp_path):
  model, src = dg_dirs["sg"]
  _, p32 = hf.load_hf_checkpoint(src)
  cfg, p16 = hf.load_hf_checkpoint(src, dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16"
  f32, f16 = hf._flatten(p32), hf._flatten(p16)
  for k in f32:
    assert f16[k].dtype == ml_dtypes.bfloat16, k
    assert np.array_equal(f16[k], f32[k].astype(ml_dtypes.bfloat16)), k
  # A bf16 HF checkpoint: loads exactly (upcast), and exports back bit-exact in bf16.
  bf_dir = hf_utils.save(copy.deepcopy(model).to(torch.bfloat16), tmp_path / "bf16")
  cfg, p = hf.load_hf_checkpoint(bf_dir, dtype="bfloat16")
  _, p_up = hf.load_hf_checkpoint(bf_dir)
  fp, fu = hf._flatten(p), hf._flatten(p_up)
  assert all(np.array_equal(fp[k].astype(np.float32), fu[k]) for k in fp)
  hf.export_hf_checkpoint(cfg, p, tmp_path / "out", multimodal_from=bf_dir,
                          base_config=hf.read_config(bf_dir))
  a, b = _tensors(bf_dir), _tensors(tmp_path / "out")
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype == ml_dtypes.bfloat16, k
    assert np.array_equal(a[k].view(np.uint16), b[k].view(np.uint16)), k
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_vision_tensors_skipped_with_one_notice(dg_dirs, caplog):
  _, src = dg_dirs["sg"]
  n_vision = sum(hf._is_multimodal(k) for k in _tensors(src))
  assert n_vision > 0
  with caplog.at_level(logging.INFO, logger="dgemma.checkpoints.hf"):
    hf.load_hf_checkpoint(src)
  notes = [r.getMessage() for r in caplog.records if r.name == "dgemma.checkpoints.hf"]
  assert len(notes) == 1 and f"skipped {n_vision} vision" in notes[0]


# ---- bad input --------------------------------------------------------------------------------

@pytest.fixture()
def dg_tensors(dg_dirs):
  _, src = dg_dirs["sg"]
  return _tensors(src), hf.read_config(src)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_missing_tensor(dg_tensors, tmp_path):
  tensors, config = dg_tensors
  name = "model.decoder.layers.1.self_attn.q_proj.weight"
  tensors.pop(name)
  _write(tmp_path, tensors, config)
  with pytest.raises(hf.HFCheckpointError, match=rf"missing tensor '{name}' \(expected shape \[128, 64\]\)"):
    hf.load_hf_checkpoint(tmp_path)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_tied_copy_alone_suffices(dg_tensors, tmp_path):
  """Decoder weights absent but encoder copies present (an untied-save layout): loads the same."""
  tensors, config = dg_tensors
  moved = {}
  for k, v in tensors.items():
    if k.startswith("model.decoder.layers.") and not k.endswith("layer_scalar"):
      moved[k.replace("model.decoder.", "model.encoder.language_model.")] = v
    else:
      moved[k] = v
  moved["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"]
  _write(tmp_path / "a", tensors, config)
  _write(tmp_path / "b", moved, config)
  fa = hf._flatten(hf.load_hf_checkpoint(tmp_path / "a")[1])
  fb = hf._flatten(hf.load_hf_checkpoint(tmp_path / "b")[1])
  assert all(np.array_equal(fa[k], fb[k]) for k in fa)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_wrong_shape(dg_tensors, tmp_path):
  tensors, config = dg_tensors
  name = "model.decoder.layers.0.experts.gate_up_proj"
  tensors[name] = np.zeros((4, 60, 64), np.float32)
  _write(tmp_path, tensors, config)
  with pytest.raises(hf.HFCheckpointError,
                     match=rf"'{name}' has shape \[4, 60, 64\], expected \[4, 64, 64\]"):
    hf.load_hf_checkpoint(tmp_path)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_unexpected_tensor(dg_tensors, tmp_path):
  tensors, config = dg_tensors
  tensors["model.decoder.layers.0.self_attn.v_norm.weight"] = np.ones(16, np.float32)
  _write(tmp_path, tensors, config)
  with pytest.raises(hf.HFCheckpointError, match=r"unexpected tensor\(s\).*v_norm"):
    hf.load_hf_checkpoint(tmp_path)


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_tied_copies_must_agree(dg_tensors, tmp_path):
  tensors, config = dg_tensors
  name = "model.encoder.language_model.layers.1.layer_scalar"
  tensors[name] = tensors[name] + 1.0
  _write(tmp_path / "a", tensors, config)
  with pytest.raises(hf.HFCheckpointError, match=r"layer_scalar buffers .*layers\.1\.layer_scalar.* differ"):
    hf.load_hf_checkpoint(tmp_path / "a")
  tensors, config = dict(dg_tensors[0]), dg_tensors[1]
  tensors["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"] * 2
  _write(tmp_path / "b", tensors, config)
  with pytest.raises(hf.HFCheckpointError, match="lm_head.weight' differ"):
    hf.load_hf_checkpoint(tmp_path / "b")


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
def test_truncated_safetensors_names_the_file(dg_dirs, tmp_path):
  import shutil
  _, src = dg_dirs["sg"]
  broken = Path(shutil.copytree(src, tmp_path / "broken"))
  weights = broken / hf.SINGLE_FILE
  weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
  with pytest.raises(hf.HFCheckpointError, match=rf"{weights}: .*truncated or damaged"):
    hf.load_hf_checkpoint(broken)


def test_missing_files(tmp_path):
  with pytest.raises(hf.HFCheckpointError, match="config.json: not found"):
    hf.load_hf_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(hf.model_config_to_hf(
      hf.model_config_from_hf({"model_type": "diffusion_gemma",
                               "text_config": hf_utils.text_config("sg")}))))
  with pytest.raises(hf.HFCheckpointError, match="model.safetensors"):
    hf.load_hf_checkpoint(tmp_path)


# ---- Gemma 4 autoregressive checkpoints ------------------------------------------------------

@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_gemma4_causal_load(tmp_path, caplog):
  model = hf_utils.gemma4_causal("sgsg", seed=3)
  src = hf_utils.save(model, tmp_path / "g4")
  with caplog.at_level(logging.INFO, logger="dgemma.checkpoints.hf"):
    cfg, params = hf.load_hf_checkpoint(src)
  assert any("self-conditioning" in r.getMessage() for r in caplog.records)
  assert cfg.num_experts == 4 and cfg.global_k_eq_v and cfg.self_conditioning
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  f = hf._flatten(params)
  np.testing.assert_array_equal(f["embedder/embedding"], sd["model.embed_tokens.weight"])
  # Layer 3 = block 1, slot 1 (global): q_proj [N*H, D] -> [D, N, H].
  q = sd["model.layers.3.self_attn.q_proj.weight"]
  np.testing.assert_array_equal(f["blocks/layer_1/attn/q_proj/kernel"][1], q.T.reshape(64, 4, 32))
  gu = sd["model.layers.2.experts.gate_up_proj"]
  np.testing.assert_array_equal(f["blocks/layer_0/moe/experts/up_proj"][1],
                                np.swapaxes(gu[:, 32:], 1, 2))
  assert "blocks/layer_1/attn/v_proj/kernel" not in f and "blocks/layer_0/attn/v_proj/kernel" in f
  sc = f["self_conditioning/gate_proj/kernel"]
  assert sc.shape == (64, 96) and 0.015 < sc.std() < 0.025
  np.testing.assert_array_equal(f["self_conditioning/pre_norm/scale"], np.ones(64, np.float32))
  _, again = hf.load_hf_checkpoint(src)  # deterministic init
  np.testing.assert_array_equal(hf._flatten(again)["self_conditioning/gate_proj/kernel"], sc)
  # The exported DiffusionGemma checkpoint keeps the trunk weights.
  from transformers import DiffusionGemmaForBlockDiffusion
  hf.export_hf_checkpoint(cfg, params, tmp_path / "dg", base_config=hf.read_config(src))
  dg = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "dg").state_dict()
  assert torch.equal(dg["model.decoder.layers.3.experts.down_proj"],
                     model.state_dict()["model.layers.3.experts.down_proj"])


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_gemma4_conditional_and_dense(tmp_path, caplog):
  from dgemma.model import param_shapes
  import flax
  cond = hf_utils.gemma4_conditional("sg", seed=4)
  src = hf_utils.save(cond, tmp_path / "cond")
  with caplog.at_level(logging.INFO, logger="dgemma.checkpoints.hf"):
    cfg, params = hf.load_hf_checkpoint(src)
  assert any("skipped" in r.getMessage() and "vision" in r.getMessage() for r in caplog.records)
  np.testing.assert_array_equal(
      hf._flatten(params)["final_norm/scale"],
      cond.state_dict()["model.language_model.norm.weight"].numpy())
  dense = hf_utils.gemma4_causal("sgsg", seed=5, moe=False, k_eq_v=False)
  cfg, params = hf.load_hf_checkpoint(hf_utils.save(dense, tmp_path / "dense"))
  f = hf._flatten(params)
  assert cfg.num_experts == 0 and not cfg.global_k_eq_v
  assert "blocks/layer_1/attn/v_proj/kernel" in f
  np.testing.assert_array_equal(f["blocks/layer_0/mlp_post_norm/scale"], np.ones((2, 64)))
  want = {"/".join(k): v.shape
          for k, v in flax.traverse_util.flatten_dict(param_shapes(cfg)).items()}
  assert want == {k: v.shape for k, v in f.items()}
  with pytest.raises(hf.HFCheckpointError, match="num_experts"):
    hf.export_hf_checkpoint(cfg, params, tmp_path / "x")


@pytest.mark.slow  # builds the HF reference checkpoint with transformers (dg_dirs; tests/conftest.py, the fast tier)
@pytest.mark.parametrize("pattern", hf_utils.PATTERNS)
def test_tree_matches_model(dg_dirs, pattern):
  """The loaded tree is exactly the Flax model's parameter tree (the contract)."""
  import flax
  from dgemma.model import param_shapes
  _, src = dg_dirs[pattern]
  for overrides in ({}, {"scan_layers": False}):
    cfg, params = hf.load_hf_checkpoint(src, config_overrides=overrides)
    want = {"/".join(k): v.shape
            for k, v in flax.traverse_util.flatten_dict(param_shapes(cfg)).items()}
    assert want == {k: v.shape for k, v in hf._flatten(params).items()}


# ---- dgemma checkpoint + CLI ------------------------------------------------------------------

def test_params_checkpoint(tmp_path):
  params = {"a": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "b": np.ones((4,), ml_dtypes.bfloat16)}
  params_ckpt.save_params(tmp_path / "ck", params, {"d_model": 3}, extra_json={"x.json": [1]})
  with pytest.raises(FileExistsError, match="use --overwrite"):
    params_ckpt.save_params(tmp_path / "ck", params, {"d_model": 3})
  got, cfg = params_ckpt.load_params(tmp_path / "ck")
  assert cfg == {"d_model": 3} and params_ckpt.read_extra_json(tmp_path / "ck", "x.json") == [1]
  np.testing.assert_array_equal(got["a"]["w"], params["a"]["w"])
  assert got["b"].dtype == ml_dtypes.bfloat16
  params_ckpt.save_params(tmp_path / "ck", {"a": {"w": np.zeros(1, np.float32)}}, {},
                            overwrite=True)
  assert params_ckpt.load_params(tmp_path / "ck")[0]["a"]["w"].shape == (1,)
  assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporaries left behind


def test_parse_size():
  assert convert.parse_size("5GB") == 5 * 10**9
  assert convert.parse_size("100KiB") == 100 * 1024 and convert.parse_size("123") == 123
  with pytest.raises(ValueError):
    convert.parse_size("lots")


@pytest.mark.slow  # three subprocesses, each importing jax + orbax
def test_cli_end_to_end(dg_dirs, tmp_path):
  # the command line's two directions (the conversions themselves: tests/checkpoints/test_convert.py, in process)
  model, src = dg_dirs["sgsg"]
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")

  def run(*args):
    r = subprocess.run([sys.executable, "-m", "dgemma.tools.convert", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

  run("--from_hf", src, "--to", str(tmp_path / "ck"), "--dtype", "bfloat16")
  params, cfg_dict = params_ckpt.load_params(tmp_path / "ck")
  assert cfg_dict["param_dtype"] == "bfloat16" and cfg_dict["layer_types"][1] == "global"
  assert params["embedder"]["embedding"].dtype == ml_dtypes.bfloat16
  from dgemma.checkpoints import convert as convert_lib
  convert_lib.to_params(src, tmp_path / "ck32")
  run("--from_ckpt", str(tmp_path / "ck32"), "--to_hf", str(tmp_path / "out"),
      "--hf_base", src, "--max_shard_size", "200KB")
  assert (tmp_path / "out" / hf.INDEX_FILE).exists()
  a, b = _tensors(src), _tensors(tmp_path / "out")
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
  # Without --hf_base the kept hf_config.json still restores canvas_length and token ids; the export is text-only
  convert_lib.to_hf(tmp_path / "ck32", tmp_path / "out2")
  out_cfg = json.loads((tmp_path / "out2" / "config.json").read_text())
  assert out_cfg["canvas_length"] == 8 and hf.is_text_only(out_cfg)
  r = subprocess.run([sys.executable, "-m", "dgemma.tools.convert", "--from_hf", src], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode != 0 and "--to" in r.stderr
