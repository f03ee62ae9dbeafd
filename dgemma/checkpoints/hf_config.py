"""Hugging Face config.json <-> ModelConfig: the architecture mapping of dgemma/checkpoints/hf.py (which moves
the tensors). DiffusionGemmaForBlockDiffusion and Gemma 4 text configs in; DiffusionGemmaForBlockDiffusion out.
"""

from __future__ import annotations

from typing import Any, Mapping

from dgemma.errors import CheckpointError
from dgemma.model.config import GLOBAL, SLIDING, ModelConfig

CONFIG_FILE = "config.json"
DIFFUSION = "diffusion_gemma"
GEMMA4 = "gemma4"
GEMMA4_TEXT = "gemma4_text"
ARCHITECTURES = {
    DIFFUSION: ("DiffusionGemmaForBlockDiffusion",),
    GEMMA4: ("Gemma4ForConditionalGeneration",),
    GEMMA4_TEXT: ("Gemma4ForCausalLM",),
}
_HF_LAYER_KIND = {"sliding_attention": SLIDING, "full_attention": GLOBAL}


class HFCheckpointError(CheckpointError):
  """A Hugging Face checkpoint or config cannot be converted; the message names the culprit."""



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


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------

def detect(config_json: Mapping[str, Any], model_type: str | None) -> tuple[str, dict]:
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
  mt, text = detect(config_json, model_type)
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


