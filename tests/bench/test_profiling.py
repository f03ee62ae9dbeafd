"""bench/profiling.py: which trace events count as ops, and their totals."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import profiling  # noqa: E402


def _meta(pid, tid=None, process=None, thread=None):
  if process is not None:
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}
  return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}


def _op(pid, tid, name, dur, **args):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur, "ts": 0, "args": args}


def test_cpu_trace_counts_xla_threads_without_runtime_scopes_or_python():
  events = [
      _meta(1, process="/host:CPU"), _meta(1, 10, thread="tf_XLAEigen/1"), _meta(1, 11, thread="tf_XLAPjRtCpuClient/2"),
      _meta(1, 12, thread="python"),
      _op(1, 10, "fusion.1", 300.0, hlo_op="fusion.1"), _op(1, 11, "fusion.1", 200.0), _op(1, 10, "dot.2", 400.0),
      _op(1, 10, "ThunkExecutor::Execute", 5000.0), _op(1, 10, "end: dot.2", 1.0), _op(1, 10, "$api.py:1 f", 900.0),
      _op(1, 12, "fusion.9", 9999.0),  # the Python thread: dispatch, not an op
      {"ph": "i", "pid": 1, "tid": 10, "name": "fusion.1"},  # not a complete event
  ]
  assert profiling.summarize(events) == [("fusion.1", 0.5, 2, ""), ("dot.2", 0.4, 1, "")]
  assert profiling.summarize(events, top=1) == [("fusion.1", 0.5, 2, "")]


def test_device_trace_counts_only_device_processes():
  events = [
      _meta(1, process="/host:CPU"), _meta(1, 10, thread="tf_XLAEigen/1"), _meta(2, process="/device:GPU:0"),
      _op(1, 10, "host_fusion", 800.0), _op(2, 5, "gemm_fusion.3", 250.0, long_name="dot(bf16[256,2816] ...)"),
      _op(2, 6, "loop_fusion.1", 100.0), _op(2, 5, "gemm_fusion.3", 250.0),
  ]
  rows = profiling.summarize(events)
  assert rows == [("gemm_fusion.3", 0.5, 2, "dot(bf16[256,2816] ...)"), ("loop_fusion.1", 0.1, 1, "")]
  text = profiling.format_top_ops(rows, per=2)
  assert "0.250" in text and "gemm_fusion.3" in text and "dot(bf16" in text


def test_a_real_trace_yields_its_ops():
  """One traced call of a jitted program on this backend: jax.profiler's Perfetto export is found and parsed, and
  its ops (whatever XLA names them here) pass the filter above."""
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
  a = jnp.ones((512, 512), jnp.float32)
  f(a).block_until_ready()
  rows = profiling.top_ops(lambda: f(a).block_until_ready(), top=3)
  assert rows and rows[0][1] > 0 and rows[0][2] >= 1
