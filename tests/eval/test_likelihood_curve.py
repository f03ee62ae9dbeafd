"""eval/likelihood_curve.py: every checkpoint of a run scored against its training minutes."""

import json

import numpy as np
import pytest

import dgemma
from dgemma.checkpoints import workdir as workdir_lib
from proj.markov import data as markov
from dgemma.errors import ConfigError
from dgemma.train import metrics as metrics_lib
from eval import likelihood_curve


def test_runs_are_checked_before_anything_loads(tmp_path, tiny_run):
  workdir, _ = tiny_run
  assert likelihood_curve.parse_runs(f"a={workdir}") == [("a", str(workdir))]
  with pytest.raises(ConfigError, match="NAME=WORKDIR"):
    likelihood_curve.parse_runs(str(workdir))
  with pytest.raises(ConfigError, match="not a training workdir"):
    likelihood_curve.parse_runs(f"a={workdir},b={tmp_path}")


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_minutes_and_scores_of_every_checkpoint(tiny_run, tmp_path):
  workdir, config = tiny_run
  minutes = metrics_lib.train_minutes(str(workdir))  # (dgemma/train/metrics.py; the curve's minutes column)
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if r["split"] == "train"]
  tokens = config.data.batch_size * config.data.seq_len
  # the minutes are the logged windows' step counts over their tokens/s, accumulated
  want, last, total = {}, 0, 0.0
  for r in train:
    total += (r["step"] - last) * tokens / r["tokens_per_sec"] / 60.0
    last, want[r["step"]] = r["step"], total
  assert minutes == pytest.approx(want) and list(minutes.values()) == sorted(minutes.values())
  texts = ["the quick brown fox", "jumps over the lazy dog"]
  out = likelihood_curve.curve([("tiny", str(workdir))], texts, truth_bpb=2.0, print_fn=lambda s: None)
  assert [r["step"] for r in out] == workdir_lib.steps(workdir)
  last_score = dgemma.load(str(workdir)).score(texts)
  assert out[-1]["bits_per_byte"] == last_score["bits_per_byte"]  # the same estimator, deterministic
  assert out[-1]["ratio_to_truth"] == pytest.approx(out[-1]["bits_per_byte"] / 2.0)
  likelihood_curve.plot(out, 2.0, tmp_path / "c.png")
  assert (tmp_path / "c.png").stat().st_size > 1000


def test_truth_of_the_scored_documents(tmp_path):
  truth = markov.write_splits(str(tmp_path), num_train=3, num_valid=4, length=100, order=2, concentration=0.2,
                              seed=1)
  texts = (tmp_path / "valid.txt").read_text().splitlines()
  chain = markov.chain_of_truth(truth)
  assert chain.bits_per_byte(texts) == pytest.approx(truth["valid_bits_per_byte"], rel=1e-12)
  assert chain.bits_per_byte(texts[:2]) != pytest.approx(truth["valid_bits_per_byte"], rel=1e-6)
  with pytest.raises(ConfigError, match="missing"):
    markov.chain_of_truth({"order": 2})
  assert np.isfinite(chain.bits_per_byte(texts[:1]))
