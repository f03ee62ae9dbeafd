"""DiffusionGemma sampling: the released entropy-bound sampler, its ablations (incl. uniform-state
ancestral, predictor-corrector and MDLM masked sampling) and block-autoregressive generation.

  from dgemma.sampling import SamplerConfig, generate
  cfg = dgemma.settings.from_config(config).canvas_sampler   # config.sample + config.diffusion.canvas_len, ...
  out = generate(model, params, prompts_BP, lengths_B, cfg, jax.random.key(0), max_new_tokens=256)
  out.tokens_BN, out.lengths_B, out.tokens_per_forward_B

  cfg = SamplerConfig(sampler="ancestral", alpha_schedule="loglinear")     # posterior sampling
  cfg = SamplerConfig(sampler="pc", max_denoising_steps=16, pc_corrector_steps=1)  # 8 predictor + 8 corrector
  cfg = SamplerConfig(sampler="masked", mask_id=4)                        # MDLM baseline models
  cfg = SamplerConfig(show="live"); generate(..., step_callback=LivePrinter(tokenizer.decode))

Layout: `config` (the `sample` group, SampleSettings; SamplerConfig, what a compiled sampler takes), `rules` (step
pieces and the acceptance / re-noise / sampler tables),
`posteriors` (the ancestral samplers' q(z_s | z_t, x)), `sampler` (the per-canvas loop), `generation`
(canvas after canvas), `autoregressive` (the AR baseline's decoding), `noise`, `live`.
"""

from dgemma.sampling.autoregressive import ar_generate
from dgemma.sampling.config import (CONTEXT_LEN, EOS_ID, END_OF_TURN_ID, PAD_ID, SampleSettings, SamplerConfig,
                                    SamplerSettings)
from dgemma.sampling.generation import (GenerateOutput, cache_size, check_request, cut_after_end, generate,
                                        infill_arrays, num_canvases, trajectory_steps)
from dgemma.sampling.live import LivePrinter, StepView
from dgemma.sampling.noise import FixedNoise, JaxNoise, as_noise, row_keys
from dgemma.sampling.posteriors import masked_posterior, uniform_posterior
from dgemma.sampling.rules import (ACCEPTANCE, KINDS, RENOISE, accept_confidence, accept_entropy_bound,
                                   accept_fixed_k, alpha, entropy, shape_logits, temperature)
from dgemma.sampling.sampler import DenoiseState, Trajectory, canvas_result, denoise_canvas, initial_canvas

__all__ = [
    "ar_generate",
    "SampleSettings", "SamplerConfig", "SamplerSettings", "CONTEXT_LEN", "EOS_ID", "END_OF_TURN_ID", "PAD_ID",
    "generate", "GenerateOutput", "denoise_canvas", "DenoiseState", "Trajectory",
    "JaxNoise", "FixedNoise", "as_noise", "row_keys", "ACCEPTANCE", "RENOISE", "KINDS", "accept_entropy_bound",
    "accept_fixed_k", "accept_confidence", "temperature", "shape_logits", "entropy", "cut_after_end", "num_canvases",
    "cache_size", "trajectory_steps", "alpha", "uniform_posterior", "masked_posterior", "initial_canvas",
    "canvas_result", "check_request", "infill_arrays", "LivePrinter", "StepView",
]
