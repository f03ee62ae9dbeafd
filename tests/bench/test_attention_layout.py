"""bench/attention_layout.py: the per-canvas attention it times is `attention.attend` over [cache; every canvas's
keys] (`all_keys_attend`) with the other canvases' keys masked out, in value and in gradient.

In float64 both sides differ only by summation order (~1e-15 here), so atol 1e-10 holds on any CPU; a query
reading another canvas's keys, or a softmax normalised over one key set only, moves outputs by O(0.1)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import attention_layout  # noqa: E402
from tests.model_utils import float64  # noqa: E402


def test_per_canvas_attend_is_attend_with_the_other_canvases_masked():
  B, K, C, S, N, Kh, H = 2, 3, 4, 5, 4, 2, 3
  T = K * C
  g = np.random.default_rng(0)
  mask_cache = g.random((B, T, S)) < 0.6
  mask_own = (g.random((B, T, C)) < 0.5) | (np.arange(C)[None, None, :] == (np.arange(T) % C)[None, :, None])
  mask_canvas = np.zeros((B, T, T), bool)  # own-canvas keys in place, other canvases' keys masked
  for k in range(K):
    mask_canvas[:, k * C:(k + 1) * C, k * C:(k + 1) * C] = mask_own[:, k * C:(k + 1) * C]
  with float64():
    q, k_cache, v_cache = (jnp.asarray(g.normal(size=s)) for s in ((B, T, N, H), (B, S, Kh, H), (B, S, Kh, H)))
    k_canvas, v_canvas = (jnp.asarray(g.normal(size=s)) for s in ((B, T, Kh, H), (B, T, Kh, H)))
    cotangent = jnp.asarray(g.normal(size=(B, T, N, H)))
    args = (q, k_cache, v_cache, k_canvas, v_canvas)

    def full(*a):
      return attention_layout.all_keys_attend(*a, jnp.asarray(np.concatenate([mask_cache, mask_canvas], -1)),
                                              jnp.float64)

    def own(*a):
      return attention_layout.per_canvas_attend(*a, jnp.asarray(mask_cache), jnp.asarray(mask_own), K)

    np.testing.assert_allclose(own(*args), full(*args), atol=1e-10, rtol=0)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2, 3, 4))(*args) for f in (full, own)]
    for want, got in zip(*grads):
      np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
