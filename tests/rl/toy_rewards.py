"""Reward functions named by module path in the RL tests (`rl.reward='python'`)."""


def share_of_digits(completion):
  """The share of the completion's characters that are digits 1-8: a reward a tiny random policy can learn."""
  return sum(ch in "12345678" for ch in completion) / max(len(completion), 1)


def with_prompt(completion, prompt):
  return float(completion.startswith(prompt[-1:]))


def with_everything(completion, **kwargs):
  return float(kwargs["reference"] == completion)


def not_finite(completion):
  return float("nan")


NOT_A_FUNCTION = 3
