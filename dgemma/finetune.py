"""Fine-tuning modes (`config.finetune`): which parameters train, and adapter-only checkpoints.

Modes (finetune.mode):
  'full'       every parameter trains (today's training); finetune.freeze_router keeps the router fixed.
  'lora'       only LoRA adapters train (dgemma/model/lora.py): W + (alpha / rank) A B on every
               kernel of the finetune.lora_targets kinds; everything else is frozen.
  'head_only'  the self-conditioning module trains in full, plus LoRA adapters that act only in decoder
               mode, so the encoder's logits and KV cache stay bit-identical to the base model's.

Trainable leaves are labelled TRAINABLE / FROZEN (`param_labels`); `dgemma.train.optimizer.make_optimizer` wraps
the optimizer in `optax.multi_transform` with `optax.set_to_zero()` on FROZEN leaves (Adam state exists
only for trainable leaves), and the train step differentiates only the trainable leaves and returns the
frozen ones unchanged.

QLoRA (finetune.base_quant, a sample.quantize preset): in lora / head_only the frozen matrices are held quantized in
the train state (`base_quantizer`, `frozen_base`: dgemma/quant.py's QArrays, never trained leaves), so the base
costs its quantized size and has no optimizer state; docs/finetuning.md.

Adapter checkpoints (the trained leaves only, written at the end of a lora / head_only run) are one of
the formats of dgemma/checkpoints/ (adapter.py); `python -m dgemma.tools.merge_lora` folds a 'lora' adapter
into its base weights.
"""

from __future__ import annotations

from typing import Any, Optional

import flax
import jax

from dgemma import quant
from dgemma.model import lora as lora_lib
from dgemma.errors import ConfigError

MODES = ("full", "lora", "head_only")
TRAINABLE, FROZEN = "trainable", "frozen"


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


def frozen_base(finetune):
  """The predicate on params key paths that picks the frozen leaves a QLoRA run may hold quantized
  (finetune.base_quant, `dgemma.quant.quantize_params(only=...)`): adapters and, in head_only, the
  self-conditioning module train in float32 and are never quantized."""
  return lambda names: label(tuple(names), finetune) == FROZEN


def base_quantizer(finetune) -> Optional[quant.Quantizer]:
  """How a QLoRA run (finetune.base_quant) holds its frozen base: the per-tensor transform that quantizes the leaves
  `frozen_base` picks as finetune.base_quant / base_quant_group_size say (the embedding included; its own keys, not
  sample.quant's, so sampling a run with other quantization settings keeps the base it trained against). None
  without base quantization."""
  if finetune is None or finetune.base_quant == "none":
    return None
  config = quant.QuantConfig(finetune.base_quant, finetune.base_quant_group_size, embedding=True,
                             group_field="finetune.base_quant_group_size",
                             scale_dtype=finetune.base_quant_scale_dtype)
  return quant.Quantizer(config, frozen_base(finetune))


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


def replace_leaves(params: Any, leaves: dict) -> Any:
  """`params` with the leaves of the nested dict `leaves` (e.g. `trained_leaves` of another state) in place of its
  own at the same paths."""
  flat = flax.traverse_util.flatten_dict(params)
  flat.update(flax.traverse_util.flatten_dict(leaves))
  return flax.traverse_util.unflatten_dict(flat)
