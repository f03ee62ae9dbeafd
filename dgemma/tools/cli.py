"""What every dgemma command line shares: absl flag parsing whose config errors are one line naming the
flag, a config flag that reports a missing file as such, and a main() tail that prints bad input as
`<prog>: <message>` (exit status 1) instead of a traceback.

  def main(argv):
    cli.no_extra_args(argv)
    train_loop.train_and_evaluate(cli.config(_CONFIG), _WORKDIR.value)

  if __name__ == "__main__":
    cli.run(main, "train.py")
"""

from __future__ import annotations

import gc
import importlib.util
import logging as py_logging
import re
import shlex
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

from absl import app, flags

from dgemma import jax_cache, settings_fields
from dgemma.errors import CheckpointError, ConfigError, DataError, TrainingDiverged, TrainingInterrupted

# Errors that are the user's input, not a bug: printed as one line.
USER_ERRORS = (ConfigError, CheckpointError, DataError, TrainingDiverged, FileNotFoundError, FileExistsError)


_FLAG_KINDS = {str: "string", int: "integer", float: "float", bool: "bool"}

# CPython's cyclic garbage collector runs a young-generation pass every 700 net allocations (thresholds 700, 10,
# 10). Tracing and lowering a JAX program allocate millions of short-lived objects, so at those thresholds the
# collector runs thousands of times a trace. Commands (and the test suite) collect every 100,000 allocations
# instead; cycles are still collected, the oldest generation after 50 x 10 young passes. The tiny model's train
# step traces and lowers in 0.84x the time (bench/gc_trace.py, docs/benchmarks.md).
GC_THRESHOLDS = (100_000, 50, 10)


def collect_garbage_less_often(thresholds: Sequence[int] = GC_THRESHOLDS) -> None:
  """Sets the collector's thresholds for a process that traces JAX programs (see GC_THRESHOLDS)."""
  gc.set_threshold(*thresholds)


def define_setting_flags(group_cls, *names: str, unset: bool = False) -> dict[str, flags.FlagHolder]:
  """One --NAME flag per key NAME of the declared settings group `group_cls` (dgemma/settings_fields.py): its type,
  bounds and help (`GROUP.NAME: doc`) from the declaration, so a command's flag never restates a setting. Default:
  the declared one, or None with `unset` (a flag left out leaves the setting as it is)."""
  specs, fields_by_name = settings_fields.keys(group_cls), {f.name: f for f, _ in settings_fields.declared(group_cls)}
  out = {}
  for name in names:
    spec = specs[name]
    bounds = {} if spec.kind not in (int, float) else {
        k: v for k, v in (("lower_bound", spec.lo), ("upper_bound", spec.hi)) if v is not None and not (
            spec.lo_open if k == "lower_bound" else spec.hi_open)}
    out[name] = getattr(flags, f"DEFINE_{_FLAG_KINDS[spec.kind]}")(
        name, None if unset else fields_by_name[name].default, f"{group_cls.GROUP}.{name}: {spec.doc}", **bounds)
  return out


def _override_flags(argv: Sequence[str]) -> list[str]:
  """The --config.KEY=VALUE overrides on a command line."""
  return [a.split("=", 1)[0].lstrip("-") for a in argv[1:] if re.match(r"--?\w+\.\w", a)]


def config_file_failure(error: BaseException, files: Sequence[str]) -> str | None:
  """One line for an exception raised while a config file among `files` loaded: its syntax error or the exception
  its code raised, at the file's own line (`FILE:LINE: ...`), or a file that defines no get_config(); None when the
  exception did not come from one of them."""
  resolved = {str(Path(f).resolve()): f for f in files if f and Path(f).is_file()}
  if isinstance(error, OSError) and error.__cause__ is not None:  # config_flags' wrapper of a file that failed
    error = error.__cause__
  if isinstance(error, SyntaxError) and error.filename and str(Path(error.filename).resolve()) in resolved:
    return f"{error.filename}:{error.lineno}: {type(error).__name__}: {error.msg}"
  inside = [f for f in traceback.extract_tb(error.__traceback__) if str(Path(f.filename).resolve()) in resolved]
  if not inside:
    if isinstance(error, AttributeError) and getattr(error, "name", None) == "get_config" and len(resolved) == 1:
      return (f"{next(iter(resolved.values()))}: defines no get_config() (a config file returns its "
              "ml_collections.ConfigDict from get_config(), e.g. configs/demo.py)")
    return None
  last = inside[-1]
  return f"{last.filename}:{last.lineno}: in {last.name}: {type(error).__name__}: {error}"


def _config_files(argv: Sequence[str]) -> list[str]:
  """The files named by --FLAG=FILE.py or --FLAG=FILE.py:ARG on a command line (config files, as config_flags
  takes them)."""
  return [a.split("=", 1)[1].split(":")[0] for a in argv[1:] if re.match(r"--?\w+=[^:]+\.py(:|$)", a)]


def parse_flags(argv: Sequence[str], prog: str):
  """absl's parser; every flag error (an unknown flag, a config override that names no key or has a bad value,
  an override before --config=, a config file that failed to load: its syntax error, what its get_config raised,
  at the file's line) becomes one line `prog: ...`."""
  hint = "python -m dgemma.settings lists every key; mesh.shape has data, fsdp, expert, tensor"
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    failure = config_file_failure(e, _config_files(argv))
    if failure is None:
      return _flag_error(e, argv, prog, hint)
    sys.exit(f"{prog}: --config: {failure}")


def _flag_error(e: Exception, argv: Sequence[str], prog: str, hint: str):
  """parse_flags' line for an error that is not a config file's own; anything else is raised again."""
  if isinstance(e, flags.Error):  # unknown flags, flag order, bad flag values
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "before a value for --" in text:
      text += "; put --config=FILE first"
    elif text.startswith("Unknown command line flag 'config.") and not _config_files(argv):
      text += "; a --config.KEY override needs --config=FILE first (the config it overrides)"
    sys.exit(f"{prog}: {text} ({prog} --help lists the flags)")
  if isinstance(e, OSError):  # an override on a config file that failed to load: report the file's own error
    sys.exit(f"{prog}: --config: {e.__cause__ or e}")
  if isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
    missing = str(e).strip("'\" ")
    overrides = _override_flags(argv)
    named = [o for o in overrides if missing in o.split(".")] or overrides
    if isinstance(e, (AttributeError, KeyError)) and named:
      from dgemma.settings import did_you_mean
      what = f"--{named[0]}: no such config key" + did_you_mean(named[0].split(".", 1)[1])  # after --config.
    else:
      what = f"{', '.join('--' + o for o in named)}: {e}" if named else str(e)
    sys.exit(f"{prog}: {what} ({hint})")
  raise e


def config(holder):
  """The value of a config_flags flag; a config file that could not be loaded is a ConfigError naming it."""
  value = holder.value
  if value is None:
    return None
  try:
    value.keys()
  except IOError as e:  # config_flags' _ErrorConfig: the file did not load
    cause = e.__cause__ or e
    raise ConfigError(f"--{holder.name}: {cause}") from None
  return value


def load_config_file(spec: str):
  """'configs/demo.py' or 'configs/demo.py:arg' -> its get_config() / get_config(arg), as --config=... reads it
  (for commands that take a config file name outside absl's config flags)."""
  path, _, arg = spec.partition(":")
  if not Path(path).is_file():
    raise FileNotFoundError(f"config file {path} does not exist")
  module_spec = importlib.util.spec_from_file_location(f"_dgemma_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    failure = config_file_failure(e, [path])
    if failure is None:
      raise
    raise ConfigError(f"config file {failure}") from None


def no_extra_args(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}")


def resume_command() -> str:
  """This process's command line, to run again (a resumable command resumes when re-run as it was)."""
  return " ".join(shlex.quote(a) for a in ["python"] + sys.argv)


class _NoPlatformProbe(py_logging.Filter):
  """JAX's INFO line for each platform it tried and did not find ("Unable to initialize backend 'tpu': ... libtpu.so
  ..."), printed by every command on a machine without that accelerator."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not (record.levelno <= py_logging.INFO and str(record.msg).startswith("Unable to initialize backend"))


def run(main: Callable, prog: str, user_errors: tuple = ()) -> None:
  """app.run(main) with `parse_flags` and bad input (USER_ERRORS + `user_errors`) as one line, without JAX's
  platform-probing notes (`_NoPlatformProbe`), the garbage collector set for tracing (GC_THRESHOLDS)."""
  caught = USER_ERRORS + tuple(user_errors)
  collect_garbage_less_often()
  probe = py_logging.getLogger("jax._src.xla_bridge")
  if not any(isinstance(f, _NoPlatformProbe) for f in probe.filters):
    probe.addFilter(_NoPlatformProbe())

  def guarded(argv):
    jax_cache.enable()
    try:
      return main(argv)
    except caught as e:
      sys.exit(f"{prog}: {e}")
    except TrainingInterrupted as e:  # saved; one line and the command that resumes, the signal's exit status
      print(f"{prog}: {e}; resume with: {resume_command()}", file=sys.stderr)
      sys.exit(e.exit_code)

  app.run(guarded, flags_parser=lambda argv: parse_flags(argv, prog))
