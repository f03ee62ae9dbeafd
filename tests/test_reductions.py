"""dgemma.reductions.argmax against jnp.argmax: same index everywhere, including ties inside and
across blocks (the first maximum wins), NaN (the first NaN wins), -inf rows, bf16, and vocabularies that
are not a multiple of the block (the plain argmax)."""

import jax.numpy as jnp
import numpy as np
import pytest

from dgemma import reductions


@pytest.mark.parametrize("V", [8192, 256, 384, 100, 128, 1000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_matches_jnp_argmax(V, dtype):
  g = np.random.default_rng(V)
  x = g.normal(size=(3, 5, V)).astype(np.float32)
  # ties: row 1 has its max in two blocks, row 2 twice inside one block, row 3 in every block
  x[0, 1, :] = 0.0
  x[0, 1, [V // 2, V - 1, 5]] = 3.0
  x[0, 2, [7, 9]] = 4.0
  x[0, 3, :] = 1.0
  x[1, 0, :] = -np.inf               # all -inf: index 0
  x[1, 1, [V - 2, 3]] = np.nan       # NaN is the max; the first one wins
  x[1, 2, V - 1] = np.inf
  x[2, 0, :] = np.round(x[2, 0, :])  # many equal values
  xj = jnp.asarray(x, dtype)
  got = reductions.argmax(xj)
  assert got.dtype == jnp.int32 and got.shape == (3, 5)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(xj, axis=-1)))
  assert int(got[0, 1]) == 5 and int(got[0, 2]) == 7 and int(got[0, 3]) == 0 and int(got[1, 1]) == 3


def test_argmax_two_dimensional_and_signed_zero():
  x = np.full((2, 512), -1.0, np.float32)
  x[0, [300, 10]] = [0.0, -0.0]  # -0.0 == 0.0: the first of them
  x[1, 200] = 2.0
  np.testing.assert_array_equal(np.asarray(reductions.argmax(jnp.asarray(x))), [10, 200])
