"""A small report folder for a run: loss curves (PNG), samples, their quality when eval.samples has scored
them (WORKDIR/sample_quality.json: real-word rate and unigram entropy beside held-out text), and an HTML
denoising trajectory (the command: python -m dgemma.tools.report --workdir=workdirs/demo --out=report)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from dgemma.train.metrics import read_metrics


def plot_losses(records: list[dict], out_png: str | Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
  for split, style in (("train", "-"), ("eval", "o-")):
    for key in ("canvas_loss", "encoder_loss"):
      pts = [(r["step"], r[key]) for r in records if r["split"] == split and key in r]
      if pts:
        steps, vals = zip(*pts)
        ax.plot(steps, vals, style, label=f"{split} {key.replace('_', ' ')}", markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title("dgemma training")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_png)
  plt.close(fig)



def plot_sweep(rows: Sequence[dict], x: str, y: str, out_png: str | Path, title: str = "") -> None:
  """One line per rows' 'group' (points in row order) of column y against column x; rows lacking either
  are skipped. Used by eval/ablate.py."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups: dict[str, list[tuple[float, float, str]]] = {}
  for row in rows:
    if isinstance(row.get(x), (int, float)) and isinstance(row.get(y), (int, float)):
      groups.setdefault(str(row.get("group", "")), []).append((float(row[x]), float(row[y]), str(row.get("name", ""))))
  fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
  for group, pts in groups.items():
    xs, ys, names = zip(*pts)
    ax.plot(xs, ys, "o-", label=group or None, markersize=4)
    for px, py, name in pts:
      ax.annotate(name, (px, py), textcoords="offset points", xytext=(3, 3), fontsize=6, alpha=0.7)
  ax.set_xlabel(x)
  ax.set_ylabel(y)
  ax.set_title(title or f"{y} vs {x}", fontsize=9)
  if any(groups):
    ax.legend(fontsize=7)
  save_figure(fig, out_png)


def save_figure(fig, out_png: str | Path) -> None:
  """Grid, tight layout, the PNG written (its directory made), the figure closed."""
  import matplotlib.pyplot as plt
  for ax in fig.axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  Path(out_png).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out_png)
  plt.close(fig)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; background: #fafafa; }
.step { margin: 0.4em 0; padding: 0.4em; background: white; border: 1px solid #ddd; border-radius: 4px; }
.step h3 { margin: 0 0 0.3em 0; font-size: 0.85em; color: #555; }
.tok { font-family: monospace; white-space: pre-wrap; padding: 0 1px; border-radius: 2px; }
.acc { background: #c8f0c8; }
.noise { background: #f3d2d2; color: #777; }
.legend span { margin-right: 1em; }
"""


def trajectory_html(pieces_SC: Sequence[Sequence[str]], accepted_SC: np.ndarray, entropy_SC: np.ndarray,
                    title: str = "Denoising trajectory", prompt: str = "") -> str:
  """HTML view of one canvas: one row per denoising step, accepted tokens green, re-noised red.

  pieces_SC[s][c] is the text of the token at canvas position c after step s (before re-noising).
  """
  rows = []
  for s, pieces in enumerate(pieces_SC):
    n_acc = int(np.sum(accepted_SC[s]))
    spans = []
    for c, piece in enumerate(pieces):
      cls = "acc" if accepted_SC[s][c] else "noise"
      spans.append(f'<span class="tok {cls}" title="entropy {float(entropy_SC[s][c]):.3f}">'
                   f"{html.escape(piece)}</span>")
    rows.append(f'<div class="step"><h3>step {s + 1}: {n_acc}/{len(pieces)} accepted, '
                f"mean entropy {float(np.mean(entropy_SC[s])):.3f}</h3>{''.join(spans)}</div>")
  prompt_html = f"<p><b>Prompt:</b> <code>{html.escape(prompt)}</code></p>" if prompt else ""
  return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
          f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{prompt_html}"
          "<p class='legend'><span class='tok acc'>accepted</span><span class='tok noise'>re-noised</span>"
          " (hover a token for its entropy)</p>" + "".join(rows) + "</body></html>")


QUALITY_FILE = "sample_quality.json"  # eval.samples' summary of the run's samples (`make demo` writes it)


def quality_html(summary: dict) -> str:
  """The sample-quality table of a report: real-word rate and unigram entropy beside held-out text."""
  def cell(key):
    value = summary.get(key)
    return "-" if value is None else f"{value:.3f}"
  rows = [("real-word rate (share of words, lowercased letter runs, found in the training text)",
           "real_word_rate", "real_word_rate_heldout"),
          ("unigram entropy of a sample's tokens, nats (low = repetitive)", "unigram_entropy",
           "unigram_entropy_heldout")]
  body = "".join(f"<tr><td>{html.escape(name)}</td><td>{cell(a)}</td><td>{cell(b)}</td></tr>" for name, a, b in rows)
  what = (f"{summary.get('num_samples', '?')} samples of {summary.get('max_new_tokens', '?')} tokens, sampler "
          f"{html.escape(str(summary.get('sampler', '?')))}, {summary.get('passes_per_canvas', float('nan')):.1f} "
          "decoder passes per canvas (python -m eval.samples)")
  return (f"<h2>Sample quality</h2><p>{what}</p><table><tr><th></th><th>samples</th><th>held-out text</th></tr>"
          f"{body}</table>")


def write_report(workdir: str | Path, out_dir: str | Path) -> Path:
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  records = read_metrics(workdir)
  plot_losses(records, out / "loss_curve.png")
  samples = Path(workdir) / "samples.txt"
  samples_html = html.escape(samples.read_text()) if samples.exists() else "(no samples yet: run sample.py)"
  evals = [r for r in records if r["split"] == "eval"]
  last_eval = evals[-1] if evals else {}
  traj = "trajectory.html" if (out / "trajectory.html").exists() else None
  index = ["<!doctype html><html><head><meta charset='utf-8'><title>dgemma report</title>",
           f"<style>{_STYLE}</style></head><body><h1>dgemma run report</h1>",
           f"<p>workdir: <code>{html.escape(str(Path(workdir).absolute()))}</code></p>",
           "<h2>Loss</h2><img src='loss_curve.png' alt='loss curve'>"]
  if last_eval:
    index.append("<p>final validation: " + ", ".join(
        f"{k}={v:.4f}" for k, v in last_eval.items() if k not in ("step", "split")) + f" (step {last_eval['step']})</p>")
  quality = Path(workdir) / QUALITY_FILE
  if quality.exists():
    index.append(quality_html(json.loads(quality.read_text())))
  index.append(f"<h2>Samples</h2><pre>{samples_html}</pre>")
  if traj:
    index.append("<h2>Denoising</h2><p><a href='trajectory.html'>one denoising trajectory</a></p>")
  index.append("</body></html>")
  (out / "index.html").write_text("\n".join(index))
  if samples.exists():
    (out / "samples.txt").write_text(samples.read_text())
  return out
