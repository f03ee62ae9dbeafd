"""Writes tests/golden/partition_specs.json: the PartitionSpec of every parameter of the tiny model
(8 experts) under each mesh preset of configs/mesh/ on 8 virtual CPU devices.

  python tests/golden/make_partition_specs.py        # from the repository root, after changing
                                                     # axis rules, presets or parameter names

tests/train/test_loop.py::test_eight_virtual_devices_match_one_device recomputes the same table with
`compute()` and compares it with the file.
"""

import json
import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "partition_specs.json"
PRESETS = ("cpu_host", "gpu8_expert", "tpu_slice")


def compute() -> dict:
  """{preset: {param path: spec}} on the current 8 devices."""
  import importlib

  from configs import tiny_test
  from dgemma import mesh as mesh_lib
  from dgemma import settings as settings_lib
  from dgemma.train import state as state_lib
  out = {}
  for preset in PRESETS:
    config = tiny_test.get_config()
    config.model.num_experts = 8  # so that the expert axis of gpu8_expert divides the experts
    config.mesh = importlib.import_module(f"configs.mesh.{preset}").get_config()
    settings = settings_lib.from_config(config)
    out[preset] = state_lib.param_partition_specs(settings.model, mesh_lib.make_mesh(settings.mesh.axis_sizes),
                                                  settings.mesh.axis_rules)
  return out


if __name__ == "__main__":
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
  from dgemma.files import write_text_atomic
  write_text_atomic(GOLDEN, json.dumps(compute(), indent=1, sort_keys=True) + "\n")
  print(f"wrote {GOLDEN}")
