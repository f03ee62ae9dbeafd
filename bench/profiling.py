"""Where a jitted call spends its time: a `jax.profiler` trace summed by op (imports only jax and the standard library).

  top = top_ops(lambda: jax.block_until_ready(step(params, x)), top=20)   # [(op name, total ms, count, what)]
  print(format_top_ops(top))

The trace is the profiler's Perfetto export (`create_perfetto_trace=True`). Which events count as ops:
- an accelerator trace (a process named '/device:...'): every complete event of those processes, i.e. the
  kernels the device ran;
- a CPU-only trace: the complete events on XLA's compute threads (thread names starting with 'tf_XLA'), less
  the runtime's own scopes (names with '::', e.g. ThunkExecutor::Execute, which enclose the ops) and Python
  frames ('$file:line ...') and the runtime's 'end: op' markers.
Two threads can run ops at once (XLA CPU's intra-op pool), so totals can add up to more than the wall time.
`what` is the first descriptive argument the trace gives the op (the HLO op or its long name), if any.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax

_DESCRIPTIVE_ARGS = ("long_name", "hlo_op", "tf_op", "name")


def trace_events(fn) -> list[dict]:
  """Runs fn() once under `jax.profiler.trace` and returns the Perfetto trace's events."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      fn()
    found = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    if not found:
      raise RuntimeError(f"jax.profiler wrote no Perfetto trace under {tmp}")
    with gzip.open(found[0]) as f:
      return json.load(f)["traceEvents"]


def summarize(events: list[dict], top: int = 20) -> list[tuple[str, float, int, str]]:
  """(op name, total ms, count, what) of the `top` ops by total time (module docstring: which events count)."""
  process_names, thread_names = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process_names[e.get("pid")] = str(e.get("args", {}).get("name", ""))
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread_names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
  devices = {pid for pid, name in process_names.items() if name.startswith("/device:")}

  def counts(e) -> bool:
    if e.get("ph") != "X" or "dur" not in e:
      return False
    if devices:
      return e.get("pid") in devices
    name = str(e.get("name", ""))
    return (thread_names.get((e.get("pid"), e.get("tid")), "").startswith("tf_XLA") and "::" not in name
            and not name.startswith(("$", "end: ")))

  total_us, count, what = collections.Counter(), collections.Counter(), {}
  for e in events:
    if counts(e):
      name = str(e["name"])
      total_us[name] += float(e["dur"])
      count[name] += 1
      if name not in what:
        args = e.get("args", {}) or {}
        what[name] = next((str(args[k]) for k in _DESCRIPTIVE_ARGS if k in args and str(args[k]) != name), "")
  return [(name, us / 1e3, count[name], what[name]) for name, us in total_us.most_common(top)]


def top_ops(fn, top: int = 20) -> list[tuple[str, float, int, str]]:
  """`summarize` of one traced call of fn (call it once before, so compilation is not in the trace)."""
  return summarize(trace_events(fn), top)


def format_top_ops(rows: list[tuple[str, float, int, str]], per: float = 1.0, unit: str = "ms") -> str:
  """A table of `top_ops` rows; `per` divides the times (e.g. the number of steps in the traced call)."""
  lines = [f"{unit:>10} {'count':>7}  op"]
  for name, ms, n, desc in rows:
    lines.append(f"{ms / per:>10.3f} {n:>7}  {name}" + (f"  ({desc[:120]})" if desc else ""))
  return "\n".join(lines)
