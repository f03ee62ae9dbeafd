"""proj/markov/denoisers.py: the exact denoiser of a Markov source seeing only a window of the canvas, and the
command line's record. (The blind denoiser's posterior is checked by enumeration in tests/proj/test_markov.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from proj.markov import data as markov
from dgemma.errors import ConfigError
from proj.markov import denoisers as markov_denoisers

REPO = Path(__file__).resolve().parents[2]
CHAIN = markov.MarkovChain.random(alphabet="abc ", order=2, concentration=0.3, seed=1)


def test_windows_span_from_the_prior_to_the_exact_posterior():
  """w >= C - 1 reads the whole canvas: the exact posterior. w = 0 reads no canvas token: p(x_i | prefix), the
  chain's transitions from the prefix's state taken i + 1 times. Between them the posterior depends on w."""
  V, alpha, prefix = 9, 0.7, "ab"
  z = np.array([3, -1, 0, 0, 2, -1, 1])
  exact = markov.canvas_posteriors(CHAIN, prefix, z, alpha, V)[1]
  np.testing.assert_allclose(markov_denoisers.window_loo_posteriors(CHAIN, prefix, z, alpha, V, len(z) - 1), exact,
                             rtol=1e-12)
  S = CHAIN.num_symbols
  state = np.zeros(S * S)
  state[CHAIN._state([0, 1])] = 1.0  # "ab"
  blind_to_all = markov_denoisers.window_loo_posteriors(CHAIN, prefix, z, alpha, V, 0)
  for i in range(len(z)):
    flow = state[:, None] * CHAIN.transitions  # [state, next symbol]
    np.testing.assert_allclose(blind_to_all[i], flow.sum(0), rtol=1e-10)
    state = np.zeros(S * S)
    np.add.at(state, ((np.arange(S * S)[:, None] % S) * S + np.arange(S)[None, :]).reshape(-1), flow.reshape(-1))
  two = markov_denoisers.window_loo_posteriors(CHAIN, prefix, z, alpha, V, 2)
  assert not np.allclose(two, exact, atol=1e-4) and not np.allclose(two, blind_to_all, atol=1e-4)


def test_document_canvases():
  # whole canvases after the first: "abc|ab |ca" gives one, "cc" none, "b a| b |a" one, "abcabc ab" two
  prefixes, x = markov_denoisers.document_canvases(CHAIN, ["abcab ca", "cc", "b a b a", "abcabc ab"], 3)
  assert prefixes == ["abc", "b a", "abc", "abcabc"]
  assert x.tolist() == [[0, 1, 3], [3, 1, 3], [0, 1, 2], [3, 0, 1]]
  with pytest.raises(ConfigError, match="document 1 holds"):
    markov_denoisers.document_canvases(CHAIN, ["abcabc", "abX"], 3)
  with pytest.raises(ConfigError, match="no document holds two canvases"):
    markov_denoisers.document_canvases(CHAIN, ["abc"], 3)


@pytest.mark.slow  # a subprocess
def test_command_line(tmp_path):
  markov.write_splits(str(tmp_path / "src"), num_train=1, num_valid=2, length=24, order=2, concentration=0.3, seed=0)
  out = tmp_path / "d.json"
  cmd = [sys.executable, "-m", "proj.markov.denoisers", f"--truth={tmp_path / 'src' / 'truth.json'}",
         f"--data={tmp_path / 'src' / 'valid.txt'}", "--canvas_len=8", "--grid=0.25,0.75", "--blind_grid=4",
         "--windows=1,7", f"--out={out}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert record["canvases"] == 4 and [r["t"] for r in record["rows"]] == [0.25, 0.75]
  for r in record["rows"]:  # a window over the whole canvas is the exact denoiser, on the same noise draws
    assert r["window_7"] == pytest.approx(r["exact"], rel=1e-5)
  assert record["summary"]["exact"]["ratio_to_exact"] == 1.0
  bad = subprocess.run(cmd[:5] + ["--grid=0,0.5", f"--out={out}"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert bad.returncode != 0 and "--grid" in bad.stderr and "Traceback" not in bad.stderr
