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


def returns_none(completion):
  del completion


def returns_text(completion):
  return completion


def raises(completion):
  return {"42": 1.0}[completion]   # fine on the synthetic check's '42', a KeyError on anything else


def raises_at_once(completion):
  raise RuntimeError(f"cannot score {completion}")


NOT_A_FUNCTION = 3
