"""Mesh preset `gpu8_expert`: one 8-GPU host, the experts of every MoE layer split 8 ways.

expert=8: each GPU holds num_experts / 8 experts of every layer and 1/8 of the batch (the expert axis
is also a batch axis, configs/mesh/__init__.py); tokens reach their experts by all-to-all, which
needs model.moe_impl='expert_parallel' (with 'ragged' XLA would gather the expert weights instead).
num_experts must be a multiple of 8 and data.batch_size of 8. In an experiment config:

  from configs.mesh import gpu8_expert
  config.mesh = gpu8_expert.get_config()
  config.model.moe_impl = "expert_parallel"

  python train.py --config=configs/demo.py --workdir=/tmp/w --config.mesh.shape.data=1 \
      --config.mesh.shape.expert=8 --config.model.moe_impl=expert_parallel   # the same from the command line
"""

import ml_collections

from configs.mesh import AXIS_RULES


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      preset="gpu8_expert",
      shape=ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=8, tensor=1)),
      axis_rules=AXIS_RULES,
  ))
