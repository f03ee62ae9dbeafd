"""Multi-process runs: starting `jax.distributed` and waiting for every process (no device collective).

A run of N processes (one per host, or several on one host) gives each the same --coordinator_address
(host:port of process 0), --num_processes=N and its own --process_id in [0, N); the three can come from
$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID instead. --num_processes=0 lets JAX detect
the cluster (SLURM, Open MPI, TPU pods). On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import errno
import os
import socket

import jax
from absl import logging
from jax._src import distributed as jax_distributed  # the coordinator client initialize() makes

from dgemma.errors import ConfigError

DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
INIT_TIMEOUT_S = 300  # how long process k waits for all N processes to reach the coordinator


def _check_coordinator_port_free(address: str) -> None:
  """Process 0 serves the coordinator at `address`: a port already taken means another process 0 (two
  processes given the same --process_id) or another job; say so instead of waiting for the timeout."""
  host, _, port = address.rpartition(":")
  if not port.isdigit():
    raise ConfigError(f"--coordinator_address: expected host:port, got {address!r}")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    try:
      sock.bind(("" if host in ("", "localhost", "0.0.0.0") else host, int(port)))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise ConfigError(f"--coordinator_address: port {port} is already in use on this host: is another "
                          "process already running with --process_id=0? Each process needs its own --process_id "
                          "in [0, --num_processes)") from None
      if e.errno != errno.EADDRNOTAVAIL:  # a host name of another interface: let JAX report it
        raise


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """`jax.distributed.initialize` for a multi-process run; returns whether it was called.

  Each argument left None is read from the environment (module docstring). Nothing set, or a single
  process: no call. Must run before anything touches a device. Errors name the flag.
  """
  env = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
  coordinator_address = coordinator_address or env["JAX_COORDINATOR_ADDRESS"]
  if num_processes is None and env["JAX_NUM_PROCESSES"]:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env["JAX_PROCESS_ID"]:
    process_id = int(env["JAX_PROCESS_ID"])
  if num_processes == 0:  # cluster auto-detection
    jax.distributed.initialize()
    return True
  if num_processes is not None and num_processes < 0:
    raise ConfigError(f"--num_processes: must be >= 0 (0 = detect the cluster), got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id: {process_id} not in [0, --num_processes={num_processes})")
  if num_processes == 1 and process_id in (None, 0):
    return False  # one process: nothing to coordinate
  if coordinator_address is None and num_processes is None and process_id is None:
    return False
  missing = [name for name, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                                  ("process_id", process_id)) if v is None]
  if missing:
    raise ConfigError(f"--{missing[0]}: a multi-process run needs --coordinator_address, --num_processes and "
                      f"--process_id (or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID); "
                      f"missing {', '.join(missing)}")
  if process_id < 0:
    raise ConfigError(f"--process_id: must be >= 0, got {process_id}")
  if process_id == 0:
    _check_coordinator_port_free(coordinator_address)
  logging.info("process %d of %d: waiting up to %d s for all %d processes at %s (each with its own --process_id)",
               process_id, num_processes, INIT_TIMEOUT_S, num_processes, coordinator_address)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=INIT_TIMEOUT_S)
  return True


def process_barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process got here, through the coordinator (no device collective)."""
  if jax.process_count() > 1:
    jax_distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)
