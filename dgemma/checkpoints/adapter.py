"""Adapter checkpoints: the trained leaves of a LoRA / head-only fine-tuning run.

Written at the end of training (finetune.mode 'lora' or 'head_only' with finetune.save_adapter) to
WORKDIR/adapter/: a params checkpoint (dgemma/checkpoints/params.py) holding only the trained leaves
(adapter factors, plus self_conditioning/* in head_only), the base model's model_config.json,
adapter_config.json = {mode, lora: {rank, alpha, targets, decoder_only}, base: train.init_from (absolute), step}
and run_config.json, the run's config.json (its dtypes, canvas, data format and sampler settings), so the
adapter loads and samples as its run does. `dgemma.load(ADAPTER_DIR)` loads the base (any checkpoint kind)
with the adapter on top; `python -m dgemma.tools.merge_lora` folds a 'lora' adapter into its base weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

from dgemma import finetune
from dgemma.checkpoints import params as params_ckpt

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
RUN_CONFIG = params_ckpt.RUN_CONFIG


def is_adapter_dir(path: str | os.PathLike) -> bool:
  return (Path(path) / ADAPTER_CONFIG).is_file() and params_ckpt.is_params_dir(path)


def save_adapter(path: str | os.PathLike, params: Any, model_cfg, finetune_cfg, *, base: str, step: int,
                 run_config_json: str | None = None) -> None:
  """Writes an adapter-only params checkpoint (module docstring) atomically, replacing an older one."""
  if finetune_cfg.mode == "full":
    raise ValueError("finetune.save_adapter: full fine-tuning trains every leaf; its checkpoint is the model")
  adapter = jax.device_get(finetune.trained_leaves(params, finetune_cfg))
  meta = {"mode": finetune_cfg.mode, "lora": finetune.lora_config(finetune_cfg).to_dict(),
          "base": str(Path(base).absolute()) if base else "", "step": int(step)}
  extra = {ADAPTER_CONFIG: meta}
  if run_config_json is not None:
    extra[RUN_CONFIG] = json.loads(run_config_json)
  params_ckpt.save_params(path, adapter, model_cfg.to_dict(), extra_json=extra, overwrite=True)


def base_path(path: str | os.PathLike, meta: dict) -> str:
  """The base checkpoint an adapter was trained from (adapter_config.json 'base'); a relative path recorded by an
  older run is read relative to the working directory, else to the run's workdir (the adapter's parent)."""
  base = Path(meta["base"])
  if base.is_absolute() or base.exists():
    return str(base)
  beside = Path(path).absolute().parent.parent / base
  return str(beside if beside.exists() else base)


def read_run_config(path: str | os.PathLike) -> str | None:
  """The config.json text of the run the weights of a params checkpoint (an adapter, a converted run) come from,
  or None (converted from elsewhere, or written before it was kept)."""
  run = params_ckpt.read_extra_json(path, RUN_CONFIG)
  return None if run is None else json.dumps(run)


def load_adapter(path: str | os.PathLike) -> tuple[dict, dict, dict]:
  """(adapter params, base model config dict, adapter_config) of an adapter checkpoint."""
  meta = params_ckpt.read_extra_json(path, ADAPTER_CONFIG)
  if meta is None:
    raise FileNotFoundError(f"--adapter: {path} has no {ADAPTER_CONFIG} (not an adapter checkpoint; "
                            "training writes one to WORKDIR/adapter with finetune.mode='lora')")
  params, model_config = params_ckpt.load_params(path)
  return params, model_config, meta

