"""eval/validation_curve.py: logged eval metrics against steps and minutes, and the step a threshold is reached."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma.errors import ConfigError
from eval import validation_curve

REPO = Path(__file__).resolve().parents[2]


def _workdir(path: Path, values: list[float], tokens_per_sec: float) -> Path:
  """A workdir's config.json and metrics.jsonl: train windows of 10 steps, an eval record every 20 steps."""
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"data": {"batch_size": 4, "seq_len": 15}}))
  lines = []
  for i, value in enumerate(values):
    step = 20 * (i + 1)
    lines += [json.dumps({"step": step - 10, "split": "train", "loss": 1.0, "tokens_per_sec": tokens_per_sec}),
              json.dumps({"step": step, "split": "train", "loss": 1.0, "tokens_per_sec": tokens_per_sec}),
              json.dumps({"step": step, "split": "eval", "canvas_ce": value})]
  (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  return path


def test_rows_minutes_and_threshold(tmp_path):
  slow = _workdir(tmp_path / "slow", [5.0, 4.5, 4.2, 3.9], tokens_per_sec=6.0)  # 60 tokens/step: 10 s a step
  fast = _workdir(tmp_path / "fast", [5.0, 3.8, 3.7, 3.6], tokens_per_sec=12.0)
  runs = validation_curve.parse_runs(f"slow={slow},fast={fast}", need_checkpoints=False)
  rows = validation_curve.curves(runs, "canvas_ce")
  assert [(r["run"], r["step"], r["canvas_ce"]) for r in rows][:2] == [("slow", 20, 5.0), ("slow", 40, 4.5)]
  # minutes: each 10-step window of 60-token steps at 6 tokens/s is 100 s
  assert rows[1]["minutes"] == pytest.approx(4 * 100 / 60)
  summary = validation_curve.summarize(rows, "canvas_ce", 4.0)
  assert summary["slow"]["steps_to_threshold"] == 80 and summary["fast"]["steps_to_threshold"] == 40
  assert summary["fast"]["minutes_to_threshold"] == pytest.approx(4 * 50 / 60)
  assert validation_curve.summarize(rows, "canvas_ce", 3.0)["fast"]["steps_to_threshold"] is None
  assert summary["slow"]["final"] == 3.9 and summary["slow"]["final_step"] == 80
  with pytest.raises(ConfigError, match="'canvas_nelbo' is not an eval metric"):
    validation_curve.curves(runs, "canvas_nelbo")
  with pytest.raises(ConfigError, match="no metrics.jsonl"):
    validation_curve.parse_runs(f"a={tmp_path}", need_checkpoints=False)


@pytest.mark.slow  # a subprocess
def test_command_line_writes_json_csv_and_plot(tmp_path):
  a = _workdir(tmp_path / "a", [5.0, 4.0], tokens_per_sec=6.0)
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "eval.validation_curve", f"--runs=a={a}", "--threshold=4.5", f"--out_dir={out}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads((out / "validation.json").read_text())
  assert data["summary"]["a"]["steps_to_threshold"] == 40 and len(data["rows"]) == 2
  assert (out / "validation.csv").read_text().splitlines()[0] == "run,step,minutes,canvas_ce"
  assert (out / "canvas_ce_vs_steps.png").read_bytes()[:4] == b"\x89PNG"
