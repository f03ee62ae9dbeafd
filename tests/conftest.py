"""Shared fixtures: a tiny text corpus and the tiny_test config pointed at it."""

import os
import random
from pathlib import Path

import pytest

# Keep tests on CPU, deterministic, and quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA compiles slowly on this 2-core CPU; many tests (and their subprocesses) compile the same tiny
# programs, so share compiled executables through JAX's persistent cache (ignored by git). `make test` turns the
# cache off (JAX_ENABLE_COMPILATION_CACHE=false, the Makefile says why); `make test-fast` and a plain pytest keep it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Tests run tiny programs: compile time dominates, so trade run-time optimisation for compile speed
# (same results up to float round-off; exactness tests compare runs made under the same flags).
# Two workers share the 2 cores, so splitting a module's code generation over threads gains nothing and costs CPU:
# one split (five test files on two workers: 111-121 s with it, 121-136 s without, docs/benchmarks.md).
# Multi-device tests run 8 virtual devices (or 2 processes) on 2 cores: a device thread can wait long
# at a collective while the others are descheduled, so raise XLA's CPU collective timeouts (the
# defaults abort the process after ~40 s stuck).
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1 "
                  "--xla_cpu_collective_timeout_seconds=900 "
                  "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300 "
                  "--xla_cpu_collective_call_terminate_timeout_seconds=900")
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Tests trace hundreds of programs: collect garbage as dgemma's commands do (dgemma/tools/cli.py GC_THRESHOLDS;
# tests/diffusion + tests/model on two workers, cold cache: 139-141 s at CPython's thresholds, 125 s so, paired runs).
# DGEMMA_TEST_GC_THRESHOLDS=700,10,10 runs the suite at CPython's defaults.
from dgemma.tools import cli as _cli  # noqa: E402  (after the environment above: it imports jax)
_cli.collect_garbage_less_often(tuple(map(int, os.environ["DGEMMA_TEST_GC_THRESHOLDS"].split(",")))
                                if os.environ.get("DGEMMA_TEST_GC_THRESHOLDS") else _cli.GC_THRESHOLDS)

_WORDS = ("the king queen crown sword night day love death fair foul heart blood tears sweet "
          "lord lady speak hence thou thee thy art doth hath noble gentle wretched bright").split()


def write_corpus(path, num_docs=60, seed=0):
  """A deterministic toy corpus, one document per line."""
  rnd = random.Random(seed)
  lines = []
  for _ in range(num_docs):
    lines.append(" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(8, 60))) + ".")
  path.write_text("\n".join(lines) + "\n")
  return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus") / "toy.txt")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """(workdir, config) of a 3-step tiny_test run on a toy corpus, trained once per test process and shared:
  tests read it and must not change its checkpoints (sample.py writing samples.txt beside them is fine)."""
  from configs import tiny_test
  from dgemma.train import loop
  tmp = tmp_path_factory.mktemp("tiny_run")
  config = tiny_test.get_config()
  config.data.source, config.data.files = "files", (str(write_corpus(tmp / "toy.txt")),)
  config.data.cache_dir = str(tmp / "cache")
  config.train.num_steps, config.train.async_checkpointing = 3, False
  loop.train_and_evaluate(config, str(tmp / "wd"))
  return tmp / "wd", config


@pytest.fixture
def tiny_config(corpus_file, tmp_path_factory):
  from configs import tiny_test
  config = tiny_test.get_config()
  config.data.source = "files"
  config.data.files = (str(corpus_file),)
  config.data.cache_dir = str(tmp_path_factory.getbasetemp() / "data_cache")
  config.train.async_checkpointing = False
  return config


# The fast tier (`make test-fast` = `-m "not slow"`, < 3 min on 2 cores with a warm compile cache) must
# stay fast. Besides the tests that resume / restart whole training runs several times, a test that starts a subprocess
# (8 virtual devices and multi-process runs are subprocesses) or builds the torch reference (HF parity:
# `transformers`) is marked `@pytest.mark.slow`. Enforced here rather than by convention: outside a slow
# test, starting a process fails the test; and in the fast tier, so does a test that leaves `transformers`
# imported when it was not before the test's setup began (its fixtures included: a module-scoped fixture that
# builds the torch reference imports it in the setup of the first test that uses it). That check runs only in
# the fast tier, where no slow test can have imported transformers first: in a full run whether it was already
# imported depends on which tests this worker ran before, so the same test could pass or fail with the order
# (a test that built the reference in its body failed alone and passed after a slow test of its module).
# (torch itself is not the signal: tensorboardX, the reference of tests/train/test_metrics.py, imports it
# whenever it is installed, as it is in the test environment.)
class _SubprocessInFastTest(AssertionError):
  pass


@pytest.fixture(scope="session", autouse=True)
def _matplotlib_font_list():
  """matplotlib lists the system fonts on its first import in a process without a cache (~/.cache/matplotlib),
  with `fc-list` in a subprocess. On a fresh machine that first import would be whichever test plots first,
  and in the fast tier the guard below refuses the subprocess. Listing them here, before any test, keeps the
  plotting tests' outcome independent of the machine's history and of the test order."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.font_manager  # noqa: F401  (builds the font list, or reads the cache)


_TRANSFORMERS_BEFORE_SETUP = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  import sys
  item.stash[_TRANSFORMERS_BEFORE_SETUP] = "transformers" in sys.modules


def _fast_tier_only(config) -> bool:
  """The run deselects every slow test (`make test-fast`: -m "not slow")."""
  return (config.getoption("markexpr") or "").replace(" ", "") == "notslow"


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
  if request.node.get_closest_marker("slow") is not None:
    yield
    return
  import subprocess
  import sys

  def refuse(*args, **kwargs):
    raise _SubprocessInFastTest(f"{request.node.nodeid} starts a subprocess ({args[:1]}): mark it "
                                "@pytest.mark.slow (tests/conftest.py, the fast tier)")

  monkeypatch.setattr(subprocess, "Popen", refuse)  # what subprocess.run / check_output call
  yield
  hf_before = request.node.stash.get(_TRANSFORMERS_BEFORE_SETUP, True)
  if _fast_tier_only(request.config) and not hf_before and "transformers" in sys.modules:
    pytest.fail(f"{request.node.nodeid} imports transformers: torch parity tests are marked @pytest.mark.slow "
                "(tests/conftest.py, the fast tier)")


def pytest_collection_modifyitems(session, config, items):
  """Slow tests first (stable within each tier). `make test` runs two xdist workers that take tests in this
  order; the slowest tests (8 devices, two processes, notebooks: 30-80 s each) are in the slow tier, so
  running them first leaves only the short fast-tier tests for the end of the run, where a long test
  would keep one worker busy while the other has nothing left."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
