"""The device mesh and the logical axis rules: what `config.mesh` (dgemma.settings.MeshSettings) means.

Meshes have the axes (data, fsdp, expert, tensor); parameters and activations carry logical axis names
(dgemma/model/sharding.py) that `mesh.axis_rules` maps onto them. `with mesh_context(mesh, rules):`
installs both (jax.set_mesh + flax's logical axis rules), so activation constraints and expert
parallelism apply inside it. Used by training, sampling and evaluation alike.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgemma.errors import ConfigError
from dgemma.model.sharding import MESH_AXES

# The mesh sampling and evaluation use when no mesh is given: data parallel over this host's devices.
DEFAULT_SHAPE = (("data", -1), ("fsdp", 1), ("expert", 1), ("tensor", 1))

# Logical axis name -> mesh axes, for every parameter (dgemma.model.layers) and the main activations
# (dgemma.model.sharding.constrain): the default `mesh.axis_rules` (configs/mesh/ presets share it).
# Parameters: 'vocab', 'embed', 'embed_out' (the output side of a [D, D] kernel), 'readout' (the R of
# model.decoder_right_readout), 'heads', 'kv_heads', 'head_dim', 'mlp', 'expert', 'expert_mlp', 'norm',
# 'layers' (the scanned block axis). Activations: 'batch' (also splits the token axis of the MoE
# all-to-all), 'act_length', 'act_embed', 'act_heads', 'act_mlp', 'act_vocab'.
# The batch is split over data, fsdp AND expert: the expert axis is a data axis for everything but the
# experts (each expert-group device holds its own rows). Dimensions an axis does not divide stay
# replicated (dgemma.model.sharding.fit_spec_to_shape).
AXIS_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed_out", None),
    ("readout", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(shape=DEFAULT_SHAPE, devices=None) -> Mesh:
  """Mesh with axes (data, fsdp, expert, tensor) from ((axis, size), ...) or {axis: size} (missing axes
  are 1); one axis may be -1 (= the remaining devices)."""
  devices = jax.devices() if devices is None else devices
  sizes_by_axis = dict(shape)
  sizes = [int(sizes_by_axis.get(a, 1)) for a in MESH_AXES]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(f"mesh.shape: {dict(zip(MESH_AXES, sizes))} does not divide {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(
        f"mesh.shape: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, found {len(devices)}")
  device_grid = mesh_utils.create_device_mesh(sizes, devices=devices, allow_split_physical_axes=True)
  return Mesh(device_grid, MESH_AXES)


def batch_axes(axis_rules) -> tuple[str, ...]:
  """Mesh axes of the logical 'batch' axis: the batch of every step is split over them."""
  for name, axes in axis_rules:
    if name == "batch":
      return () if axes is None else (tuple(axes) if isinstance(axes, (tuple, list)) else (axes,))
  raise ConfigError("mesh.axis_rules: no rule for the logical axis 'batch'")


def batch_sharding(mesh: Mesh, axis_rules) -> NamedSharding:
  return NamedSharding(mesh, P(tuple(a for a in batch_axes(axis_rules) if a in mesh.shape)))


def batch_shards(mesh: Mesh, axis_rules) -> int:
  """How many pieces the batch is split into on `mesh`."""
  return math.prod(mesh.shape[a] for a in batch_axes(axis_rules) if a in mesh.shape)


def mesh_context(mesh: Mesh, axis_rules) -> contextlib.ExitStack:
  """`with mesh_context(mesh, rules):` installs the mesh (`jax.set_mesh`) and the logical axis rules
  (`nn.logical_axis_rules`): activation constraints and expert parallelism apply inside it."""
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(tuple(axis_rules)))
  return stack


def check_batch_fits_mesh(batch_size: int, grad_accum_steps: int, mesh: Mesh, axis_rules) -> None:
  """The global batch (and each micro-batch) splits evenly over the batch shards and the processes."""
  axes = [a for a in batch_axes(axis_rules) if a in mesh.shape]
  shards = math.prod(mesh.shape[a] for a in axes)
  if batch_size % shards:
    raise ConfigError(
        f"data.batch_size: {batch_size} is not divisible by the {shards} batch shards "
        f"(mesh {' x '.join(axes)} = {' x '.join(str(mesh.shape[a]) for a in axes)})")
  if shards % jax.process_count():
    raise ConfigError(f"mesh.shape: the {shards} batch shards do not split over "
                      f"{jax.process_count()} processes (each process feeds its own rows)")
  if batch_size % (shards * grad_accum_steps):
    raise ConfigError(
        f"opt.grad_accum_steps: {grad_accum_steps} micro-batches of data.batch_size={batch_size} rows do "
        f"not divide evenly over the {shards} batch shards (need batch_size % (shards * steps) == 0)")


def put(tree: Any, formats: Any) -> Any:
  """`tree`'s arrays in `formats` (a tree like it of `jax.experimental.layout.Format`s, e.g. a compiled program's
  `input_formats`: sharding and memory layout), each copied only where its own differs, its old buffer donated: at
  most one array is held twice at a time."""
  return jax.tree.map(lambda x, f: x if x.format == f else jax.device_put(x, f, donate=True), tree, formats)


def free_memory_bytes() -> int:
  """Memory one request may still allocate on the first device: on GPU / TPU its limit less what is in use; on
  CPU the host's available memory (/proc/meminfo MemAvailable where there is one, else all physical memory).
  The checks that refuse a request before allocating it (sampling, eval.likelihood) compare against this."""
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
