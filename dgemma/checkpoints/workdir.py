"""A training run's workdir: Orbax run checkpoints (`checkpoints/<step>/`), the run's `config.json`, its
tokenizer, metrics and TensorBoard events.

  WORKDIR/config.json              the experiment config (dgemma.settings.to_json), written atomically:
                                   at the start of a new run, and on resume only once the restore succeeded
  WORKDIR/tokenizer.model          the run's trained / given SentencePiece model (none for the byte tokenizer)
  WORKDIR/checkpoints/<step>/      `state` (step, params, optimizer state) and `data_iter` (the grain
                                   iterator state as JSON; in a multi-process run {"per_process": [...]})
  WORKDIR/corrupt/<step>-<time>/   a checkpoint that could not be read, moved aside (never deleted)
  WORKDIR/metrics.jsonl, tensorboard/, adapter/ (fine-tuning), samples.txt
  WORKDIR/.lock                    held (flock) by the training process writing the workdir; it names that
                                   process. The kernel releases it when the process ends, however it ends, so
                                   a lock file left by a killed run is stale and the next run takes it over

Orbax writes each step into a temporary directory and renames it when complete, so an interrupted save
never replaces a good checkpoint; keep-N rotation runs only after a newer step is complete, and the loop
never saves a non-finite state, so the last good checkpoint is never rotated away. `describe` reads a run's header
(config.json, once), `read` one step's params (for `dgemma.checkpoints.load`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from dgemma import distributed, files
from dgemma import settings as settings_lib
from dgemma.checkpoints.checkpoint import Checkpoint, Placement, check_finite, with_dtype
from dgemma.checkpoints.orbax_logs import quiet_orbax
from dgemma.errors import CheckpointError

STATE = "state"
DATA_ITER = "data_iter"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt"
LOCK_FILE = ".lock"


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
  return Path(workdir).absolute() / CHECKPOINTS


def is_workdir(path: str | os.PathLike) -> bool:
  p = Path(path)
  return (p / CONFIG_FILE).is_file() and checkpoint_dir(p).is_dir()


def read_config_json(workdir: str | os.PathLike) -> str:
  path = Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path}: not found: is {workdir} a dgemma training workdir?")
  text = path.read_text(encoding="utf-8")
  files.parse_json(text, path)  # a damaged config.json is named here, not deep inside a caller
  return text


def write_config_json(workdir: str | os.PathLike, text: str) -> None:
  files.write_text_atomic(Path(workdir) / CONFIG_FILE, text)


def check_writable(workdir: str | os.PathLike) -> None:
  """A run's workdir can be made and written, or one CheckpointError naming it, before anything is built (a
  read-only mount, a directory without permission): a probe file is created and removed in the workdir, or in its
  nearest existing parent when it does not exist yet."""
  path = Path(workdir)
  where = path
  while not where.exists() and where != where.parent:
    where = where.parent
  if not where.is_dir():
    raise CheckpointError(f"--workdir: {workdir} cannot be made: {where} is not a directory")
  try:
    fd, name = tempfile.mkstemp(prefix=".write_check_", dir=where)
    os.close(fd)
    os.unlink(name)
  except OSError as e:
    raise CheckpointError(f"--workdir: {workdir} cannot be written ({where}: {e.strerror or e}); use a writable "
                          "--workdir (a run writes its checkpoints, config.json and metrics there)") from None


@contextlib.contextmanager
def locked(workdir: str | os.PathLike) -> Iterator[None]:
  """Holds WORKDIR/.lock while a run writes the workdir (module docstring). A second run on the same workdir
  fails at once, naming the process that holds it; a lock file whose process has ended is taken over. On a
  filesystem without flock support the run goes on unlocked, with a warning."""
  path = Path(workdir) / LOCK_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        logging.warning("%s: cannot lock the workdir on this filesystem (%s); make sure no other run writes it", path, e)
        yield
        return
      holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
      raise CheckpointError(f"--workdir: {workdir} is in use by {holder}; wait for that run to end or stop it, "
                            "or use another --workdir") from None
    stale = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if stale:
      logging.warning("%s: taking over the lock of %s, which has ended", path, stale)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (f"process {os.getpid()} on {socket.gethostname()} (started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                   f"{' '.join(sys.argv)[:200]})\n").encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)
  finally:
    os.close(fd)  # releases the flock


def make_manager(workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False) -> ocp.CheckpointManager:
  quiet_orbax()
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                         create=not read_only, read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), item_names=(STATE, DATA_ITER), options=options)


def steps(workdir: str | os.PathLike) -> list[int]:
  """The complete checkpoint steps of a workdir, ascending (Orbax lists only finished saves)."""
  root = checkpoint_dir(workdir)
  if not root.is_dir():
    return []
  manager = make_manager(workdir, read_only=True, async_save=False)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def step_dir(workdir: str | os.PathLike, step: int) -> Path:
  return checkpoint_dir(workdir) / str(step)


def save_step(workdir: str | os.PathLike, step: int, state: Any, data_state: dict | None = None) -> None:
  """Writes one checkpoint step of a workdir outside a training loop, synchronously (a relaid copy, a run made of
  given weights)."""
  manager = make_manager(workdir, keep=1, async_save=False)
  try:
    save(manager, step, state, data_state)
    manager.wait_until_finished()
  finally:
    manager.close()


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict | None) -> None:
  items = {STATE: ocp.args.StandardSave(state)}
  if data_state is not None:
    items[DATA_ITER] = ocp.args.JsonSave(data_state)
  manager.save(step, args=ocp.args.Composite(**items))


def save_error(workdir: str | os.PathLike, error: BaseException) -> CheckpointError:
  """One line for a checkpoint save that failed (a full disk, a file size limit, a lost mount): the step's
  directory, the system's reason, the free space left there, and the last complete checkpoint, which is kept."""
  text = str(error)
  code = re.search(r"os_error_code='(\d+)'", text)
  errno_value = getattr(error, "errno", None) or (int(code.group(1)) if code else None)
  reason = os.strerror(errno_value) if errno_value else (text.strip().splitlines() or [type(error).__name__])[0][:200]
  root = checkpoint_dir(workdir)
  step = re.search(re.escape(str(root)) + r"/(\d+)(?:\.orbax-checkpoint-tmp)?", text)
  where = root / step.group(1) if step else root
  try:
    free = f"{shutil.disk_usage(root if root.exists() else workdir).free / 2**30:.2f} GiB free there"
  except OSError:
    free = "free space unknown"
  kept = steps(workdir)
  last = f"the last complete checkpoint, step {kept[-1]}, is kept" if kept else "no complete checkpoint was saved yet"
  return CheckpointError(f"saving checkpoint {where} failed: {reason} ({free}); training stopped and {last}. Free "
                         "space (or raise the limit) and re-run the command to resume")


# ---- reading, and naming what is broken ------------------------------------------------------------

_TENSORSTORE_FILE = re.compile(r'local file "([^"]+)"')


def damaged_file(directory: Path, error: BaseException) -> Path | None:
  """The file of a checkpoint step that made a restore fail: the innermost file tensorstore names in the
  error, else the first JSON file of the step that does not parse (Orbax's metadata files), else None."""
  named = [Path(p) for p in _TENSORSTORE_FILE.findall(str(error))]
  named = [p for p in named if p.is_file()]
  if named:
    return named[-1]
  for path in sorted(directory.rglob("*")):
    if not path.is_file() or path.suffix in (".txt",) or "d" in path.relative_to(directory).parts[:-1]:
      continue  # commit markers and array data (not JSON)
    if path.name.startswith("_") or path.name in ("metadata",) or path.parent.name == "array_metadatas":
      try:
        json.loads(path.read_bytes())
      except (ValueError, UnicodeDecodeError):
        return path
  return None


def restore_error(workdir: str | os.PathLike, step: int, error: BaseException, hint: str) -> CheckpointError:
  """A CheckpointError naming the step and the damaged file, with what to do about it."""
  directory = step_dir(workdir, step)
  bad = damaged_file(directory, error)
  where = f"file {bad}" if bad is not None else f"directory {directory}"
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  return CheckpointError(f"checkpoint step {step} of {workdir} cannot be read ({type(error).__name__} in {where}: "
                         f"{first}); {hint}")


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, *,
            with_data: bool = True) -> tuple[Any, dict | None]:
  """Restores `state` onto the shardings in `abstract_state` (a tree of jax.ShapeDtypeStruct), and the
  data iterator state. Raises whatever Orbax raises (see `restore_error`)."""
  items = {STATE: ocp.args.StandardRestore(abstract_state)}
  has_data = with_data and (Path(manager.directory) / str(step) / DATA_ITER).exists()
  if has_data:
    items[DATA_ITER] = ocp.args.JsonRestore()
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return restored[STATE], (restored[DATA_ITER] if has_data else None)


def restore_params(workdir: str | os.PathLike, step: int, abstract_params: Any) -> Any:
  """Only the params of a run checkpoint, onto the shardings of `abstract_params` (the optimizer state
  is never read: Orbax's partial restore of the `params` subtree)."""
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), abstract_params)
  quiet_orbax()
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    restored = checkpointer.restore(step_dir(workdir, step) / STATE, args=ocp.args.PyTreeRestore(
        item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True))
  finally:
    checkpointer.close()
  return restored["params"]


def move_aside(workdir: str | os.PathLike, step: int) -> Path:
  """Moves a checkpoint step that cannot be read to WORKDIR/corrupt/<step>-<time>/ (kept, not deleted)."""
  src = step_dir(workdir, step)
  dest = Path(workdir).absolute() / CORRUPT / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
  dest.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(str(src), str(dest))
  return dest


# ---- the data iterator's position, per process -----------------------------------------------------

def all_process_data_states(data_state: dict) -> dict:
  """The data_iter item to save: this process's iterator state, or in a multi-process run every
  process's (gathered as JSON bytes; Orbax writes JSON items from process 0 only). Call on every process."""
  if jax.process_count() == 1:
    return data_state
  blob = np.frombuffer(json.dumps(data_state).encode(), np.uint8)
  distributed.process_barrier("dgemma_gather_data_states")  # start the gathers together (gloo connect timeout)
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


def describe(path: str | os.PathLike, field: str = "path") -> Checkpoint:
  """The header of a run: its config.json (read here, once), architecture, steps (the latest to read) and tokenizer."""
  config_json = read_config_json(path)
  model, stored = settings_lib.run_model(config_json, Path(path) / CONFIG_FILE)
  available = tuple(steps(path))
  tok = Path(path) / TOKENIZER_FILE
  return Checkpoint(str(path), "workdir", model, field=field, step=available[-1] if available else None,
                    steps=available, config_json=config_json, tokenizer_file=tok if tok.is_file() else None,
                    stored_quantizer=stored)


def read(header: Checkpoint, placement: Placement, dtype: str | None = None) -> Any:
  """The params of step header.step (never the optimizer state), restored onto `placement` as the run stored them (a
  QLoRA run's frozen base quantized), checked finite. A step that cannot be read is one error naming it and the
  earlier step to try."""
  if header.step is None:
    raise CheckpointError(f"{header.field}: {checkpoint_dir(header.path)} holds no finished checkpoint "
                          f"(train first: python train.py --workdir={header.path})")
  try:
    restored = restore_params(header.path, header.step,
                              placement.abstract(with_dtype(header.model, dtype), header.stored_quantizer))
  except Exception as e:  # pylint: disable=broad-except  (Orbax / tensorstore / JSON errors of a damaged step)
    earlier = [s for s in header.steps if s < header.step]
    hint = (f"sample the previous step with sample.checkpoint_step={earlier[-1]}" if earlier else
            "no earlier step is left to sample")
    raise restore_error(header.path, header.step, e, hint) from e
  check_finite(restored, f"{header.path} step {header.step}")
  return restored
