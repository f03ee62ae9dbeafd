"""`tiny` preset: the DiffusionGemma structure at test size (seconds on CPU).

Same structure as the 26B-A4B model (sliding + global layers, K=V global heads with their own head
dim and KV-head count, partial RoPE, dense GeGLU + MoE branches, self-conditioning), scaled down.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      preset="tiny",
      vocab_size=512,
      d_model=64,
      num_layers=4,
      layer_types=("sliding", "global", "sliding", "global"),
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      sliding_window=32,
      rope_base=10_000.0,
      global_num_kv_heads=1,
      global_head_dim=32,
      global_rope_base=1_000_000.0,
      global_rope_fraction=0.25,
      global_k_eq_v=True,
      mlp_hidden=128,
      num_experts=4,
      experts_per_token=2,
      expert_hidden=32,
      final_logit_softcap=30.0,
      rms_eps=1e-6,
      self_conditioning=True,
      decoder_shift=False,  # not in the released model (dgemma/model/config.py)
      decoder_right_readout=0,  # not in the released model; R right neighbours read (dgemma/model/config.py)
      decoder_head_layers=0,  # not in the released model; decoder-only layers over the canvas (dgemma/model/config.py)
      decoder_two_stream=False,  # not in the released model; logits blind to their own token (dgemma/model/config.py)
      moe_impl="ragged",
      moe_capacity_factor=1.5,  # moe_impl="capacity" only
      moe_dense_block=0,  # moe_impl="dense" only: every expert at once
      attention_impl="auto",
      scan_layers=True,
      remat="none",
      dtype="float32",
      param_dtype="float32",
      router_aux_loss_weight=0.0,
      router_z_loss_weight=0.0,
  ))
