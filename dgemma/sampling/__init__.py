"""DiffusionGemma sampling: the released entropy-bound sampler, its ablations (incl. uniform-state
ancestral sampling and MDLM masked sampling) and block-autoregressive generation.

  from dgemma.sampling import SamplerConfig, generate
  cfg = SamplerConfig.from_config(config)            # config.sample + config.diffusion.canvas_len
  out = generate(model, params, prompts_BP, lengths_B, cfg, jax.random.key(0), max_new_tokens=256)
  out.tokens_BN, out.lengths_B, out.tokens_per_forward_B

  cfg = SamplerConfig(sampler="ancestral", alpha_schedule="loglinear")     # posterior sampling
  cfg = SamplerConfig(sampler="masked", mask_id=4)                        # MDLM baseline models
  cfg = SamplerConfig(show="live"); generate(..., step_callback=LivePrinter(tokenizer.decode))
"""

from dgemma.sampling.autoregressive import ar_generate
from dgemma.sampling.generation import (GenerateOutput, cache_size, check_request, cut_after_end, generate,
                                        infill_arrays, num_canvases, trajectory_steps)
from dgemma.sampling.live import LivePrinter, StepView
from dgemma.sampling.noise import FixedNoise, JaxNoise, as_noise, row_keys
from dgemma.sampling.sampler import (CONTEXT_LEN, DenoiseState, SamplerConfig, Trajectory, accept_confidence,
                                     accept_entropy_bound, accept_fixed_k, alpha, canvas_result, denoise_canvas,
                                     entropy, initial_canvas, masked_posterior, shape_logits, temperature,
                                     uniform_posterior)

__all__ = [
    "ar_generate",
    "SamplerConfig", "generate", "GenerateOutput", "denoise_canvas", "DenoiseState", "Trajectory",
    "JaxNoise", "FixedNoise", "as_noise", "row_keys", "accept_entropy_bound", "accept_fixed_k",
    "accept_confidence", "temperature", "shape_logits", "entropy", "cut_after_end", "num_canvases",
    "cache_size", "trajectory_steps", "alpha", "uniform_posterior", "masked_posterior", "initial_canvas", "canvas_result", "check_request",
    "infill_arrays", "LivePrinter", "StepView", "CONTEXT_LEN",
]
