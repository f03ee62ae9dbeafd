"""The layer layout of a parameter tree: `model.scan_layers` stacked blocks <-> one unrolled block.

`Transformer.blocks` is an `nn.scan` over cfg.num_blocks copies of a block of cfg.block_period layers:
`blocks/layer_{i}/...` leaves have a leading axis of size num_blocks, and model layer l lives at row
b = l // period of `layer_{l % period}` (dgemma/model/transformer.py). With scan_layers=True the period is
the layer pattern's (e.g. 6 for 5 sliding + 1 global); with scan_layers=False it is num_layers and there
is one block. The two layouts hold the same numbers, so a checkpoint of either can start a run of the
other (`train.init_from`); `relayout` moves any tree that holds a `blocks` subtree (params, and Adam's
mu / nu, which mirror them) from one to the other exactly (no arithmetic: slices and stacks).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig

BLOCKS = "blocks"


def differences_but_layout(saved: ModelConfig, new: ModelConfig) -> list[str]:
  """settings.model_differences without model.scan_layers: what relaying cannot bridge (compute choices such
  as dtype, moe_impl or remat may differ: they do not change the tree)."""
  return [d for d in settings_lib.model_differences(saved, new) if not d.startswith("model.scan_layers:")]


def _layer_name(i: int) -> str:
  return f"layer_{i}"


def _stack(rows):
  return jnp.stack(rows) if isinstance(rows[0], jax.Array) else np.stack(rows)


def _relayout_blocks(blocks: dict, saved: ModelConfig, new: ModelConfig) -> dict:
  old_p, new_p = saved.block_period, new.block_period
  expected = {_layer_name(i) for i in range(old_p)}
  if set(blocks) != expected:
    raise ConfigError(f"model.scan_layers: the tree's blocks hold {sorted(blocks)}, not the {sorted(expected)} of "
                      f"scan_layers={saved.scan_layers} ({saved.num_blocks} block(s) of {old_p} layer(s))")
  # one subtree per model layer l, each leaf without the block axis
  per_layer = [jax.tree.map(lambda x, b=l // old_p: x[b], blocks[_layer_name(l % old_p)])
               for l in range(saved.num_layers)]
  return {_layer_name(i): jax.tree.map(lambda *rows: _stack(rows),
                                       *[per_layer[b * new_p + i] for b in range(new.num_blocks)])
          for i in range(new_p)}


def _walk(node: Any, saved: ModelConfig, new: ModelConfig) -> Any:
  if isinstance(node, dict):
    return {k: _relayout_blocks(v, saved, new) if k == BLOCKS else _walk(v, saved, new) for k, v in node.items()}
  if isinstance(node, tuple) and hasattr(node, "_fields"):  # optax states are named tuples
    return type(node)(*(_walk(x, saved, new) for x in node))
  if isinstance(node, (list, tuple)):
    return type(node)(_walk(x, saved, new) for x in node)
  return node


def relayout(tree: Any, saved: ModelConfig, new: ModelConfig) -> Any:
  """`tree` (params, or an optimizer state of named tuples / dicts around params-shaped trees) laid out for
  `saved` -> the same numbers laid out for `new`. The two configs may differ only in scan_layers."""
  diffs = differences_but_layout(saved, new)
  if diffs:
    raise ConfigError(f"model: a relayout changes only model.scan_layers; these differ too: {'; '.join(diffs)}")
  if saved.block_period == new.block_period:
    return tree
  return _walk(tree, saved, new)
