"""dgemma.model.qarray: int4 packed two to a byte, and the chunked products against a quantized table, each against
the obvious unpacked / unchunked computation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.model import qarray
from tests.model_utils import float64


def _int4(shape, seed=0):
  """A QArray of every int4 level (-8 .. 7) at random, with random positive fp32 scales per last-axis column."""
  g = np.random.default_rng(seed)
  values = jnp.asarray(g.integers(-8, 8, shape), jnp.int4)
  scale = jnp.asarray(g.uniform(0.5, 2.0, shape[:-2] + (1, shape[-1])), jnp.float32)
  return qarray.make(values, scale)


@pytest.mark.parametrize("shape, axis", [((3, 4, 5, 6), -1), ((3, 4, 6, 5), -2), ((3, 4, 6, 5), -3), ((2, 8, 3), -2)])
def test_packing_keeps_every_value_and_the_scale(shape, axis):
  q = _int4(shape)
  packed = qarray.pack(q, axis)
  assert packed.packed.dtype == jnp.uint8 and packed.packed.shape[axis] == shape[axis] // 2
  assert packed.shape == shape and packed.packed.nbytes * 2 == np.prod(shape)  # half a byte a value
  unpacked = qarray.unpack(packed)
  np.testing.assert_array_equal(np.asarray(unpacked.qvalue, np.int8), np.asarray(q.qvalue, np.int8))
  np.testing.assert_array_equal(unpacked.scale, q.scale)
  # dequantized: the same products of the same values and scales
  np.testing.assert_array_equal(qarray.dequantize(packed), qarray.dequantize(q))
  # in a layer: the `like` leaf first, of the unpacked shape (flax's shape check), the rest as stored
  tree = qarray.with_shape_leaf({"a": packed, "b": q, "c": jnp.ones(3)})
  assert jax.tree.leaves(tree["a"])[0].shape == shape and tree["a"].packed is packed.packed
  assert tree["b"] is q and tree["c"].shape == (3,)
  np.testing.assert_array_equal(qarray.dequantize(tree["a"]), qarray.dequantize(q))


def _table(kind, V, D, seed=1):
  """A quantized [V, D] table as dgemma.quant makes an embedding's: int8 one scale a row, or int4 in groups of 4
  along D."""
  g = np.random.default_rng(seed)
  if kind == "int8":
    return qarray.make(jnp.asarray(g.integers(-127, 128, (V, D)), jnp.int8),
                       jnp.asarray(g.uniform(0.001, 0.01, (V, 1)), jnp.result_type(float)))
  return qarray.make(jnp.asarray(g.integers(-8, 8, (V, D)), jnp.int4),
                     jnp.asarray(g.uniform(0.01, 0.1, (V, D // 4)), jnp.result_type(float)))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_chunked_table_products_equal_the_whole_table_products_and_their_gradients(kind):
  """37 rows read 8 at a time (four whole chunks and a remainder of 5) against the products with the whole table
  dequantized, and the gradients of a weighted sum of each. float64: every product is the same sum of D (or V)
  terms, grouped differently at most, so the difference is round-off of about V * 2^-53 relative to the sums of
  magnitudes: a 1e-12 bound."""
  V, D = 37, 8
  g = np.random.default_rng(2)
  with float64():
    table = _table(kind, V, D)
    whole = qarray.dequantize(table)
    x = jnp.asarray(g.normal(size=(2, 3, D)))
    p = jax.nn.softmax(jnp.asarray(g.normal(size=(2, 3, V))), axis=-1)
    w_logits, w_mix = jnp.asarray(g.normal(size=(2, 3, V))), jnp.asarray(g.normal(size=(2, 3, D)))
    chunked_logits = lambda x: qarray.table_logits(x, table, chunk_rows=8)
    whole_logits = lambda x: jnp.einsum("btd,vd->btv", x, whole)
    chunked_mix = lambda p: qarray.table_mix(p, table, chunk_rows=8)
    whole_mix = lambda p: jnp.einsum("btv,vd->btd", p, whole)
    got = {"logits": chunked_logits(x), "mix": chunked_mix(p),
           "d logits / dx": jax.grad(lambda x: jnp.sum(chunked_logits(x) * w_logits))(x),
           "d mix / dp": jax.grad(lambda p: jnp.sum(chunked_mix(p) * w_mix))(p)}
    want = {"logits": whole_logits(x), "mix": whole_mix(p),
            "d logits / dx": jax.grad(lambda x: jnp.sum(whole_logits(x) * w_logits))(x),
            "d mix / dp": jax.grad(lambda p: jnp.sum(whole_mix(p) * w_mix))(p)}
    got, want = jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)
    scale = float(np.abs(np.asarray(whole)).max()) * V
  for name in want:
    assert got[name].shape == want[name].shape and got[name].dtype == np.float64, name
    np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12 * scale, err_msg=name)
  assert not np.allclose(want["d logits / dx"], 0)  # the gradients are not trivially zero


def test_a_table_shorter_than_a_chunk_is_one_chunk():
  """5 rows, the default chunk of 16384: one product of the same 4-term dot products (fp32 round-off only)."""
  table = _table("int8", 5, 4)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 2, 4)), jnp.float32)
  np.testing.assert_allclose(qarray.table_logits(x, table),
                             jnp.einsum("btd,vd->btv", x, qarray.dequantize(table, jnp.float32)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("packed", [False, True])
def test_a_frozen_product_is_the_product_with_the_dequantized_weight_and_its_x_gradient(packed):
  """float64, f = the dense MoE's in-projection shape ([T, D] x [E, D, F] -> [T, E, F]): the value and the gradient in
  x equal those of f(x, dequantize(w)) differentiated directly (the same products, so to float64 round-off: 1e-12
  relative to their sums of magnitudes); the frozen weight's scale gets a zero gradient."""
  g = np.random.default_rng(4)
  with float64():
    q = qarray.make(jnp.asarray(g.integers(-8, 8, (3, 8, 5)), jnp.int4),
                    jnp.asarray(g.uniform(0.5, 2.0, (3, 2, 5))))  # groups of 4 along D = 8
    w = qarray.pack(q, -2) if packed else q
    x = jnp.asarray(g.normal(size=(6, 8)))
    weight = jnp.asarray(g.normal(size=(6, 3, 5)))
    f = lambda x, W: jnp.einsum("td,edf->tef", x, W)
    frozen = lambda x, w: jnp.sum(qarray.frozen_product(f, x, w, jnp.float64) * weight)
    direct = lambda x: jnp.sum(f(x, qarray.dequantize(q, jnp.float64)) * weight)
    got, want = jax.value_and_grad(frozen)(x, w), jax.value_and_grad(direct)(x)
    d_scale = jax.grad(lambda s: frozen(x, dataclasses.replace(w, scale=s)))(w.scale)
    got, want, d_scale = jax.tree.map(np.asarray, (got, want, d_scale))
    bound = 1e-12 * float(np.abs(np.asarray(qarray.dequantize(q))).sum())
  np.testing.assert_allclose(got[0], want[0], rtol=0, atol=bound * 10)
  np.testing.assert_allclose(got[1], want[1], rtol=0, atol=bound)
  assert np.abs(want[1]).max() > 0 and not d_scale.any()
