"""bench/train_ab.py: its variant syntax, its config check before compiling, and a run of two variants (all
subprocesses: the script defines absl flags, --config among them, that other modules define too)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, corpus_file):
  # A subprocess: the script defines absl flags (--config, --variant) that must not enter this process's FLAGS.
  base = ["--config=configs/tiny_test.py", "--config.data.source=files", f"--config.data.files=('{corpus_file}',)",
          f"--config.data.cache_dir={tmp_path / 'cache'}"]
  return subprocess.run([sys.executable, str(ROOT / "bench" / "train_ab.py"), *base, *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # subprocesses that compile two train steps
def test_two_variants_are_timed_in_turn(tmp_path, corpus_file):
  # The script, not the model, is under test: no MoE and one decoder pass (self_cond_prob 0) halve the compiles.
  run = _run(["--config.model.num_experts=0", "--config.diffusion.self_cond_prob=0.0",
              "--variant=scan:model.scan_layers=True",
              "--variant=one_block:model.scan_layers=False,opt.lr=2e-3,diffusion.curriculum_alpha_range=(0.04, 0.93)",
              "--rounds=2", "--steps=1"], tmp_path, corpus_file)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  # Python literals, and commas inside brackets stay in their value.
  assert any(line.startswith("one_block {'model.scan_layers': False, 'opt.lr': 0.002, "
                             "'diffusion.curriculum_alpha_range': (0.04, 0.93)}: compiled in") for line in lines), lines
  assert sum(line.startswith("round ") for line in lines) == 2
  table = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("scan", "one_block")}
  assert table["scan"][3] == "1.000"  # the first variant is the reference of the ratio column
  assert float(table["one_block"][1]) > 0


@pytest.mark.slow
def test_an_unknown_key_fails_before_compiling(tmp_path, corpus_file):
  run = _run(["--variant=a:model.scan_layers=True", "--variant=b:model.no_such_key=1"], tmp_path, corpus_file)
  assert run.returncode != 0
  assert "model.no_such_key" in run.stderr
  assert "compiled in" not in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["no_colon", ":a=1", "x:model.scan_layers"])
def test_a_malformed_variant_is_named(tmp_path, corpus_file, bad):
  run = _run([f"--variant={bad}", "--variant=b:model.scan_layers=True"], tmp_path, corpus_file)
  assert run.returncode != 0
  assert f"--variant={bad!r}" in run.stderr
