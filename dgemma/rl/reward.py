"""Rewards as a registry: `rl.reward` names a record of `REWARDS`, one function scoring a batch of samples.

  score(prompts, completions, references) -> float64[N]     (lists of N decoded strings)

prompts: the prompt each sample was drawn for (its text, without BOS); completions: the sample, cut after its
end token; references: the data row's own canvas text (its answer, where the data has one; a reward may ignore it).
Rewards run on the host, between the jitted rollout and the jitted update (dgemma/rl/grpo.py).

  exact_match  1 when the completion equals the reference (both stripped of surrounding whitespace), else 0
  python       the user's function `rl.reward_fn = 'module.path:function'`: called per sample with the completion's
               text, plus prompt= and reference= when its signature takes them; returns a float
A study's rewards (proj/<study>/) are added by `register` when its module is imported: a config that uses one names
that module in `imports`, which dgemma.settings imports before it checks rl.reward. Adding a reward touches this
table (or, for a study, its own module) and its test.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

import numpy as np
from absl import logging

from dgemma import registry
from dgemma.errors import ConfigError

ScoreFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str
  score: ScoreFn | None   # None: built from the settings (`python`)
  doc: str


def per_sample(fn: Callable[[str, str, str], float]) -> ScoreFn:
  """A batch score from a per-sample fn(prompt, completion, reference) -> float."""
  return lambda prompts, completions, references: np.asarray(
      [float(fn(p, c, r)) for p, c, r in zip(prompts, completions, references)], np.float64)


def _exact_match(prompt: str, completion: str, reference: str) -> float:
  del prompt
  return float(completion.strip() == reference.strip())


REWARDS = registry.Table("rl.reward", (
    Reward("exact_match", per_sample(_exact_match), "1 when the completion equals the reference (stripped)"),
    Reward("python", None, "rl.reward_fn = 'module.path:function', text -> float"),
))
register, names = REWARDS.register, REWARDS.names  # a study's module calls register


def _python_score(fn: Callable) -> ScoreFn:
  """The batch score of the user's rl.reward_fn: each sample's value a finite float; anything else, or an exception
  the function raises, is one ConfigError naming rl.reward_fn, the sample's index and its completion."""
  params = inspect.signature(fn).parameters
  takes = lambda name: name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
  extra = [name for name in ("prompt", "reference") if takes(name)]

  def score(prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    out = np.empty(len(completions), np.float64)
    for n, (prompt, completion, reference) in enumerate(zip(prompts, completions, references)):
      kwargs = {name: value for name, value in (("prompt", prompt), ("reference", reference)) if name in extra}
      where = f"rl.reward_fn: sample {n} (completion {completion[:60]!r})"
      try:
        value = fn(completion, **kwargs)
      except Exception as e:  # pylint: disable=broad-except  (the user's code: one line naming it)
        raise ConfigError(f"{where}: {type(e).__name__}: {e}") from e
      out[n] = _number(value, where)
    return out
  return score


def _number(value, where: str) -> float:
  """A reward as a float: a scalar that float() reads (a Python or NumPy number or bool, a 0-d array); None, text
  and non-finite values are refused, naming `where`."""
  if value is None or isinstance(value, (str, bytes)) or np.ndim(value) != 0:
    raise ConfigError(f"{where}: returned {type(value).__name__} {value!r:.60}, not a number")
  try:
    number = float(value)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{where}: returned {type(value).__name__} {value!r:.60}, not a number") from e
  if not np.isfinite(number):
    raise ConfigError(f"{where}: returned {number}, not a finite number")
  return number


def check_python_reward(fn: Callable) -> None:
  """Calls the user's rl.reward_fn on one small synthetic sample (prompt 'Q', completion '42', reference '42')
  before anything is compiled: a function that returns a non-number (None, text, NaN) fails at once, in one line.
  One that raises on it is only warned about: it may need a real reference (a grid, JSON) to parse, and is checked
  again on every rollout."""
  try:
    _python_score(fn)(["Q"], ["42"], ["42"])
  except ConfigError as e:
    if "returned" in str(e):
      raise
    logging.warning("%s; if it needs a real prompt or reference this is expected (it is checked again on every "
                    "rollout)", e)


def scorer(rl) -> ScoreFn:
  """The batch score of the settings `rl` (an RLSettings) name; errors name the field."""
  reward = REWARDS.lookup(rl.reward)
  if reward.name == "python":
    fn = registry.load_function(rl.reward_fn, "rl.reward_fn")
    check_python_reward(fn)
    return _python_score(fn)
  return reward.score
