"""dgemma/model/layers.py: the projection's hand-written backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.model import layers


@pytest.mark.parametrize("lead, D, F", [((2, 7), 16, 48), ((3, 5), 48, 16), ((11,), 8, 8)])
def test_matmul_last_value_and_gradients_equal_the_einsum(lead, D, F):
  """layers.matmul_last (x @ w whose backward transposes the narrower of x and the output gradient) gives the
  einsum's value and gradients: fp32 against float64 on the same fp32 inputs, within the fp32 bound of a
  length-n dot (Higham: n u sum|terms|, u = eps / 2; here 2 n eps). Both branches of the backward (D <= F,
  D > F) and several leading dims. The loss is sum(c * y) with a fixed fp32 c, so the output gradient is c
  exactly and each gradient is one fp32 dot per entry."""
  eps = float(np.finfo(np.float32).eps)
  g = np.random.default_rng(0)
  x = g.normal(size=(*lead, D)).astype(np.float32)
  w = g.normal(size=(D, F)).astype(np.float32)
  c = g.normal(size=(*lead, F)).astype(np.float32)
  loss = lambda x, w: jnp.sum(layers.matmul_last(x, w) * c)
  y32 = jax.jit(layers.matmul_last)(x, w)
  dx32, dw32 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, c))
  rows = int(np.prod(lead))
  y64, dx64 = x64 @ w64, c64 @ w64.T
  dw64 = x64.reshape(rows, D).T @ c64.reshape(rows, F)
  bound_y = 2 * D * eps * (np.abs(x64) @ np.abs(w64))
  bound_dx = 2 * F * eps * (np.abs(c64) @ np.abs(w64).T)
  bound_dw = 2 * rows * eps * (np.abs(x64).reshape(rows, D).T @ np.abs(c64).reshape(rows, F))
  assert y32.shape == (*lead, F) and dx32.shape == x.shape and dw32.shape == (D, F) and dw32.dtype == np.float32
  assert np.all(np.abs(np.asarray(y32) - y64) <= bound_y)
  assert np.all(np.abs(np.asarray(dx32) - dx64) <= bound_dx)
  assert np.all(np.abs(np.asarray(dw32) - dw64) <= bound_dw)
  # a wrong backward (dw transposed the wrong way round or summed over the wrong rows) is far outside the bound
  assert np.abs(dw64).max() > 100 * bound_dw.max()


def test_einsum_takes_matmul_last_exactly_for_a_kernel_on_the_last_dim(monkeypatch):
  """The projections that read x's last dim with a 2-D kernel (the GeGLU's gate / up / down) go through
  matmul_last; the attention projections (3-D kernels) keep jnp.einsum."""
  assert layers._is_matmul_last("...d,df->...f") and layers._is_matmul_last("...f,fd->...d")
  assert not layers._is_matmul_last("btd,dnh->btnh") and not layers._is_matmul_last("...nh,nhd->...d")
  calls = []
  monkeypatch.setattr(layers, "matmul_last", lambda x, w: calls.append(w.shape) or jnp.einsum("...d,df->...f", x, w))
  mlp = layers.GeGLU(d_model=8, hidden=24)
  x = jnp.ones((2, 3, 8))
  mlp.init_with_output(jax.random.PRNGKey(0), x)
  assert calls == [(8, 24), (8, 24), (24, 8)]
