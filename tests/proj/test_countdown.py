"""The Countdown task (proj/countdown): generated problems, the exact checker, the reward, the SFT rows and eval."""

from __future__ import annotations

import json
import numpy as np
import pytest

from dgemma import data as data_lib
from dgemma import settings as settings_lib
from dgemma.rl import reward as reward_lib
from dgemma.rl.config import RLSettings
from proj.countdown import data, make_jsonl, reward
from proj.countdown.configs import countdown, rl_countdown


def test_generated_problems_are_solved_by_their_answer():
  rows = data.generate(300, count=3, max_number=20, max_target=100, seed=4)
  assert len({r["prompt"] for r in rows}) > 250
  for row in rows:
    numbers, target = data.parse_prompt(row["prompt"])
    assert len(numbers) == 3 and all(1 <= n <= 20 for n in numbers) and 1 <= target <= 100
    assert data.check(row["response"], numbers, target), row
  assert data.generate(5, seed=4) == rows[:5]  # seeded


@pytest.mark.parametrize("answer", [
    "(12-7)*3+30",          # 30 is not a given number
    "12*3+7+2",             # neither is 2
    "12+7*3",               # 33
    "3*(12+3)",             # 45, but 3 twice and 7 unused
    "(7+12)*3",             # 57
    "3*12+7",               # 43
    "12*(7-3)",             # 48
    "12/0", "12/(7-7)*3",   # division by zero
    "__import__('os')", "3+", "(3+7", "3+7)", "", "3 7 12",
])
def test_check_refuses_wrong_answers(answer):
  assert not data.check(answer, [3, 7, 12], 45)


@pytest.mark.parametrize("answer", ["3*(7+12)-12", "(12-7)*3*3"])
def test_check_needs_each_number_exactly_once(answer):
  assert not data.check(answer, [3, 7, 12], 45)


@pytest.mark.parametrize("answer,numbers,target", [
    ("12*3+7+2", [12, 3, 7, 2], 45), (" (12 - 7) * 9 ", [12, 7, 9], 45), ("90/2", [90, 2], 45),
    ("7*(12-3)-18", [7, 12, 3, 18], 45), ("10/4*18", [10, 4, 18], 45),  # exact rationals: 2.5 * 18
])
def test_check_accepts_right_answers(answer, numbers, target):
  assert data.check(answer, numbers, target)


def test_reward_reads_the_problem_from_a_rendered_prompt():
  prompt = "<|turn>user\n" + data.prompt_text([3, 7, 12], 45) + "<turn|>\n<|turn>model\n"
  score = reward_lib.scorer(RLSettings(reward="countdown"))
  np.testing.assert_array_equal(score([prompt] * 3, ["(12-7)*9", "3*(12+3)", "12*3+7+2"], [""] * 3), [0, 0, 0])
  np.testing.assert_array_equal(score([prompt, prompt], ["3*12+7-(12-12)", "(7+3)*12/3+5"], ["", ""]), [0, 0])
  np.testing.assert_array_equal(score([prompt], ["3*(12+7)-12"], [""]), [0])
  assert reward.solved(data.prompt_text([3, 7, 12], 45), "3*12+(7+2)") == 0.0
  assert reward.solved(data.prompt_text([3, 7, 12], 43), "3*12+7") == 1.0
  assert reward.solved("no problem here", "3*12+7") == 0.0


def test_make_jsonl_writes_disjoint_splits(tmp_path):
  assert make_jsonl.write(tmp_path, 300, 40) == (300, 40)
  train = [json.loads(l) for l in open(tmp_path / "train.jsonl")]
  test = [json.loads(l) for l in open(tmp_path / "test.jsonl")]
  assert len(train) == 300 and len(test) == 40
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_the_configs_make_rows_that_fit(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in data.generate(64, seed=1)))
  config = countdown.get_config(str(path))
  config.data.cache_dir = str(tmp_path / "cache")
  config.data.sft_overflow = "error"      # every prompt fits the context: nothing truncated
  settings = settings_lib.from_config(config)
  prepared = data_lib.prepare(settings)
  batch = next(data_lib.make_iterator(settings, prepared, "train"))
  assert batch["tokens"].shape == (32, 96)
  text = prepared.tokenizer.decode([t for t in batch["tokens"][0, -16:] if t > 3])
  parsed = data.parse_prompt(prepared.tokenizer.decode([t for t in batch["tokens"][0, :-16] if t > 3]))
  assert parsed is not None and data.check(text, *parsed)   # the canvas is the answer to the row's prompt
  rl = settings_lib.from_config(rl_countdown.get_config("workdirs/countdown"))
  assert rl.rl.reward == "countdown" and rl.train.init_from == "workdirs/countdown"


@pytest.mark.slow  # loads a run and compiles its chat generation: about 15 s on 2 cores
def test_eval_scores_a_run_from_its_own_samples(tmp_path, capsys):
  """proj.countdown.eval on a random (untrained) run: every prompt gets one sample, scored by the exact checker."""
  import dgemma
  from proj.countdown import eval as countdown_eval
  from tests.model_utils import save_random_run
  config = countdown.get_config(str(tmp_path / "unused.jsonl"))
  save_random_run(config, tmp_path / "run")
  problems = data.generate(6, seed=2)
  rate, records = countdown_eval.success(dgemma.load(str(tmp_path / "run")), problems, batch_size=4, seed=0)
  assert len(records) == 6 and [r["prompt"] for r in records] == [p["prompt"] for p in problems]
  assert rate == np.mean([data.check(r["prediction"].strip(), *data.parse_prompt(r["prompt"])) for r in records])
  # the command line reads a given step, and a step the run does not hold is one line naming it
  path = tmp_path / "test.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in problems[:2]))
  countdown_eval.main(["--checkpoint", str(tmp_path / "run"), "--data", str(path), "--step", "1", "--batch_size", "2"])
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"] == 2
  with pytest.raises(SystemExit, match="proj.countdown.eval: .*7"):
    countdown_eval.main(["--checkpoint", str(tmp_path / "run"), "--data", str(path), "--step", "7"])
