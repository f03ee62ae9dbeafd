"""Training checkpoints: Orbax `CheckpointManager` with named items, keep-N and async writes.

Items per step: `state` (step, params, optimizer state; restored with the training shardings) and
`data_iter` (the grain iterator state as JSON, so a resumed run sees exactly the batches an
uninterrupted run would). The experiment config sits beside them as `config.json`.
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted
save never replaces a good checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

STATE = "state"
DATA_ITER = "data_iter"


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
  return Path(workdir).absolute() / "checkpoints"


def make_manager(workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                         create=not read_only, read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), item_names=(STATE, DATA_ITER), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict | None) -> None:
  items = {STATE: ocp.args.StandardSave(state)}
  if data_state is not None:
    items[DATA_ITER] = ocp.args.JsonSave(data_state)
  manager.save(step, args=ocp.args.Composite(**items))


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, *,
            with_data: bool = True) -> tuple[Any, dict | None]:
  """Restores `state` onto the shardings in `abstract_state` (a tree of jax.ShapeDtypeStruct)."""
  items = {STATE: ocp.args.StandardRestore(abstract_state)}
  has_data = with_data and (checkpoint_dir_for_step(manager, step) / DATA_ITER).exists()
  if has_data:
    items[DATA_ITER] = ocp.args.JsonRestore()
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return restored[STATE], (restored[DATA_ITER] if has_data else None)


def checkpoint_dir_for_step(manager: ocp.CheckpointManager, step: int) -> Path:
  return Path(manager.directory) / str(step)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` via a temporary file and rename: readers never see a partial file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
