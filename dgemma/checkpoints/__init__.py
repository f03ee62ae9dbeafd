"""Every checkpoint format in one package (docs/checkpoints.md), and one loader that tells them apart.

  kind(path)   'workdir'  a training run (config.json + checkpoints/<step>/, dgemma/checkpoints/workdir.py)
               'params'   a params checkpoint (model_config.json + params/, from dgemma.tools.convert or
                          merge_lora; params.py)
               'adapter'  the trained leaves of a LoRA / head-only run (adapter_config.json; adapter.py)
               'hf'       a Hugging Face DiffusionGemma or Gemma 4 text directory (config.json + safetensors;
                          hf.py reads it directly, streaming and casting tensor by tensor)
  load(path, step=, mesh=, axis_rules=, dtype=) -> Checkpoint   the params only (never a run's optimizer
                          state), placed on `mesh`, checked finite, with the tokenizer file that belongs
                          to them and, for a run, its config.json
  layout.relayout(tree, saved, new)   a params (or optimizer state) tree between the stacked
                          (model.scan_layers) and the unrolled layer layout (layout.py)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from configs.mesh import AXIS_RULES
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter, hf, params, workdir
from dgemma.errors import CheckpointError
from dgemma.model import ModelConfig, abstract_params
from dgemma.model.lora import LoraConfig

KINDS = ("workdir", "params", "adapter", "hf")
# How the command lines (sample.py, eval.*) name a checkpoint path in their errors; Python callers see `path`.
CHECKPOINT_FLAG = "--checkpoint"


def kind(path: str | os.PathLike, field: str = "path") -> str:
  """Which format `path` holds (module docstring); raises FileNotFoundError naming `field` and what was
  looked for."""
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"{field}: {path} does not exist")
  if workdir.is_workdir(p):
    return "workdir"
  if adapter.is_adapter_dir(p):
    return "adapter"
  if params.is_params_dir(p):
    return "params"
  if hf.is_hf_dir(p):
    return "hf"
  raise FileNotFoundError(
      f"{field}: {path} is none of: a training workdir (config.json + checkpoints/, from train.py), a params "
      f"checkpoint ({params.MODEL_CONFIG} + params/, from python -m dgemma.tools.convert), an adapter "
      f"({adapter.ADAPTER_CONFIG}), or a Hugging Face directory (config.json + {hf.SINGLE_FILE} or {hf.INDEX_FILE})")


@dataclasses.dataclass
class Checkpoint:
  """What a checkpoint holds, loaded.

  path / kind: what was loaded; model: the architecture (with a run's LoRA layout); params: on the mesh
  (or host numpy when no placement was asked for); step: a run's training step (None otherwise);
  config_json: a run's config.json (None otherwise); tokenizer_file: the SentencePiece / tokenizers file that
  belongs to the weights (None: a run's byte tokenizer, or none found); hf_config: an HF directory's config.json
  (or the one a converted checkpoint kept).
  """
  path: str
  kind: str
  model: ModelConfig
  params: Any
  step: Optional[int] = None
  config_json: Optional[str] = None
  tokenizer_file: Optional[Path] = None
  hf_config: Optional[dict] = None


@jax.jit
def _finite_leaves(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True, tree)


def header(path: str | os.PathLike, field: str = "path") -> Checkpoint:
  """What a checkpoint holds, without reading its weights (params=None): the architecture, the tokenizer
  file, a run's config.json (and latest step), an HF config. Errors name `field`."""
  k = kind(path, field)
  if k == "workdir":
    config_json = workdir.read_config_json(path)
    run = settings_lib.from_json(config_json)
    available = workdir.steps(path)
    tok = Path(path) / workdir.TOKENIZER_FILE
    return Checkpoint(str(path), k, ModelConfig.from_config_dict(run.model), None,
                      step=available[-1] if available else None, config_json=config_json,
                      tokenizer_file=tok if tok.is_file() else None)
  if k == "params":
    _, cfg_dict = params.read_header(path)
    return Checkpoint(str(path), k, ModelConfig.from_config_dict(cfg_dict), None,
                      tokenizer_file=params.tokenizer_file(path), hf_config=params.read_extra_json(path, hf.HF_CONFIG))
  if k == "adapter":
    meta = params.read_extra_json(path, adapter.ADAPTER_CONFIG)
    base = header(str(meta.get("base") or "")) if meta.get("base") else None
    if base is None:
      raise CheckpointError(f"{path}/{adapter.ADAPTER_CONFIG}: names no base checkpoint ('base'), so the adapter "
                            "cannot be loaded on its own")
    lora = LoraConfig(**{k_: tuple(v) if isinstance(v, list) else v for k_, v in meta["lora"].items()})
    return Checkpoint(str(path), k, dataclasses.replace(base.model, lora=lora), None,
                      tokenizer_file=base.tokenizer_file, hf_config=base.hf_config)
  config_json = hf.read_config(path)
  return Checkpoint(str(path), k, hf.model_config_from_hf(config_json), None, tokenizer_file=params.tokenizer_file(path),
                    hf_config=config_json)


def _check_finite(tree: Any, where: str) -> None:
  """Raises naming the leaves that hold a NaN or inf (host numpy arrays are checked on the host)."""
  finite = (jax.tree.map(lambda x: bool(np.all(np.isfinite(x))) if np.issubdtype(x.dtype, np.inexact) else True, tree)
            if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree)) else jax.device_get(_finite_leaves(tree)))
  bad = [jax.tree_util.keystr(path) for path, ok in jax.tree_util.tree_leaves_with_path(finite) if not bool(ok)]
  if bad:
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise CheckpointError(f"{where}: parameters {', '.join(bad[:3])}{more} are not finite (NaN or inf): the run "
                          "diverged before it was saved; pick an earlier step")


def _with_dtype(model: ModelConfig, dtype: Optional[str]) -> ModelConfig:
  return model if dtype is None else dataclasses.replace(model, dtype=dtype, param_dtype=dtype)


def _place(tree: Any, model: ModelConfig, mesh, axis_rules) -> Any:
  """Host arrays -> device arrays in model.param_dtype on `mesh` (by logical axis names)."""
  abstract = abstract_params(model, mesh, axis_rules)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}
  return jax.tree_util.tree_map_with_path(
      lambda p, s: jax.device_put(np.asarray(flat[jax.tree_util.keystr(p)]).astype(s.dtype), s.sharding), abstract)


def _default_mesh(mesh, axis_rules):
  if mesh is None:
    mesh = mesh_lib.make_mesh()
  return mesh, AXIS_RULES if axis_rules is None else axis_rules


def load_workdir(path: str | os.PathLike, *, step: Optional[int] = None, mesh=None, axis_rules=None,
                 config_json: Optional[str] = None, dtype: Optional[str] = None) -> Checkpoint:
  """A run's params at `step` (None = the latest), restored onto `mesh` without its optimizer state.

  config_json: the run config to read the architecture from (default: the workdir's config.json)."""
  config_json = config_json if config_json is not None else workdir.read_config_json(path)
  run = settings_lib.from_config(settings_lib.from_json(config_json))
  mesh, axis_rules = _default_mesh(mesh, axis_rules if axis_rules is not None else run.mesh.axis_rules)
  available = workdir.steps(path)
  if not available:
    raise CheckpointError(f"--checkpoint: {workdir.checkpoint_dir(path)} holds no finished checkpoint "
                          f"(train first: python train.py --workdir={path})")
  if step is not None and step >= 0 and step not in available:
    raise CheckpointError(f"sample.checkpoint_step: step {step} not in {workdir.checkpoint_dir(path)} "
                          f"(have {available})")
  step = available[-1] if step is None or step < 0 else step
  model = _with_dtype(run.model, dtype)
  try:
    restored = workdir.restore_params(path, step, abstract_params(model, mesh, axis_rules))
  except Exception as e:  # pylint: disable=broad-except  (Orbax / tensorstore / JSON errors of a damaged step)
    earlier = [s for s in available if s < step]
    hint = (f"sample the previous step with sample.checkpoint_step={earlier[-1]}" if earlier else
            "no earlier step is left to sample")
    raise workdir.restore_error(path, step, e, hint) from e
  _check_finite(restored, f"{path} step {step}")
  tok = Path(path) / workdir.TOKENIZER_FILE
  return Checkpoint(str(path), "workdir", model, restored, step=step, config_json=config_json,
                    tokenizer_file=tok if tok.is_file() else None)


def load_params_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None,
                    place: bool = True) -> Checkpoint:
  """A params checkpoint (or a merged one); place=False keeps the host numpy arrays."""
  tree, cfg_dict = params.load_params(path)
  model = _with_dtype(ModelConfig.from_config_dict(cfg_dict), dtype)
  if place:
    mesh, axis_rules = _default_mesh(mesh, axis_rules)
    tree = _place(tree, model, mesh, axis_rules)
  _check_finite(tree, str(path))
  return Checkpoint(str(path), "params", model, tree, tokenizer_file=params.tokenizer_file(path),
                    hf_config=params.read_extra_json(path, hf.HF_CONFIG))


def load_hf_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None,
                place: bool = True) -> Checkpoint:
  """A Hugging Face directory, read directly (tensor by tensor, cast to `dtype`, default float32)."""
  model, tree = hf.load_hf_checkpoint(path, dtype=dtype or "float32")
  model = _with_dtype(model, dtype)
  if place:
    mesh, axis_rules = _default_mesh(mesh, axis_rules)
    tree = _place(tree, model, mesh, axis_rules)
  return Checkpoint(str(path), "hf", model, tree, tokenizer_file=params.tokenizer_file(path),
                    hf_config=hf.read_config(path))


def load_adapter_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None) -> Checkpoint:
  """An adapter on top of its base (adapter_config.json's `base`: a params checkpoint)."""
  described = header(path)
  leaves, _, meta = adapter.load_adapter(path)
  base = load_params_dir(str(meta["base"]), dtype=dtype, place=False)
  model = _with_dtype(described.model, dtype)
  merged = _merge_trees(base.params, leaves)
  mesh, axis_rules = _default_mesh(mesh, axis_rules)
  return dataclasses.replace(described, model=model, params=_place(merged, model, mesh, axis_rules))


def _merge_trees(base: dict, extra: dict) -> dict:
  out = dict(base)
  for k, v in extra.items():
    out[k] = _merge_trees(out.get(k, {}), v) if isinstance(v, dict) else v
  return out


def load(path: str | os.PathLike, *, step: Optional[int] = None, mesh=None, axis_rules=None,
         dtype: Optional[str] = None) -> Checkpoint:
  """Loads the params of any checkpoint kind (module docstring); `step` is for runs only."""
  k = kind(path)
  if step is not None and step >= 0 and k != "workdir":
    raise CheckpointError(f"step: {path} is a {k} checkpoint, which has no training steps")
  if k == "workdir":
    return load_workdir(path, step=step, mesh=mesh, axis_rules=axis_rules, dtype=dtype)
  if k == "params":
    return load_params_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype)
  if k == "adapter":
    return load_adapter_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype)
  return load_hf_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype)


__all__ = ["KINDS", "Checkpoint", "kind", "header", "load", "load_workdir", "load_params_dir", "load_hf_dir", "load_adapter_dir",
           "adapter", "hf", "params", "workdir"]
