"""Tiny random Hugging Face DiffusionGemma / Gemma 4 models for the converter and parity tests.

Every parameter and buffer is randomised (norm scales, router scales, layer scalars included) so
a parity check cannot pass because some weight happens to be 1 or 0. Models are float32, eager.
"""

from __future__ import annotations

import math
import os

import torch

PATTERNS = ("sg", "ssgssg", "sgsg")
_KIND = {"s": "sliding_attention", "g": "full_attention"}


def text_config(pattern: str = "sg", **overrides) -> dict:
  """Tiny DiffusionGemma / Gemma 4 text config; `pattern` is a string of 's'/'g' per layer."""
  cfg = dict(
      vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=len(pattern),
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
      num_global_key_value_heads=1, sliding_window=8, layer_types=[_KIND[c] for c in pattern],
      num_experts=4, top_k_experts=2, moe_intermediate_size=32, rms_norm_eps=1e-6,
      max_position_embeddings=4096,
  )
  cfg.update(overrides)
  return cfg


def vision_config() -> dict:
  return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, position_embedding_size=16, patch_size=4)


def diffusion_gemma(pattern: str = "sg", *, seed: int = 0, **overrides):
  """A randomised tiny `DiffusionGemmaForBlockDiffusion` (eval mode, float32, eager).

  It always has a (tiny) vision tower: HF builds one even without a vision config.
  """
  from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
  config = DiffusionGemmaConfig(text_config=text_config(pattern, **overrides),
                                vision_config=vision_config(), canvas_length=8)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"
  torch.manual_seed(seed)
  model = DiffusionGemmaForBlockDiffusion(config).float().eval()
  randomize_(model, seed)
  return model


def gemma4_causal(pattern: str = "sg", *, seed: int = 0, moe: bool = True, k_eq_v: bool = True,
                  **overrides):
  """A randomised tiny `Gemma4ForCausalLM` (no PLE, no KV sharing)."""
  from transformers import Gemma4ForCausalLM, Gemma4TextConfig
  kw = text_config(pattern, **overrides)
  if not moe:
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
      kw.pop(key)
  kw.setdefault("final_logit_softcapping", 30.0)
  config = Gemma4TextConfig(**kw, enable_moe_block=moe, attention_k_eq_v=k_eq_v,
                            hidden_size_per_layer_input=0, num_kv_shared_layers=0)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"
  torch.manual_seed(seed)
  model = Gemma4ForCausalLM(config).float().eval()
  randomize_(model, seed)
  return model


def gemma4_conditional(pattern: str = "sg", *, seed: int = 0, **overrides):
  """A randomised tiny `Gemma4ForConditionalGeneration` (text MoE tower + tiny vision tower)."""
  from transformers import Gemma4Config, Gemma4ForConditionalGeneration
  kw = text_config(pattern, **overrides)
  kw.update(final_logit_softcapping=30.0, enable_moe_block=True, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0)
  config = Gemma4Config(text_config=kw, vision_config=vision_config(), audio_config=None)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"
  torch.manual_seed(seed)
  model = Gemma4ForConditionalGeneration(config).float().eval()
  randomize_(model, seed)
  return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
  """Fills every parameter and persistent buffer with random values of a sensible scale.

  Tied parameters are shared objects, so they stay tied; the encoder's `layer_scalar` buffers are
  set equal to the decoder's (dgemma keeps one copy).
  """
  gen = torch.Generator().manual_seed(seed)

  def uniform(t, lo, hi):
    t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))

  def normal(t, std):
    t.copy_(std * torch.randn(t.shape, generator=gen))

  for name, p in model.named_parameters():
    if "norm" in name or name.endswith("router.scale") or name.endswith("per_expert_scale"):
      uniform(p, 0.7, 1.3)
    elif name.endswith("embed_tokens.weight"):
      normal(p, 1.0 / math.sqrt(p.shape[1]))
    elif name.endswith("router.proj.weight"):
      normal(p, 2.0)
    elif name.endswith("experts.gate_up_proj"):
      normal(p, 1.0 / math.sqrt(p.shape[2]))
    elif name.endswith("experts.down_proj"):
      normal(p, 1.0 / math.sqrt(p.shape[2]))
    elif p.ndim >= 2:
      normal(p, 1.0 / math.sqrt(p.shape[-1]))
    else:
      uniform(p, 0.7, 1.3)
  buffers = dict(model.named_buffers())
  for name, b in buffers.items():
    if name.endswith("layer_scalar"):
      uniform(b, 0.7, 1.3)
  for name, b in buffers.items():
    if ".encoder.language_model.layers." in name and name.endswith("layer_scalar"):
      twin = name.replace(".encoder.language_model.layers.", ".decoder.layers.")
      if twin in buffers:
        b.copy_(buffers[twin])


def save(model, path: str | os.PathLike, *, max_shard_size: str | int | None = None) -> str:
  """`save_pretrained` into `path` (sharded when `max_shard_size` is given); returns the path."""
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(str(path), **kw)
  return str(path)
