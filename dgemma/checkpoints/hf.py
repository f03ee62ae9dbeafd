"""Hugging Face checkpoint import/export for the dgemma parameter tree.

Reads `DiffusionGemmaForBlockDiffusion` checkpoints and Gemma 4 autoregressive text checkpoints
(`Gemma4ForCausalLM`, `Gemma4ForConditionalGeneration`; the self-conditioning module is then freshly
initialised), and writes `DiffusionGemmaForBlockDiffusion` checkpoints. Tensors are streamed one at a
time from safetensors into preallocated stacked numpy arrays, so a checkpoint is never held twice.
torch is not needed: safetensors is read with its numpy backend (bfloat16 via ml_dtypes).

dgemma tree (leading `num_blocks` axis on everything under `blocks/`; HF layer = b * period + i):
  embedder/embedding [V, D], final_norm/scale [D], self_conditioning/{pre_norm/scale, gate_proj,
  up_proj, down_proj}, blocks/layer_{i}/{pre_attn_norm, attn/{q,k,v,o}_proj, attn/{q,k}_norm,
  post_attn_norm, mlp_pre_norm, mlp/{gate,up,down}_proj, mlp_post_norm, moe_pre_norm, moe/router/...,
  moe/experts/..., moe_post_norm, ffw_post_norm, layer_scalar}. With num_experts == 0 (dense Gemma 4)
  the moe_* leaves are absent; HF dense layers have no post_feedforward_layernorm_1, so mlp_post_norm
  is set to ones (rms_norm(rms_norm(x)) equals rms_norm(x) up to the eps term, ~1e-6 relative).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dgemma import files
from dgemma.errors import CheckpointError
from dgemma.model.config import GLOBAL, SLIDING, ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

DIFFUSION = "diffusion_gemma"
GEMMA4 = "gemma4"
GEMMA4_TEXT = "gemma4_text"
ARCHITECTURES = {
    DIFFUSION: ("DiffusionGemmaForBlockDiffusion",),
    GEMMA4: ("Gemma4ForConditionalGeneration",),
    GEMMA4_TEXT: ("Gemma4ForCausalLM",),
}
_HF_LAYER_KIND = {"sliding_attention": SLIDING, "full_attention": GLOBAL}
_MULTIMODAL_PARTS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
_SC_SEED = 0

_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float16": np.dtype(np.float16)}


class HFCheckpointError(CheckpointError):
  """A Hugging Face checkpoint or config cannot be converted; the message names the culprit."""


def _np_dtype(name: str) -> np.dtype:
  if name not in _DTYPES:
    raise HFCheckpointError(f"dtype {name!r} not in {sorted(_DTYPES)}")
  return _DTYPES[name]


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------

def _detect(config_json: Mapping[str, Any], model_type: str | None) -> tuple[str, dict]:
  """Returns (model_type, text config dict); checks the architecture."""
  mt = model_type or config_json.get("model_type")
  if mt not in ARCHITECTURES:
    raise HFCheckpointError(
        f"{CONFIG_FILE}: model_type {mt!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
  archs = config_json.get("architectures") or [ARCHITECTURES[mt][0]]
  for arch in archs:
    if arch not in ARCHITECTURES[mt]:
      raise HFCheckpointError(
          f"{CONFIG_FILE}: architecture {arch!r} (model_type {mt!r}) is not supported; "
          f"expected one of {list(ARCHITECTURES[mt])}")
  if mt == GEMMA4_TEXT:
    text = dict(config_json)
  else:
    if not isinstance(config_json.get("text_config"), Mapping):
      raise HFCheckpointError(f"{CONFIG_FILE}: model_type {mt!r} needs a 'text_config' object")
    text = dict(config_json["text_config"])
  return mt, text


def _reject(cond: bool, field: str, msg: str) -> None:
  if cond:
    raise HFCheckpointError(f"{CONFIG_FILE}: text_config.{field}: {msg}; dgemma does not model this")


def _layer_shapes(text: Mapping[str, Any], kinds: list[str], mt: str) -> dict[str, tuple[int, int]]:
  """(head_dim, num_kv_heads) per layer kind, from `per_layer_config` or the legacy global_* keys."""
  base = (int(text["head_dim"]), int(text["num_key_value_heads"]))
  per_layer: list[tuple[int, int]] = [base] * len(kinds)
  plc = text.get("per_layer_config")
  if plc is not None:
    for key, over in plc.items():
      unknown = sorted(set(over) - {"head_dim", "num_key_value_heads"})
      _reject(bool(unknown), f"per_layer_config[{key}]", f"overrides {unknown}")
      if str(key).lstrip("-").isdigit():
        idx = [int(key)]
      elif key in _HF_LAYER_KIND:
        idx = [i for i, k in enumerate(kinds) if k == _HF_LAYER_KIND[key]]
      else:
        raise HFCheckpointError(f"{CONFIG_FILE}: text_config.per_layer_config: bad key {key!r}")
      for i in idx:
        if not 0 <= i < len(kinds):
          raise HFCheckpointError(
              f"{CONFIG_FILE}: text_config.per_layer_config: layer {i} out of range")
        hd, kv = per_layer[i]
        per_layer[i] = (int(over.get("head_dim", hd)), int(over.get("num_key_value_heads", kv)))
  else:
    # Legacy form: HF derives the global-layer override from these keys in __post_init__.
    gate = text.get("attention_k_eq_v", True if mt == DIFFUSION else False)
    g_hd = int(text.get("global_head_dim", 512))
    g_kv = text.get("num_global_key_value_heads") if gate else None
    g_kv = base[1] if g_kv is None else int(g_kv)
    per_layer = [(g_hd, g_kv) if k == GLOBAL else base for k in kinds]
  out: dict[str, tuple[int, int]] = {}
  for i, (kind, shape) in enumerate(zip(kinds, per_layer)):
    if out.setdefault(kind, shape) != shape:
      raise HFCheckpointError(
          f"{CONFIG_FILE}: text_config.per_layer_config: layer {i} ({kind}) has (head_dim, "
          f"num_key_value_heads)={shape} but an earlier {kind} layer has {out[kind]}; dgemma needs "
          "one shape per layer kind")
  return out


def _rope(text: Mapping[str, Any]) -> tuple[float, float, float]:
  """(sliding base, global base, global fraction) from `rope_parameters`."""
  rp = text.get("rope_parameters") or {
      "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                         "rope_theta": 1_000_000.0}}
  for key in ("sliding_attention", "full_attention"):
    if not isinstance(rp.get(key), Mapping):
      raise HFCheckpointError(f"{CONFIG_FILE}: text_config.rope_parameters.{key} is missing")
  out = []
  for key in ("sliding_attention", "full_attention"):
    p = rp[key]
    field = f"rope_parameters.{key}"
    rtype = p.get("rope_type", "default")
    frac = float(p.get("partial_rotary_factor", 1.0))
    _reject(rtype not in ("default", "proportional"), field, f"rope_type {rtype!r}")
    _reject(float(p.get("factor", 1.0)) != 1.0, field, f"factor {p.get('factor')}")
    _reject(rtype == "default" and frac != 1.0, field, "partial_rotary_factor with default RoPE")
    _reject(key == "sliding_attention" and frac != 1.0, field, "partial RoPE on sliding layers")
    out.append((float(p["rope_theta"]), frac))
  return out[0][0], out[1][0], out[1][1]


def model_config_from_hf(config_json: Mapping[str, Any], *, model_type: str | None = None,
                         **overrides: Any) -> ModelConfig:
  """Maps an HF `config.json` dict to a `ModelConfig`.

  Supports model_type 'diffusion_gemma' (DiffusionGemmaForBlockDiffusion), 'gemma4'
  (Gemma4ForConditionalGeneration, text tower only) and 'gemma4_text' (Gemma4ForCausalLM).
  `sliding_window` is read as serialised: HF's `to_dict` undoes the halving `__post_init__` applies
  for use_bidirectional_attention='all', and 'all' itself is rejected (dgemma's encoder is causal).
  `overrides` set non-architecture fields (param_dtype, scan_layers, moe_impl, ...).
  """
  mt, text = _detect(config_json, model_type)
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "sliding_window"):
    if text.get(key) is None:
      raise HFCheckpointError(f"{CONFIG_FILE}: text_config.{key} is missing")
  n = int(text["num_hidden_layers"])
  hf_types = list(text.get("layer_types") or
                  ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
  for i, t in enumerate(hf_types):
    if t not in _HF_LAYER_KIND:
      raise HFCheckpointError(f"{CONFIG_FILE}: text_config.layer_types[{i}] is {t!r}; expected "
                              f"one of {sorted(_HF_LAYER_KIND)}")
  if len(hf_types) != n:
    raise HFCheckpointError(f"{CONFIG_FILE}: text_config.layer_types has {len(hf_types)} entries "
                            f"but num_hidden_layers={n}")
  if hf_types and hf_types[-1] != "full_attention":
    hf_types[-1] = "full_attention"  # HF forces the last layer global
  kinds = [_HF_LAYER_KIND[t] for t in hf_types]

  _reject(text.get("use_bidirectional_attention") == "all", "use_bidirectional_attention",
          "'all' (bidirectional encoder)")
  _reject(bool(text.get("attention_bias", False)), "attention_bias", "attention biases")
  _reject(text.get("attn_logit_softcapping") is not None, "attn_logit_softcapping",
          "attention logit soft-capping")
  act = text.get("hidden_activation", "gelu_pytorch_tanh")
  _reject(act != "gelu_pytorch_tanh", "hidden_activation", f"activation {act!r}")
  if mt == DIFFUSION:
    k_eq_v = True  # DiffusionGemma global layers never have v_proj
    moe = True
    softcap = text.get("final_logit_softcapping", 30.0)
    _reject(softcap is None, "final_logit_softcapping", "null (DiffusionGemma always soft-caps)")
  else:
    # Gemma 4 defaults hidden_size_per_layer_input to 256, so a missing key means PLE is on.
    _reject(bool(text.get("hidden_size_per_layer_input", 256)), "hidden_size_per_layer_input",
            "per-layer embeddings (PLE)")
    _reject(int(text.get("num_kv_shared_layers", 0) or 0) > 0, "num_kv_shared_layers",
            "KV sharing across layers (and the double-wide MLP of shared layers)")
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    moe = bool(text.get("enable_moe_block", False))
    softcap = text.get("final_logit_softcapping")
  shapes = _layer_shapes(text, kinds, mt)
  s_hd, s_kv = shapes.get(SLIDING, (int(text["head_dim"]), int(text["num_key_value_heads"])))
  g_hd, g_kv = shapes.get(GLOBAL, (s_hd, s_kv))
  rope_base, g_rope_base, g_frac = _rope(text)
  if moe:
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
      if text.get(key) is None:
        raise HFCheckpointError(f"{CONFIG_FILE}: text_config.{key} is missing (MoE model)")
  values = dict(
      vocab_size=int(text["vocab_size"]),
      d_model=int(text["hidden_size"]),
      num_layers=n,
      layer_types=tuple(kinds),
      num_heads=int(text["num_attention_heads"]),
      num_kv_heads=s_kv,
      head_dim=s_hd,
      sliding_window=int(text["sliding_window"]),
      rope_base=rope_base,
      global_num_kv_heads=g_kv,
      global_head_dim=g_hd,
      global_rope_base=g_rope_base,
      global_rope_fraction=g_frac,
      global_k_eq_v=k_eq_v,
      mlp_hidden=int(text["intermediate_size"]),
      num_experts=int(text["num_experts"]) if moe else 0,
      experts_per_token=int(text["top_k_experts"]) if moe else 0,
      expert_hidden=int(text["moe_intermediate_size"]) if moe else 0,
      final_logit_softcap=float(softcap or 0.0),
      rms_eps=float(text.get("rms_norm_eps", 1e-6)),
      self_conditioning=True,
  )
  values.update(overrides)
  return ModelConfig(**values)


def model_config_to_hf(cfg: ModelConfig, base_config: Mapping[str, Any] | None = None) -> dict:
  """`config.json` dict of a `DiffusionGemmaForBlockDiffusion` for `cfg`.

  `base_config` (an HF config.json dict, e.g. the one a checkpoint was imported from) supplies
  non-architecture fields: token ids, vision_config, canvas_length, max_position_embeddings.
  """
  _export_check(cfg)
  base = dict(base_config or {})
  base_mt = base.get("model_type")
  base_text = dict(base if base_mt == GEMMA4_TEXT else (base.get("text_config") or {}))
  text: dict[str, Any] = {k: base_text[k] for k in (
      "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
      "initializer_range") if k in base_text}
  global_layers = [i for i, k in enumerate(cfg.layer_types) if k == GLOBAL]
  text.update(
      model_type="diffusion_gemma_text",
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      intermediate_size=cfg.mlp_hidden,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      global_head_dim=cfg.global_head_dim,
      num_global_key_value_heads=cfg.global_num_kv_heads,
      per_layer_config={str(i): {"head_dim": cfg.global_head_dim,
                                 "num_key_value_heads": cfg.global_num_kv_heads}
                        for i in global_layers},
      hidden_activation="gelu_pytorch_tanh",
      rms_norm_eps=cfg.rms_eps,
      sliding_window=cfg.sliding_window,
      layer_types=["sliding_attention" if k == SLIDING else "full_attention"
                   for k in cfg.layer_types],
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base},
          "full_attention": {"rope_type": "proportional",
                             "partial_rotary_factor": cfg.global_rope_fraction,
                             "rope_theta": cfg.global_rope_base}},
      num_experts=cfg.num_experts,
      top_k_experts=cfg.experts_per_token,
      moe_intermediate_size=cfg.expert_hidden,
      final_logit_softcapping=cfg.final_logit_softcap,
      attention_bias=False,
      use_bidirectional_attention=None,
      tie_word_embeddings=True,
  )
  out: dict[str, Any] = {}
  if base_mt in (DIFFUSION, GEMMA4):
    for k in ("boi_token_id", "eoi_token_id", "image_token_id", "initializer_range",
              "canvas_length", "vision_config"):
      if base.get(k) is not None:
        out[k] = base[k]
  out.update(architectures=list(ARCHITECTURES[DIFFUSION]), model_type=DIFFUSION,
             text_config=text, tie_word_embeddings=True)
  return out


def _export_check(cfg: ModelConfig) -> None:
  def need(cond, field, msg):
    if not cond:
      raise HFCheckpointError(f"model.{field}: {msg}; DiffusionGemmaForBlockDiffusion cannot "
                              "represent this")
  need(cfg.num_experts > 0, "num_experts", "0 (dense)")
  need(cfg.global_k_eq_v, "global_k_eq_v", "False (global layers with v_proj)")
  need(cfg.self_conditioning, "self_conditioning", "False")
  need(cfg.final_logit_softcap > 0, "final_logit_softcap", "0 (no soft-cap)")
  need(cfg.layer_types[-1] == GLOBAL, "layer_types", "last layer is not global")


# ---------------------------------------------------------------------------------------------
# Name mapping
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor (possibly stored under several tied names) and the dgemma leaves it fills."""
  names: tuple[str, ...]          # every HF name carrying this value; first is the canonical one
  export_names: tuple[str, ...]   # names written on export
  shape: tuple[int, ...]          # HF shape
  targets: tuple[str, ...]        # '/'-joined dgemma paths
  index: int | None               # block index on the leading axis; None for non-layer leaves
  to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  to_hf: Callable[..., np.ndarray]


def _same(x):
  return (x,)


def _ident(x):
  return x


def _linear(shape_ours: tuple[int, ...]):
  """HF nn.Linear [out, in] <-> ours [in, *out-or-split]."""
  def to_ours(w):
    return (np.reshape(w.T, shape_ours),)
  def to_hf(k):
    return np.ascontiguousarray(np.reshape(k, (shape_ours[0], -1)).T)
  return to_ours, to_hf


def _o_proj(n: int, h: int, d: int):
  def to_ours(w):  # [D, N*H] -> [N, H, D]
    return (np.reshape(w.T, (n, h, d)),)
  def to_hf(k):
    return np.ascontiguousarray(np.reshape(k, (n * h, d)).T)
  return to_ours, to_hf


def _gate_up(fe: int):
  def to_ours(w):  # [E, 2Fe, D] -> gate, up [E, D, Fe]
    return (np.swapaxes(w[:, :fe], 1, 2), np.swapaxes(w[:, fe:], 1, 2))
  def to_hf(g, u):
    return np.ascontiguousarray(np.concatenate([np.swapaxes(g, 1, 2), np.swapaxes(u, 1, 2)], 1))
  return to_ours, to_hf


def _swap12(x):
  return (np.swapaxes(x, 1, 2),)


def _swap12_hf(x):
  return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _prefixes(mt: str) -> list[str]:
  """Prefixes of the text stack's tensors; the first is canonical (DiffusionGemma: decoder)."""
  if mt == DIFFUSION:
    return ["model.decoder.", "model.encoder.language_model."]
  if mt == GEMMA4:
    return ["model.language_model."]
  return ["model."]


def _entries(cfg: ModelConfig, mt: str) -> list[_Entry]:
  """The full HF <-> dgemma mapping for `cfg` read as model_type `mt`."""
  d, v, f = cfg.d_model, cfg.vocab_size, cfg.mlp_hidden
  prefixes = _prefixes(mt)
  out: list[_Entry] = []

  def add(rel, shape, targets, index, conv=None, export_all=False, layer=True, names=None):
    if names is None:
      names = tuple(p + rel for p in prefixes) if layer else (rel,)
    to_ours, to_hf = conv or (_same, _ident)
    out.append(_Entry(tuple(names), tuple(names) if export_all else (names[0],), tuple(shape),
                      tuple(targets), index, to_ours, to_hf))

  add("embed_tokens.weight", (v, d), ["embedder/embedding"], None,
      names=tuple(p + "embed_tokens.weight" for p in prefixes) + ("lm_head.weight",))
  add("norm.weight", (d,), ["final_norm/scale"], None)
  period = cfg.block_period
  for layer in range(cfg.num_layers):
    b, i = divmod(layer, period)
    pre = f"layers.{layer}."
    base = f"blocks/layer_{i}/"
    glob = cfg.layer_types[layer] == GLOBAL
    h = cfg.global_head_dim if glob else cfg.head_dim
    k = cfg.global_num_kv_heads if glob else cfg.num_kv_heads
    n = cfg.num_heads
    add(pre + "input_layernorm.weight", (d,), [base + "pre_attn_norm/scale"], b)
    add(pre + "self_attn.q_proj.weight", (n * h, d), [base + "attn/q_proj/kernel"], b,
        _linear((d, n, h)))
    add(pre + "self_attn.k_proj.weight", (k * h, d), [base + "attn/k_proj/kernel"], b,
        _linear((d, k, h)))
    if not (glob and cfg.global_k_eq_v):
      add(pre + "self_attn.v_proj.weight", (k * h, d), [base + "attn/v_proj/kernel"], b,
          _linear((d, k, h)))
    add(pre + "self_attn.o_proj.weight", (d, n * h), [base + "attn/o_proj/kernel"], b,
        _o_proj(n, h, d))
    add(pre + "self_attn.q_norm.weight", (h,), [base + "attn/q_norm/scale"], b)
    add(pre + "self_attn.k_norm.weight", (h,), [base + "attn/k_norm/scale"], b)
    add(pre + "post_attention_layernorm.weight", (d,), [base + "post_attn_norm/scale"], b)
    add(pre + "pre_feedforward_layernorm.weight", (d,), [base + "mlp_pre_norm/scale"], b)
    add(pre + "mlp.gate_proj.weight", (f, d), [base + "mlp/gate_proj/kernel"], b, _linear((d, f)))
    add(pre + "mlp.up_proj.weight", (f, d), [base + "mlp/up_proj/kernel"], b, _linear((d, f)))
    add(pre + "mlp.down_proj.weight", (d, f), [base + "mlp/down_proj/kernel"], b, _linear((f, d)))
    add(pre + "post_feedforward_layernorm.weight", (d,), [base + "ffw_post_norm/scale"], b)
    add(pre + "layer_scalar", (1,), [base + "layer_scalar"], b, export_all=True)
    if cfg.num_experts:
      e, fe = cfg.num_experts, cfg.expert_hidden
      add(pre + "post_feedforward_layernorm_1.weight", (d,), [base + "mlp_post_norm/scale"], b)
      add(pre + "pre_feedforward_layernorm_2.weight", (d,), [base + "moe_pre_norm/scale"], b)
      add(pre + "post_feedforward_layernorm_2.weight", (d,), [base + "moe_post_norm/scale"], b)
      add(pre + "router.proj.weight", (e, d), [base + "moe/router/proj/kernel"], b, _linear((d, e)))
      add(pre + "router.scale", (d,), [base + "moe/router/scale"], b)
      add(pre + "router.per_expert_scale", (e,), [base + "moe/router/per_expert_scale"], b)
      add(pre + "experts.gate_up_proj", (e, 2 * fe, d),
          [base + "moe/experts/gate_proj", base + "moe/experts/up_proj"], b, _gate_up(fe))
      add(pre + "experts.down_proj", (e, d, fe), [base + "moe/experts/down_proj"], b,
          (_swap12, _swap12_hf))
  if mt == DIFFUSION:
    sc = "model.decoder.self_conditioning."
    add(sc + "pre_norm.weight", (d,), ["self_conditioning/pre_norm/scale"], None, layer=False)
    add(sc + "gate_proj.weight", (f, d), ["self_conditioning/gate_proj/kernel"], None,
        _linear((d, f)), layer=False)
    add(sc + "up_proj.weight", (f, d), ["self_conditioning/up_proj/kernel"], None,
        _linear((d, f)), layer=False)
    add(sc + "down_proj.weight", (d, f), ["self_conditioning/down_proj/kernel"], None,
        _linear((f, d)), layer=False)
  return out


def _synthetic(cfg: ModelConfig, mt: str, dtype: np.dtype) -> dict[str, np.ndarray]:
  """Leaves the HF checkpoint does not hold: Gemma 4's self-conditioning, dense mlp_post_norm."""
  out: dict[str, np.ndarray] = {}
  d, f = cfg.d_model, cfg.mlp_hidden
  if mt != DIFFUSION:
    rng = np.random.default_rng(_SC_SEED)
    out["self_conditioning/pre_norm/scale"] = np.ones((d,), dtype)
    for name, shape in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
      out[f"self_conditioning/{name}/kernel"] = rng.normal(0.0, 0.02, shape).astype(dtype)
  if not cfg.num_experts:
    for i in range(cfg.block_period):
      out[f"blocks/layer_{i}/mlp_post_norm/scale"] = np.ones((cfg.num_blocks, d), dtype)
  return out


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Flat '/'-path -> shape of the dgemma tree for `cfg` (stacked layer leaves included)."""
  shapes: dict[str, tuple[int, ...]] = {}
  for e in _entries(cfg, DIFFUSION):
    ours = e.to_ours(np.zeros(e.shape, np.int8))
    for path, arr in zip(e.targets, ours):
      shapes[path] = ((cfg.num_blocks,) if e.index is not None else ()) + tuple(arr.shape)
  for path, arr in _synthetic(cfg, DIFFUSION, np.dtype(np.int8)).items():
    shapes[path] = arr.shape
  return shapes


def _is_multimodal(name: str) -> bool:
  return any(part in _MULTIMODAL_PARTS for part in name.split("."))


# ---------------------------------------------------------------------------------------------
# Tree helpers
# ---------------------------------------------------------------------------------------------

def _unflatten(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for path, val in flat.items():
    node = tree
    parts = path.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = val
  return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat: dict[str, Any] = {}
  for key, val in tree.items():
    path = f"{prefix}{key}"
    if isinstance(val, Mapping):
      flat.update(_flatten(val, path + "/"))
    else:
      flat[path] = val
  return flat


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------

def _safe_open(path: Path):
  """safetensors' safe_open, with errors (a truncated or damaged file) that name the file."""
  try:
    return safe_open(str(path), framework="np")
  except Exception as e:  # SafetensorError names no path
    raise HFCheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or damaged") from e


class _Reader:
  """Lazily opened safetensors files of one checkpoint (single file or sharded with index)."""

  def __init__(self, ckpt_dir: Path):
    self.dir = ckpt_dir
    index, single = ckpt_dir / INDEX_FILE, ckpt_dir / SINGLE_FILE
    self.where: dict[str, str] = {}
    if index.exists():
      weight_map = files.read_json(index)["weight_map"]
      self.where = dict(weight_map)
    elif single.exists():
      with _safe_open(single) as f:
        self.where = {k: SINGLE_FILE for k in f.keys()}
    else:
      raise HFCheckpointError(f"{ckpt_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._open: dict[str, Any] = {}

  def _file(self, name: str):
    fname = self.where[name]
    if fname not in self._open:
      path = self.dir / fname
      if not path.exists():
        raise HFCheckpointError(f"{self.dir / INDEX_FILE}: shard {fname!r} (holding {name!r}) "
                                "does not exist")
      self._open[fname] = _safe_open(path)
    return self._open[fname]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._file(name).get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    try:
      return self._file(name).get_tensor(name)
    except Exception as e:  # safetensors' SafetensorError names neither the file nor the tensor
      raise HFCheckpointError(f"{self.dir / self.where[name]}: cannot read tensor {name!r} ({e}); the file may be "
                              "truncated or damaged") from e

  def close(self):
    for f in self._open.values():
      f.__exit__(None, None, None)
    self._open.clear()


def read_config(ckpt_dir: str | os.PathLike) -> dict:
  path = Path(ckpt_dir) / CONFIG_FILE
  if not path.exists():
    raise HFCheckpointError(f"{path}: not found")
  return files.read_json(path)


def load_hf_checkpoint(ckpt_dir: str | os.PathLike, *, dtype: str = "float32",
                       model_type: str | None = None,
                       config_overrides: Mapping[str, Any] | None = None
                       ) -> tuple[ModelConfig, dict]:
  """Reads an HF checkpoint directory into (ModelConfig, params).

  `params` is a nested dict of numpy arrays in `dtype` (the model's param_dtype is set to it).
  Tensors stream one at a time into preallocated stacked arrays. Vision/audio tensors are skipped
  (one notice); Gemma 4 AR checkpoints get a freshly initialised self-conditioning module (notice).
  Tied copies (encoder/decoder layers, lm_head) must be equal when several are stored.
  """
  ckpt_dir = Path(ckpt_dir)
  config_json = read_config(ckpt_dir)
  mt, _ = _detect(config_json, model_type)
  overrides = dict(param_dtype=dtype)
  overrides.update(config_overrides or {})
  cfg = model_config_from_hf(config_json, model_type=mt, **overrides)
  target = _np_dtype(dtype)
  entries = _entries(cfg, mt)

  flat: dict[str, np.ndarray] = {}
  for e in entries:
    ours = e.to_ours(np.zeros(e.shape, np.int8))
    for path, arr in zip(e.targets, ours):
      if path not in flat:
        lead = (cfg.num_blocks,) if e.index is not None else ()
        flat[path] = np.empty(lead + tuple(arr.shape), target)

  reader = _Reader(ckpt_dir)
  try:
    known: set[str] = set()
    for e in entries:
      known.update(e.names)
      present = [n for n in e.names if n in reader.where]
      if not present:
        raise HFCheckpointError(f"{ckpt_dir}: missing tensor {e.names[0]!r} (expected shape "
                                f"{list(e.shape)})")
      first = None
      for name in present:
        found = reader.shape(name)
        if found != e.shape:
          raise HFCheckpointError(f"{ckpt_dir}: tensor {name!r} has shape {list(found)}, "
                                  f"expected {list(e.shape)}")
        raw = reader.get(name)
        if first is None:
          first = (name, raw)
          for path, val in zip(e.targets, e.to_ours(raw)):
            if e.index is None:
              flat[path][...] = val
            else:
              flat[path][e.index] = val
        elif not np.array_equal(first[1], raw):
          what = "layer_scalar buffers" if name.endswith("layer_scalar") else "tied tensors"
          raise HFCheckpointError(
              f"{ckpt_dir}: {what} {first[0]!r} and {name!r} differ; dgemma shares one copy "
              "between encoder and decoder (and the lm_head with the embedding)")
        del raw
    skipped = [n for n in reader.where if n not in known and _is_multimodal(n)]
    extra = sorted(n for n in reader.where if n not in known and not _is_multimodal(n))
    if extra:
      more = f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""
      raise HFCheckpointError(f"{ckpt_dir}: unexpected tensor(s) {extra[:10]}{more} for "
                              f"model_type {mt!r}")
  finally:
    reader.close()
  if skipped and not is_text_only(config_json):
    log.warning("%s: skipped %d vision/audio tensor(s) (dgemma is text-only)", ckpt_dir,
                len(skipped))
  flat.update(_synthetic(cfg, mt, target))
  if mt != DIFFUSION:
    log.warning("%s: Gemma 4 autoregressive checkpoint has no self-conditioning module; "
                "initialised it fresh (seed %d, normal std 0.02 kernels, unit pre_norm scale)",
                ckpt_dir, _SC_SEED)
  if not cfg.num_experts:
    log.warning("%s: dense Gemma 4 (no MoE): num_experts=0, mlp_post_norm scales set to ones",
                ckpt_dir)
  return cfg, _unflatten(flat)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def _check_tree(cfg: ModelConfig, flat: Mapping[str, Any]) -> None:
  want = param_shapes(cfg)
  missing = sorted(set(want) - set(flat))
  extra = sorted(set(flat) - set(want))
  if missing or extra:
    raise HFCheckpointError(f"params do not match the config: missing {missing[:10]}, "
                            f"unexpected {extra[:10]}")
  for path, shape in want.items():
    got = tuple(np.shape(flat[path]))
    if got != shape:
      raise HFCheckpointError(f"params: {path} has shape {list(got)}, expected {list(shape)}")


def _multimodal_sources(src_dir: Path) -> Iterator[tuple[str, str]]:
  """(source name, DiffusionGemma name) of the vision tensors in an HF checkpoint."""
  reader = _Reader(src_dir)
  try:
    names = list(reader.where)
  finally:
    reader.close()
  for name in names:
    m = re.match(r"^(?:model\.encoder\.|model\.)?(vision_tower\..*|embed_vision\..*)$", name)
    if m:
      yield name, "model.encoder." + m.group(1)


# transformers' DiffusionGemmaForBlockDiffusion always builds a vision tower (a default Gemma 4 one, 170M
# parameters, when config.json has none). A text-only export therefore describes the smallest tower the class
# accepts and writes its weights as zeros, so transformers loads the export with no newly initialised weights;
# it is never run on text. tests/checkpoints/test_hf.py loads such an export in transformers.
TEXT_ONLY_VISION = dict(hidden_size=4, intermediate_size=4, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=4, position_embedding_size=1, patch_size=1,
                        pooling_kernel_size=1, model_type="gemma4_vision")


def is_text_only(config_json: Mapping[str, Any]) -> bool:
  """Whether an HF config.json describes a text-only export's stub vision tower (`TEXT_ONLY_VISION`)."""
  vision = config_json.get("vision_config") or {}
  return all(vision.get(k) == v for k, v in TEXT_ONLY_VISION.items())


def _vision_stub(d_model: int) -> dict[str, np.ndarray]:
  """Zero weights of the `TEXT_ONLY_VISION` tower and its projection into the text model (transformers' names)."""
  h, inner = TEXT_ONLY_VISION["hidden_size"], TEXT_ONLY_VISION["intermediate_size"]
  head, patch = TEXT_ONLY_VISION["head_dim"], TEXT_ONLY_VISION["patch_size"]
  tower, layer = "model.encoder.vision_tower.", "model.encoder.vision_tower.encoder.layers.0."
  shapes = {tower + "patch_embedder.position_embedding_table": (2, TEXT_ONLY_VISION["position_embedding_size"], h),
            tower + "patch_embedder.input_proj.weight": (h, 3 * patch * patch),
            "model.encoder.embed_vision.embedding_projection.weight": (d_model, h)}
  for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    shapes[f"{layer}self_attn.{proj}.linear.weight"] = (h, h)
  shapes[f"{layer}self_attn.q_norm.weight"] = shapes[f"{layer}self_attn.k_norm.weight"] = (head,)
  for proj, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
    shapes[f"{layer}mlp.{proj}.linear.weight"] = shape
  for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
    shapes[f"{layer}{norm}.weight"] = (h,)
  return {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}


GENERATION_CONFIG = "generation_config.json"
RUN_CONFIG_KEY = "dgemma"  # config.json key of an export: the settings of the run it came from (dgemma.load reads it)


def export_hf_checkpoint(cfg: ModelConfig, params: Mapping[str, Any], out_dir: str | os.PathLike,
                         *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         base_config: Mapping[str, Any] | None = None,
                         multimodal_from: str | os.PathLike | None = None,
                         dtype: str | None = None, overwrite: bool = False,
                         extra_config: Mapping[str, Any] | None = None,
                         generation_config: Mapping[str, Any] | None = None,
                         extra_files: Mapping[str, str | os.PathLike] | None = None) -> None:
  """Writes `params` as a `DiffusionGemmaForBlockDiffusion` checkpoint (config.json + safetensors).

  Shards with an index when the tensors exceed `max_shard_bytes`. `base_config`: see
  `model_config_to_hf`. `multimodal_from`: an HF checkpoint dir whose vision tensors are copied
  (e.g. the one the params came from), so the export is a complete multimodal checkpoint; without it the
  export is text-only (`TEXT_ONLY_VISION`). `dtype` casts on the way out (default: keep each leaf's dtype).
  `extra_config`: keys added to config.json (canvas_length, a run's settings); `generation_config`: written as
  generation_config.json; `extra_files` {name: source}: copied in (the tokenizer). Every file gets the
  permissions of the umask.
  """
  out_dir = Path(out_dir)
  for option in ("decoder_shift", "decoder_right_readout", "decoder_head_layers", "decoder_two_stream"):
    if getattr(cfg, option):
      raise HFCheckpointError(f"{out_dir}: model.{option} is a dgemma research option that Hugging Face's "
                              "DiffusionGemma does not have; its export would decode differently")
  if out_dir.exists() and any(out_dir.iterdir()):
    if not overwrite:
      raise HFCheckpointError(f"{out_dir}: exists and is not empty (use --overwrite to replace it)")
    for p in out_dir.iterdir():
      if (p.name in (CONFIG_FILE, INDEX_FILE, GENERATION_CONFIG, *(extra_files or {}))
          or p.name.endswith(".safetensors")):
        p.unlink()
  flat = _flatten(params)
  _check_tree(cfg, flat)
  config_json = model_config_to_hf(cfg, base_config)
  config_json.update(extra_config or {})
  out_dtype = _np_dtype(dtype) if dtype else None

  def part(path: str, index: int | None) -> np.ndarray:
    # Slice before converting, so a jax leaf is never copied whole.
    x = flat[path] if index is None else flat[path][index]
    return np.asarray(x)

  # (name, nbytes, producer) for every tensor to write.
  items: list[tuple[str, int, Callable[[], np.ndarray]]] = []
  for e in _entries(cfg, DIFFUSION):
    def produce(e=e):
      arr = np.asarray(e.to_hf(*[part(p, e.index) for p in e.targets]))
      return arr.astype(out_dtype) if out_dtype is not None else arr
    itemsize = (out_dtype or np.dtype(flat[e.targets[0]].dtype)).itemsize
    for name in e.export_names:
      items.append((name, int(np.prod(e.shape)) * itemsize, produce))
  if multimodal_from is not None:
    src = _Reader(Path(multimodal_from))
    for src_name, name in _multimodal_sources(Path(multimodal_from)):
      nbytes = int(np.prod(src.shape(src_name))) * _safetensors_itemsize(src, src_name)
      items.append((name, nbytes, lambda s=src_name: src.get(s)))
  else:
    src = None
    config_json["vision_config"] = dict(TEXT_ONLY_VISION)
    stub = _vision_stub(cfg.d_model)
    items.extend((name, arr.nbytes, lambda a=arr: a.astype(out_dtype) if out_dtype is not None else a)
                 for name, arr in stub.items())

  shards: list[list[int]] = [[]]
  size = 0
  for i, (_, nbytes, _) in enumerate(items):
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(i)
    size += nbytes
  out_dir.mkdir(parents=True, exist_ok=True)
  weight_map: dict[str, str] = {}
  total = 0
  try:
    for s, idx in enumerate(shards):
      fname = SINGLE_FILE if len(shards) == 1 else f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
      tensors = {}
      for i in idx:
        name, nbytes, produce = items[i]
        tensors[name] = np.ascontiguousarray(produce())
        weight_map[name] = fname
        total += tensors[name].nbytes
      _save_atomic(tensors, out_dir / fname)
      del tensors
  finally:
    if src is not None:
      src.close()
  if len(shards) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / INDEX_FILE, index)
  dtypes = {str(np.dtype(x.dtype)) for x in flat.values()} if out_dtype is None else {str(out_dtype)}
  config_json["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
  for name, source in (extra_files or {}).items():
    files.copy_file_atomic(source, out_dir / name)
  if generation_config is not None:
    _write_json(out_dir / GENERATION_CONFIG, dict(generation_config))
  _write_json(out_dir / CONFIG_FILE, config_json)


def _safetensors_itemsize(reader: _Reader, name: str) -> int:
  return _ST_SIZES[reader._file(name).get_slice(name).get_dtype()]


_ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _save_atomic(tensors: Mapping[str, np.ndarray], path: Path) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
  os.chmod(tmp, files.umask_mode())  # safetensors creates its files 0600
  os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
  files.write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


HF_CONFIG = "hf_config.json"  # the source config.json, kept in a params checkpoint converted from it


def is_hf_dir(path: str | os.PathLike) -> bool:
  p = Path(path)
  return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())
