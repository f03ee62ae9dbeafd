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
