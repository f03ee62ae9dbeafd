"""Experiment-config checks: every key must be one `configs/base.py` defines, values must make sense.

`validate(config)` runs before any data is built or anything is compiled, so a typo or an impossible
value fails in a second with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

from configs import base
from dgemma import finetune, objectives, quant, tokenizers
from dgemma.model.config import ConfigError, ModelConfig

# Groups whose keys are free-form mappings (mesh axis names) rather than a fixed schema.
_OPEN_GROUPS = ("mesh.shape",)
# Groups owned by a preset: checked against ModelConfig's fields instead of the base preset.
_MODEL_GROUP = "model"


def _check_keys(config: Any, reference: Any, prefix: str) -> None:
  if prefix in _OPEN_GROUPS or prefix == _MODEL_GROUP:
    return
  if isinstance(reference, ml_collections.ConfigDict):
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
      raise ConfigError(f"{prefix}: expected a group of settings, got {config!r}")
    unknown = sorted(set(config.keys()) - set(reference.keys()))
    if unknown:
      names = ", ".join(f"{prefix + '.' if prefix else ''}{k}" for k in unknown)
      raise ConfigError(f"unknown config key(s): {names} (see configs/base.py for the keys dgemma reads)")
    for key in config.keys():
      _check_keys(config[key], reference[key], f"{prefix}.{key}" if prefix else key)


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
  """Checks an experiment config; returns its ModelConfig. Raises ConfigError naming the field."""
  _check_keys(config, base.get_config(), "")
  model_cfg = ModelConfig.from_config_dict(config.model)
  data, diff = config.data, config.diffusion

  def need(cond: bool, field: str, msg: str):
    if not cond:
      raise ConfigError(f"{field}: {msg}")

  need(data.seq_len > 0, "data.seq_len", f"must be positive, got {data.seq_len}")
  need(data.batch_size > 0, "data.batch_size", f"must be positive, got {data.batch_size}")
  need(0 < diff.canvas_len, "diffusion.canvas_len", f"must be positive, got {diff.canvas_len}")
  need(diff.canvas_len < data.seq_len, "diffusion.canvas_len",
       f"canvas of {diff.canvas_len} tokens does not fit in data.seq_len={data.seq_len} "
       "(the sequence is context + canvas; the canvas must be shorter)")
  need(0.0 < diff.t_eps < 1.0, "diffusion.t_eps", f"must be in (0, 1), got {diff.t_eps}")
  need(diff.encoder_loss_weight >= 0, "diffusion.encoder_loss_weight", "must be >= 0")
  need(0.0 <= diff.self_cond_prob <= 1.0, "diffusion.self_cond_prob", f"must be in [0, 1], got {diff.self_cond_prob}")
  need(diff.objective in objectives.OBJECTIVES, "diffusion.objective",
       f"{diff.objective!r} not in {objectives.OBJECTIVES}")
  need(diff.schedule in objectives.SCHEDULES, "diffusion.schedule",
       f"{diff.schedule!r} not in {objectives.SCHEDULES}")
  K = diff.canvases_per_row
  need(isinstance(K, int) and K >= 1, "diffusion.canvases_per_row", f"must be an integer >= 1, got {K!r}")
  need(K * diff.canvas_len <= data.seq_len, "diffusion.canvases_per_row",
       f"{K} canvases of diffusion.canvas_len={diff.canvas_len} do not fit in data.seq_len={data.seq_len}")
  need(K == 1 or diff.objective != "ar", "diffusion.canvases_per_row",
       f"objective 'ar' has no canvases; use 1, got {K}")
  need(data.format in ("text", "sft"), "data.format", f"{data.format!r} not in ('text', 'sft')")
  need(data.format != "sft" or data.source == "files", "data.format",
       f"'sft' reads .jsonl records from data.files; set data.source='files' (got {data.source!r})")
  need(K == 1 or data.format != "sft", "diffusion.canvases_per_row",
       f"data.format='sft' rows hold one response canvas; use 1, got {K}")
  need(data.sft_overflow in ("truncate_left", "error"), "data.sft_overflow",
       f"{data.sft_overflow!r} not in ('truncate_left', 'error')")
  need(diff.reweight_cap >= 1.0, "diffusion.reweight_cap", f"must be >= 1, got {diff.reweight_cap}")
  if diff.objective == "mdlm":
    need(0 <= diff.mask_id < model_cfg.vocab_size, "diffusion.mask_id",
         f"{diff.mask_id} is not an id of the model's vocabulary (model.vocab_size={model_cfg.vocab_size})")
    if data.tokenizer.kind in ("byte", "sentencepiece"):
      # Tokenizers built here use every id below their vocabulary size (4 specials, then pieces / bytes).
      tok_vocab = 260 if data.tokenizer.kind == "byte" else data.tokenizer.vocab_size
      need(diff.mask_id >= tok_vocab, "diffusion.mask_id",
           f"{diff.mask_id} is a real token of the {data.tokenizer.kind} tokenizer (ids < {tok_vocab}); for "
           f"objective='mdlm' use an added id, e.g. mask_id={tok_vocab} with model.vocab_size > {tok_vocab}")
  kind = data.tokenizer.kind
  need(kind in ("sentencepiece", "byte", "file"), "data.tokenizer.kind",
       f"{kind!r} not in ('sentencepiece', 'byte', 'file')")
  if kind == "sentencepiece":
    tokenizers.check_sentencepiece_vocab_size(data.tokenizer.vocab_size)
    need(model_cfg.vocab_size >= data.tokenizer.vocab_size, "model.vocab_size",
         f"{model_cfg.vocab_size} is smaller than data.tokenizer.vocab_size={data.tokenizer.vocab_size}")
  if kind == "byte":
    need(model_cfg.vocab_size >= 260, "model.vocab_size",
         f"{model_cfg.vocab_size} is too small for the byte tokenizer (256 bytes + 4 special tokens = 260)")
  opt, train = config.opt, config.train
  need(opt.lr > 0, "opt.lr", f"must be positive, got {opt.lr}")
  need(opt.warmup_steps >= 0, "opt.warmup_steps", "must be >= 0")
  need(isinstance(opt.grad_accum_steps, int) and opt.grad_accum_steps >= 1, "opt.grad_accum_steps",
       f"must be an integer >= 1, got {opt.grad_accum_steps!r}")
  need(data.batch_size % opt.grad_accum_steps == 0, "opt.grad_accum_steps",
       f"{opt.grad_accum_steps} does not divide data.batch_size={data.batch_size}")
  need(opt.state_dtype in ("float32", "bfloat16"), "opt.state_dtype",
       f"{opt.state_dtype!r} not in ('float32', 'bfloat16')")
  need(0.0 <= opt.end_lr_fraction <= 1.0, "opt.end_lr_fraction", "must be in [0, 1]")
  need(train.num_steps > 0, "train.num_steps", f"must be positive, got {train.num_steps}")
  for field in ("log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
    need(train[field] > 0, f"train.{field}", f"must be positive, got {train[field]}")
  unknown_axes = sorted(set(config.mesh.shape.keys()) - {"data", "fsdp", "expert", "tensor"})
  need(not unknown_axes, "mesh.shape", f"unknown mesh axes {unknown_axes}; use data, fsdp, expert, tensor")
  need(sum(1 for v in config.mesh.shape.values() if v == -1) <= 1, "mesh.shape", "at most one axis may be -1")
  need(isinstance(config.finetune.save_adapter, bool), "finetune.save_adapter", "must be True or False")
  quant.QuantConfig.from_config(config)  # sample.quantize / quant_group_size
  expert_axis = int(config.mesh.shape.get("expert", 1))
  if model_cfg.moe_impl == "expert_parallel" and model_cfg.num_experts and expert_axis > 0:
    need(model_cfg.num_experts % expert_axis == 0, "model.num_experts",
         f"{model_cfg.num_experts} experts do not split over mesh.shape.expert={expert_axis} devices "
         "(moe_impl='expert_parallel' needs num_experts % expert == 0)")
  # LoRA adapters are part of the parameter tree, so the model carries their layout.
  return dataclasses.replace(model_cfg, lora=finetune.lora_config(config.finetune))


def to_json(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=2, sort_keys=True)


def from_json(text: str) -> ml_collections.ConfigDict:
  """Inverse of `to_json`, laid over today's defaults (configs/base.py), so a run saved before a key
  existed still loads, with that key at its default. Tuples come back as lists."""
  config = base.get_config()
  _merge(config, json.loads(text), "")
  return config


def _merge(config: ml_collections.ConfigDict, values: dict, prefix: str) -> None:
  for key, value in values.items():
    if isinstance(value, dict) and isinstance(config.get(key), ml_collections.ConfigDict):
      _merge(config[key], value, f"{prefix}{key}.")
    else:
      with config.ignore_type():
        config[key] = value
