"""Sharding rules without devices or compiles: spec fitting, mesh presets, batch axes, distributed flags.

The 8-device equivalence runs and the golden PartitionSpecs are in tests/train/test_loop.py
(test_eight_virtual_devices_match_one_device); multi-process runs in tests/train/test_multiprocess.py.
"""

import importlib

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from configs import tiny_test
from dgemma import distributed
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.model.sharding import fit_spec_to_shape


def _mesh(**sizes):
  return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def test_fit_spec_keeps_the_longest_dividing_prefix_and_drops_size_one_axes():
  mesh = _mesh(data=2, fsdp=1, expert=4, tensor=2)
  batch = ("data", "fsdp", "expert")
  assert fit_spec_to_shape(P(batch, None), (8, 5), mesh) == P(("data", "expert"), None)
  assert fit_spec_to_shape(P(batch, None), (2, 5), mesh) == P("data", None)  # 2 rows: data only
  assert fit_spec_to_shape(P(batch), (3,), mesh) == P(None)
  assert fit_spec_to_shape(P(None, "tensor", None), (64, 1, 32), mesh) == P(None, None, None)  # 1 KV head
  assert fit_spec_to_shape(P("fsdp", "tensor"), (64, 128), mesh) == P(None, "tensor")  # fsdp=1 splits nothing
  assert fit_spec_to_shape(P("expert"), (4, 16, 8), mesh) == P("expert", None, None)  # padded to the rank


@pytest.mark.parametrize("preset", ["cpu_host", "gpu8_expert", "tpu_slice"])
def test_mesh_presets_are_valid_configs(preset):
  config = tiny_test.get_config()
  config.mesh = importlib.import_module(f"configs.mesh.{preset}").get_config()
  settings = settings_lib.from_config(config)
  assert config.mesh.preset == preset
  assert mesh_lib.batch_axes(settings.mesh.axis_rules) == ("data", "fsdp", "expert")
  names = {name for name, _ in settings.mesh.axis_rules}
  assert {"batch", "embed", "expert", "expert_mlp", "act_embed", "act_heads", "act_mlp", "act_vocab"} <= names


def test_batch_must_split_over_the_batch_axes():
  config = tiny_test.get_config()
  config.data.batch_size = 6
  settings = settings_lib.from_config(config)
  with pytest.raises(ConfigError, match=r"data.batch_size: 6 .* 4 batch shards \(mesh data x fsdp x "
                                        r"expert = 1 x 1 x 4\)"):
    mesh_lib.check_batch_fits_mesh(settings.data.batch_size, settings.opt.grad_accum_steps,
                                   _mesh(data=1, fsdp=1, expert=4, tensor=2), settings.mesh.axis_rules)
  rules = tuple(r for r in settings.mesh.axis_rules if r[0] != "batch")
  with pytest.raises(ConfigError, match="mesh.axis_rules: no rule for the logical axis 'batch'"):
    mesh_lib.batch_axes(rules)
  config.mesh.axis_rules = rules  # and a config without the rule is refused up front
  with pytest.raises(ConfigError, match="mesh.axis_rules: no rule for the logical axis 'batch'"):
    settings_lib.from_config(config)


def test_moe_impl_is_checked():
  config = tiny_test.get_config()
  config.model.moe_impl = "expert_paralel"
  with pytest.raises(ConfigError, match="model.moe_impl"):
    settings_lib.from_config(config)
  config.model.moe_impl = "expert_parallel"
  config.mesh.shape.expert = 8  # tiny has 4 experts
  with pytest.raises(ConfigError, match="model.num_experts: 4 experts do not split over mesh.shape.expert=8"):
    settings_lib.from_config(config)


def test_init_distributed_arguments(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in distributed.DISTRIBUTED_ENV:
    monkeypatch.delenv(name, raising=False)
  assert distributed.init_distributed() is False and calls == []  # single process: nothing to do
  with pytest.raises(ValueError, match="--process_id: a multi-process run needs"):
    distributed.init_distributed("localhost:1234", 2)
  with pytest.raises(ValueError, match=r"--process_id: 2 not in \[0, --num_processes=2\)"):
    distributed.init_distributed("localhost:1234", 2, 2)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:99")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.init_distributed() is True
  assert calls[-1] == dict(coordinator_address="host0:99", num_processes=4, process_id=3,
                           initialization_timeout=distributed.INIT_TIMEOUT_S)
  assert distributed.init_distributed(process_id=1) and calls[-1]["process_id"] == 1  # a flag beats the variable
  assert distributed.init_distributed(num_processes=0) and calls[-1] == {}  # cluster auto-detection


def test_a_second_process_zero_is_told_the_port_is_taken(monkeypatch):
  """Two processes given the same --process_id=0: the second finds the coordinator port taken and says so
  at once (before, it waited silently for the 300 s initialization timeout)."""
  import socket
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in distributed.DISTRIBUTED_ENV:
    monkeypatch.delenv(name, raising=False)
  with socket.socket() as first:  # the first process 0's coordinator
    first.bind(("", 0))
    first.listen()
    port = first.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--coordinator_address: port {port} is already in use.*--process_id=0"):
      distributed.init_distributed(f"localhost:{port}", 2, 0)
  assert calls == []
  assert distributed.init_distributed(f"localhost:{port}", 2, 0) and calls[-1]["process_id"] == 0  # port free again
  with pytest.raises(ConfigError, match=r"--process_id: 1 not in \[0, --num_processes=1\)"):
    distributed.init_distributed(None, 1, 1)  # named as the range error, not a missing coordinator
  assert distributed.init_distributed(None, 1, 0) is False  # one process: nothing to coordinate


def test_module_level_jits_are_keyed_on_the_logical_axis_rules():
  """A function jitted once at import (the sampler, AR decoding, likelihood) is traced again when the
  flax logical axis rules change: jax's own cache key holds the mesh but not the rules, so a program
  traced without rules would otherwise run, unconstrained, under rules on the same mesh."""
  import flax.linen as nn
  import jax.numpy as jnp
  import numpy as np
  from dgemma.model import sharding

  traced_rules = []

  def double(x):
    traced_rules.append(sharding.current_axis_rules())
    return sharding.constrain(x, ("batch", None)) * 2

  jitted = sharding.jit_with_axis_rules(double)
  mesh = jax.make_mesh((1,), ("data",))
  x = jnp.ones((2, 3))
  with jax.set_mesh(mesh):
    np.testing.assert_array_equal(jitted(x), 2 * x)
    np.testing.assert_array_equal(jitted(x), 2 * x)      # cached: no second trace
    with nn.logical_axis_rules((("batch", "data"),)):
      np.testing.assert_array_equal(jitted(x), 2 * x)    # new rules: traced again, under those rules
      jitted(x)
    jitted(x)                                            # back without rules: the first program again
  assert traced_rules == [(), (("batch", "data"),)]
