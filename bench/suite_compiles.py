"""Where the test suite's time goes to JAX: every jit trace, XLA compile and persistent-cache load, by test.

The suite is bound by tracing and compiling (docs/benchmarks.md, "The test suite's traces and compiles"). Run it
with this file as a pytest plugin, then summarise:

  DGEMMA_COMPILE_LOG=/tmp/compiles .venv/bin/python -m pytest -q -n 2 -p bench.suite_compiles tests
  .venv/bin/python bench/suite_compiles.py --log_dir=/tmp/compiles [--top=25]

(add `JAX_COMPILATION_CACHE_DIR=/tmp/empty_cache` for a cold cache, as CI has). Each pytest process (the xdist
workers) appends rows to LOG_DIR/<worker>.<pid>.tsv: time, test id, kind (`trace`, `compile`: an XLA compile or a
persistent-cache load, JAX times both as one; `cache_hit`: the load's note), the jitted function's name, seconds,
and for a trace the innermost frame of this repository that asked for it. The rows come from JAX's own
debug log records (`jax._src.pjit`, `jax._src.dispatch`, `jax._src.compiler`), read without turning on
`jax_log_compiles`; processes a test starts (subprocesses, notebook kernels) are not logged.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
LOG_ENV = "DGEMMA_COMPILE_LOG"
LOGGERS = ("jax._src.pjit", "jax._src.dispatch", "jax._src.compiler")
_TRACE = re.compile(r"Finished tracing (.*) for jit in ([0-9.]+) sec")
_COMPILE = re.compile(r"Finished XLA compilation of (.*) in ([0-9.]+) sec")
_HIT = re.compile(r"Persistent compilation cache hit for '(.*)'")
_current_test = ["<collection>"]


def _source_frame() -> str:
  """'path:line' of the innermost frame in this repository (not a dependency) on the current stack."""
  for frame in reversed(traceback.extract_stack()):
    path = Path(frame.filename)
    if ROOT in path.parents and ".venv" not in path.parts and path != Path(__file__).resolve():
      return f"{path.relative_to(ROOT)}:{frame.lineno}"
  return ""


class _Rows(logging.Handler):
  """Writes one TSV row per trace / compile / cache-hit record of JAX's loggers."""

  def __init__(self, out):
    super().__init__(level=logging.DEBUG)
    self.out = out

  def emit(self, record):
    text = str(record.msg)  # the format string: only the three kinds below are formatted (cheap)
    if not text.startswith(("Finished tracing", "Finished XLA compilation", "Persistent compilation cache hit")):
      return
    message = record.getMessage()
    for kind, pattern in (("trace", _TRACE), ("compile", _COMPILE), ("cache_hit", _HIT)):
      match = pattern.match(message)
      if match:
        seconds = match.group(2) if kind != "cache_hit" else "0"
        where = _source_frame() if kind == "trace" else ""
        self.out.write(f"{time.time():.3f}\t{_current_test[0]}\t{kind}\t{match.group(1)}\t{seconds}\t{where}\n")
        self.out.flush()
        return


def install(path: str | Path) -> Callable[[], None]:
  """Appends this process's rows to `path` from now on; returns the function that stops it and restores the
  loggers' levels."""
  out = open(path, "a", encoding="utf-8")
  handler = _Rows(out)
  saved = []
  for name in LOGGERS:
    logger = logging.getLogger(name)
    saved.append((logger, logger.level, logger.propagate))
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # JAX's debug records go to this handler only, not to pytest's log capture
    logger.addHandler(handler)

  def uninstall():
    for logger, level, propagate in saved:
      logger.removeHandler(handler)
      logger.setLevel(level)
      logger.propagate = propagate
    out.close()
  return uninstall


def set_test(test_id: str) -> None:
  _current_test[0] = test_id


# ---- pytest plugin hooks (`-p bench.suite_compiles`) ----
def pytest_configure(config):
  log_dir = os.environ.get(LOG_ENV)
  if not log_dir:
    raise RuntimeError(f"bench.suite_compiles: set {LOG_ENV} to the folder for the rows")
  Path(log_dir).mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  config._suite_compiles_uninstall = install(Path(log_dir) / f"{worker}.{os.getpid()}.tsv")


def pytest_runtest_logstart(nodeid, location):
  set_test(nodeid)


def pytest_unconfigure(config):
  uninstall = getattr(config, "_suite_compiles_uninstall", None)
  if uninstall:
    uninstall()


# ---- the summary ----
def read_rows(log_dir: str | Path) -> list[tuple[str, str, str, float, str]]:
  """(test id, kind, function, seconds, source) of every row under `log_dir`."""
  rows = []
  for path in sorted(Path(log_dir).glob("*.tsv")):
    for line in path.read_text(encoding="utf-8").splitlines():
      fields = line.split("\t")
      if len(fields) == 6:
        rows.append((fields[1], fields[2], fields[3], float(fields[4]), fields[5]))
  return rows


def summarize(rows, top: int = 20) -> str:
  """Totals per kind, then the `top` functions, trace sources and tests by seconds."""
  lines = []
  totals = collections.Counter()
  counts = collections.Counter()
  for _, kind, _, seconds, _ in rows:
    totals[kind] += seconds
    counts[kind] += 1
  lines.append("kind        count    seconds")
  for kind in ("trace", "compile", "cache_hit"):
    lines.append(f"{kind:10s} {counts[kind]:6d} {totals[kind]:10.1f}")

  def table(title, key, kinds):
    seconds, number, tests = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    for row in rows:
      if row[1] in kinds:
        k = key(row)
        seconds[k] += row[3]
        number[k] += 1
        tests[k].add(row[0])
    lines.append("")
    lines.append(f"{title}: seconds, count, tests")
    for k, s in seconds.most_common(top):
      lines.append(f"{s:9.1f} {number[k]:6d} {len(tests[k]):5d}  {k}")

  table("compiles by function", lambda r: r[2], ("compile",))
  table("traces by function and source", lambda r: f"{r[2]}  <- {r[4]}", ("trace",))
  table("traces + compiles by test", lambda r: r[0], ("trace", "compile"))
  return "\n".join(lines)


def main(argv):
  from absl import flags
  flags.DEFINE_string("log_dir", None, "The folder DGEMMA_COMPILE_LOG pointed at.", required=True)
  flags.DEFINE_integer("top", 20, "Rows per table.")
  flags.FLAGS(argv)
  rows = read_rows(flags.FLAGS.log_dir)
  if not rows:
    raise SystemExit(f"--log_dir: no rows under {flags.FLAGS.log_dir} (run pytest with -p bench.suite_compiles "
                     f"and {LOG_ENV} set to it)")
  print(summarize(rows, flags.FLAGS.top))


if __name__ == "__main__":
  main(sys.argv)
