"""Device-mesh presets (`config.mesh = <preset>.get_config()` in an experiment config).

Each preset is the `mesh` group: `shape` (sizes of the mesh axes data, fsdp, expert, tensor; -1 =
all remaining devices) and `axis_rules` (logical axis name -> mesh axes, used for every parameter
(`dgemma.model.layers.matrix_init`) and the main activations (`dgemma.model.sharding.constrain`)).
`AXIS_RULES` below is shared by the presets; the mesh shape is what differs.

  cpu_host     one CPU host: pure data parallelism over its devices (the default in configs/base.py)
  gpu8_expert  one 8-GPU host: the 8 experts shards of every MoE layer on 8 GPUs (expert=8); use
               with model.moe_impl='expert_parallel' (all-to-all token exchange)
  tpu_slice    a TPU slice: FSDP over the slice, 4-way tensor parallelism inside (fsdp=-1, tensor=4)
"""

from dgemma.mesh import AXIS_RULES  # noqa: F401  (the rules the presets share live in the library)
