"""The likelihood of held-out text against training time, for one or more runs: every saved checkpoint scored.

  python -m eval.likelihood_curve --runs=diffusion=workdirs/ll_small,ar=workdirs/ll_ar \\
      --data=data_cache/markov/valid.txt --truth=data_cache/markov/truth.json \\
      --out_dir=ll_curve

Each checkpoint step of each run is scored with `dgemma.load(run, step=...).score(texts)` (the estimator of
eval.likelihood: a NELBO bound for diffusion runs, the exact NLL for AR ones) with the run's own eval
settings. Training minutes at a step are the sum of the run's logged train windows up to it (metrics.jsonl:
log_every steps of batch x seq_len tokens at the window's tokens/s; evaluation and checkpointing excluded).
--truth: the truth.json of proj/markov/make_text.py: the chain is rebuilt from it and the exact bits per
byte of the scored documents are the ratio column's denominator and the plot's reference line.
Writes out_dir/curve.json, curve.csv and bound_vs_minutes.png.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from absl import flags

import dgemma
from dgemma import files, run_report
from dgemma.checkpoints import workdir as workdir_lib
from dgemma.data import builder as builder_lib
from proj.markov import data as markov
from dgemma.errors import ConfigError
from dgemma.tools import cli
from dgemma.train import metrics as metrics_lib

_FLAGS: dict = {}


def define_flags() -> None:
  """The command line's flags (defined only when run as a program, so importing this module for its
  functions leaves absl's global flags alone)."""
  _FLAGS["runs"] = flags.DEFINE_string("runs", None, "Comma-separated NAME=WORKDIR pairs.", required=True)
  _FLAGS["data"] = flags.DEFINE_string("data", None,
                                       "A .txt (one document per line) or .jsonl file to score.", required=True)
  _FLAGS["truth"] = flags.DEFINE_string("truth", "", "truth.json of proj.markov.make_text (optional).")
  _FLAGS["out_dir"] = flags.DEFINE_string("out_dir", None,
                                          "Where curve.json, curve.csv and the plot go.", required=True)
  _FLAGS["max_documents"] = flags.DEFINE_integer("max_documents", 0,
                                                 "Score only the first this many documents (0 = all).")


def parse_runs(text: str, need_checkpoints: bool = True) -> list[tuple[str, str]]:
  """'a=dir1,b=dir2' -> [(a, dir1), (b, dir2)]; every dir must be a training workdir (with saved checkpoints
  when `need_checkpoints`; with its metrics.jsonl otherwise)."""
  runs = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise ConfigError(f"--runs: {item!r} is not NAME=WORKDIR")
    if need_checkpoints and (not workdir_lib.is_workdir(path) or not workdir_lib.steps(path)):
      raise ConfigError(f"--runs: {path!r} ({name}) is not a training workdir with saved checkpoints")
    if not need_checkpoints and not (Path(path) / metrics_lib.METRICS_FILE).is_file():
      raise ConfigError(f"--runs: {path!r} ({name}) has no {metrics_lib.METRICS_FILE}: not a training workdir")
    runs.append((name, path))
  if not runs:
    raise ConfigError("--runs: empty")
  return runs


def curve(runs: list[tuple[str, str]], texts: list[str], truth_bpb: float | None, print_fn=print) -> list[dict]:
  rows = []
  for name, path in runs:
    minutes = metrics_lib.train_minutes(path)
    for step in workdir_lib.steps(path):
      out = dgemma.load(path, step=step, field="--runs").score(texts)
      row = {"run": name, "step": step, "minutes": minutes.get(step), "measure": out["measure"],
             "bits_per_byte": out["bits_per_byte"], "bits_per_byte_se": out["bits_per_byte_se"],
             "nats_per_token": out["nats_per_token"]}
      if truth_bpb:
        row["ratio_to_truth"] = out["bits_per_byte"] / truth_bpb
      rows.append(row)
      print_fn(json.dumps(row))
  return rows


def plot(rows: list[dict], truth_bpb: float | None, out_png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
  for name in dict.fromkeys(r["run"] for r in rows):
    pts = [(r["minutes"], r["bits_per_byte"], r["bits_per_byte_se"]) for r in rows
           if r["run"] == name and r["minutes"] is not None]
    if pts:
      xs, ys, es = zip(*pts)
      ax.errorbar(xs, ys, yerr=es, fmt="o-", markersize=3, capsize=2, label=name)
  if truth_bpb:
    ax.axhline(truth_bpb, color="k", ls="--", lw=1, label="truth (entropy of the source)")
    ax.axhline(1.1 * truth_bpb, color="gray", ls=":", lw=1, label="truth + 10%")
  ax.set_xlabel("training minutes (this CPU)")
  ax.set_ylabel("bits per byte (bound / exact NLL)")
  ax.legend(fontsize=7)
  run_report.save_figure(fig, out_png)


def main(argv):
  cli.no_extra_args(argv)
  runs = parse_runs(_FLAGS['runs'].value)  # bad input fails before any weight is read
  builder_lib.check_files([_FLAGS['data'].value])
  texts = list(builder_lib.iter_file_documents(_FLAGS['data'].value, "line", "text", "strict"))
  if _FLAGS['max_documents'].value > 0:
    texts = texts[:_FLAGS['max_documents'].value]
  truth_bpb = None
  if _FLAGS['truth'].value:
    truth_bpb = markov.read_chain(_FLAGS['truth'].value).bits_per_byte(texts)
  out_dir = Path(_FLAGS['out_dir'].value)
  rows = curve(runs, texts, truth_bpb)
  files.write_json_atomic(out_dir / "curve.json", {"data": _FLAGS['data'].value, "documents": len(texts),
                                                   "truth_bits_per_byte": truth_bpb, "rows": rows})
  with open(out_dir / "curve.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
    writer.writeheader()
    writer.writerows(rows)
  plot(rows, truth_bpb, out_dir / "bound_vs_minutes.png")
  print(f"wrote {out_dir}/curve.json, curve.csv and bound_vs_minutes.png ({len(rows)} checkpoints)")


if __name__ == "__main__":
  define_flags()
  cli.run(main, "eval.likelihood_curve")
