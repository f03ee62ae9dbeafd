"""A standalone dgemma parameter checkpoint: an Orbax params tree plus `model_config.json`.

Layout of CKPT_DIR:
  params/              Orbax StandardCheckpointer item (the nested params dict)
  model_config.json    ModelConfig.to_dict()
  <extra>.json         optional extra JSON files (the converter keeps the source HF config.json, and a run's
                       config as run_config.json: `dgemma.load` samples with the run's settings)
  tokenizer.model / tokenizer.json   the tokenizer that belongs to the weights (the converter copies it
                       from the Hugging Face directory; `dgemma.load` finds it here)
Written into a temporary sibling directory and renamed into place, so a reader never sees a
partial checkpoint. `describe` reads its header, `read` its weights (for `dgemma.checkpoints.load`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import flax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dgemma import files, quant
from dgemma.checkpoints.checkpoint import Checkpoint
from dgemma.checkpoints.orbax_logs import quiet_orbax
from dgemma.model import ModelConfig

PARAMS = "params"
MODEL_CONFIG = "model_config.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # a SentencePiece model, else an HF tokenizers file
RUN_CONFIG = "run_config.json"  # the settings of the run the weights come from (an adapter's, a converted run's)
HF_CONFIG = "hf_config.json"  # the source config.json, kept in a params checkpoint converted from it


def is_params_dir(path: str | os.PathLike) -> bool:
  return (Path(path) / MODEL_CONFIG).is_file() and (Path(path) / PARAMS).is_dir()


def tokenizer_file(path: str | os.PathLike) -> Path | None:
  """The tokenizer stored with a checkpoint (tokenizer.model first, then tokenizer.json), or None."""
  for name in TOKENIZER_FILES:
    if (Path(path) / name).is_file():
      return Path(path) / name
  return None


def save_params(path: str | os.PathLike, params: Any, model_config_dict: Mapping[str, Any], *,
                extra_json: Mapping[str, Any] | None = None, extra_files: Mapping[str, str | os.PathLike] | None = None,
                overwrite: bool = False) -> None:
  """Saves `params` and the model config to `path` atomically (refuses an existing path
  unless `overwrite`); `extra_files` {name: source path} are copied in beside them."""
  path = Path(path).absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path}: already exists (use --overwrite to replace it)")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    quiet_orbax()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp / PARAMS, params)
    ckptr.wait_until_finished()
    ckptr.close()
    (tmp / MODEL_CONFIG).write_text(json.dumps(dict(model_config_dict), indent=2) + "\n")
    for name, obj in (extra_json or {}).items():
      (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    for name, source in (extra_files or {}).items():
      shutil.copyfile(source, tmp / name)
    if path.exists():
      old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
      os.replace(path, old)
      os.replace(tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, path)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)


def read_header(path: str | os.PathLike) -> tuple[Path, dict]:
  """(the checkpoint's absolute path, its model config dict), without reading the weights."""
  path = Path(path).absolute()
  cfg_path = path / MODEL_CONFIG
  if not cfg_path.exists():
    raise FileNotFoundError(f"{cfg_path}: not found (not a dgemma params checkpoint?)")
  return path, files.read_json(cfg_path)


def load_params(path: str | os.PathLike) -> tuple[Any, dict]:
  """Returns (params as a nested dict of numpy arrays, model config dict)."""
  path, model_config = read_header(path)
  return _restore(path), model_config


def _restore(path: Path) -> Any:
  quiet_orbax()
  ckptr = ocp.StandardCheckpointer()
  try:
    params = ckptr.restore(Path(path).absolute() / PARAMS)
  finally:
    ckptr.close()
  return _to_numpy(params)


def _restore_each(path: Path, each: Callable[[tuple[str, ...], np.ndarray], Any]) -> Any:
  """The params tree restored one leaf at a time: each leaf is restored alone (Orbax's partial restore) and replaced
  by `each(key path, numpy array)` before the next is read, so only one float leaf is on the host at once (a QLoRA
  run's base, quantized as it is read)."""
  path = Path(path).absolute()
  quiet_orbax()
  ckptr = ocp.PyTreeCheckpointer()
  try:
    shapes = flax.traverse_util.flatten_dict(_plain(ckptr.metadata(path / PARAMS).item_metadata))
    out = {}
    for key, meta in shapes.items():
      one = lambda leaf: flax.traverse_util.unflatten_dict({key: leaf})
      got = ckptr.restore(path / PARAMS, args=ocp.args.PyTreeRestore(
          item=one(np.zeros((), meta.dtype)), restore_args=one(ocp.RestoreArgs(restore_type=np.ndarray)),
          partial_restore=True))
      out[key] = each(key, np.asarray(flax.traverse_util.flatten_dict(got)[key]))
      del got
  finally:
    ckptr.close()
  return flax.traverse_util.unflatten_dict(out)


def _plain(tree: Any) -> Any:
  """Orbax's tree metadata as nested dicts."""
  if isinstance(tree, Mapping) or (hasattr(tree, "items") and hasattr(tree, "keys")):
    return {k: _plain(v) for k, v in tree.items()}
  return tree


def read_extra_json(path: str | os.PathLike, name: str) -> Any | None:
  """An extra JSON file saved beside the params, or None when absent."""
  p = Path(path) / name
  return files.read_json(p) if p.exists() else None


def _to_numpy(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)


def read_run_config(path: str | os.PathLike) -> str | None:
  """The config.json text of the run the weights of a params checkpoint (an adapter, a converted run) come from,
  or None (converted from elsewhere, or written before it was kept)."""
  run = read_extra_json(path, RUN_CONFIG)
  return None if run is None else json.dumps(run)


def describe(path: str | os.PathLike, field: str = "path") -> Checkpoint:
  """The header of a params checkpoint (nothing but its JSON files is read)."""
  _, cfg_dict = read_header(path)
  return Checkpoint(str(path), "params", ModelConfig.from_config_dict(cfg_dict), field=field,
                    config_json=read_run_config(path), tokenizer_file=tokenizer_file(path),
                    hf_config=read_extra_json(path, HF_CONFIG))


def read(header: Checkpoint, dtype: str | None = None, quantizer: quant.Quantizer | None = None) -> Any:
  """The params on the host (numpy). With `quantizer` each weight it quantizes is read alone, cast to `dtype` and
  quantized (a `QArray` on the default device) before the next is read: the float tree never exists."""
  if quantizer is None:
    return _restore(header.path)

  def each(key, a):
    if quantizer.plan(key, a.shape) is None:
      return a
    return quantizer(key, jnp.asarray(a.astype(np.dtype(dtype)) if dtype else a))
  return _restore_each(header.path, each)
