"""bench/dot_ceiling.py: the dots it finds in a jaxpr (counts through jit, scan and grad), their FLOPs, and the
ceiling arithmetic."""

import math

import jax
import jax.numpy as jnp

from bench import dot_ceiling


def _fn(w1, w2, x):
  def layer(h, _):
    return jnp.tanh(h @ w2), None
  h = jax.jit(lambda a, b: a @ b)(x, w1)              # [8, 16] @ [16, 32]: inside a nested jit
  h, _ = jax.lax.scan(layer, h, None, length=3)       # [8, 32] @ [32, 32], three times
  return jnp.einsum("bij,bjk->bik", h.reshape(2, 4, 32), h.reshape(2, 32, 4)).sum()  # batched: 2 x [4,32]@[32,4]


def test_dots_are_found_with_their_counts_and_flops():
  w1, w2, x = jnp.ones((16, 32)), jnp.ones((32, 32)), jnp.ones((8, 16))
  dots, unknown = dot_ceiling.step_dots(_fn, w1, w2, x)
  assert unknown == 0
  by_shapes = {(d.lhs_shape, d.rhs_shape): d for d in dots}
  assert by_shapes[((8, 16), (16, 32))].count == 1
  assert by_shapes[((8, 32), (32, 32))].count == 3
  assert by_shapes[((2, 4, 32), (2, 32, 4))].count == 1
  assert by_shapes[((8, 16), (16, 32))].flops == 2 * 8 * 16 * 32
  assert by_shapes[((2, 4, 32), (2, 32, 4))].flops == 2 * 2 * 4 * 32 * 4
  assert sum(d.count for d in dots) == 5


def test_the_gradient_adds_its_dots_and_the_flop_total_matches_the_arithmetic():
  w1, w2, x = jnp.ones((16, 32)), jnp.ones((32, 32)), jnp.ones((8, 16))
  fwd, _ = dot_ceiling.step_dots(_fn, w1, w2, x)
  both, _ = dot_ceiling.step_dots(jax.value_and_grad(_fn, argnums=(0, 1)), w1, w2, x)
  fwd_flops = sum(d.flops * d.count for d in fwd)
  assert fwd_flops == 2 * (8 * 16 * 32 + 3 * 8 * 32 * 32 + 2 * 4 * 32 * 4)
  # Reverse mode: the weight gradients of the two matmul kinds (w1's and three of w2's), the scan's input
  # gradients (x's is not asked for, so h's chain: 3 through the scan) and the einsum's two operand gradients.
  assert sum(d.flops * d.count for d in both) > 2 * fwd_flops


def test_a_while_body_with_dots_is_reported():
  def f(w, x):
    return jax.lax.while_loop(lambda c: c[1] < 4, lambda c: (c[0] @ w, c[1] + 1), (x, 0))[0].sum()
  dots, unknown = dot_ceiling.step_dots(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
  assert unknown == 1 and dots[0].count == 1


def test_the_ceiling_is_total_flops_over_total_isolated_time():
  a = dot_ceiling.Dot((64, 32), (32, 16), "float32", "float32", (((1,), (0,)), ((), ())), None, count=2)
  b = dot_ceiling.Dot((8, 8), (8, 8), "float32", "float32", (((1,), (0,)), ((), ())), None, count=1)
  gflops, total_gflop, seconds = dot_ceiling.ceiling_gflops([(a, 1e-3), (b, 2e-3)])
  assert math.isclose(seconds, 2 * 1e-3 + 2e-3)
  assert math.isclose(total_gflop, (2 * 2 * 64 * 32 * 16 + 2 * 8 * 8 * 8) / 1e9)
  assert math.isclose(gflops, total_gflop / seconds)


def test_a_dot_is_timed_alone():
  dot = dot_ceiling.Dot((32, 16), (16, 8), "float32", "float32", (((1,), (0,)), ((), ())), None)
  assert 0 < dot_ceiling.time_dot(dot, reps=2, trials=2) < 1.0
