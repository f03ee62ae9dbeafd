"""Mesh preset `tpu_slice`: a TPU slice, FSDP over the slice and 4-way tensor parallelism inside it.

fsdp = devices / 4 (parameters and optimizer state split over 'embed', the batch over fsdp), tensor=4
(heads, MLP / expert hidden and vocabulary split 4 ways; KV heads that 4 does not divide are
replicated). In an experiment config:

  from configs.mesh import tpu_slice
  config.mesh = tpu_slice.get_config()

  python train.py --config=configs/demo.py --workdir=workdirs/tpu --config.mesh.shape.data=1 \
      --config.mesh.shape.fsdp=-1 --config.mesh.shape.tensor=4   # the same from the command line
"""

import ml_collections

from configs.mesh import AXIS_RULES


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      preset="tpu_slice",
      shape=ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=4)),
      axis_rules=AXIS_RULES,
  ))
