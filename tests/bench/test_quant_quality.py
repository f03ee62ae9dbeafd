"""bench/quant_quality.py end to end on a saved tiny run (random weights): it loads the run, scores the
same validation batches at every scheme and prints one row per scheme, the reference's deltas zero."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_utils import save_random_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess
def test_quant_quality_runs_on_a_saved_run(tiny_config, tmp_path):
  config = tiny_config
  workdir = tmp_path / "run"
  save_random_run(config, workdir)

  # A subprocess: the script defines absl flags (a required --workdir) that must not leak into this
  # process's global FLAGS, which other tests' CLIs parse.
  run = subprocess.run([sys.executable, str(ROOT / "bench" / "quant_quality.py"), f"--workdir={workdir}",
                        "--batches=1", "--group_size=16", "--prompts=2", "--steps=4"], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  out = run.stdout.splitlines()
  rows = {line.split()[0]: line.split() for line in out if line.split() and line.split()[0] in ("none", "int8", "int4")}
  assert set(rows) == {"none", "int8", "int4"}
  assert rows["none"][3] == "+0.0000" and rows["none"][5] == "+0.0000"
  assert float(rows["int8"][1]) < float(rows["none"][1])  # smaller weights
  # mean decoder passes per canvas: between 1 and the --steps budget (a random model rarely meets the
  # stopping rule, so usually exactly 4), the reference's delta zero
  passes = {name: float(row[8]) for name, row in rows.items()}
  budget = 4
  assert all(1.0 <= p <= budget for p in passes.values()), passes
  assert rows["none"][9] == "+0.00"
