"""bench/lm_eval_noise.py: its task (four-way questions from held-out lines) and its two noise modes, on the tiny run."""

import numpy as np
import pytest

from bench import lm_eval_noise
from eval.lm_eval import dgemma_lm


def test_questions_hold_the_true_ending_among_three_others():
  lines = [" ".join(f"w{i}_{j}" for j in range(8 + i % 5)) for i in range(20)]
  questions = lm_eval_noise.make_questions(lines, 30, answer_words=3)
  assert questions == lm_eval_noise.make_questions(lines, 30, answer_words=3)  # seeded
  for q in questions:
    words = q["context"].split()
    line = next(l for l in lines if l.startswith(q["context"]))
    true = " " + " ".join(line.split()[len(words):len(words) + 3])
    assert len(q["choices"]) == 4 and q["choices"][q["label"]] == true
    assert all(len(c.split()) == 3 for c in q["choices"]) and len(set(q["choices"])) == 4
  assert len({q["label"] for q in questions}) == 4  # the right ending is not always in one place


def test_common_noise_picks_are_the_model_classes_and_independent_noise_differs(tiny_run):
  lm = dgemma_lm(checkpoint=str(tiny_run[0]), num_t_samples=2, batch_size=8)
  questions = [{"context": "the king", "choices": [" crown", " sword", " night", " heart"], "label": 0},
               {"context": "thou art", "choices": [" fair", " foul", " sweet", " noble"], "label": 1}]
  common = lm_eval_noise.picks(lm, questions, common=True)
  direct = [int(np.argmax([s.logprob for s in lm.score_continuations([(q["context"], c) for c in q["choices"]])]))
            for q in questions]
  assert common.tolist() == direct
  docs, starts = lm_eval_noise.choice_ids(lm, questions)
  scores = lambda common: lm.score_ids(docs, starts, lm_eval_noise.noise_keys(questions, common))
  assert [s.logprob for s in scores(True)] != [s.logprob for s in scores(False)]



@pytest.mark.slow  # the fast tier's budget: the benchmark's scoring programs (~6 s)
def test_the_command_prints_its_tables(tiny_run, tmp_path, capsys):
  out = tmp_path / "noise.json"
  lm_eval_noise.main(["--checkpoint", str(tiny_run[0]), "--questions", "3", "--seeds", "2", "--samples", "2,1",
                      "--batch_size", "8", "--gen_tokens", "8", "--out", str(out)])
  import json
  table = json.loads(out.read_text())
  assert set(table["accuracy"]) == {"common", "independent"} and set(table["accuracy"]["common"]) == {"1", "2"}
  assert table["agreement_with_largest_m"]["common"]["2"] >= 0.5  # a mean over 2 seeds, seed 0's being the reference
  assert table["s_per_generate_until_request"] > 0 and set(table["s_per_loglikelihood_request"]) == {"1", "2"}
  assert capsys.readouterr().out.rstrip().endswith("}")
