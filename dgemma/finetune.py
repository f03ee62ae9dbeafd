"""Fine-tuning modes (`config.finetune`): which parameters train, and adapter-only checkpoints.

Modes (finetune.mode):
  'full'       every parameter trains (today's training); finetune.freeze_router keeps the router fixed.
  'lora'       only LoRA adapters train (dgemma/model/lora.py): W + (alpha / rank) A B on every
               kernel of the finetune.lora_targets kinds; everything else is frozen.
  'head_only'  the self-conditioning module trains in full, plus LoRA adapters that act only in decoder
               mode, so the encoder's logits and KV cache stay bit-identical to the base model's.

Trainable leaves are labelled TRAINABLE / FROZEN (`param_labels`); `dgemma.trainer.make_optimizer` wraps
the optimizer in `optax.multi_transform` with `optax.set_to_zero()` on FROZEN leaves (Adam state exists
only for trainable leaves), and the train step differentiates only the trainable leaves and returns the
frozen ones unchanged.

Adapter checkpoint (lora / head_only with finetune.save_adapter, written at the end of training to
WORKDIR/adapter/): a dgemma params checkpoint (dgemma/checkpoint_io.py) holding only the trained leaves
(adapter factors, plus self_conditioning/* in head_only), the base model's model_config.json, and
adapter_config.json = {mode, lora: {rank, alpha, targets, decoder_only}, base: train.init_from, step}.
`python -m dgemma.tools.merge_lora` folds a 'lora' adapter into its base weights.
"""

from __future__ import annotations

import os
from typing import Any

import flax
import jax

from dgemma import checkpoint_io
from dgemma.model import lora as lora_lib
from dgemma.model.config import ConfigError

MODES = ("full", "lora", "head_only")
TRAINABLE, FROZEN = "trainable", "frozen"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"


def lora_config(finetune) -> lora_lib.LoraConfig | None:
  """Checks `config.finetune` and returns the model's LoRA layout (None in full mode).

  head_only trains the self-conditioning module in full, so it gets no adapters there;
  freeze_router drops the router adapters."""
  mode = finetune.mode
  if mode not in MODES:
    raise ConfigError(f"finetune.mode: {mode!r} not in {MODES}")
  if not isinstance(finetune.freeze_router, bool):
    raise ConfigError(f"finetune.freeze_router: must be True or False, got {finetune.freeze_router!r}")
  if mode == "full":
    return None
  rank = finetune.lora_rank
  if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
    raise ConfigError(f"finetune.lora_rank: must be a positive integer, got {rank!r}")
  if not finetune.lora_alpha > 0:
    raise ConfigError(f"finetune.lora_alpha: must be positive, got {finetune.lora_alpha!r}")
  targets = finetune.lora_targets
  if isinstance(targets, str):
    targets = (targets,)
  unknown = sorted(set(targets) - set(lora_lib.TARGETS) - {"all"})
  if unknown or not targets:
    raise ConfigError(f"finetune.lora_targets: {tuple(targets)!r}; use ('all',) or a subset of {lora_lib.TARGETS}")
  chosen = lora_lib.TARGETS if "all" in targets else tuple(t for t in lora_lib.TARGETS if t in targets)
  if mode == "head_only":
    chosen = tuple(t for t in chosen if t != "self_conditioning")
  if finetune.freeze_router:
    chosen = tuple(t for t in chosen if t != "router")
  if mode == "lora" and not chosen:
    raise ConfigError(f"finetune.lora_targets: {tuple(targets)!r} leaves nothing to train in mode 'lora' "
                      "(router adapters are dropped by freeze_router)")
  return lora_lib.LoraConfig(rank=int(rank), alpha=float(finetune.lora_alpha), targets=chosen,
                             decoder_only=mode == "head_only")


def has_frozen(finetune) -> bool:
  """Whether some parameters are frozen (else the optimizer is exactly the full-training one)."""
  return finetune is not None and (finetune.mode != "full" or bool(finetune.freeze_router))


def _names(path) -> tuple[str, ...]:
  """Dict keys of a params tree path (boxing wrappers such as nn.LogicallyPartitioned are skipped)."""
  return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def label(names: tuple[str, ...], finetune) -> str:
  """TRAINABLE or FROZEN for the params leaf at `names`."""
  if finetune.mode == "full":
    return FROZEN if finetune.freeze_router and "router" in names else TRAINABLE
  if lora_lib.is_adapter(names[-1]):
    return TRAINABLE
  if finetune.mode == "head_only" and names[0] == "self_conditioning":
    return TRAINABLE
  return FROZEN


def param_labels(params: Any, finetune) -> Any:
  """A tree like `params` (boxed or not) of TRAINABLE / FROZEN labels (optax.multi_transform)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: label(_names(path), finetune), params)


def trainable_mask(params: Any, finetune) -> Any:
  return jax.tree_util.tree_map_with_path(lambda path, _: label(_names(path), finetune) == TRAINABLE, params)


def split(params: Any, mask: Any) -> tuple[Any, Any]:
  """(trainable, frozen): two trees like `params` with None in place of the other group's leaves."""
  return (jax.tree.map(lambda p, m: p if m else None, params, mask),
          jax.tree.map(lambda p, m: None if m else p, params, mask))


def join(trainable: Any, frozen: Any) -> Any:
  """Inverse of `split`."""
  return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None)


def trained_leaves(params: Any, finetune) -> dict:
  """The nested dict of only the trained leaves (what an adapter checkpoint holds)."""
  flat = flax.traverse_util.flatten_dict(params)
  kept = {k: v for k, v in flat.items() if label(tuple(str(n) for n in k), finetune) == TRAINABLE}
  return flax.traverse_util.unflatten_dict(kept)


def save_adapter(path: str | os.PathLike, params: Any, model_cfg, finetune, *, base: str, step: int) -> None:
  """Writes an adapter-only params checkpoint (module docstring) atomically, replacing an older one."""
  if finetune.mode == "full":
    raise ValueError("finetune.save_adapter: full fine-tuning trains every leaf; its checkpoint is the model")
  adapter = jax.device_get(trained_leaves(params, finetune))
  meta = {"mode": finetune.mode, "lora": lora_config(finetune).to_dict(), "base": str(base), "step": int(step)}
  checkpoint_io.save_params(path, adapter, model_cfg.to_dict(), extra_json={ADAPTER_CONFIG: meta}, overwrite=True)


def load_adapter(path: str | os.PathLike) -> tuple[dict, dict, dict]:
  """(adapter params, base model config dict, adapter_config) of an adapter checkpoint."""
  meta = checkpoint_io.read_extra_json(path, ADAPTER_CONFIG)
  if meta is None:
    raise FileNotFoundError(f"--adapter: {path} has no {ADAPTER_CONFIG} (not an adapter checkpoint; "
                            "training writes one to WORKDIR/adapter with finetune.mode='lora')")
  params, model_config = checkpoint_io.load_params(path)
  return params, model_config, meta

