"""The training loop: `train_and_evaluate(config, workdir)` is what train.py calls.

The step is jitted over a `jax.sharding.Mesh` built from `config.mesh`; parameters are placed by their
logical axis names and `mesh.axis_rules` (dgemma.train.state), the batch over the batch axes.

Safety, in order (docs/reliability.md):
  1. Every setting is checked (dgemma.settings) and the data is built before the workdir is created, so a
     run that fails validation leaves nothing behind.
  2. Re-running a workdir resumes it. A config whose architecture, fine-tuning layout, optimizer state or
     tokenizer differs from the saved config.json is an error listing the keys, before anything is written;
     config.json is replaced (atomically) only once the restore has succeeded. Other training keys
     (settings.training_differences: opt.lr, train.num_steps, data.*, diffusion.*) may change on resume; each
     such resume is logged and recorded in WORKDIR/config_changes.jsonl. A finished run with changed
     training keys is an error: nothing would train with them.
  3. A checkpoint that cannot be read is named (step and file). With train.on_corrupt_checkpoint='fallback'
     (default) it is moved to WORKDIR/corrupt/ (never deleted) and the previous complete step is restored.
  4. metrics.jsonl drops the rows past the restored step, so a resumed step never has two train rows.
  5. A non-finite loss, gradient norm or updated state stops training with TrainingDiverged naming the step
     (train.nonfinite='halt'), or that update is dropped and counted (train.nonfinite='skip', halting after
     train.max_nonfinite_skips in a row). A non-finite state is never saved, so keep-N rotation never
     removes the last good checkpoint.
  6. One run at a time writes a workdir: process 0 holds WORKDIR/.lock (checkpoints.workdir.locked), so a
     second train.py on it fails at once, naming the first; a lock left by a killed run is taken over. A new
     workdir that fails before its first checkpoint is saved (a bad train.init_from, an interrupt) is removed.
  7. SIGINT / SIGTERM stop training after the current step, which is saved, with TrainingInterrupted naming it
     (dgemma/train/interrupts.py; train.py prints it as one line with the resume command); a second signal exits
     at once, keeping the last complete checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm import tqdm

from dgemma import checkpoints
from dgemma import data as data_lib
from dgemma import distributed
from dgemma import files
from dgemma import mesh as mesh_lib
from dgemma import finetune as finetune_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.checkpoints import orbax_logs
from dgemma.checkpoints.orbax_logs import quiet_orbax
from dgemma.diffusion import distill as distill_lib
from dgemma.errors import CheckpointError, ConfigError, DataError, TrainingDiverged, TrainingInterrupted
from dgemma.train import evaluate, interrupts, metrics as metrics_lib, optimizer as optimizer_lib, rl_step
from dgemma.train import state as state_lib, step as step_lib

CONFIG_CHANGES_FILE = "config_changes.jsonl"  # WORKDIR/: {"step", "changes"} per resume with changed training keys
BASE_IDENTITY_FILE = "base_identity.txt"  # WORKDIR/: train.init_from's fingerprint when the run started from it


def prepare_data(settings):
  """Builds the dataset and tokenizer once (process 0 first on multi-host runs), then opens them."""
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      data_lib.prepare(settings)
    distributed.process_barrier("dgemma_prepare_data")  # not a device collective: building may take long
  return data_lib.prepare(settings)


def check_resume(workdir: Path, settings) -> list[str]:
  """Re-running a workdir must keep what its checkpoints were saved with (module docstring, 2). Returns the
  training keys that change on this resume ('key: saved -> new'); a finished run cannot take any."""
  if not workdir_ckpt.is_workdir(workdir) or not workdir_ckpt.steps(workdir):
    return []
  saved = settings_lib.load_json(workdir_ckpt.read_config_json(workdir), source=workdir / workdir_ckpt.CONFIG_FILE)
  diffs = settings_lib.architecture_differences(saved, settings)
  if diffs:
    hint = ""
    if any(d.startswith("model.scan_layers:") for d in diffs):
      hint = (f". For the other layer layout alone, copy the run into it (python -m dgemma.tools.relayout "
              f"--workdir={workdir} --out=NEW_WORKDIR --{'' if settings.model.scan_layers else 'no'}scan_layers) "
              f"or start a new run from its params (--config.train.init_from={workdir})")
    raise ConfigError(f"--workdir: {workdir} holds checkpoints of another setup, so it cannot resume with this "
                      f"config (saved -> new): {'; '.join(diffs)}. Use a new --workdir, or the saved settings{hint}")
  changes = settings_lib.training_differences(saved, settings)
  train = settings.train
  resume_step = train.restore_step if train.restore_step >= 0 else workdir_ckpt.steps(workdir)[-1]
  if changes and resume_step >= train.num_steps:
    raise ConfigError(f"--workdir: the run in {workdir} is finished (step {resume_step}, train.num_steps="
                      f"{train.num_steps}) and was trained with other settings (saved -> new): "
                      f"{'; '.join(changes)}. Nothing would train with them, and what the workdir holds is the "
                      "saved run's model. Use a new --workdir, or raise train.num_steps to train on with them")
  return changes  # logged once the step it resumes from is restored (_train: a damaged step may fall back)


def _record_config_changes(workdir: Path, step: int, changes: list[str]) -> None:
  """One row per resume that changed training keys: config.json then holds only the latest settings
  (process 0 writes it)."""
  if changes:
    with open(workdir / CONFIG_CHANGES_FILE, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, "changes": changes}) + "\n")


def _copy_tokenizer(workdir: Path, tokenizer) -> None:
  """The run's SentencePiece model beside its checkpoints (what dgemma.load reads back)."""
  model_path = getattr(tokenizer, "model_path", None)
  dest = workdir / workdir_ckpt.TOKENIZER_FILE
  if model_path is not None and jax.process_index() == 0 and not dest.exists():
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copyfile(model_path, tmp)
    tmp.replace(dest)


class RunPrograms(NamedTuple):
  """What a run traces and compiles, made once per process for each setup (`run_programs`)."""
  optimizer: Any
  init_fn: Callable
  abstract_state: Any
  state_shardings: Any
  init_state: Callable   # jitted: rng -> a fresh TrainState placed on the mesh
  train_step: Callable   # jitted: (state, batch, rng) -> (state, metrics), the state donated; an RL run's
                         # rl_step.GRPO (rollout, rewards, rl.num_iterations updates)
  eval_step: Callable    # jitted: (params, batch, rng) -> metrics
  laid_out: bool         # the train step compiled with the frozen base laid out by its compiler
                         # (state_lib.step_shardings): a run calls `compiled_steps` and puts its state in their layouts
  compiled: dict         # compiled_steps' cache of a laid-out run: batch shape -> (train step, eval step)


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # run_programs' cache, the latest last
_PROGRAMS_KEPT = 2


def run_programs(settings, mesh) -> RunPrograms:
  """The optimizer, state layout and jitted init / train / eval steps of the run `settings` describe on `mesh`.

  Re-running train_and_evaluate in one process with the same model, objective, optimizer, schedule length,
  fine-tuning, distillation and mesh (a resume, a notebook cell run again) reuses the jitted functions, so
  nothing is traced or compiled twice: jax.jit keys its caches on the function object, which would be new
  on every call. Data, checkpoint and logging settings are not part of the key (they are not in the programs).
  The programs of the last two setups are kept."""
  key = (settings.model, settings.diffusion, settings.opt, settings.finetune, settings.distill,
         settings.train.num_steps, settings.train.nonfinite, settings.mesh.axis_rules, mesh, settings.rl,
         settings.canvas_sampler if settings.rl.enabled else None)
  if key in _PROGRAMS:
    _PROGRAMS.move_to_end(key)
  else:
    _PROGRAMS[key] = _make_programs(settings, mesh)
    while len(_PROGRAMS) > _PROGRAMS_KEPT:
      _PROGRAMS.popitem(last=False)
  return _PROGRAMS[key]


def clear_programs() -> None:
  """Drops run_programs' cache (its jitted functions and their compiled executables), e.g. in a notebook before
  training a model of another size; the next run traces and compiles afresh."""
  _PROGRAMS.clear()


def _make_programs(settings, mesh) -> RunPrograms:
  """run_programs' work, reading only the settings in its key."""
  optimizer, init_fn, abstract_state, state_shardings = state_lib.run_abstract_state(settings, mesh)
  # A fresh state is a TrainState; a distillation run adds its round-0 teacher to it (_train).
  fresh_shardings = state_lib.TrainState(step=state_shardings.step, params=state_shardings.params,
                                         opt_state=state_shardings.opt_state)
  schedule = optimizer_lib.make_schedule(settings.opt, settings.train.num_steps)
  data_sharding = mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules)
  step_shardings = state_lib.step_shardings(settings, state_shardings, abstract_state)
  train_step = jax.jit(step_lib.make_train_step(settings.model, settings.diffusion, optimizer, schedule,
                                                grad_accum_steps=settings.opt.grad_accum_steps,
                                                finetune_cfg=settings.finetune,
                                                skip_nonfinite=settings.train.nonfinite == "skip",
                                                distill_cfg=settings.distill),
                       in_shardings=(step_shardings, data_sharding, None), out_shardings=(step_shardings, None),
                       donate_argnums=(0,))
  if settings.rl.enabled:
    train_step = rl_step.GRPO(settings, optimizer, schedule, state_shardings)
  eval_step = jax.jit(step_lib.make_eval_step(settings.model, settings.diffusion),
                      in_shardings=(state_shardings.params, data_sharding, None))
  return RunPrograms(optimizer, init_fn, abstract_state, state_shardings,
                     state_lib.jit_init(init_fn, fresh_shardings), train_step, eval_step,
                     laid_out=step_shardings is not state_shardings, compiled={})


def batch_specs(settings, mesh, batch_keys: tuple[str, ...] = ("tokens", "segment_ids", "positions")) -> dict:
  """The shapes of a training batch on `mesh`: data.batch_size x data.seq_len rows of int32 `batch_keys`, sharded
  as the run shards its batches (what the train and eval steps are lowered for)."""
  sharding = mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules)
  return {k: jax.ShapeDtypeStruct((settings.data.batch_size, settings.data.seq_len), jnp.int32, sharding=sharding)
          for k in batch_keys}


def compiled_steps(programs: RunPrograms, train_step, settings, mesh, base_rng, eval_rng,
                   batch_keys: tuple[str, ...] = ("tokens", "segment_ids", "positions")) -> tuple[Any, Any]:
  """`train_step` and the eval step compiled ahead of time for the run's batch (data.batch_size x data.seq_len
  rows of int32 `batch_keys`: an SFT run's rows add 'loss_mask'): what a multi-process run compiles before its first
  collective, and what a laid-out run (`RunPrograms.laid_out`) calls: only the compiled step knows the layouts it
  picked for the frozen base (`input_formats`), so the eval step is compiled on those same layouts of the params,
  the step's output state is held to them, and the run puts its state in them (mesh_lib.put, in _train). A
  laid-out run's pair is kept in `programs.compiled`."""
  key = ((settings.data.batch_size, settings.data.seq_len), tuple(sorted(batch_keys)))
  if programs.laid_out and key in programs.compiled:
    return programs.compiled[key]
  data_sharding = mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules)
  batch_spec = batch_specs(settings, mesh, batch_keys)
  train_compiled = train_step.lower(programs.abstract_state, batch_spec, base_rng).compile()
  eval_step = programs.eval_step
  if programs.laid_out:
    formats = train_compiled.input_formats[0][0]
    if jax.tree.leaves(train_compiled.output_formats[0]) != jax.tree.leaves(formats):
      # the compiler laid the updated state out otherwise than the state it reads: the next step could not take
      # it. Compile again with both fixed to the layouts it picked for the input.
      logging.info("train step: the compiled state's output layouts differ from its inputs'; compiling with both "
                   "set to the input layouts")
      fixed = jax.jit(train_step.__wrapped__, in_shardings=(formats, data_sharding, None),
                      out_shardings=(formats, None), donate_argnums=(0,))
      train_compiled = fixed.lower(programs.abstract_state, batch_spec, base_rng).compile()
    eval_step = jax.jit(programs.eval_step.__wrapped__, in_shardings=(formats.params, data_sharding, None))
  steps = train_compiled, eval_step.lower(programs.abstract_state.params, batch_spec, eval_rng).compile()
  if programs.laid_out:
    programs.compiled[key] = steps
  return steps


def _restore(manager, workdir: Path, settings, abstract_state):
  """(step, state, data_state) of the checkpoint to resume from, falling back past unreadable steps
  (module docstring, 3); (None, None, None) for a fresh run."""
  available = sorted(manager.all_steps())
  wanted = settings.train.restore_step
  if not available and wanted < 0:
    return None, None, None
  if wanted >= 0 and wanted not in available:
    raise CheckpointError(f"train.restore_step: step {wanted} not in {workdir_ckpt.checkpoint_dir(workdir)} "
                          f"(have {available})")
  candidates = [wanted] if wanted >= 0 else list(reversed(available))
  for step in candidates:
    try:
      state, data_state = workdir_ckpt.restore(manager, step, abstract_state)
      return step, state, data_state
    except Exception as e:  # pylint: disable=broad-except  (Orbax / tensorstore / JSON errors of a damaged step)
      earlier = [s for s in available if s < step]
      hint = (f"resume from the previous step with train.restore_step={earlier[-1]}, or set "
              "train.on_corrupt_checkpoint='fallback'" if earlier else "no earlier step is left")
      error = workdir_ckpt.restore_error(workdir, step, e, hint)
      if settings.train.on_corrupt_checkpoint == "error" or wanted >= 0:
        raise error from e
      if jax.process_index() == 0:
        moved = workdir_ckpt.move_aside(workdir, step)
        logging.warning("%s -- moved it to %s; restoring the previous complete step", error, moved)
      distributed.process_barrier(f"dgemma_moved_aside_{step}")
      manager.reload()
  raise CheckpointError(f"--workdir: no checkpoint of {workdir} can be read (each was moved to "
                        f"{workdir / workdir_ckpt.CORRUPT}); remove the workdir to start afresh")


def train_and_evaluate(config, workdir: str, *,
                       stop_after_steps: Optional[int] = None) -> state_lib.TrainState:
  """Trains (resuming from the latest checkpoint in workdir/checkpoints) and returns the final state. `config`: an
  experiment config (checked here, dgemma.settings.from_config) or Settings.

  `stop_after_steps` ends this run early (as a preemption would) after that many steps of this
  invocation, saving a checkpoint; the schedule still follows config.train.num_steps.
  """
  quiet_orbax()
  if Path(workdir).exists() and not Path(workdir).is_dir():
    raise ConfigError(f"--workdir: {workdir} is a file, not a directory")
  if jax.process_index() == 0:
    workdir_ckpt.check_writable(workdir)
  # bad config -> one clear error, before any work; below, typed settings only
  settings = config if isinstance(config, settings_lib.Settings) else settings_lib.from_config(config)
  optimizer_lib.check(settings.opt, settings.finetune)
  workdir_path = Path(workdir)
  config_changes = check_resume(workdir_path, settings)
  if settings.train.init_from:
    state_lib.check_init_from(settings.train.init_from, settings.model)
  if settings.rl.enabled:
    rl_step.check(settings)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  mesh_lib.check_batch_fits_mesh(settings.data.batch_size, settings.opt.grad_accum_steps, mesh,
                                 settings.mesh.axis_rules)
  prepared = prepare_data(settings)
  if prepared.tokenizer.vocab_size > settings.model.vocab_size:
    raise ConfigError(f"model.vocab_size: {settings.model.vocab_size} is smaller than the tokenizer's "
                      f"vocabulary ({prepared.tokenizer.vocab_size})")
  created = not workdir_path.exists()
  workdir_path.mkdir(parents=True, exist_ok=True)
  with workdir_ckpt.locked(workdir_path) if jax.process_index() == 0 else contextlib.nullcontext():
    try:
      with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):  # activation constraints apply inside
        return _train(settings, workdir_path, mesh, prepared, stop_after_steps, config_changes)
    except BaseException:
      if created and jax.process_index() == 0 and not workdir_ckpt.steps(workdir_path):
        # A new run that failed before its first checkpoint leaves no half-made workdir behind (module docstring, 6).
        shutil.rmtree(workdir_path, ignore_errors=True)
      raise


def _train(settings, workdir_path: Path, mesh, prepared, stop_after_steps: Optional[int],
           config_changes: list[str]) -> state_lib.TrainState:
  model_cfg, train_cfg = settings.model, settings.train
  _copy_tokenizer(workdir_path, prepared.tokenizer)
  num_steps = train_cfg.num_steps
  programs = run_programs(settings, mesh)
  optimizer, init_fn = programs.optimizer, programs.init_fn
  abstract_state, state_shardings = programs.abstract_state, programs.state_shardings
  distilling = distill_lib.enabled(settings.distill)
  data_sharding = mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules)

  manager = workdir_ckpt.make_manager(workdir_path, keep=train_cfg.keep_checkpoints,
                                      async_save=train_cfg.async_checkpointing)
  train_iter = data_lib.make_iterator(settings, prepared, "train", shard_index=jax.process_index(),
                                      shard_count=jax.process_count())
  restored_step, state, data_state = _restore(manager, workdir_path, settings, abstract_state)
  if restored_step is not None:
    data_state = workdir_ckpt.this_process_data_state(data_state)
    if data_state is not None:
      try:
        train_iter.set_state(data_state)
      except data_lib.DataChanged as e:
        if not settings.data.restart_if_changed:
          raise DataError(f"data: {e} since step {restored_step} of {workdir_path} was saved, so its place in the "
                          "data cannot carry over. Train in a new --workdir, keep the saved settings, or resume with "
                          "--config.data.restart_if_changed=True (the model and optimizer resume; the data is read "
                          "from its beginning)") from None
        logging.warning("data: %s since step %d was saved; data.restart_if_changed: the data is read from its "
                        "beginning", e, restored_step)
    logging.info("Resumed from step %d (%s)", restored_step, workdir_ckpt.checkpoint_dir(workdir_path))
    if config_changes:
      logging.warning("Resuming %s from step %d with changed training settings (saved -> new; recorded in %s): %s",
                      workdir_path, restored_step, CONFIG_CHANGES_FILE, "; ".join(config_changes))
  elif train_cfg.init_from:
    if jax.process_index() == 0:  # the base as this run read it at its start, which its adapter records
      files.write_text_atomic(workdir_path / BASE_IDENTITY_FILE, checkpoints.identity(train_cfg.init_from) + "\n")
    state = state_lib.state_from_checkpoint(train_cfg.init_from, model_cfg, optimizer, state_shardings,
                                            settings.mesh.axis_rules, init_fn, jax.random.PRNGKey(settings.seed),
                                            finetune_lib.base_quantizer(settings.finetune))
  else:
    state = programs.init_state(jax.random.PRNGKey(settings.seed))
  if distilling and restored_step is None:  # round 0's teacher: the run the student starts from
    state = state_lib.with_teacher(state, state_lib.copy_params(state.params, state_shardings.params))
  if settings.rl.enabled and restored_step is None:  # the KL term's reference: the run's start
    ref = finetune_lib.trained_leaves(state.params, settings.finetune)
    state = state_lib.with_reference(state, settings.finetune, state_lib.copy_params(ref, state_shardings.ref_params))
  if jax.process_index() == 0:  # only now: a failed restore leaves the saved config as it was
    workdir_ckpt.write_config_json(workdir_path, settings.config_json)
    if restored_step is not None:
      _record_config_changes(workdir_path, restored_step, config_changes)
  writer = metrics_lib.MetricWriter(workdir_path)
  writer.truncate_after(restored_step or 0)

  base_rng = jax.random.fold_in(jax.random.PRNGKey(settings.seed), 1)
  eval_rng = evaluate.validation_rng(settings)
  skip_nonfinite = train_cfg.nonfinite == "skip"
  train_step, eval_step = programs.train_step, programs.eval_step
  if settings.rl.enabled:
    train_step = train_step.bind(prepared.tokenizer)
  advance = getattr(train_step, "steps_per_call", 1)  # updates per call: an RL step's rl.num_iterations
  start_step = int(state.step)
  end_step = num_steps if stop_after_steps is None else min(num_steps, start_step + -(-stop_after_steps // advance)
                                                             * advance)
  first_batch = next(train_iter) if start_step < end_step else None
  if first_batch is not None and (programs.laid_out or jax.process_count() > 1):
    train_step, eval_step = compiled_steps(programs, train_step, settings, mesh, base_rng, eval_rng,
                                           batch_keys=tuple(first_batch))
    if programs.laid_out:  # the frozen base in the layouts the step's compiler picked for it, once
      state = mesh_lib.put(state, train_step.input_formats[0][0])
    if jax.process_count() > 1:
      # Both steps are compiled first, then every process waits: the first cross-process collective
      # must start everywhere within gloo's 30 s connect timeout, and compile times differ.
      distributed.process_barrier("dgemma_steps_compiled")

  tokens_per_step = settings.data.batch_size * settings.data.seq_len
  if settings.rl.enabled:  # the tokens sampled per update
    tokens_per_step = settings.data.batch_size * settings.rl.group_size * settings.diffusion.canvas_len // advance
  reached = lambda done, every: done // every != (done - advance) // every  # a multiple of `every` in this call
  bar = None
  if train_cfg.progress_bar and jax.process_index() == 0 and metrics_lib.interactive_output():
    bar = tqdm(total=num_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
  window_start, window_steps, pending = time.perf_counter(), 0, []
  skips_in_a_row = 0
  last_saved = restored_step
  interrupted = False
  with interrupts.StopRequest() as stop, orbax_logs.closed_loop_noise_dropped():  # SIGINT / SIGTERM: this step is
    # the last, saved (interrupts.py); a failed asynchronous save is one line (workdir_ckpt.save_error)
    try:
      host_batch = first_batch
      for step in range(start_step, end_step, advance):
        state, metrics = train_step(state, step_lib.device_batch(host_batch, data_sharding), base_rng)
        done = step + advance
        try:  # a background save that has ended in failure stops the run here, not at the next save
          if not manager.is_saving_in_progress():
            manager.wait_until_finished()  # returns at once; re-raises what the save's finalize thread raised
        except Exception as e:  # pylint: disable=broad-except  (the disk's, in one line)
          raise workdir_ckpt.save_error(workdir_path, e) from e
        stream_state = train_iter.get_state()  # the stream after this step's batch: what its checkpoint resumes
        # The next batch is made here, while the device runs this step (dispatch returns before it finishes).
        host_batch = next(train_iter, None) if done < end_step else None
        interrupted = done < end_step and stop.requested()
        last = done == end_step or host_batch is None or interrupted
        if host_batch is None and done < end_step:
          logging.warning("train step %d: the training data ended (data.num_epochs=%d) before step %d; stopping here",
                          done, settings.data.num_epochs, end_step)
        if float(metrics["nonfinite"]):  # one scalar to the host per step: nothing non-finite goes further
          skips_in_a_row += 1
          what = ", ".join(f"{k}={float(metrics[k]):.4g}" for k in ("loss", "grad_norm"))
          kept = f"the last checkpoint (step {last_saved}) is kept" if last_saved else "no checkpoint was saved yet"
          if not skip_nonfinite:
            raise TrainingDiverged(f"train step {done}: non-finite loss, gradient norm or updated state ({what}); "
                                   f"training stopped before saving it ({kept}). Lower opt.lr, check the data, or "
                                   "set train.nonfinite='skip' to drop such updates")
          if skips_in_a_row >= train_cfg.max_nonfinite_skips:
            raise TrainingDiverged(f"train step {done}: {skips_in_a_row} non-finite updates in a row were skipped "
                                   f"(train.max_nonfinite_skips={train_cfg.max_nonfinite_skips}; {what}); {kept}")
          logging.warning("train step %d: non-finite update skipped (%s)", done, what)
        else:
          skips_in_a_row = 0
        pending.append(metrics)
        window_steps += advance
        if reached(done, train_cfg.log_every) or last:
          window = _window_metrics(pending, window_steps * tokens_per_step / max(time.perf_counter() - window_start,
                                                                                 1e-9), skip_nonfinite)
          writer.write(done, window)
          if bar is not None:
            shown = dict(loss=f"{window['loss']:.3f}", tok_s=f"{window['tokens_per_sec']:.0f}")
            if "reward_mean" in window:  # an RL step's
              shown = dict(reward=f"{window['reward_mean']:.3f}", kl=f"{window['kl']:.4f}",
                           samples_s=f"{window['samples_per_sec']:.1f}")
            bar.set_postfix(**shown)
          window_start, window_steps, pending = time.perf_counter(), 0, []
        if bar is not None:
          bar.update(advance)
        if reached(done, train_cfg.eval_every) or done == num_steps:
          eval_iter = data_lib.make_iterator(settings, prepared, settings.eval.split, shard_index=jax.process_index(),
                                             shard_count=jax.process_count())
          writer.write(done, evaluate.validation_metrics(eval_step, state.params, eval_iter, train_cfg.eval_batches,
                                                         data_sharding, eval_rng), prefix="eval")
          window_start = time.perf_counter()  # do not count evaluation in tokens/s
        if reached(done, train_cfg.ckpt_every) or last:
          try:  # an asynchronous save's failure surfaces at the next save (or at the end, below)
            workdir_ckpt.save(manager, done, state, workdir_ckpt.all_process_data_states(stream_state))
          except Exception as e:  # pylint: disable=broad-except  (the disk's, in one line)
            raise workdir_ckpt.save_error(workdir_path, e) from e
          last_saved = done
        if last:
          break
    finally:
      save_failed = None
      try:
        manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except  (an asynchronous save that failed)
        save_failed = workdir_ckpt.save_error(workdir_path, e)
        save_failed.__cause__ = e
      finally:
        try:
          manager.close()
        except Exception:  # pylint: disable=broad-except  (the same failure again; reported above)
          if save_failed is None:
            raise
      writer.close()
      if bar is not None:
        bar.close()
    if save_failed is not None:  # raised only when nothing else was: a first error is the one reported
      raise save_failed
  if interrupted:
    raise TrainingInterrupted(f"interrupted by {stop.name} after step {done} of {num_steps}; saved: "
                              f"{workdir_ckpt.step_dir(workdir_path, done)}", stop.signum)
  if settings.finetune.mode != "full" and settings.finetune.save_adapter and int(state.step) == num_steps:
    adapter_ckpt.save_adapter(workdir_path / adapter_ckpt.ADAPTER_DIR, state.params, model_cfg, settings.finetune,
                              base=train_cfg.init_from, step=int(state.step), run_config_json=settings.config_json,
                              base_identity=_base_identity(workdir_path))
  return state


def _base_identity(workdir: Path) -> str:
  """The fingerprint of train.init_from taken when the run started from it (BASE_IDENTITY_FILE; '' for a run
  started before fingerprints were kept): a base trained further since is not recorded as the adapter's."""
  path = workdir / BASE_IDENTITY_FILE
  return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


def _window_metrics(pending: list, tokens_per_sec: float, skip_nonfinite: bool) -> dict[str, float]:
  """The mean of each metric over a logging window; with skipped (non-finite) steps, over the others,
  plus their count as nonfinite_skips."""
  host = [jax.device_get(m) for m in pending]
  kept = [m for m in host if not float(m["nonfinite"])] if skip_nonfinite else host
  out = {k: float(np.mean([m[k] for m in kept])) if kept else math.nan for k in host[-1] if k != "nonfinite"}
  out["tokens_per_sec"] = tokens_per_sec
  if skip_nonfinite:
    out["nonfinite_skips"] = float(len(host) - len(kept))
  return out
