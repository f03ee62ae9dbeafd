"""The matmul ceiling of a jitted step: its dot_generals, found in its jaxpr, each timed alone.

  dots = step_dots(step, state, batch, rng)        # [Dot(lhs, rhs, dims, ..., count)], deduplicated
  rows = time_dots(dots)                           # [(dot, seconds per call alone)]
  ceiling = ceiling_gflops(rows)                   # sum of FLOPs / sum of isolated times

`ceiling_gflops` is the FLOP rate the step would reach if everything but its matmuls took no time and each
matmul ran as fast as it does on its own (bench/train_throughput.py prints it beside the step's rate). It bounds
the step's rate for these shapes only roughly: the step can run two small dots side by side on two cores faster
than each alone on both (the small preset's step measured 1.03x its figure, docs/benchmarks.md "Training"). Loops: a `scan` body counts `length` times; a `while` body once
(its trip count is not in the jaxpr; `loops_unknown` says how many such bodies held dots).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Dot:
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  dimension_numbers: tuple
  preferred_element_type: str | None
  count: int = 1

  @property
  def key(self) -> "Dot":
    """This dot with count 1: what identifies a distinct dot."""
    return dataclasses.replace(self, count=1)

  @property
  def flops(self) -> int:
    """2 x output elements x contracted size, for one call."""
    (lc, _), (lb, _) = self.dimension_numbers
    contract = math.prod(self.lhs_shape[d] for d in lc)
    batch = math.prod(self.lhs_shape[d] for d in lb)
    # out = batch x lhs_free x rhs_free; lhs = batch x lhs_free x contract; rhs = batch x contract x rhs_free
    return 2 * math.prod(self.lhs_shape) * math.prod(self.rhs_shape) // (contract * batch)


def _sub_jaxprs(value):
  if isinstance(value, jax_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def _walk(jaxpr, times: int, found: dict, unknown: list):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      pet = eqn.params.get("preferred_element_type")
      dims = tuple(tuple(tuple(int(d) for d in side) for side in pair) for pair in eqn.params["dimension_numbers"])
      dot = Dot(tuple(lhs.shape), tuple(rhs.shape), str(lhs.dtype), str(rhs.dtype), dims,
                None if pet is None else str(jnp.dtype(pet)))
      found[dot.key] = found.get(dot.key, 0) + times
      continue
    inner = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        before = sum(found.values())
        _walk(sub, inner, found, unknown)
        if eqn.primitive.name == "while" and sum(found.values()) > before:
          unknown.append(eqn)


def step_dots(fn, *args) -> tuple[list[Dot], int]:
  """(the dot_generals of fn(*args), one record per distinct dot with its count; how many `while` bodies
  with dots were counted once)."""
  found, unknown = {}, []
  _walk(jax.make_jaxpr(fn)(*args).jaxpr, 1, found, unknown)
  return [dataclasses.replace(k, count=n) for k, n in found.items()], len(unknown)


def _random(shape, dtype, rng):
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(rng.integers(-8, 8, size=shape), dtype)
  return jnp.asarray(rng.standard_normal(shape), dtype)


def time_dot(dot: Dot, reps: int = 5, trials: int = 3, seed: int = 0) -> float:
  """Best-of-`trials` seconds per call of this dot alone (jitted, inputs on device, compile excluded)."""
  rng = np.random.default_rng(seed)
  a, b = _random(dot.lhs_shape, dot.lhs_dtype, rng), _random(dot.rhs_shape, dot.rhs_dtype, rng)
  pet = None if dot.preferred_element_type is None else jnp.dtype(dot.preferred_element_type)
  f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dot.dimension_numbers, preferred_element_type=pet))
  f(a, b).block_until_ready()
  best = math.inf
  for _ in range(trials):
    t = time.perf_counter()
    for _ in range(reps):
      out = f(a, b)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return best


def time_dots(dots: list[Dot], **kw) -> list[tuple[Dot, float]]:
  return [(d, time_dot(d, **kw)) for d in dots]


def ceiling_gflops(rows: list[tuple[Dot, float]]) -> tuple[float, float, float]:
  """(GFLOP/s of all the dots run alone, their total GFLOP per step, their total seconds per step)."""
  flops = sum(d.flops * d.count for d, _ in rows)
  seconds = sum(s * d.count for d, s in rows)
  return flops / seconds / 1e9, flops / 1e9, seconds
