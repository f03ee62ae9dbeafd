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


def test_source_label_folds_layers_loops_and_autodiff_wrappers():
  label = profiling.source_label
  assert label("jit(train_step)/transpose(jvp(Transformer.decode))/while/body/closed_call/blocks/layer_3/attn/add") \
      == "backward Transformer.decode/blocks/layer_*/attn/add"
  assert label("jit(train_step)/jvp(Transformer.decode)/while/body/closed_call/blocks/layer_0/attn/add") \
      == "Transformer.decode/blocks/layer_*/attn/add"  # the forward of the same op, every layer one label
  assert label("jit(train_step)/jvp(Transformer.encode)/Transformer._logits/Transformer._readout/tanh") \
      == "Transformer.encode/Transformer._logits/Transformer._readout/tanh"
  assert label("jit(train_step)/vmap()/closed_call/dot_general") == "vmap/dot_general"
  assert label("jit(f)/transpose(jvp())/mul") == "backward mul"
  assert label("jit(f)/blocks/layer_1/attn/jit(_where)/select_n") == "blocks/layer_*/attn/jit(_where)/select_n"
  assert label("jit(f)") == "(no op name)"


def test_by_source_sums_ops_of_one_source_and_by_group_takes_the_first_matching_group():
  sources = {"fusion.1": "jit(s)/jvp(Transformer.decode)/while/body/closed_call/blocks/layer_0/moe/experts/dot_general",
             "fusion.2": "jit(s)/jvp(Transformer.decode)/while/body/closed_call/blocks/layer_1/moe/experts/dot_general",
             "fusion.3": "jit(s)/jvp(Transformer.decode)/Transformer._logits/Transformer._readout/tanh",
             "fusion.4": "jit(s)/jvp()/exp"}
  rows = [("fusion.1", 3.0, 1, ""), ("fusion.3", 5.0, 1, ""), ("fusion.2", 4.0, 1, ""), ("fusion.4", 1.0, 1, ""),
          ("copy.9", 0.5, 1, "")]
  by_source = profiling.by_source(rows, sources)
  assert by_source == [("Transformer.decode/blocks/layer_*/moe/experts/dot_general", 7.0, 2),
                       ("Transformer.decode/Transformer._logits/Transformer._readout/tanh", 5.0, 1),
                       ("exp", 1.0, 1), ("(unknown) copy.9", 0.5, 1)]
  groups = [("experts", r"/moe/"), ("vocabulary", r"_readout"), ("model", r"Transformer\.")]
  assert profiling.by_group(by_source, groups) == [("experts", 7.0, 2), ("vocabulary", 5.0, 1), ("model", 0.0, 0),
                                                   ("other", 1.5, 2)]
  parts = dict((name, ms) for name, ms, _ in profiling.by_group(by_source, profiling.TRAIN_STEP_PARTS))
  assert parts["MoE: router and experts"] == 7.0 and sum(parts.values()) == 13.5
  assert [ms for name, ms in parts.items() if name.startswith("vocabulary")] == [5.0]
  text = profiling.format_by_source(by_source, per=2, top=2)
  assert "all ops: 6.8 ms" in text and "3.50" in text and "copy.9" not in text


def test_hlo_sources_name_the_ops_of_a_real_trace():
  """The compiled program's text maps the instructions a trace names to the jaxpr ops they came from."""
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
  a = jnp.ones((256, 256), jnp.float32)
  f(a).block_until_ready()
  sources = profiling.hlo_sources(f.lower(a).compile().as_text())
  assert any(op.endswith("dot_general") for op in sources.values())
  rows = profiling.summarize(profiling.trace_events(lambda: f(a).block_until_ready()), top=None)
  named = [name for name, *_ in rows if name in sources]
  assert named, (rows, sorted(sources))
  assert sum(ms for _, ms, _ in profiling.by_source(rows, sources)) == sum(ms for _, ms, _, _ in rows)
