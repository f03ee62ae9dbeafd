"""docs/results/likelihood_small/bound_vs_minutes.png from the recorded curves (run from the repository root):

  python docs/results/likelihood_small/two_stream/plot.py

AR and the released decoder (curve.json), the shifted decoder (shift/curve.json), shift + two right readouts
(right_readout/r2/curve.json; that run shared the cores, so its minutes are the shifted run's at the same step
times the step-time ratio measured in point 7, 1.04) and the two-stream recipe (two_stream/curve_probe.json: the probe's
1,300-step run; two_stream/curve_1100.json: the library's, 1,100 steps, the right-readout recipe's compute;
long_3900/curve.json: the library's recipe for 3,900 steps, three times the budget, 2026-12-05), their
own minutes on the 2026-12-04 Intel host, where the right-readout recipe's step measured 0.67x theirs; and the
two-stream recipe trained with Muon (muon/curve.json, 2026-12-05) and with Muon plus the middle-noise times
(muon/tmix/curve.json, the recipe shipped; tests shared the cores during that run, so its steps are placed at the
uniform-t Muon run's minutes: the same step, the same step time); and the recipe for 3,900 steps (muon_3900/curve.json,
2026-12-05 afternoon, nothing else running).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
from eval import likelihood_curve  # noqa: E402

HERE = Path("docs/results/likelihood_small")


def rows(path, rename=None):
  data = json.loads((HERE / path).read_text())
  out = data["rows"]
  for r in out:
    r["run"] = (rename or {}).get(r["run"], r["run"])
  return data["truth_bits_per_byte"], out


truth, base = rows("curve.json", {"diffusion_loo_ce": "diffusion, loo_ce, released decoder", "ar": "AR"})
_, shift = rows("shift/curve.json", {"diffusion_loo_ce_shift": "loo_ce, shifted decoder output"})
_, r2 = rows("right_readout/r2/curve.json", {"right_readout_2": "loo_ce, shift + two right readouts"})
shift_minutes = {r["step"]: r["minutes"] for r in shift}
for r in r2:
  r["minutes"] = 1.04 * shift_minutes[r["step"]]
_, two = rows("two_stream/curve_probe.json", {"two_stream_blind_ce": "two streams, blind_ce, 1,300 steps (Intel host)"})
_, two_1100 = rows("two_stream/curve_1100.json", {"two_stream": "two streams, blind_ce, 1,100 steps (Intel host)"})
_, long = rows("long_3900/curve.json", {"two_stream_3900": "two streams, blind_ce, 3,900 steps (Intel host)"})
_, muon = rows("muon/curve.json", {"muon": "two streams, blind_ce, Muon (Intel host)"})
_, muon_tmix = rows("muon/tmix/curve.json", {"muon_tmix": "two streams, blind_ce, Muon + t mixture (the recipe)"})
_, muon_long = rows("muon_3900/curve.json", {"muon_3900": "the recipe (Muon + t mixture), 3,900 steps"})
muon_minutes = {r["step"]: r["minutes"] for r in muon}
for r in muon_tmix:
  r["minutes"] = muon_minutes[r["step"]]
likelihood_curve.plot(base + shift + r2 + two + two_1100 + long + muon + muon_tmix + muon_long, truth,
                      HERE / "bound_vs_minutes.png")
print("wrote", HERE / "bound_vs_minutes.png")
