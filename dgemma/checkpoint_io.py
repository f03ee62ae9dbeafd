"""A standalone dgemma parameter checkpoint: an Orbax params tree plus `model_config.json`.

Layout of CKPT_DIR:
  params/              Orbax StandardCheckpointer item (the nested params dict)
  model_config.json    ModelConfig.to_dict()
  <extra>.json         optional extra JSON files (the converter keeps the source HF config.json)
Written into a temporary sibling directory and renamed into place, so a reader never sees a
partial checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import orbax.checkpoint as ocp

PARAMS = "params"
MODEL_CONFIG = "model_config.json"


def save_params(path: str | os.PathLike, params: Any, model_config_dict: Mapping[str, Any], *,
                extra_json: Mapping[str, Any] | None = None, overwrite: bool = False) -> None:
  """Saves `params` and the model config to `path` atomically (refuses an existing path
  unless `overwrite`)."""
  path = Path(path).absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path}: already exists (pass overwrite=True to replace it)")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp / PARAMS, params)
    ckptr.wait_until_finished()
    ckptr.close()
    (tmp / MODEL_CONFIG).write_text(json.dumps(dict(model_config_dict), indent=2) + "\n")
    for name, obj in (extra_json or {}).items():
      (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
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


def load_params(path: str | os.PathLike) -> tuple[Any, dict]:
  """Returns (params as a nested dict of numpy arrays, model config dict)."""
  path = Path(path).absolute()
  cfg_path = path / MODEL_CONFIG
  if not cfg_path.exists():
    raise FileNotFoundError(f"{cfg_path}: not found (not a dgemma params checkpoint?)")
  ckptr = ocp.StandardCheckpointer()
  try:
    params = ckptr.restore(path / PARAMS)
  finally:
    ckptr.close()
  params = _to_numpy(params)
  return params, json.loads(cfg_path.read_text())


def read_extra_json(path: str | os.PathLike, name: str) -> Any | None:
  """An extra JSON file saved beside the params, or None when absent."""
  p = Path(path) / name
  return json.loads(p.read_text()) if p.exists() else None


def _to_numpy(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)
