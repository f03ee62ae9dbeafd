"""Adapter checkpoints: the trained leaves of a LoRA / head-only fine-tuning run.

Written at the end of training (finetune.mode 'lora' or 'head_only' with finetune.save_adapter) to
WORKDIR/adapter/: a params checkpoint (dgemma/checkpoints/params.py) holding only the trained leaves
(adapter factors, plus self_conditioning/* in head_only), the base model's model_config.json,
adapter_config.json = {mode, lora: {rank, alpha, targets, decoder_only}, base: train.init_from (absolute), step,
base_identity: the base's fingerprint (`dgemma.checkpoints.reader.identity`: loading the adapter on other weights is
refused unless asked for)}
and run_config.json, the run's config.json (its dtypes, canvas, data format and sampler settings), so the
adapter loads and samples as its run does. `dgemma.load(ADAPTER_DIR)` loads the base (any checkpoint kind)
with the adapter on top (`describe`, `read`: the base is read by the cross-kind reader the caller passes in);
`python -m dgemma.tools.merge_lora` folds a 'lora' adapter into its base weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import flax
import jax

from dgemma import finetune, quant
from dgemma import settings as settings_lib
from dgemma.checkpoints import params as params_ckpt
from dgemma.checkpoints.checkpoint import Checkpoint, Placement, with_dtype
from dgemma.errors import CheckpointError
from dgemma.model.lora import LoraConfig

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
RUN_CONFIG = params_ckpt.RUN_CONFIG
BASE_IDENTITY = "base_identity"  # adapter_config.json: the fingerprint of the base it was trained on


def is_adapter_dir(path: str | os.PathLike) -> bool:
  return (Path(path) / ADAPTER_CONFIG).is_file() and params_ckpt.is_params_dir(path)


def save_adapter(path: str | os.PathLike, params: Any, model_cfg, finetune_cfg, *, base: str, step: int,
                 run_config_json: str | None = None, base_identity: str = "") -> None:
  """Writes an adapter-only params checkpoint (module docstring) atomically, replacing an older one. `base_identity`:
  the fingerprint of the base it was trained on (`dgemma.checkpoints.reader.identity`), checked when it is loaded."""
  if finetune_cfg.mode == "full":
    raise ValueError("finetune.save_adapter: full fine-tuning trains every leaf; its checkpoint is the model")
  adapter = jax.device_get(finetune.trained_leaves(params, finetune_cfg))
  meta = {"mode": finetune_cfg.mode, "lora": finetune.lora_config(finetune_cfg).to_dict(),
          "base": str(Path(base).absolute()) if base else "", "step": int(step)}
  if base_identity:
    meta[BASE_IDENTITY] = base_identity
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


def load_adapter(path: str | os.PathLike) -> tuple[dict, dict, dict]:
  """(adapter params, base model config dict, adapter_config) of an adapter checkpoint."""
  meta = params_ckpt.read_extra_json(path, ADAPTER_CONFIG)
  if meta is None:
    raise FileNotFoundError(f"--adapter: {path} has no {ADAPTER_CONFIG} (not an adapter checkpoint; "
                            "training writes one to WORKDIR/adapter with finetune.mode='lora')")
  params, model_config = params_ckpt.load_params(path)
  return params, model_config, meta



def describe(path: str | os.PathLike, field: str, describe_base: Callable[[str, str], Checkpoint],
             identity: Callable[[Checkpoint], str], *, base: str | None = None, any_base: bool = False) -> Checkpoint:
  """The header of an adapter: the adapter's model (its run's settings when kept, else its base's, with the adapter's
  LoRA layout) and its base's header (`describe_base(path, field)`: any kind) in `base`: the base it records, or
  the `base` given. Its fingerprint (`identity`) must be the one the adapter recorded when it was saved (an adapter
  saved before fingerprints were kept is not checked), unless `any_base`: another run of the same architecture, or
  a base trained further since, is refused in one CheckpointError naming both."""
  meta = params_ckpt.read_extra_json(path, ADAPTER_CONFIG)
  if not meta.get("base") and base is None:
    raise CheckpointError(f"{path}/{ADAPTER_CONFIG}: names no base checkpoint ('base'), so the adapter "
                          "cannot be loaded on its own")
  recorded = base_path(path, meta) if meta.get("base") else None
  base_header = describe_base(base if base is not None else recorded,
                              "base" if base is not None else f"{path}/{ADAPTER_CONFIG} 'base'")
  wanted = meta.get(BASE_IDENTITY)
  if wanted and not any_base:
    found = identity(base_header)
    if found != wanted:
      chosen = (f"the base given, {base}," if base is not None else f"its base {recorded}")
      raise CheckpointError(
          f"{field}: {path} was trained on {recorded or 'another base'} (fingerprint {wanted}), but {chosen} is "
          f"another checkpoint (fingerprint {found}): another run, the base trained further since, or a re-saved "
          "copy. Load the adapter on the base it was trained on (dgemma.load(adapter, base=PATH); merge_lora "
          "--base=PATH), or use this one anyway with dgemma.load(adapter, any_base=True) or merge_lora --any_base "
          "(then sample, train from or convert the merged checkpoint)")
  base = base_header
  lora = LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["lora"].items()})
  run_json = params_ckpt.read_run_config(path)
  # The run's own model settings (dtypes, compute choices) when the adapter kept its config, else the base's; a QLoRA
  # adapter sits on its base quantized as the run held it.
  model, stored = (settings_lib.run_model(run_json, Path(path) / RUN_CONFIG) if run_json is not None
                   else (base.model, None))
  step = meta.get("step")
  return Checkpoint(str(path), "adapter", dataclasses.replace(model, lora=lora), field=field,
                    step=int(step) if step is not None else None, config_json=run_json,
                    tokenizer_file=base.tokenizer_file, hf_config=base.hf_config, stored_quantizer=stored, base=base)


def read(header: Checkpoint, placement: Placement, dtype: str | None, load_as: Callable[..., Checkpoint],
         quantizer: Optional[quant.Quantizer] = None) -> Any:
  """The adapter's base (any kind, its header in header.base) laid out as the adapter's model with the adapter's
  leaves on top, placed; `load_as` is the cross-kind reader's. The base is held as the run held it
  (header.stored_quantizer), its other weights quantized by `quantizer` as they are read."""
  leaves = flax.traverse_util.flatten_dict(load_adapter(header.path)[0])
  return load_as(header.base, with_dtype(header.model, dtype), placement=placement,
                 quantizer=quant.chain(header.stored_quantizer, quantizer), leaves=lambda missing: leaves).params
