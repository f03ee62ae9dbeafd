"""Logical-axis sharding helpers shared by the model, training and loading.

Parameters carry logical axis names (`layers.matrix_init`); activations are constrained with
`constrain(x, ('batch', 'act_length', 'act_embed'))`. Logical names become mesh axes through the
rules in `config.mesh.axis_rules` (installed by `dgemma.mesh.mesh_context` with `nn.logical_axis_rules`)
and the mesh installed with `jax.set_mesh`. Outside such a context (plain `jax.jit` on one device,
the tests of single modules) every helper here is a no-op, so the same model code runs everywhere.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")  # every mesh dgemma builds has these axes (dgemma.mesh)


def fit_spec_to_shape(spec: P, shape: tuple[int, ...], mesh) -> P:
  """Drops mesh axes from dimensions they do not divide, so every preset runs on every mesh: a
  dimension keeps the longest leading run of its axes whose sizes multiply to a divisor (1 global KV
  head over tensor=2 -> replicated; 2 sampled rows over (data=2, fsdp=2, expert=4) -> data only).
  Axes of size 1 are left out (they split nothing), so specs show only the real splits.
  `mesh`: a Mesh or AbstractMesh."""
  fitted = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    kept = tuple(a for a in names if mesh.shape.get(a, 1) > 1)  # size-1 axes split nothing
    while kept and dim % math.prod(mesh.shape[a] for a in kept):
      kept = kept[:-1]
    fitted.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
  return P(*fitted)


def context_mesh():
  """The mesh installed with `jax.set_mesh` (an AbstractMesh inside jit), or None when there is none."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def current_axis_rules() -> tuple:
  """flax's logical axis rules in this context as a hashable tuple (() when none are installed)."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in nn.get_logical_axis_rules())


def jit_with_axis_rules(fn: Callable, *, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
                        in_shardings: Any = None):
  """`jax.jit(fn)` whose compilation cache is keyed on flax's logical axis rules too.

  jax keys its cache on the arguments and the context mesh, but `constrain` and expert parallelism read
  the rules installed with `nn.logical_axis_rules` at trace time: a module-level jitted function first
  traced without rules would be reused, without any constraint, under rules on the same mesh. Here the
  caller's rules become a static argument and are re-installed around the trace. `in_shardings`: jax.jit's, over
  fn's non-static positional arguments (None: unspecified)."""
  def with_rules(rules, *args, **kwargs):
    with nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  # the jitted program keeps fn's name (compile logs, profiles); not functools.wraps: the signature differs
  with_rules.__name__, with_rules.__qualname__ = fn.__name__, fn.__qualname__
  jitted = jax.jit(with_rules, static_argnums=(0, *(i + 1 for i in static_argnums)),
                   static_argnames=tuple(static_argnames),
                   **({} if in_shardings is None else dict(in_shardings=in_shardings)))

  @functools.wraps(fn)
  def call(*args, **kwargs):
    return jitted(current_axis_rules(), *args, **kwargs)
  call.jitted = jitted  # its compiled programs: call.jitted._cache_size()
  call.lower = lambda *args, **kwargs: jitted.lower(current_axis_rules(), *args, **kwargs)  # ahead of time
  return call


def logical_to_mesh_axes(logical_axes: Sequence[str | None]) -> P | None:
  """Mesh PartitionSpec of logical axis names under the context's rules (None when no rules are set)."""
  rules = nn.get_logical_axis_rules()
  if not rules:
    return None
  return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def mesh_axes_of(logical_name: str) -> tuple[str, ...]:
  """Mesh axes a single logical name maps to under the context's rules (() if unmapped / no rules)."""
  for name, axes in nn.get_logical_axis_rules():
    if name == logical_name:
      if axes is None:
        return ()
      return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  return ()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; dimensions a mesh axis does not divide stay
  replicated (`fit_spec_to_shape`). A no-op without a context mesh and rules."""
  mesh = context_mesh()
  spec = logical_to_mesh_axes(logical_axes) if mesh is not None else None
  if spec is None:
    return x
  return jax.lax.with_sharding_constraint(x, fit_spec_to_shape(spec, x.shape, mesh))


def unbox(tree):
  """`nn.unbox` without sharding constraints (flax applies its own, unfitted, ones when a mesh is
  installed): parameters are placed by explicit shardings (`place`) instead."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box)


def place(boxed_tree, mesh, axis_rules) -> tuple[Any, Any]:
  """(abstract tree of jax.ShapeDtypeStruct with shardings, the NamedShardings) of a boxed (nn.Partitioned)
  abstract tree: each leaf placed on `mesh` by its logical axis names under `axis_rules`, dimensions a mesh
  axis does not divide replicated (`fit_spec_to_shape`)."""
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), tuple(axis_rules))
  unboxed = unbox(boxed_tree)
  shardings = jax.tree.map(lambda x, spec: NamedSharding(mesh, fit_spec_to_shape(spec, x.shape, mesh)),
                           unboxed, mesh_specs, is_leaf=lambda x: isinstance(x, P))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), unboxed, shardings)
  return abstract, shardings
