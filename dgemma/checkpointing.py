"""Training checkpoints: Orbax `CheckpointManager` with named items, keep-N and async writes.

Items per step: `state` (step, params, optimizer state; restored with the training shardings) and
`data_iter` (the grain iterator state as JSON, so a resumed run sees exactly the batches an
uninterrupted run would; in a multi-process run {"per_process": [state of process 0, 1, ...]}, each
process reading its own shard, see `all_process_data_states`). The experiment config sits beside them as `config.json`.
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted
save never replaces a good checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

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


def all_process_data_states(data_state: dict) -> dict:
  """The data_iter item to save: this process's iterator state, or in a multi-process run every
  process's (gathered as JSON bytes; Orbax writes JSON items from process 0 only). Call on every process."""
  if jax.process_count() == 1:
    return data_state
  from jax.experimental import multihost_utils
  from dgemma import trainer
  blob = np.frombuffer(json.dumps(data_state).encode(), np.uint8)
  trainer.process_barrier("dgemma_gather_data_states")  # start the gathers together (gloo connect timeout)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int32))).reshape(-1)
  width = -(-int(sizes.max()) // 4096) * 4096  # stable shapes: one small gather program per size class
  padded = np.zeros((width,), np.uint8)
  padded[:blob.size] = blob
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
  return {"per_process": [json.loads(bytes(gathered[i, :sizes[i]]).decode()) for i in range(len(sizes))]}


def this_process_data_state(saved: dict | None) -> dict | None:
  """This process's iterator state from a saved data_iter item, or None (with a warning: the data
  order restarts) when the checkpoint was written by a different number of processes."""
  if saved is None:
    return None
  per_process = saved.get("per_process") if isinstance(saved, dict) else None
  count = 1 if per_process is None else len(per_process)
  if count != jax.process_count():
    logging.warning("data_iter: the checkpoint holds the data position of %d process(es), this run has %d: "
                    "the data iterators start from the beginning of their shards", count, jax.process_count())
    return None
  return saved if per_process is None else per_process[jax.process_index()]


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
