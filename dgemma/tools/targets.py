"""The accelerators a memory plan compiles for, on a machine without them (`python -m dgemma.tools.memory --target`).

XLA compiles for a GPU through jax's CUDA plugin and for a TPU through libtpu without the device: a GPU is described
by its `GpuTargetConfig` (the card's data sheet: SMs, shared memory, compute capability, memory size), a TPU by a
topology name (`v5e:1x1`: one chip on a host, as MaxText's train_compile compiles). `make venv` installs both plugins
beside the environment (.venv/cuda-plugin, .venv/tpu-plugin), off JAX's default platforms so nothing else changes;
`use_plugins` puts the one a target needs on the path before JAX starts its backends.

  TARGETS[name]   kind ('host' | 'gpu' | 'tpu'), the device's memory, and the description the compiler takes
  device(name)    the (abstract) device to compile for
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import jax

from dgemma.errors import ConfigError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator a plan compiles for. memory: the bytes a program may use on it (a GPU's device memory; a TPU's
  HBM as its compiler counts it); gpu: (SMs, compute capability (major, minor), shared memory per SM, per block
  opt-in, threads per SM, L2 bytes, bandwidth B/s, clock GHz); topology: a TPU's topology name."""
  name: str
  kind: str
  description: str
  memory: int = 0
  gpu: Optional[tuple] = None
  topology: str = ""


TARGETS = {t.name: t for t in (
    Target("host", "host", "this machine's first device"),
    # Hopper (sm_90): 132 SMs, 228 KiB shared memory per SM
    Target("h100", "gpu", "NVIDIA H100 80GB HBM3", 85_520_809_984,
           gpu=(132, (9, 0), 233472, 232448, 2048, 52428800, 3_352_320_000_000, 1.98)),
    Target("h200", "gpu", "NVIDIA H200", 150_754_820_096,
           gpu=(132, (9, 0), 233472, 232448, 2048, 52428800, 4_800_000_000_000, 1.98)),
    # Ampere (sm_80): an A100 40 GB (Colab's)
    Target("a100_40gb", "gpu", "NVIDIA A100-SXM4-40GB", 42_505_273_344,
           gpu=(108, (8, 0), 167936, 166912, 2048, 41943040, 1_555_000_000_000, 1.41)),
    # Ada (sm_89), 24 GB: an L4 (Colab's) and an RTX 4090
    Target("l4", "gpu", "NVIDIA L4", 23_580_639_232,
           gpu=(58, (8, 9), 102400, 101376, 1536, 50331648, 300_000_000_000, 2.04)),
    Target("rtx4090", "gpu", "NVIDIA GeForce RTX 4090", 25_393_692_672,
           gpu=(128, (8, 9), 102400, 101376, 1536, 75497472, 1_008_000_000_000, 2.52)),
    # one chip each (Colab's TPU runtimes); memory: the HBM the compiler allows a program
    Target("v5e", "tpu", "TPU v5 lite (v5e-1, 16 GB)", int(15.75 * GiB), topology="v5e:1x1"),
    Target("v6e", "tpu", "TPU v6 lite (v6e-1, 32 GB)", int(31.25 * GiB), topology="v6e:1x1"),
)}


def get(name: str) -> Target:
  if name not in TARGETS:
    raise ConfigError(f"--target: {name!r}; one of {sorted(TARGETS)}")
  return TARGETS[name]


def gpu_target_config(target: Target) -> str:
  """XLA's GpuTargetConfig (text proto) of a GPU target."""
  sms, (major, minor), smem_sm, smem_optin, threads_sm, l2, bandwidth, clock = target.gpu
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem_sm} threads_per_core_limit: {threads_sm} core_count: {sms} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: {l2} clock_rate_ghz: {clock}
  device_memory_size: {target.memory} shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{target.description}"
"""


PLUGIN_DIRS = {"gpu": "cuda-plugin", "tpu": "tpu-plugin"}  # beside the environment (make venv)
PLUGIN_PACKAGES = {"gpu": "jax-cuda13-plugin and jax-cuda13-pjrt", "tpu": "libtpu"}


def use_plugins(name: str = "") -> None:
  """Before JAX starts its backends: the plugin target `name` compiles with (every target's, without a name), from
  beside this environment (make venv) when it is not importable already, and the settings that let it compile
  without its device (the CUDA plugin's version checks skipped; libtpu told it is alone on a one-chip host, with no
  metadata server to ask)."""
  if not name:
    for kind in PLUGIN_DIRS:
      use_plugins(next(t.name for t in TARGETS.values() if t.kind == kind))
    return
  kind = get(name).kind
  if kind == "host":
    return
  beside = Path(sys.prefix) / PLUGIN_DIRS[kind]
  if beside.is_dir() and str(beside) not in sys.path:
    sys.path.append(str(beside))
  if kind == "gpu":
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  else:
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", get(name).topology.split(":")[0] + "-1"),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0")):
      os.environ.setdefault(key, value)


def device(name: str = "host"):
  """The device a plan compiles for: 'host' (this process's first device) or a target's abstract device, compiled for
  without one (`use_plugins` must run before JAX's backends start, as the command line does)."""
  target = get(name)
  if target.kind == "host":
    return jax.devices()[0]
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    if target.kind == "gpu":
      topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target),
                                              topology="1x1x1")
    else:
      topology = topologies.get_topology_desc(topology_name=target.topology, platform="tpu",
                                              chips_per_host_bounds=(1, 1, 1))
  except (NotImplementedError, RuntimeError, ValueError) as e:
    raise ConfigError(f"--target={name}: compiling for a {target.kind.upper()} without one needs "
                      f"{PLUGIN_PACKAGES[target.kind]} (make venv installs it in .venv/{PLUGIN_DIRS[target.kind]}); "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
  return topology.devices[0]
