"""dgemma/mesh.py: placing a tree in given formats (sharding and memory layout)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from dgemma import mesh as mesh_lib
from dgemma.checkpoints import workdir as workdir_ckpt


def _column_major(x: jax.Array) -> Format:
  """x's format with its dimensions' order reversed (untiled, as the CPU backend reports its layouts)."""
  return Format(Layout(major_to_minor=tuple(reversed(range(x.ndim))), tiling=()), x.sharding)


def test_put_moves_only_the_arrays_whose_format_differs_and_keeps_their_values(tmp_path):
  """mesh.put lays a [3, 4] array out column-major (the layout a compiled step may pick for a frozen weight): its
  values are unchanged, its old buffer donated; an array already in its format is returned as it is. A state
  holding such an array is checkpointed and restored (Orbax, the train loop's save) with the same values, in the
  default layout, as the loop then puts it back."""
  weight, bias = jnp.arange(12, dtype=jnp.float32).reshape(3, 4), jnp.ones(5, jnp.uint8)
  want = np.arange(12, dtype=np.float32).reshape(3, 4)
  formats = {"w": _column_major(weight), "b": bias.format}
  assert formats["w"] != weight.format  # row-major, (0, 1), by default
  out = mesh_lib.put({"w": weight, "b": bias}, formats)
  assert out["b"] is bias and weight.is_deleted()
  assert out["w"].format == formats["w"]
  np.testing.assert_array_equal(np.asarray(out["w"]), want)

  workdir_ckpt.save_step(tmp_path, 1, out)
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in out.items()}
  manager = workdir_ckpt.make_manager(tmp_path, read_only=True, async_save=False)
  try:
    restored, _ = workdir_ckpt.restore(manager, 1, abstract, with_data=False)
  finally:
    manager.close()
  np.testing.assert_array_equal(np.asarray(restored["w"]), want)
  assert restored["w"].format != formats["w"]
  again = mesh_lib.put(restored, formats)
  assert again["w"].format == formats["w"]
  np.testing.assert_array_equal(np.asarray(again["w"]), want)
