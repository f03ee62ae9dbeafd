"""`small` preset (15.6M parameters, 8.5M active per token): the DiffusionGemma structure sized for CPU experiments.

  python -m dgemma.tools.model_size --config=configs/models/small.py
"""

from configs.models import tiny


def get_config():
  config = tiny.get_config()
  config.update(dict(
      preset="small",
      vocab_size=8192,
      d_model=256,
      num_layers=6,
      layer_types=("sliding",) * 5 + ("global",),
      num_heads=4,
      num_kv_heads=2,
      head_dim=64,
      sliding_window=256,
      global_num_kv_heads=1,
      global_head_dim=128,
      mlp_hidden=512,
      num_experts=8,
      experts_per_token=2,
      expert_hidden=256,
  ))
  return config
