"""The maintained benchmarks of bench/ (those `make bench` runs, and the host data pipeline and sampler memory ones)
run end to end at tiny size and print their figures: each is a command line, so each runs as one (the figures
themselves are measured by running them, docs/benchmarks.md; sampler_vs_hf is covered by its own figures there,
its model being fixed at the reference's size)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
  out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, (args, out.stderr[-3000:])
  return out.stdout


def _data(corpus_file, tmp_path):
  return [f"--config.data.source=files", f"--config.data.files=('{corpus_file}',)",
          f"--config.data.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.slow  # subprocesses, each compiling a tiny program
def test_the_training_benchmarks_run(corpus_file, tmp_path):
  data = _data(corpus_file, tmp_path)
  train = _run("bench/train_throughput.py", "--config=configs/tiny_test.py", "--steps=2", "--nodots", "--matmul_n=256",
               *data)
  assert "train step:" in train and "ratio (MFU vs matmul peak):" in train
  host = _run("bench/data_throughput.py", "--config=configs/tiny_test.py", "--batches=2", "--rounds=1", *data)
  assert "host batch: median" in host


@pytest.mark.slow  # subprocesses, each compiling tiny programs
def test_the_model_benchmarks_run():
  forward = _run("bench/model_forward.py", "--config=configs/models/tiny.py", "--canvas=16", "--context=16",
                 "--reps=1", "--matmul_n=256")
  assert "MoE branch removed" in forward
  moe = _run("bench/moe.py", "--reps=1", "--min_time=0.001", "--sizes=tiny")
  assert "tiny:" in moe and "GeGLU (k*Fe)" in moe


@pytest.mark.slow  # subprocesses, each compiling tiny programs
def test_the_memory_benchmarks_run():
  memory = _run("bench/memory_check.py", "--config=configs/models/tiny.py", "--context=16", "--canvas=16",
                "--skip_train")
  assert "est/meas" in memory
  vocab = _run("bench/sampler_memory.py", "--vocab=512", "--canvas=16", "--dtype=float32")
  assert "XLA scratch:" in vocab
