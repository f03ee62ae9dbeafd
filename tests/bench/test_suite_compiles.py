"""bench/suite_compiles.py: one row per jit trace and XLA compile, under the running test, and the summary."""

import logging

import jax
import jax.numpy as jnp

from bench import suite_compiles


def test_rows_name_each_trace_and_compile_and_the_loggers_are_restored(tmp_path):
  before = [(logging.getLogger(n).level, logging.getLogger(n).propagate) for n in suite_compiles.LOGGERS]
  uninstall = suite_compiles.install(tmp_path / "w.tsv")
  try:
    suite_compiles.set_test("tests/x.py::test_a")
    def doubled(x):
      return x * 2
    f = jax.jit(doubled)
    f(jnp.ones(3))
    f(jnp.ones(3))          # cached: no row
    f(jnp.ones(4))          # a new shape: traced and compiled again
    suite_compiles.set_test("tests/x.py::test_b")
    jax.eval_shape(jax.jit(lambda x: x + 1), jnp.ones(2))   # traced, not compiled
  finally:
    uninstall()
    suite_compiles.set_test("<collection>")
  jnp.ones(5) * 3  # after uninstall: no row
  assert [(n.level, n.propagate) for n in map(logging.getLogger, suite_compiles.LOGGERS)] == before

  rows = suite_compiles.read_rows(tmp_path)
  mine = [(test, kind, fn) for test, kind, fn, _, _ in rows if fn in ("doubled", "jit(doubled)", "<lambda>")]
  assert mine == [("tests/x.py::test_a", "trace", "doubled"), ("tests/x.py::test_a", "compile", "jit(doubled)"),
                  ("tests/x.py::test_a", "trace", "doubled"), ("tests/x.py::test_a", "compile", "jit(doubled)"),
                  ("tests/x.py::test_b", "trace", "<lambda>")]
  sources = {source for _, kind, fn, _, source in rows if kind == "trace" and fn == "doubled"}
  assert len(sources) == 2 and all(s.startswith("tests/bench/test_suite_compiles.py:") for s in sources)  # two calls
  assert all(seconds >= 0 for *_, seconds, _ in rows)

  summary = suite_compiles.summarize(rows)
  trace_line = next(line for line in summary.splitlines() if line.startswith("trace "))
  assert int(trace_line.split()[1]) == sum(kind == "trace" for _, kind, *_ in rows)
  assert "jit(doubled)" in summary and "tests/x.py::test_a" in summary
