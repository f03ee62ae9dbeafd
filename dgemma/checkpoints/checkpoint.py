"""What every checkpoint kind's reader shares: the `Checkpoint` record (a header, then the loaded params), where the
params go (`Placement`), and the checks and moves onto devices a reader makes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import mesh as mesh_lib, quant
from dgemma.errors import CheckpointError
from dgemma.model import ModelConfig, abstract_params

# How the command lines (sample.py, eval.*) name a checkpoint path in their errors; Python callers see `path`.
CHECKPOINT_FLAG = "--checkpoint"


@dataclasses.dataclass
class Checkpoint:
  """What a checkpoint holds: its header (`dgemma.checkpoints.header`: everything but the weights, params None),
  then the same with its params (`load`, `load_as`).

  path / kind: what it is; field: how errors name the path (a command line's flag); model: the architecture (with a
  run's LoRA layout); params: on the mesh (or host numpy when no placement was asked for); step: a run's step to
  read (the latest unless asked for another) and steps: those it has (None for other kinds); config_json: the
  settings of the run the weights come from (a run's config.json, an adapter's or a conversion's copy; None
  otherwise); tokenizer_file: the SentencePiece / tokenizers file that belongs to the weights (None: a run's byte
  tokenizer, or none found); hf_config: an HF directory's config.json (or the one a converted checkpoint kept);
  stored_quantizer: how the checkpoint holds its frozen base (a QLoRA run's or adapter's `finetune.base_quant`),
  None for float weights; base: an adapter's base (its header).
  """
  path: str
  kind: str
  model: ModelConfig
  params: Any = None
  field: str = "path"
  step: Optional[int] = None
  steps: Optional[tuple[int, ...]] = None
  config_json: Optional[str] = None
  tokenizer_file: Optional[Path] = None
  hf_config: Optional[dict] = None
  stored_quantizer: Optional[quant.Quantizer] = None
  base: Optional["Checkpoint"] = None


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where loaded params go: `mesh` and the logical axis rules that lay each parameter out on it."""
  mesh: jax.sharding.Mesh
  axis_rules: tuple

  @classmethod
  def of(cls, mesh=None, axis_rules=None) -> "Placement":
    """Defaults: a data-parallel mesh over this host's devices, the standard axis rules."""
    return cls(mesh if mesh is not None else mesh_lib.make_mesh(),
               tuple(mesh_lib.AXIS_RULES if axis_rules is None else axis_rules))

  def abstract(self, model: ModelConfig, quantizer: Optional[quant.Quantizer] = None) -> Any:
    """`model`'s params as placed jax.ShapeDtypeStructs (QArrays where `quantizer` quantizes)."""
    return abstract_params(model, self.mesh, self.axis_rules, quantizer.boxed if quantizer is not None else None)


@jax.jit
def _finite_leaves(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True, tree)


def check_finite(tree: Any, where: str) -> None:
  """Raises naming the leaves that hold a NaN or inf (host numpy arrays are checked on the host)."""
  finite = (jax.tree.map(lambda x: bool(np.all(np.isfinite(x))) if np.issubdtype(x.dtype, np.inexact) else True, tree)
            if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree)) else jax.device_get(_finite_leaves(tree)))
  bad = [jax.tree_util.keystr(path) for path, ok in jax.tree_util.tree_leaves_with_path(finite) if not bool(ok)]
  if bad:
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise CheckpointError(f"{where}: parameters {', '.join(bad[:3])}{more} are not finite (NaN or inf): the run "
                          "diverged before it was saved; pick an earlier step")


def with_dtype(model: ModelConfig, dtype: Optional[str]) -> ModelConfig:
  return model if dtype is None else dataclasses.replace(model, dtype=dtype, param_dtype=dtype)


def put(x: Any, target: jax.ShapeDtypeStruct) -> jax.Array:
  """One leaf (host or device array) in `target`'s dtype on its sharding."""
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  return jax.device_put(x.astype(target.dtype), target.sharding)


def place(tree: Any, model: ModelConfig, placement: Placement) -> Any:
  """Host (or device) arrays -> device arrays in model.param_dtype on the placement (by logical axis names);
  `QArray`s (quantized as they were read) stay where they are, on the default device: `load_as` places them on a
  quantized layout."""
  abstract = placement.abstract(model)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_quantized)}
  one = lambda v, s: v if quant.is_quantized(v) else put(v, s)
  return jax.tree_util.tree_map_with_path(lambda p, s: one(flat[jax.tree_util.keystr(p)], s), abstract)
