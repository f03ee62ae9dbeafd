"""Mesh preset `cpu_host`: one host, data parallelism over all its devices (configs/base.py default).

  python train.py --config=configs/tiny_test.py --workdir=/tmp/dgemma_tiny   # uses this preset
  python train.py --config=configs/tiny_test.py --workdir=/tmp/w --config.mesh.shape.data=2 --config.mesh.shape.fsdp=-1
"""

import ml_collections

from configs.mesh import AXIS_RULES


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      preset="cpu_host",
      shape=ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1)),
      axis_rules=AXIS_RULES,
  ))
