"""Copy a training workdir into the other layer layout (model.scan_layers), so that it resumes there exactly.

  python -m dgemma.tools.relayout --workdir=workdirs/run --out=workdirs/run_unrolled --noscan_layers
  python train.py --config=CONFIG --workdir=workdirs/run_unrolled --config.model.scan_layers=False \
      --config.train.num_steps=8000

A run's checkpoints keep the layout it was trained with (`nn.scan` over stacked blocks, or one unrolled
block: dgemma/checkpoints/layout.py), and resuming a workdir with the other one is refused, since one
workdir's steps must all read with its config.json. This tool writes a new workdir instead: one checkpoint
(the latest finished step, or --step) with the params, the optimizer state (Adam's moments are
params-shaped) and a distillation run's teacher relaid, the data iterator's position as it was, the
run's config.json with model.scan_layers set, and its tokenizer. Nothing in --workdir is changed.
Relaying only slices and stacks, so the new workdir resumes at exactly the state the old one holds.
For a fresh optimizer state instead, start a new run with --config.train.init_from=WORKDIR, which relays
the params itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import jax
from absl import flags, logging

from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import layout
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import CheckpointError, ConfigError
from dgemma.tools import cli
from dgemma.train import state as state_lib

_FLAGS = {}


def _define_flags():
  """Defined only when run as a program: other commands use the names --workdir, --out and --step too."""
  _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "The training workdir to copy (read only).", required=True)
  _FLAGS["out"] = flags.DEFINE_string("out", None, "The new workdir to write (must not exist).", required=True)
  _FLAGS["scan_layers"] = flags.DEFINE_bool("scan_layers", None, "The new workdir's model.scan_layers (the other "
                                            "layout).", required=True)
  _FLAGS["step"] = flags.DEFINE_integer("step", None, "The step to copy (default: the latest finished one).")


def relayout_workdir(src: str, out: str, scan_layers: bool, *, step: Optional[int] = None) -> int:
  """Writes `out`: `src`'s checkpoint at `step` (default the latest) in the layout of scan_layers, with
  its data position, config.json (model.scan_layers set) and tokenizer. Returns the step copied."""
  if not workdir_ckpt.is_workdir(src):
    raise FileNotFoundError(f"--workdir: {src} is not a training workdir (config.json + checkpoints/)")
  available = workdir_ckpt.steps(src)
  if not available:
    raise CheckpointError(f"--workdir: {workdir_ckpt.checkpoint_dir(src)} holds no finished checkpoint")
  if step is not None and step not in available:
    raise CheckpointError(f"--step: step {step} not in {workdir_ckpt.checkpoint_dir(src)} (have {available})")
  if Path(out).exists():
    raise FileExistsError(f"--out: {out} already exists")
  step = available[-1] if step is None else step
  saved = settings_lib.load_json(workdir_ckpt.read_config_json(src), source=Path(src) / workdir_ckpt.CONFIG_FILE)
  if saved.model.scan_layers == scan_layers:
    raise ConfigError(f"--scan_layers: {src} already has model.scan_layers={scan_layers}")
  new = saved.replace(**{"model.scan_layers": scan_layers})

  mesh = mesh_lib.make_mesh(saved.mesh.axis_sizes)
  _, _, saved_abstract, _ = state_lib.run_abstract_state(saved, mesh)
  _, _, _, new_shardings = state_lib.run_abstract_state(new, mesh)
  reader = workdir_ckpt.make_manager(src, keep=len(available) + 1, async_save=False)
  try:
    state, data_state = workdir_ckpt.restore(reader, step, saved_abstract)
  except Exception as e:  # pylint: disable=broad-except  (Orbax / tensorstore / JSON errors of a damaged step)
    raise workdir_ckpt.restore_error(src, step, e, "copy an earlier step with --step") from e
  finally:
    reader.close()
  relaid = {k: layout.relayout(getattr(state, k), saved.model, new.model)
            for k in ("params", "opt_state", "teacher_params") if hasattr(state, k)}
  state = jax.device_put(state.replace(**relaid), new_shardings)

  tmp = Path(out).with_name(f".{Path(out).name}.tmp")  # the new workdir appears whole, or not at all
  if tmp.exists():
    shutil.rmtree(tmp)
  tmp.mkdir(parents=True)
  workdir_ckpt.write_config_json(tmp, new.config_json)
  tokenizer = Path(src) / workdir_ckpt.TOKENIZER_FILE
  if tokenizer.is_file():
    shutil.copyfile(tokenizer, tmp / workdir_ckpt.TOKENIZER_FILE)
  workdir_ckpt.save_step(tmp, step, state, data_state)
  tmp.rename(out)
  logging.info("Wrote %s: step %d of %s with model.scan_layers=%s", out, step, src, scan_layers)
  return step


def main(argv):
  cli.no_extra_args(argv)
  src, out, scan_layers = _FLAGS["workdir"].value, _FLAGS["out"].value, _FLAGS["scan_layers"].value
  step = relayout_workdir(src, out, scan_layers, step=_FLAGS["step"].value)
  print(f"{out}: step {step} of {src}, model.scan_layers={scan_layers}")


if __name__ == "__main__":
  _define_flags()
  cli.run(main, "dgemma.tools.relayout")
