"""DiffusionGemma 26B-A4B text trunk, exactly as released (see ../shared/reference/diffusiongemma.md).

  python -m dgemma.tools.params --config=configs/models/diffusiongemma_26b_a4b.py
"""

from configs.models import tiny


def get_config():
  config = tiny.get_config()
  config.update(dict(
      preset="diffusiongemma_26b_a4b",
      vocab_size=262_144,
      d_model=2816,
      num_layers=30,
      layer_types=(("sliding",) * 5 + ("global",)) * 5,
      num_heads=16,
      num_kv_heads=8,
      head_dim=256,
      sliding_window=1024,
      rope_base=10_000.0,
      global_num_kv_heads=2,
      global_head_dim=512,
      global_rope_base=1_000_000.0,
      global_rope_fraction=0.25,
      global_k_eq_v=True,
      mlp_hidden=2112,
      num_experts=128,
      experts_per_token=8,
      expert_hidden=704,
      final_logit_softcap=30.0,
      dtype="bfloat16",
      param_dtype="bfloat16",
  ))
  return config
