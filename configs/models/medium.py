"""`medium` preset (1.95B parameters, 0.76B active per token): the released structure (5 sliding + 1 global layers,
the released vocabulary, heads and head dims, 128 -> 64 experts top-8) at d_model 1536 and 12 layers, for
training on one accelerator (issue #17 item 8: bench/gpu_train_step.py times its train step).

  python -m dgemma.tools.model_size --config=configs/models/medium.py
  python bench/gpu_train_step.py --out=docs/experiments/gpu/train_step.json      # its train step on one GPU
"""

from configs.models import diffusiongemma_26b_a4b


def get_config():
  config = diffusiongemma_26b_a4b.get_config()
  config.update(dict(
      preset="medium",
      d_model=1536,
      num_layers=12,
      layer_types=(("sliding",) * 5 + ("global",)) * 2,
      num_heads=8,
      num_kv_heads=4,
      global_num_kv_heads=1,
      mlp_hidden=1152,
      num_experts=64,
      expert_hidden=384,
      param_dtype="float32",  # training keeps fp32 weights; compute stays bf16
  ))
  return config
