"""DiffusionGemma 26B-A4B text trunk, exactly as released (see docs/model.md): the model group's declared defaults
(dgemma/model/config.py), stored in bfloat16, its experts on jax.lax.ragged_dot (a choice, not the architecture).

  python -m dgemma.tools.model_size --config=configs/models/diffusiongemma_26b_a4b.py
"""

from dgemma import settings


def get_config():
  config = settings.default_config().model
  config.update(dict(preset="diffusiongemma_26b_a4b", dtype="bfloat16", param_dtype="bfloat16", moe_impl="ragged"))
  return config
