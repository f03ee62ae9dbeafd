"""Noise schedules alpha(t) of the uniform-state (and masked) diffusion process, shared by training and
sampling.

alpha(t) is the probability that a token is still clean at diffusion time t in [0, 1] (alpha(0) = 1,
alpha(1) ~ 0). Training draws t and corrupts with probability 1 - alpha(t) (`diffusion.schedule`); the
likelihood weights use alpha'(t); the ancestral and masked samplers walk a time grid from 1 to 0 through
the same function (`sample.alpha_schedule`). A schedule is a record of `SCHEDULES`; adding one touches only
this file (and its test).

  linear     alpha = 1 - t (the released recipe).
  cosine     alpha = cos(pi t / 2).
  loglinear  the log-linear noise of MDLM / UDLM (Sahoo et al. 2024; Schiff et al. 2024): total noise
             sigma(t) = -log(1 - (1 - eps) t), alpha = exp(-sigma) = 1 - (1 - eps) t, so alpha(1) = eps > 0
             keeps sigma finite at t = 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dgemma.errors import ConfigError


def _linear(t, eps):
  del eps
  return 1.0 - t, -jnp.ones_like(t)


def _cosine(t, eps):
  del eps
  return jnp.cos(0.5 * math.pi * t), -0.5 * math.pi * jnp.sin(0.5 * math.pi * t)


def _loglinear(t, eps):
  # 1 - (1 - eps) t written as (1 - t) + eps t: no fp32 cancellation near t = 1
  sigma = -jnp.log((1.0 - t) + jnp.float32(eps) * t)
  return jnp.exp(-sigma), jnp.full_like(t, -(1.0 - eps))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """fn(t, eps) -> (alpha(t), alpha'(t)), fp32 arrays shaped like t; `eps` is used by loglinear only."""
  name: str
  fn: Callable[[jax.Array, float], tuple[jax.Array, jax.Array]]


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("linear", _linear), Schedule("cosine", _cosine), Schedule("loglinear", _loglinear))}


def get(name: str, field: str = "diffusion.schedule") -> Schedule:
  """The schedule called `name`; an unknown name raises ConfigError naming `field`."""
  if name not in SCHEDULES:
    raise ConfigError(f"{field}: {name!r} not in {tuple(SCHEDULES)}")
  return SCHEDULES[name]


def alpha_and_derivative(name: str, t, eps: float = 1e-3) -> tuple[jax.Array, jax.Array]:
  """(alpha(t), alpha'(t)) in fp32."""
  return get(name).fn(jnp.asarray(t, jnp.float32), float(eps))


def alpha(name: str, t, eps: float = 1e-3) -> jax.Array:
  """alpha(t) in fp32."""
  return alpha_and_derivative(name, t, eps)[0]
