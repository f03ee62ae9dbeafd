"""The reward registry (dgemma/rl/reward.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dgemma.errors import ConfigError
from dgemma.rl import reward
from dgemma.rl.config import RLSettings


def score(name, prompts, completions, references, **kw):
  return reward.scorer(RLSettings(reward=name, **kw))(prompts, completions, references)


def test_registry_lists_the_builtins_and_the_studies():
  import proj.sudoku.reward  # noqa: F401  (registers the study's rewards, as a config naming it in `imports` does)
  names = reward.names()
  assert {"exact_match", "python", "sudoku", "sudoku_partial"} <= set(names)


def test_exact_match():
  np.testing.assert_array_equal(score("exact_match", ["", ""], [" 42\n", "41"], ["42", "42"]), [1.0, 0.0])


def test_python_callables_get_what_their_signature_takes():
  got = score("python", ["ab", "ab"], ["1x2y", "zz"], ["", ""], reward_fn="tests.rl.toy_rewards:share_of_digits")
  np.testing.assert_allclose(got, [0.5, 0.0])
  got = score("python", ["xb", "xa"], ["b..", "b.."], ["", ""], reward_fn="tests.rl.toy_rewards:with_prompt")
  np.testing.assert_array_equal(got, [1.0, 0.0])
  got = score("python", ["", ""], ["r", "s"], ["r", "r"], reward_fn="tests.rl.toy_rewards:with_everything")
  np.testing.assert_array_equal(got, [1.0, 0.0])


@pytest.mark.parametrize("path,message", [
    ("tests.rl.toy_rewards", "is not 'module.path:function'"),
    ("tests.rl.no_such_module:f", "cannot import 'tests.rl.no_such_module'"),
    ("tests.rl.toy_rewards:missing", "has no function 'missing'"),
    ("tests.rl.toy_rewards:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
])
def test_a_bad_reward_function_is_one_line_naming_the_field(path, message):
  with pytest.raises(ConfigError, match=f"rl.reward_fn: .*{message}"):
    reward.scorer(RLSettings(reward="python", reward_fn=path))


@pytest.mark.parametrize("fn, message", [
    ("not_finite", r"sample 0 \(completion '42'\): returned nan, not a finite number"),
    ("returns_none", r"sample 0 \(completion '42'\): returned NoneType None, not a number"),
    ("returns_text", r"sample 0 \(completion '42'\): returned str '42', not a number"),
])
def test_a_reward_function_that_returns_a_non_number_is_refused_at_once(fn, message):
  """scorer() calls rl.reward_fn once on a synthetic sample (before a run builds anything, rl_step.check): a
  function returning a non-number or a non-finite value is one ConfigError naming rl.reward_fn."""
  with pytest.raises(ConfigError, match="rl.reward_fn: " + message):
    reward.scorer(RLSettings(reward="python", reward_fn=f"tests.rl.toy_rewards:{fn}"))


def test_a_reward_function_that_raises_is_warned_about_then_named_on_the_sample(caplog):
  """A function that raises on the synthetic sample may need a real reference to parse: a warning naming
  rl.reward_fn, not a refusal; on a real batch its failure is one ConfigError naming the sample and completion.
  NumPy and 0-d array rewards are numbers."""
  import logging
  with caplog.at_level(logging.WARNING):
    score_fn = reward.scorer(RLSettings(reward="python", reward_fn="tests.rl.toy_rewards:raises_at_once"))
  assert any("rl.reward_fn: sample 0 (completion '42'): RuntimeError: cannot score 42" in r.getMessage()
             for r in caplog.records)
  with pytest.raises(ConfigError, match=r"rl.reward_fn: sample 0 \(completion 'x'\): RuntimeError: cannot score x"):
    score_fn([""], ["x"], [""])
  np.testing.assert_array_equal(reward._python_score(lambda c: np.bool_(c == "a"))(["", ""], ["a", "b"], ["", ""]),
                                [1.0, 0.0])
  np.testing.assert_array_equal(reward._python_score(lambda c: np.asarray(0.5))([""], ["a"], [""]), [0.5])


def test_a_reward_function_that_fails_later_names_the_sample():
  score_fn = reward.scorer(RLSettings(reward="python", reward_fn="tests.rl.toy_rewards:raises"))  # passes the check
  np.testing.assert_array_equal(score_fn(["", ""], ["42", "42"], ["", ""]), [1.0, 1.0])
  with pytest.raises(ConfigError, match=r"rl.reward_fn: sample 1 \(completion 'x'\): KeyError: 'x'"):
    score_fn(["", ""], ["42", "x"], ["", ""])


def test_settings_name_what_is_missing():
  with pytest.raises(ConfigError, match="rl.reward: .* needs a reward"):
    RLSettings(algorithm="grpo")
  with pytest.raises(ConfigError, match="rl.reward_fn: rl.reward='python' needs the function"):
    RLSettings(algorithm="grpo", reward="python")
  with pytest.raises(ConfigError, match="rl.reward"):
    RLSettings(algorithm="grpo", reward="no_such_reward")
