"""bench/rerun_overhead.py: three runs of one config in one process, timed, with the program cache cleared before
the third (a subprocess: the script defines absl flags, --config among them, that other modules define too)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess that trains three tiny runs
def test_three_runs_are_timed_and_each_trains(tmp_path, corpus_file):
  # The script, not the model, is under test: no MoE and one decoder pass (self_cond_prob 0) halve the compiles.
  run = subprocess.run([sys.executable, str(ROOT / "bench" / "rerun_overhead.py"), "--config=configs/tiny_test.py",
                        "--config.data.source=files", f"--config.data.files=('{corpus_file}',)",
                        f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.model.num_experts=0",
                        "--config.diffusion.self_cond_prob=0.0", "--config.train.num_steps=2",
                        f"--workdirs={tmp_path / 'runs'}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  seconds = {line.split(":")[0]: float(line.split()[1]) for line in lines
             if line.split(":")[0] in ("first", "again", "cleared")}
  assert list(seconds) == ["first", "again", "cleared"] and all(s > 0 for s in seconds.values())
  ratio = [line for line in lines if line.startswith("again / cleared: ")]
  assert ratio and float(ratio[0].split()[-1]) == pytest.approx(seconds["again"] / seconds["cleared"], abs=2e-3)
  for name in seconds:  # each run trained the whole schedule into its own workdir
    rows = [json.loads(l) for l in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2, name
