"""Interleaved A/B of train-step variants of one config: which change makes the step faster on this machine.

  .venv/bin/python bench/train_ab.py --config=proj/sudoku/configs/sudoku.py \
      --config.data.sudoku.train_csv=/work/sudoku/data/train.csv \
      --variant=scan:model.scan_layers=True --variant=unrolled:model.scan_layers=False [--rounds=6 --steps=5]

Each `--variant=NAME:KEY=VALUE[,KEY=VALUE...]` applies config overrides (dotted keys as in configs/base.py,
values as Python literals or bare strings; `dgemma.settings.with_overrides`) on top of --config. Every variant's step is compiled once; then `rounds` rounds each time `steps`
steps of every variant in turn (the order rotates each round), so slow drift of a shared VM (another tenant,
clock changes) falls on all variants alike instead of on whichever ran last. A sequential comparison of two
runs on this kind of VM moved by more than 5%; the interleaved medians resolve a few percent.
Prints each variant's median and min ms per step, its ratio to the first variant's median, and the loss of its
first step (same batch and key: variants that only change the program's layout agree to round-off; a change of
parameter layout, such as stacked layers, draws other initial weights and is only comparable in time).
"""

import ast
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
from absl import app, flags
from ml_collections import config_flags

from bench.timing import host_cpu
from bench.train_setup import train_step_inputs
from dgemma import settings as settings_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config (the common base).")
_VARIANTS = flags.DEFINE_multi_string("variant", [], "NAME:KEY=VALUE[,KEY=VALUE...] (at least two).")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Rounds of timings; every variant is timed once per round.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per timing.")


def _split_top_level(text: str) -> list[str]:
  """Split on commas outside brackets and quotes: 'a=1,b=(0.1, 0.9)' -> ['a=1', 'b=(0.1, 0.9)']."""
  parts, depth, quote, start = [], 0, "", 0
  for i, ch in enumerate(text):
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return parts + [text[start:]]


def parse_variant(spec: str) -> tuple[str, dict]:
  """'name:a.b=1,c=x,d=(1, 2)' -> ('name', {'a.b': 1, 'c': 'x', 'd': (1, 2)}); a value that is not a Python
  literal stays a string."""
  name, sep, body = spec.partition(":")
  if not sep or not name:
    raise ValueError(f"--variant={spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
  overrides = {}
  for item in filter(None, _split_top_level(body)):
    key, eq, raw = item.partition("=")
    if not eq or not key:
      raise ValueError(f"--variant={spec!r}: {item!r} is not KEY=VALUE")
    try:
      overrides[key.strip()] = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
      overrides[key.strip()] = raw.strip()
  return name, overrides


class Variant:
  """One compiled train step with its own state and its config's first training batch."""

  def __init__(self, name: str, settings):
    self.name = name
    self.step, self.state, self.batch, self.rng = train_step_inputs(settings)
    t0 = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch, self.rng)
    self.first_loss = float(metrics["loss"])
    self.compile_s = time.perf_counter() - t0
    self.ms = []

  def time_steps(self, steps: int):
    t0 = time.perf_counter()
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch, self.rng)
    jax.block_until_ready(metrics)
    self.ms.append((time.perf_counter() - t0) / steps * 1e3)


def main(argv):
  del argv
  specs = [parse_variant(s) for s in _VARIANTS.value]
  if len(specs) < 2:
    raise app.UsageError("give at least two --variant=NAME:KEY=VALUE,...")
  if len({name for name, _ in specs}) != len(specs):
    raise app.UsageError("variant names must differ")
  # Every variant's config is checked before anything compiles: a key configs/base.py lacks, or a bad value,
  # is a ConfigError naming it.
  checked = [settings_lib.from_config(settings_lib.with_overrides(_CONFIG.value, ov)) for _, ov in specs]
  print(f"cpu: {host_cpu()}")
  variants = []
  for (name, overrides), settings in zip(specs, checked):
    variants.append(Variant(name, settings))
    print(f"{name} {overrides}: compiled in {variants[-1].compile_s:.1f} s, "
          f"first-step loss {variants[-1].first_loss:.6f}", flush=True)
  for v in variants:  # one untimed warm-up each after compilation
    v.time_steps(1)
    v.ms.clear()
  for r in range(_ROUNDS.value):
    order = variants[r % len(variants):] + variants[:r % len(variants)]
    for v in order:
      v.time_steps(_STEPS.value)
    print(f"round {r + 1}: " + "  ".join(f"{v.name} {v.ms[-1]:.1f}" for v in variants), flush=True)
  base = statistics.median(variants[0].ms)
  print(f"{'variant':<16} {'median ms':>10} {'min ms':>8} {'ratio':>6}")
  for v in variants:
    med = statistics.median(v.ms)
    print(f"{v.name:<16} {med:10.1f} {min(v.ms):8.1f} {med / base:6.3f}")


if __name__ == "__main__":
  app.run(main)
