"""Adapter checkpoints: the trained leaves of a LoRA / head-only fine-tuning run.

Written at the end of training (finetune.mode 'lora' or 'head_only' with finetune.save_adapter) to
WORKDIR/adapter/: a params checkpoint (dgemma/checkpoints/params.py) holding only the trained leaves
(adapter factors, plus self_conditioning/* in head_only), the base model's model_config.json, and
adapter_config.json = {mode, lora: {rank, alpha, targets, decoder_only}, base: train.init_from, step}.
`dgemma.load(ADAPTER_DIR)` loads the base (adapter_config.json's `base`) with the adapter on top;
`python -m dgemma.tools.merge_lora` folds a 'lora' adapter into its base weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

from dgemma import finetune
from dgemma.checkpoints import params as params_ckpt

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | os.PathLike) -> bool:
  return (Path(path) / ADAPTER_CONFIG).is_file() and params_ckpt.is_params_dir(path)


def save_adapter(path: str | os.PathLike, params: Any, model_cfg, finetune_cfg, *, base: str, step: int) -> None:
  """Writes an adapter-only params checkpoint (module docstring) atomically, replacing an older one."""
  if finetune_cfg.mode == "full":
    raise ValueError("finetune.save_adapter: full fine-tuning trains every leaf; its checkpoint is the model")
  adapter = jax.device_get(finetune.trained_leaves(params, finetune_cfg))
  meta = {"mode": finetune_cfg.mode, "lora": finetune.lora_config(finetune_cfg).to_dict(), "base": str(base),
          "step": int(step)}
  params_ckpt.save_params(path, adapter, model_cfg.to_dict(), extra_json={ADAPTER_CONFIG: meta}, overwrite=True)


def load_adapter(path: str | os.PathLike) -> tuple[dict, dict, dict]:
  """(adapter params, base model config dict, adapter_config) of an adapter checkpoint."""
  meta = params_ckpt.read_extra_json(path, ADAPTER_CONFIG)
  if meta is None:
    raise FileNotFoundError(f"--adapter: {path} has no {ADAPTER_CONFIG} (not an adapter checkpoint; "
                            "training writes one to WORKDIR/adapter with finetune.mode='lora')")
  params, model_config = params_ckpt.load_params(path)
  return params, model_config, meta

