"""Any checkpoint kind -> a dgemma params checkpoint, or -> a Hugging Face DiffusionGemma directory
(`python -m dgemma.tools.convert`).

  to_params(src, out)   a run (its latest step), a params checkpoint, an adapter on its base or an HF directory
                        -> model_config.json + params/, with the tokenizer and, where the source is a run (or
                        carries one's settings), the run's config as run_config.json, so `dgemma.load(out)`
                        samples as the run did. An HF directory is read tensor by tensor on the host.
  to_hf(src, out)       the same sources -> config.json + safetensors + generation_config.json + the tokenizer.
                        config.json carries the run's canvas length (`canvas_length`, read by transformers) and
                        the run's settings (`dgemma`, read by `dgemma.load`); generation_config.json the run's
                        denoising steps, temperatures, acceptance and stopping settings in the fields
                        transformers' DiffusionGemma generate() reads. Text-only unless --hf_base names a
                        checkpoint to copy vision tensors from (hf.TEXT_ONLY_VISION).

LoRA adapters of the source are folded into their weights (W + alpha / rank A B, `checkpoints.load_as`);
head_only adapters act only in decoder mode and cannot become plain weights, so such a source is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
from absl import logging

from dgemma import settings as settings_lib
from dgemma.checkpoints import hf, params as params_ckpt
from dgemma.checkpoints.checkpoint import Checkpoint
from dgemma.checkpoints.reader import header, load_as

FROM_FLAG = "--from_ckpt"
RUN_CONFIG_KEY = hf.RUN_CONFIG_KEY
_EB_CLASS = "EntropyBoundSamplerConfig"  # transformers' name for the entropy-bound sampler's settings


def merged_run_config(config_json: str) -> dict:
  """A run's config as the settings of a checkpoint whose adapters are folded in: finetune.mode 'full' (its
  weights are plain weights now: a QLoRA run's base is written dequantized, finetune.base_quant 'none') and no
  train.init_from; everything else (canvas, data format, sampler) kept."""
  run = json.loads(config_json)
  run.setdefault("finetune", {}).update(mode="full", freeze_router=False, base_quant="none")
  run.setdefault("train", {})["init_from"] = ""
  return run


def generation_config(settings: settings_lib.Settings, vocab: Optional[dict] = None) -> tuple[dict, list[str]]:
  """(generation_config.json for transformers' DiffusionGemma generate(), what it cannot represent): the run's
  max_new_tokens, denoising steps, temperature ramp, entropy bound, stopping rule and end / pad / BOS ids."""
  sampler = settings.sampler_config
  out: dict[str, Any] = {"max_new_tokens": settings.sample.max_new_tokens,
                         "max_denoising_steps": sampler.max_denoising_steps,
                         "sampler_config": {"entropy_bound": float(sampler.entropy_bound), "_cls_name": _EB_CLASS},
                         "stability_threshold": sampler.stability_threshold,
                         "eos_token_id": list(sampler.end_ids), "pad_token_id": sampler.pad_id}
  if vocab and vocab.get("bos_token_id") is not None:
    out["bos_token_id"] = vocab["bos_token_id"]
  unrepresented = []
  if sampler.t_max > sampler.t_min:  # transformers requires a strictly falling ramp
    out.update(t_max=sampler.t_max, t_min=sampler.t_min)
  else:
    unrepresented.append(f"a constant temperature {sampler.t_max} (transformers needs t_max > t_min)")
  if sampler.confidence_threshold > 0:
    out["confidence_threshold"] = float(sampler.confidence_threshold)
  else:
    unrepresented.append("confidence_threshold=0 (never stop early)")
  released = dict(sampler="released", acceptance="entropy_bound", renoise="non_accepted", top_k=0, top_p=1.0,
                  self_conditioning=True)
  unrepresented += [f"sample.{k}={getattr(sampler, k)!r}" for k, v in released.items() if getattr(sampler, k) != v]
  return out, unrepresented


def sample_settings_from_generation_config(generation: dict) -> dict[str, Any]:
  """The `sample.*` values an HF generation_config.json sets (the inverse of `generation_config`)."""
  out: dict[str, Any] = {}
  for ours, theirs in (("max_new_tokens", "max_new_tokens"), ("max_denoising_steps", "max_denoising_steps"),
                       ("t_max", "t_max"), ("t_min", "t_min"), ("stability_threshold", "stability_threshold"),
                       ("confidence_threshold", "confidence_threshold")):
    if generation.get(theirs) is not None:
      out[ours] = generation[theirs]
  bound = (generation.get("sampler_config") or {}).get("entropy_bound")
  if bound is not None:
    out["entropy_bound"] = float(bound)
  eos = generation.get("eos_token_id")
  if eos is not None:
    out["end_ids"] = tuple(eos) if isinstance(eos, list) else (int(eos),)
  return out


def _check_out(out: str | os.PathLike, overwrite: bool, flag: str) -> None:
  """An existing output is refused before any weight is read (unless overwrite)."""
  if not overwrite and os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"{flag}: {out} already exists (use --overwrite to replace it)")


def _plain(src: str | os.PathLike, field: str) -> tuple[Checkpoint, Any]:
  """(the source's header, its params without adapters: folded in) on the host."""
  described = header(src, field)
  model = dataclasses.replace(described.model, lora=None)
  loaded = load_as(described, model)
  return dataclasses.replace(described, model=model), jax.device_get(loaded.params)


def to_params(src: str | os.PathLike, out: str | os.PathLike, *, dtype: Optional[str] = None,
              model_type: Optional[str] = None, overwrite: bool = False, field: str = FROM_FLAG):
  """Writes the params checkpoint `out` from any checkpoint kind (module docstring); returns its ModelConfig.
  `dtype` casts the parameters; `model_type` overrides an HF config.json's."""
  _check_out(out, overwrite, "--to")
  described = header(src, field)
  if described.kind == "hf":  # tensor by tensor on the host: an HF directory can be larger than a device
    model, params = hf.load_hf_checkpoint(src, dtype=dtype or "float32", model_type=model_type)
  else:
    described, params = _plain(src, field)
    model = described.model
    if dtype is not None:
      model = dataclasses.replace(model, param_dtype=dtype)
      params = jax.tree.map(lambda x: x.astype(hf._np_dtype(dtype)), params)
  extra = {}
  if described.hf_config is not None:
    extra[params_ckpt.HF_CONFIG] = described.hf_config
  if described.config_json is not None:
    extra[params_ckpt.RUN_CONFIG] = merged_run_config(described.config_json)
  tokenizer = described.tokenizer_file
  params_ckpt.save_params(out, params, model.to_dict(), extra_json=extra, overwrite=overwrite,
                          extra_files={tokenizer.name: tokenizer} if tokenizer is not None else None)
  return model


def to_hf(src: str | os.PathLike, out: str | os.PathLike, *, hf_base: Optional[str] = None,
          max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES, dtype: Optional[str] = None, overwrite: bool = False,
          field: str = FROM_FLAG):
  """Writes the HF DiffusionGemma directory `out` from any checkpoint kind (module docstring); returns its
  ModelConfig. `hf_base`: an HF checkpoint whose vision tensors and config are copied."""
  _check_out(out, overwrite, "--to_hf")
  described, params = _plain(src, field)
  base = hf.read_config(hf_base) if hf_base else described.hf_config
  extra_config, generation = {}, None
  if described.config_json is not None:
    run = merged_run_config(described.config_json)
    settings = settings_lib.from_config(settings_lib.from_json(json.dumps(run)))
    text = (base or {}).get("text_config") or {}
    generation, unrepresented = generation_config(settings, text)
    extra_config = {"canvas_length": settings.diffusion.canvas_len, RUN_CONFIG_KEY: run}
    if unrepresented:
      logging.warning("%s: transformers' DiffusionGemma generate() runs the released entropy-bound sampler; this "
                      "run's %s are kept for dgemma.load (config.json '%s') but transformers will not use them",
                      out, ", ".join(unrepresented), RUN_CONFIG_KEY)
  tokenizer = described.tokenizer_file
  hf.export_hf_checkpoint(described.model, params, out, max_shard_bytes=max_shard_bytes, base_config=base,
                          multimodal_from=hf_base, dtype=dtype, overwrite=overwrite, extra_config=extra_config,
                          generation_config=generation,
                          extra_files={tokenizer.name: tokenizer} if tokenizer is not None else None)
  return described.model
