"""DiffusionGemma sampling: the released entropy-bound sampler and block-autoregressive generation.

  from dgemma.sampling import SamplerConfig, generate
  cfg = SamplerConfig.from_config(config)            # config.sample + config.diffusion.canvas_len
  out = generate(model, params, prompts_BP, lengths_B, cfg, jax.random.key(0), max_new_tokens=256)
  out.tokens_BN, out.lengths_B, out.tokens_per_forward_B
"""

from dgemma.sampling.generation import (GenerateOutput, cache_size, cut_after_end, generate, num_canvases,
                                        trajectory_steps)
from dgemma.sampling.noise import FixedNoise, JaxNoise, as_noise, row_keys
from dgemma.sampling.sampler import (DenoiseState, SamplerConfig, Trajectory, accept_confidence,
                                     accept_entropy_bound, accept_fixed_k, denoise_canvas, entropy,
                                     shape_logits, temperature)

__all__ = [
    "SamplerConfig", "generate", "GenerateOutput", "denoise_canvas", "DenoiseState", "Trajectory",
    "JaxNoise", "FixedNoise", "as_noise", "row_keys", "accept_entropy_bound", "accept_fixed_k",
    "accept_confidence", "temperature", "shape_logits", "entropy", "cut_after_end", "num_canvases",
    "cache_size", "trajectory_steps",
]
