"""docs/results/likelihood_small/block_length/bound_vs_canvas_len.png from the recorded bounds (run from the
repository root):

  python docs/results/likelihood_small/block_length/plot.py

One point per canvas length: the shipped recipe's run at 32 (muon/likelihood_muon0.02_tmix_step1300.json,
docs/results.md point 12) and the runs of docs/results.md point 17 (likelihood_c*.json here), each trained
for the recipe's minutes (its steps scaled by its step time), scored by `eval.likelihood` on the 16 documents.
"""
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path("docs/results/likelihood_small/block_length")
TRUTH = json.loads(Path("docs/results/likelihood_small/curve.json").read_text())["truth_bits_per_byte"]

RECIPE = Path("docs/results/likelihood_small/muon/likelihood_muon0.02_tmix_step1300.json")
runs = {int(m.group(1)): path for path in HERE.glob("likelihood_c*.json")
        if (m := re.fullmatch(r"likelihood_c(\d+)", path.stem))}  # the first seed of each length
runs[32] = RECIPE
points = []
for length, path in runs.items():
  data = json.loads(path.read_text())
  points.append((length, data["bits_per_byte"] / TRUTH, data["bits_per_byte_se"] / TRUTH))
points.sort()
lengths, ratios, errors = zip(*points)
fig, ax = plt.subplots(figsize=(6, 4))
ax.errorbar(lengths, ratios, yerr=errors, marker="o", capsize=3, label="the recipe, its 1,300 steps' minutes each")
ax.axhline(1.10, color="gray", linestyle="--", label="the issue's target (1.10)")
ax.axhline(1.0, color="black", linewidth=0.8, label="the truth")
ax.set_xscale("log", base=2)
ax.set_xticks(lengths)
ax.set_xticklabels([str(n) for n in lengths])
ax.set_xlabel("canvas length (tokens per diffusion block)")
ax.set_ylabel("bound / true bits per byte")
ax.legend()
fig.tight_layout()
fig.savefig(HERE / "bound_vs_canvas_len.png", dpi=120)
print("wrote", HERE / "bound_vs_canvas_len.png")
