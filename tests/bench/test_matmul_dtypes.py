"""bench/matmul_dtypes.py: the matmul it times is [M, K] x [K, N] in the dtype asked, accumulated into f32."""

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import dot_ceiling, matmul_dtypes  # noqa: E402


def test_matmul_is_m_by_k_times_k_by_n_in_the_dtype_into_f32():
  dot = matmul_dtypes.matmul(4, 3, 5, "bfloat16")
  assert dot.flops == 2 * 4 * 3 * 5
  a, b = np.arange(12.0).reshape(4, 3), np.arange(15.0).reshape(3, 5)
  out = jax.lax.dot_general(a.astype(dot.lhs_dtype), b.astype(dot.rhs_dtype), dot.dimension_numbers,
                            preferred_element_type=dot.preferred_element_type)
  assert out.shape == (4, 5) and out.dtype == np.float32
  np.testing.assert_array_equal(out, a @ b)  # small integers: exact in bf16 and f32
  assert dot_ceiling.time_dot(dot, reps=1, trials=1) > 0
