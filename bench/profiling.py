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

A CPU trace names ops by their HLO instruction (`ynn_fusion.539`) and says nothing of where they came from;
`hlo_sources` reads that from the compiled program's text (each instruction's `op_name` metadata: the jaxpr
path, e.g. `jvp(Transformer.decode)/.../moe/experts/dot_general`), and `by_source` sums the ops' times by it:

  sources = hlo_sources(step.lower(*args).compile().as_text())
  print(format_by_source(by_source(summarize(trace_events(fn), top=None), sources), per=steps))
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
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


def summarize(events: list[dict], top: int | None = 20) -> list[tuple[str, float, int, str]]:
  """(op name, total ms, count, what) of the `top` ops by total time, or of every op with top None (module
  docstring: which events count)."""
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


_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{[^}\n]*?op_name="([^"]*)"', re.M)


def hlo_sources(hlo_text: str) -> dict[str, str]:
  """{instruction name: its `op_name` metadata} of a compiled program's HLO text (`compiled.as_text()`). The
  ops of a CPU trace are named by these instructions; a fusion's metadata is that of its root op."""
  return {m.group(1): m.group(2) for m in _INSTRUCTION.finditer(hlo_text)}


def source_label(op_name: str) -> str:
  """A coarse where-from of an `op_name`: 'backward ' for the transposed (gradient) program, the outermost jit
  and the autodiff wrappers removed (an empty `vmap()` stays as 'vmap'), layer indices and the loop scaffolding
  (while/body/closed_call) folded, so that the same op of every layer sums into one row:
  'jit(step)/transpose(jvp(Transformer.decode))/while/body/closed_call/blocks/layer_3/attn/add'
  -> 'backward Transformer.decode/blocks/layer_*/attn/add'."""
  parts = op_name.split("/")
  if parts and re.fullmatch(r"p?jit\(.*\)", parts[0]):
    parts = parts[1:]
  backward = bool(parts) and parts[0].startswith("transpose(")
  kept = []
  for part in parts:
    bare = part
    while (m := re.fullmatch(r"(transpose|jvp|vmap)\((.*)\)", bare)):
      bare = m.group(2) or ("vmap" if m.group(1) == "vmap" else "")
    if bare and bare not in ("while", "body", "closed_call"):
      kept.append(re.sub(r"^layer_\d+$", "layer_*", bare))
  return ("backward " if backward else "") + ("/".join(kept) or "(no op name)")


def by_source(rows: list[tuple[str, float, int, str]], sources: dict[str, str]) -> list[tuple[str, float, int]]:
  """(source label, total ms, ops) of `summarize` rows grouped by `source_label` of their instruction's op_name,
  largest first; an op the HLO text does not name is '(unknown) <op name>' (e.g. a copy XLA added)."""
  total_ms, ops = collections.Counter(), collections.Counter()
  for name, ms, _, _ in rows:
    label = source_label(sources[name]) if name in sources else f"(unknown) {name}"
    total_ms[label] += ms
    ops[label] += 1
  return [(label, ms, ops[label]) for label, ms in total_ms.most_common()]


# The coarse parts of a dgemma train step, for `by_group` (a source label goes to the first that matches).
TRAIN_STEP_PARTS = [
    ("MoE: router and experts", r"/moe/"),
    ("attention", r"/attn/"),
    ("dense MLP", r"/mlp/"),
    ("vocabulary: final norm, tied logits, softcap, self-conditioning softmax and soft embedding",
     r"_readout|soft_encode|embedder|Transformer\._logits/|^(backward )?Transformer\.decode/[^/]+$"),
    ("the rest of the model: norms, residuals, two-stream combiner", r"Transformer\."),
    ("outside the model: losses over the logits, optimizer, noise, metrics", r".*"),
]


def by_group(rows: list[tuple[str, float, int]], groups: list[tuple[str, str]]) -> list[tuple[str, float, int]]:
  """`by_source` rows summed into coarser groups: `groups` is an ordered list of (group name, regex); a source
  label goes to the first group whose regex it matches (`re.search`), else to 'other'. Rows in `groups`' order,
  then 'other'; every group listed, empty ones with 0."""
  total_ms, ops = collections.Counter(), collections.Counter()
  for label, ms, n in rows:
    name = next((g for g, pattern in groups if re.search(pattern, label)), "other")
    total_ms[name] += ms
    ops[name] += n
  names = [g for g, _ in groups] + (["other"] if "other" in total_ms else [])
  return [(name, total_ms[name], ops[name]) for name in names]


def format_by_source(rows: list[tuple[str, float, int]], per: float = 1.0, top: int = 30) -> str:
  """A table of the `top` `by_source` rows and the total of all of them; `per` divides the times."""
  total = sum(ms for _, ms, _ in rows) / per
  lines = [f"{'ms':>9} {'share':>6} {'ops':>5}  source (all ops: {total:.1f} ms)"]
  for label, ms, n in rows[:top]:
    lines.append(f"{ms / per:>9.2f} {ms / per / total:>6.1%} {n:>5}  {label}")
  return "\n".join(lines)


def top_ops(fn, top: int = 20) -> list[tuple[str, float, int, str]]:
  """`summarize` of one traced call of fn (call it once before, so compilation is not in the trace)."""
  return summarize(trace_events(fn), top)


def format_top_ops(rows: list[tuple[str, float, int, str]], per: float = 1.0, unit: str = "ms") -> str:
  """A table of `top_ops` rows; `per` divides the times (e.g. the number of steps in the traced call)."""
  lines = [f"{unit:>10} {'count':>7}  op"]
  for name, ms, n, desc in rows:
    lines.append(f"{ms / per:>10.3f} {n:>7}  {name}" + (f"  ({desc[:120]})" if desc else ""))
  return "\n".join(lines)
