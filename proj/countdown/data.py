"""Countdown: reach a target from given numbers with + - * / (each number used exactly once), an answer checked
exactly. A verifiable task generated here for reinforcement learning (dgemma/rl; the reward is proj/countdown/
reward.py), in the format of TinyZero's Countdown: the prompt gives the numbers and the target, the answer is one
arithmetic expression.

  prompt    'numbers 3 7 12 target 45'           (PROMPT_FORMAT)
  response  '(12-7)*3+30'-style infix expression  (every given number exactly once; exact rational arithmetic)

`generate` draws problems that have a solution by construction: the numbers are combined by a random expression tree
whose every intermediate value is a positive integer (a division only where exact), and the target is its value.
`check` parses an answer without eval (a recursive-descent parser over integers, + - * / and parentheses) and
verifies its numbers and value with Fractions.
"""

from __future__ import annotations

import collections
import fractions
import re
from typing import Optional, Sequence

import numpy as np

PROMPT_FORMAT = "numbers {numbers} target {target}"
_PROMPT = re.compile(r"numbers ((?:\d+ )*\d+) target (\d+)")
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def prompt_text(numbers: Sequence[int], target: int) -> str:
  return PROMPT_FORMAT.format(numbers=" ".join(str(n) for n in numbers), target=target)


def parse_prompt(text: str) -> Optional[tuple[list[int], int]]:
  """(numbers, target) of the last problem statement in `text` (a rendered chat prompt holds it among its markers);
  None when there is none."""
  found = _PROMPT.findall(text)
  if not found:
    return None
  numbers, target = found[-1]
  return [int(n) for n in numbers.split()], int(target)


# ---- exact checking ------------------------------------------------------------------------------------

class _Parser:
  """expr := term (('+' | '-') term)*; term := atom (('*' | '/') atom)*; atom := integer | '(' expr ')'."""

  def __init__(self, text: str):
    self.tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
      m = _TOKEN.match(text, pos)
      if not m or m.end() == pos:
        raise ValueError(f"unexpected {text[pos:pos + 5]!r}")
      self.tokens.append(int(m.group(1)) if m.group(1) is not None else m.group(2))
      pos = m.end()
    self.i = 0
    self.numbers: list[int] = []

  def peek(self):
    return self.tokens[self.i] if self.i < len(self.tokens) else None

  def take(self):
    tok = self.peek()
    self.i += 1
    return tok

  def expr(self) -> fractions.Fraction:
    value = self.term()
    while self.peek() in ("+", "-"):
      value = value + self.term() if self.take() == "+" else value - self.term()
    return value

  def term(self) -> fractions.Fraction:
    value = self.atom()
    while self.peek() in ("*", "/"):
      op = self.take()
      rhs = self.atom()
      if op == "*":
        value = value * rhs
      elif rhs == 0:
        raise ValueError("division by zero")
      else:
        value = value / rhs
    return value

  def atom(self) -> fractions.Fraction:
    tok = self.take()
    if isinstance(tok, int):
      self.numbers.append(tok)
      return fractions.Fraction(tok)
    if tok == "(":
      value = self.expr()
      if self.take() != ")":
        raise ValueError("unbalanced parenthesis")
      return value
    raise ValueError(f"expected a number or '(', got {tok!r}")


def evaluate(expression: str) -> tuple[fractions.Fraction, list[int]]:
  """(exact value, the integers it uses, in order) of an arithmetic expression; ValueError when it does not parse."""
  parser = _Parser(expression)
  value = parser.expr()
  if parser.peek() is not None:
    raise ValueError(f"unexpected {parser.peek()!r} after the expression")
  return value, parser.numbers


def check(expression: str, numbers: Sequence[int], target: int) -> bool:
  """Whether `expression` uses each of `numbers` exactly once (no other number) and equals `target` exactly."""
  try:
    value, used = evaluate(expression)
  except (ValueError, ZeroDivisionError, RecursionError):
    return False
  return collections.Counter(used) == collections.Counter(numbers) and value == target


# ---- generation ----------------------------------------------------------------------------------------

def _format(tree, parent_prec: int = 0, right: bool = False) -> str:
  if isinstance(tree, int):
    return str(tree)
  op, lhs, rhs = tree
  prec = _PREC[op]
  text = _format(lhs, prec, False) + op + _format(rhs, prec, True)
  # parentheses where precedence or (a - (b - c), a / (b * c)) associativity needs them
  needs = prec < parent_prec or (right and prec == parent_prec)
  return f"({text})" if needs else text


def _combine(rng: np.random.Generator, values: list, max_value: int):
  """A random expression tree over the (value, tree) items: pairs are merged by an operation whose result is a
  positive integer <= max_value; None when no such merge exists at some point."""
  items = list(values)
  while len(items) > 1:
    i, j = rng.choice(len(items), 2, replace=False)
    (a, ta), (b, tb) = items[i], items[j]
    options = [("+", a + b), ("*", a * b)]
    if a > b:
      options.append(("-", a - b))
    if b and a % b == 0 and b > 1:
      options.append(("/", a // b))
    options = [(op, v) for op, v in options if 0 < v <= max_value]
    if not options:
      return None
    op, v = options[rng.integers(len(options))]
    items = [it for k, it in enumerate(items) if k not in (i, j)] + [(v, (op, ta, tb))]
  return items[0]


def make_problem(rng: np.random.Generator, count: int, max_number: int, max_target: int) -> tuple[list[int], int, str]:
  """(numbers, target, one solution) with `count` numbers in 1..max_number and a target in 1..max_target."""
  while True:
    numbers = [int(n) for n in rng.integers(1, max_number + 1, count)]
    found = _combine(rng, [(n, n) for n in numbers], max_target)
    if found is not None:
      target, tree = found
      solution = _format(tree)
      assert check(solution, numbers, target), (solution, numbers, target)
      return numbers, target, solution


def generate(num: int, *, count: int = 3, max_number: int = 20, max_target: int = 100, seed: int = 0) -> list[dict]:
  """`num` problems as {'prompt', 'response'} records (the SFT format of dgemma/data/sft.py), seeded."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    numbers, target, solution = make_problem(rng, count, max_number, max_target)
    out.append({"prompt": prompt_text(numbers, target), "response": solution})
  return out
