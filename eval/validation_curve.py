"""The validation metric logged during training, for one or more runs, against steps and training minutes;
and the first step (and minute) at which each run reaches a threshold.

  python -m eval.validation_curve --runs=plain=workdirs/demo,duo=workdirs/demo_duo --metric=canvas_ce \
      --threshold=4.0 --out_dir=duo_demo

Reads each run's eval records (metrics.jsonl, split 'eval', written every train.eval_every steps) without
loading weights. Minutes are training minutes (dgemma.train.metrics.train_minutes: evaluation and
checkpointing excluded) at the eval step, or the last logged step before it. With --threshold, a run
reaches it at its first eval record at or below it (lower is better for every loss metric); `null` when it
never does. Writes out_dir/validation.json (rows and per-run summary), validation.csv and
<metric>_vs_steps.png.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

from absl import flags

from dgemma import files, run_report
from dgemma.errors import ConfigError
from dgemma.tools import cli
from dgemma.train import metrics as metrics_lib
from eval.likelihood_curve import parse_runs

_FLAGS: dict = {}


def define_flags() -> None:
  """The command line's flags (defined only when run as a program)."""
  _FLAGS["runs"] = flags.DEFINE_string("runs", None, "Comma-separated NAME=WORKDIR pairs.", required=True)
  _FLAGS["metric"] = flags.DEFINE_string("metric", "canvas_ce", "An eval metric of metrics.jsonl.")
  _FLAGS["threshold"] = flags.DEFINE_float("threshold", None, "Report the first step at or below this value.")
  _FLAGS["out_dir"] = flags.DEFINE_string("out_dir", None, "Where the JSON, CSV and plot go.", required=True)


def _minutes_at(minutes: dict[int, float], step: int) -> Optional[float]:
  before = [s for s in minutes if s <= step]
  return minutes[max(before)] if before else None


def curves(runs: list[tuple[str, str]], metric: str) -> list[dict]:
  """One row per eval record of every run: {run, step, minutes, <metric>}."""
  rows = []
  for name, path in runs:
    minutes = metrics_lib.train_minutes(path)
    evals = [r for r in metrics_lib.read_metrics(path) if r.get("split") == "eval"]
    if not any(metric in r for r in evals):
      have = sorted({k for r in evals for k in r} - {"step", "split"})
      raise ConfigError(f"--metric: {metric!r} is not an eval metric of {path} ({name}); it logs {have}")
    for r in evals:
      if metric in r:
        rows.append({"run": name, "step": r["step"], "minutes": _minutes_at(minutes, r["step"]), metric: r[metric]})
  return rows


def summarize(rows: list[dict], metric: str, threshold: Optional[float]) -> dict[str, dict]:
  """Per run: its last value, and with a threshold the first step / minutes at or below it (None: never)."""
  out = {}
  for name in dict.fromkeys(r["run"] for r in rows):
    mine = [r for r in rows if r["run"] == name]
    entry = {"final_step": mine[-1]["step"], "final": mine[-1][metric]}
    if threshold is not None:
      hit = next((r for r in mine if math.isfinite(r[metric]) and r[metric] <= threshold), None)
      entry.update(threshold=threshold, steps_to_threshold=hit["step"] if hit else None,
                   minutes_to_threshold=hit["minutes"] if hit else None)
    out[name] = entry
  return out


def main(argv):
  cli.no_extra_args(argv)
  runs = parse_runs(_FLAGS["runs"].value, need_checkpoints=False)
  metric, threshold = _FLAGS["metric"].value, _FLAGS["threshold"].value
  rows = curves(runs, metric)
  summary = summarize(rows, metric, threshold)
  out_dir = Path(_FLAGS["out_dir"].value)
  files.write_json_atomic(out_dir / "validation.json", {"metric": metric, "runs": dict(runs), "summary": summary,
                                                        "rows": rows})
  with open(out_dir / "validation.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["run", "step", "minutes", metric])
    writer.writeheader()
    writer.writerows(rows)
  run_report.plot_sweep([dict(r, group=r["run"]) for r in rows], "step", metric, out_dir / f"{metric}_vs_steps.png",
                    title=f"validation {metric} during training")
  print(json.dumps(summary, indent=2))
  print(f"wrote {out_dir}/validation.json, validation.csv and {metric}_vs_steps.png")


if __name__ == "__main__":
  define_flags()
  cli.run(main, "eval.validation_curve")
