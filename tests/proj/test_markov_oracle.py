"""proj/markov/oracle.py: the project's time-grid samplers driven by a Markov source's exact denoiser draw
the source's own documents as the steps shrink, and measurably not at two steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proj.markov import data as markov
from dgemma.errors import ConfigError
from proj.markov import oracle as markov_oracle

REPO = Path(__file__).resolve().parents[2]
CHAIN = markov.MarkovChain.random(alphabet="abc", order=1, concentration=0.3, seed=4)


def _scores(name, steps, num_samples=1024, **kw):
  """Scores of the samples under the truth; the vocabulary is the alphabet alone, so every noise token is a
  symbol and the sampler must tell noise from signal (with the 260 byte ids, noise is mostly non-symbols)."""
  cfg = markov_oracle.sampler_config(name, steps, canvas_len=6, t_max=1.0, t_min=1.0, **kw)
  texts = markov_oracle.sample_texts(CHAIN, cfg, num_samples, seed=0, ids_S=range(3), vocab_size=3)
  assert len(texts) == num_samples and all(len(t) == 6 for t in texts)
  return markov.sample_scores(CHAIN, texts)


@pytest.mark.parametrize("name", ["ancestral", "pc"])
def test_exact_denoiser_samples_the_source(name):
  """At temperature 1 with small steps the samples' score under the truth is the expected score of the
  source's own 6-symbol documents, within 4 standard errors of the mean over 1,024 samples (the error left
  by 64 steps is below that: on a 27-symbol chain 64 and 128 steps agree within 0.02 bits). A sampler
  that mis-reads the posterior (the loo shift left off: sample.loo_logits on a posterior output) fails it."""
  s = _scores(name, 64, greedy_last_step=False)
  assert s["truth_scored_fraction"] == 1.0
  assert abs(s["truth_bits_per_byte"] - s["truth_expected_bits"]) < 4 * s["truth_bits_per_byte_se"]
  wrong = _scores(name, 64, greedy_last_step=False, loo_logits=True)
  assert abs(wrong["truth_bits_per_byte"] - wrong["truth_expected_bits"]) > 4 * wrong["truth_bits_per_byte_se"]


def test_two_steps_are_measurably_off():
  """Two steps move three symbols at once from per-position posteriors: their joint is not the source's."""
  s = _scores("ancestral", 2, greedy_last_step=False)
  assert s["truth_bits_per_byte"] - s["truth_expected_bits"] > 4 * s["truth_bits_per_byte_se"]


def test_needs_a_time_grid():
  cfg = markov_oracle.sampler_config("released", 4, canvas_len=6, t_max=1.0, t_min=1.0)
  with pytest.raises(ConfigError, match="sample.sampler"):
    markov_oracle.exact_decode_fn(CHAIN, cfg, range(3), 3)
  cfg = markov_oracle.sampler_config("ancestral", 4, canvas_len=6, t_max=1.0, t_min=1.0)
  with pytest.raises(ConfigError, match="distinct ids"):
    markov_oracle.exact_decode_fn(CHAIN, cfg, [0, 0, 1], 3)


@pytest.mark.slow  # a subprocess
def test_command_line(tmp_path):
  markov.write_splits(str(tmp_path / "src"), num_train=1, num_valid=1, length=8, order=1, concentration=0.5, seed=0)
  out = tmp_path / "rows.json"
  cmd = [sys.executable, "-m", "proj.markov.oracle", f"--truth={tmp_path / 'src' / 'truth.json'}", "--steps=2,4",
         "--num_samples=8", "--canvas_len=4", f"--out={out}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["sampler"], r["steps"]) for r in rows] == [("ancestral", 2), ("ancestral", 4), ("pc", 2), ("pc", 4)]
  assert all(r["num_samples"] == 8 and r["truth_scored_fraction"] == 1.0 for r in rows)
  bad = subprocess.run(cmd[:4] + ["--samplers=released", f"--out={out}"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert bad.returncode != 0 and "--samplers" in bad.stderr and "Traceback" not in bad.stderr
