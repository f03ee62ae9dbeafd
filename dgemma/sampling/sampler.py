"""The DiffusionGemma canvas sampler (released defaults) and the uniform-state ancestral ablation.

One canvas is denoised by up to `max_denoising_steps` decoder passes against a read-only KV cache.

sampler='released' (reference doc, "Sampler (released defaults)"; numerics follow HF transformers
5.24, `generation_diffusion_gemma.py`). Per step s = 0 .. S-1:

  logits   = decoder(canvas, cache, self-conditioning logits)            (no signal at s = 0)
  T_s      = t_min + (t_max - t_min) * (S - s) / S                        (HF counts steps S..1, so
                                                                           T_0 = t_max, T_{S-1} > t_min)
  proc     = logits / T_s                                                 (+ optional top-k / top-p)
  sampled  ~ softmax(proc) at every position;  argmax = argmax(proc)
  H_i      = entropy(softmax(proc_i));  accept lowest-H positions while cumsum(H) - H_i <= bound
  canvas'  = accepted ? sampled : fresh uniform token                     (nothing is frozen)
  stop row when argmax == previous argmax for `stability_threshold` steps and mean(H) < threshold;
  finished rows keep canvas, argmax and self-conditioning logits unchanged
  sc_logits = proc
The canvas result is the argmax canvas (HF appends `argmax_canvas`, not the sampled canvas).

sampler='ancestral' (reference doc, "Uniform-state diffusion likelihood", posterior): the time grid
t_s = 1 - s / S runs from 1 to 0; step s draws z_{t_{s+1}} ~ q(. | z_{t_s}, x_theta) with
x_theta = softmax(proc) (same temperature schedule, shaping and self-conditioning as released) and,
with `greedy_last_step`, the last step takes argmax(x_theta). No acceptance, no early stopping (the
sample is only complete at t = 0); the canvas result is the final canvas z_0. For a model trained with
a leave-one-out objective (`loo_logits`), x_theta = softmax(f + delta(alpha_t) onehot(z_t)), the x0
prediction that objective trains (dgemma.objectives.loo_logits), before the temperature.

sampler='masked': ancestral sampling of the masked-diffusion baseline (diffusion.objective='mdlm';
MDLM, Sahoo et al. 2024). The canvas starts as all `mask_id`; on the same time grid a masked position
is revealed with probability (alpha_s - alpha_t) / (1 - alpha_t), drawing its token from x_theta (the
mask token excluded), and a revealed token is never changed again (SUBS parameterisation). At
t = 0 (alpha = 1) every position is revealed; the canvas result is z_0.

The released sampler uses the network logits as they are for every objective: its canvas mixes
accepted samples and fresh noise, so no diffusion time (and no loo shift) is defined for it.

Two loop forms with identical results: `lax.scan` over all steps (finished rows frozen) and
`lax.while_loop` that exits as soon as every row has finished (`early_exit`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from dgemma import objectives
from dgemma.model.config import ConfigError
from dgemma.sampling import live

PAD_ID = 0
EOS_ID = 1
END_OF_TURN_ID = 106  # `<turn|>` in the Gemma 4 vocabulary only


def file_tokenizer_end_ids(path: str) -> tuple[int, ...]:
  """Automatic end ids of a SentencePiece tokenizer file: its EOS, plus its `<turn|>` piece when it has
  Gemma's chat pieces (`dgemma.data.sft.end_id`, the end SFT trains on; Gemma 4: (1, 106)). Without a readable file (e.g. sampling a converted checkpoint before the
  tokenizer is in place), Gemma 4's (1, 106)."""
  if not path or not os.path.isfile(path):
    return (EOS_ID, END_OF_TURN_ID)
  return _end_ids_of_file(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _end_ids_of_file(path: str, mtime_ns: int) -> tuple[int, ...]:
  from dgemma import tokenizers
  from dgemma.data import sft
  try:
    tokenizer = tokenizers.load_tokenizer_file(path)
  except ValueError as e:
    raise ConfigError(f"data.tokenizer.path: {e}") from e
  # EOS, and the token SFT training ends a response with (`<turn|>` with Gemma's chat pieces, else EOS)
  return tuple(dict.fromkeys((tokenizer.eos_id, sft.end_id(tokenizer))))


CONTEXT_LEN = 262_144  # DiffusionGemma's context in positions (reference doc, architecture table)

SAMPLERS = ("released", "ancestral", "masked")
ACCEPTANCE_RULES = ("entropy_bound", "confidence", "fixed_k")
RENOISE_POLICIES = ("non_accepted", "none", "low_confidence")
ALPHA_SCHEDULES = ("linear", "loglinear")
SHOW_MODES = ("none", "live")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static sampler settings (hashable: a `jax.jit` static argument).

  Released sampler (HF 5.24 defaults): the first nine fields.
    canvas_len: tokens denoised in parallel (the block length; `config.diffusion.canvas_len`).
    max_denoising_steps: decoder passes per canvas at most.
    entropy_bound: acceptance budget: sum of accepted entropies minus the largest one (nats; > 0).
    t_max / t_min: linear temperature schedule (first step t_max, falling towards t_min).
    stability_threshold: argmax canvas unchanged for this many consecutive steps ...
    confidence_threshold: ... and mean token entropy below this -> the row stops (0 disables).
    end_ids: tokens that end a response (EOS 1; `<turn|>` 106 with the Gemma 4 vocabulary).
    pad_id: fills a row after its end token.
  Loop form:
    early_exit: `lax.while_loop` leaving when every row finished (else `lax.scan` over all steps).
    self_conditioning: feed the previous step's processed logits back (False = zero signal, as in
      training without self-conditioning).
  Ablations (defaults reproduce the release):
    sampler: 'released' | 'ancestral' (uniform-state posterior sampling; module docstring).
    acceptance: 'entropy_bound' | 'confidence' (positions whose top probability >= accept_confidence)
      | 'fixed_k' (the accept_k lowest-entropy positions). At least one open position is accepted.
    renoise: 'non_accepted' (released: every non-accepted position gets a fresh uniform token,
      accepted ones are re-predicted every step) | 'none' (non-accepted positions keep their
      token) | 'low_confidence' (an accepted token stays on the canvas on later steps, outside the
      acceptance budget, until the model's probability of it falls below renoise_confidence; then
      it is re-noised and its position is open again; open non-accepted positions get fresh tokens).
    top_k / top_p: logit shaping after the temperature (0 / 1.0 = off); the shaped logits are used
      for sampling, entropy, argmax, stopping and self-conditioning alike.
    alpha_schedule / schedule_eps / greedy_last_step: samplers 'ancestral' and 'masked' (see `alpha`).
    mask_id: sampler='masked': the mask token (diffusion.mask_id of the mdlm training run).
    loo_logits: the model was trained with a leave-one-out objective (set from diffusion.objective);
      sampler='ancestral' then adds the loo shift to the logits (module docstring).
  Limits and display:
    max_context: positions the model may use: prompt + every canvas must fit (`check_request`).
    show: 'none' | 'live' (a host callback per denoising step, `dgemma.sampling.live`).
  """

  canvas_len: int = 256
  max_denoising_steps: int = 48
  entropy_bound: float = 0.1
  t_max: float = 0.8
  t_min: float = 0.4
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  end_ids: tuple[int, ...] = (EOS_ID, END_OF_TURN_ID)
  pad_id: int = PAD_ID
  early_exit: bool = True
  self_conditioning: bool = True
  sampler: str = "released"
  acceptance: str = "entropy_bound"
  accept_confidence: float = 0.9
  accept_k: int = 1
  renoise: str = "non_accepted"
  renoise_confidence: float = 0.1
  top_k: int = 0
  top_p: float = 1.0
  alpha_schedule: str = "linear"
  schedule_eps: float = 1e-3
  greedy_last_step: bool = True
  mask_id: int = 4
  loo_logits: bool = False
  max_context: int = CONTEXT_LEN
  show: str = "none"

  def __post_init__(self):
    object.__setattr__(self, "end_ids", tuple(int(i) for i in self.end_ids))
    self.validate()

  def validate(self) -> None:
    def need(cond, msg):
      if not cond:
        raise ConfigError(msg)

    def one_of(name, options):
      need(getattr(self, name) in options, f"sample.{name} must be one of {options}, got {getattr(self, name)!r}")

    need(self.canvas_len > 0, f"diffusion.canvas_len must be positive, got {self.canvas_len}")
    need(self.max_denoising_steps > 0,
         f"sample.max_denoising_steps must be positive, got {self.max_denoising_steps}")
    need(self.entropy_bound > 0, f"sample.entropy_bound must be > 0, got {self.entropy_bound}")
    need(self.t_max > 0, f"sample.t_max must be > 0, got {self.t_max}")
    need(self.t_min >= 0, f"sample.t_min must be >= 0, got {self.t_min}")
    need(self.t_min <= self.t_max,
         f"sample.t_min must be <= sample.t_max (got t_min={self.t_min}, t_max={self.t_max})")
    need(self.stability_threshold >= 0,
         f"sample.stability_threshold must be >= 0, got {self.stability_threshold}")
    need(self.confidence_threshold >= 0,
         f"sample.confidence_threshold must be >= 0, got {self.confidence_threshold}")
    need(all(i >= 0 for i in self.end_ids), f"sample.end_ids must be token ids >= 0, got {self.end_ids}")
    need(self.pad_id not in self.end_ids, f"sample.end_ids must not contain the pad id {self.pad_id}")
    one_of("sampler", SAMPLERS)
    one_of("acceptance", ACCEPTANCE_RULES)
    need(0.0 <= self.accept_confidence <= 1.0,
         f"sample.accept_confidence must be in [0, 1], got {self.accept_confidence}")
    need(self.accept_k >= 1, f"sample.accept_k must be >= 1, got {self.accept_k}")
    one_of("renoise", RENOISE_POLICIES)
    need(0.0 <= self.renoise_confidence <= 1.0,
         f"sample.renoise_confidence must be in [0, 1], got {self.renoise_confidence}")
    need(self.top_k >= 0, f"sample.top_k must be >= 0 (0 = off), got {self.top_k}")
    need(0.0 < self.top_p <= 1.0, f"sample.top_p must be in (0, 1] (1 = off), got {self.top_p}")
    one_of("alpha_schedule", ALPHA_SCHEDULES)
    need(0.0 < self.schedule_eps < 1.0, f"sample.schedule_eps must be in (0, 1), got {self.schedule_eps}")
    need(self.mask_id >= 0, f"diffusion.mask_id must be a token id >= 0, got {self.mask_id}")
    need(self.max_context > self.canvas_len,
         f"sample.max_context must exceed diffusion.canvas_len={self.canvas_len}, got {self.max_context}")
    one_of("show", SHOW_MODES)

  @classmethod
  def from_config(cls, config) -> "SamplerConfig":
    """From an experiment config: `config.sample` plus `config.diffusion.canvas_len`.

    `sample.end_ids = ()` means automatic: EOS, plus `<turn|>` (106) only for a tokenizer file
    (the Gemma 4 vocabulary) -- with the byte tokenizer id 106 is the letter 'f', and a
    SentencePiece model trained here has only 4 special pieces. For a tokenizer file the ids are
    read from the file when it exists (its EOS, and its `<turn|>` piece if it has one: a foreign
    SentencePiece model may put EOS at 2 and an ordinary piece at 106). Ids outside the vocabulary are
    dropped. `sample.max_context = 0` means DiffusionGemma's 262,144 positions.

    The sampler must match the training objective (`diffusion.objective`): 'mdlm' models are sampled
    with sample.sampler='masked' only, and 'masked' needs an 'mdlm' model; 'ar' models have no
    canvas sampler (dgemma.sampling.ar_generate). loo objectives set `loo_logits`.
    """
    s = config.sample
    objective = str(config.diffusion.get("objective", "base_ce")) if "diffusion" in config else "base_ce"
    sampler = str(s.get("sampler", "released"))
    if objective == "ar":
      raise ConfigError("diffusion.objective='ar' trains an autoregressive model: sample it with "
                        "dgemma.sampling.ar_generate, not the canvas sampler")
    if (objective == "mdlm") != (sampler == "masked"):
      raise ConfigError(f"sample.sampler={sampler!r} does not fit diffusion.objective={objective!r}: "
                        "masked-diffusion (mdlm) models need sample.sampler='masked', and only they")
    vocab = int(config.model.vocab_size)
    end_ids = tuple(int(i) for i in s.end_ids)
    if not end_ids:
      kind = config.data.tokenizer.kind if "data" in config else "file"
      end_ids = file_tokenizer_end_ids(str(config.data.tokenizer.get("path", ""))) if kind == "file" else (EOS_ID,)
    end_ids = tuple(i for i in end_ids if i < vocab)
    fields = {f.name for f in dataclasses.fields(cls)} - {"canvas_len", "end_ids", "pad_id", "mask_id",
                                                            "loo_logits"}
    kwargs = {name: s[name] for name in fields if name in s}
    for name in ("max_denoising_steps", "stability_threshold", "accept_k", "top_k", "max_context"):
      if name in kwargs:
        kwargs[name] = int(kwargs[name])
    for name in ("entropy_bound", "t_max", "t_min", "confidence_threshold", "accept_confidence",
                 "renoise_confidence", "top_p", "schedule_eps"):
      if name in kwargs:
        kwargs[name] = float(kwargs[name])
    if kwargs.get("max_context") == 0:
      kwargs["max_context"] = CONTEXT_LEN
    mask_id = int(config.diffusion.get("mask_id", 4)) if "diffusion" in config else 4
    return cls(canvas_len=int(config.diffusion.canvas_len), end_ids=end_ids, mask_id=mask_id,
               loo_logits=objective in ("loo_ce", "reweighted_loo_ce"), **kwargs)


# ---- pieces of one step ------------------------------------------------------------------------


def temperature(cfg: SamplerConfig, step) -> jax.Array:
  """T at 0-based step s: t_min + (t_max - t_min) * (S - s) / S, in fp32 like HF (which counts S..1)."""
  n = cfg.max_denoising_steps
  frac = (n - jnp.asarray(step, jnp.int32)).astype(jnp.float32) / jnp.float32(n)
  return jnp.float32(cfg.t_min) + jnp.float32(cfg.t_max - cfg.t_min) * frac


def shape_logits(logits_BCV: jax.Array, cfg: SamplerConfig) -> jax.Array:
  """Optional top-k / top-p filtering (masked logits -> -inf)."""
  neg_inf = jnp.array(-jnp.inf, logits_BCV.dtype)
  if cfg.top_k and cfg.top_k < logits_BCV.shape[-1]:
    kth_BC1 = jax.lax.top_k(logits_BCV, cfg.top_k)[0][..., -1:]
    logits_BCV = jnp.where(logits_BCV < kth_BC1, neg_inf, logits_BCV)
  if cfg.top_p < 1.0:
    sorted_BCV = jnp.sort(logits_BCV, axis=-1)[..., ::-1]
    probs_BCV = jax.nn.softmax(sorted_BCV, axis=-1)
    mass_before_BCV = jnp.cumsum(probs_BCV, axis=-1) - probs_BCV
    # the smallest logit still needed to reach mass top_p (the top token always survives)
    keep_BCV = mass_before_BCV < cfg.top_p
    cutoff_BC1 = jnp.min(jnp.where(keep_BCV, sorted_BCV, jnp.inf), axis=-1, keepdims=True)
    logits_BCV = jnp.where(logits_BCV < cutoff_BC1, neg_inf, logits_BCV)
  return logits_BCV


def entropy(logits_BCV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(entropy [B, C], log-probabilities [B, C, V]) of softmax(logits) in fp32; -inf logits allowed."""
  logp_BCV = jax.nn.log_softmax(logits_BCV.astype(jnp.float32), axis=-1)
  p_BCV = jnp.exp(logp_BCV)
  plogp_BCV = jnp.where(p_BCV > 0, p_BCV * logp_BCV, 0.0)
  return -jnp.sum(plogp_BCV, axis=-1), logp_BCV


def accept_entropy_bound(entropy_BC: jax.Array, bound: float) -> jax.Array:
  """Entropy-bound acceptance (arXiv 2505.24857): sort entropies ascending, accept while
  cumsum(H) - H_i <= bound (H_i is the running maximum), so the lowest is always accepted.
  Positions with entropy +inf (excluded from the rule) are never accepted."""
  order_BC = jnp.argsort(entropy_BC, axis=-1, stable=True)
  sorted_BC = jnp.take_along_axis(entropy_BC, order_BC, axis=-1)
  keep_sorted_BC = jnp.cumsum(sorted_BC, axis=-1) - sorted_BC <= bound  # inf - inf = nan -> False
  rows_B1 = jnp.arange(entropy_BC.shape[0])[:, None]
  return jnp.zeros(entropy_BC.shape, bool).at[rows_B1, order_BC].set(keep_sorted_BC)


def accept_fixed_k(entropy_BC: jax.Array, k: int) -> jax.Array:
  """The k lowest-entropy positions."""
  k = min(k, entropy_BC.shape[-1])
  order_BC = jnp.argsort(entropy_BC, axis=-1, stable=True)
  rank_BC = jnp.argsort(order_BC, axis=-1)
  return rank_BC < k


def accept_confidence(entropy_BC: jax.Array, top_prob_BC: jax.Array, threshold: float) -> jax.Array:
  """Positions whose most likely token has probability >= threshold; the lowest-entropy one always."""
  lowest_BC = accept_fixed_k(entropy_BC, 1)
  return (top_prob_BC >= threshold) | lowest_BC


def alpha(cfg: SamplerConfig, t) -> jax.Array:
  """Signal level alpha(t) of the ancestral sampler (fp32), t in [0, 1].

  'linear': alpha = 1 - t, the training recipe's schedule (reference doc, "Training recipe").
  'loglinear': the log-linear noise schedule of MDLM / UDLM (Sahoo et al. 2024, Schiff et al. 2024):
    total noise sigma(t) = -log(1 - (1 - eps) t), alpha = exp(-sigma(t)) = 1 - (1 - eps) t; the
    same line, except that alpha(1) = eps > 0 keeps sigma finite at t = 1.
  """
  t = jnp.asarray(t, jnp.float32)
  if cfg.alpha_schedule == "linear":
    return 1.0 - t
  # 1 - (1 - eps) t written as (1 - t) + eps t: no fp32 cancellation near t = 1
  sigma = -jnp.log((1.0 - t) + jnp.float32(cfg.schedule_eps) * t)
  return jnp.exp(-sigma)


def uniform_posterior(x_BCV: jax.Array, z_BC: jax.Array, alpha_t, alpha_s) -> jax.Array:
  """q(z_s | z_t, x) over the vocabulary [B, C, V] (fp32; rows sum to 1), s < t, alpha_s > 0.

  Reference doc, "Uniform-state diffusion likelihood": with N = vocab size and z_t one-hot,
    q  proportional to  N alpha_t x*z_t + (alpha_t/alpha_s - alpha_t) z_t + (alpha_s - alpha_t) x
                        + (1 - alpha_t/alpha_s)(1 - alpha_s)/N,
  normaliser N alpha_t x[z_t] + 1 - alpha_t. x: a distribution (the model's x0-prediction).
  """
  x_BCV = x_BCV.astype(jnp.float32)
  n = x_BCV.shape[-1]
  a_t, a_s = jnp.asarray(alpha_t, jnp.float32), jnp.asarray(alpha_s, jnp.float32)
  is_z_BCV = jnp.arange(n, dtype=jnp.int32) == z_BC[..., None].astype(jnp.int32)
  x_z_BC1 = jnp.sum(jnp.where(is_z_BCV, x_BCV, 0.0), axis=-1, keepdims=True)
  q_BCV = (a_s - a_t) * x_BCV + (1.0 - a_t / a_s) * (1.0 - a_s) / n
  q_BCV = q_BCV + jnp.where(is_z_BCV, n * a_t * x_z_BC1 + (a_t / a_s - a_t), 0.0)
  return q_BCV / jnp.sum(q_BCV, axis=-1, keepdims=True)


# ---- the denoising loop --------------------------------------------------------------------------


@struct.dataclass
class Trajectory:
  """Per-step record of one canvas ([S, B, C]; `active_SB` [S, B]). Entries of steps a row did not
  run (finished or never reached) keep the fill: tokens -1, accepted False, entropy 0.

  canvas: the decoder input; sampled: the denoiser's sample (released) or z_s (ancestral);
  argmax: the argmax prediction; accepted: tokens held on the canvas after the step (released:
  the acceptance mask, plus tokens kept by renoise='low_confidence' and infilled ones; ancestral:
  z_s == argmax); shown: what the step produced before re-noising (released: the newly accepted
  positions' samples, elsewhere the input token; ancestral: z_s); entropy: per-position entropy
  of the tempered distribution.
  """

  canvas_SBC: jax.Array
  sampled_SBC: jax.Array
  argmax_SBC: jax.Array
  accepted_SBC: jax.Array
  shown_SBC: jax.Array
  entropy_SBC: jax.Array
  active_SB: jax.Array

  @classmethod
  def empty(cls, steps: int, batch: int, canvas_len: int) -> "Trajectory":
    tok = jnp.full((steps, batch, canvas_len), -1, jnp.int32)
    return cls(canvas_SBC=tok, sampled_SBC=tok, argmax_SBC=tok,
               accepted_SBC=jnp.zeros((steps, batch, canvas_len), bool), shown_SBC=tok,
               entropy_SBC=jnp.zeros((steps, batch, canvas_len), jnp.float32),
               active_SB=jnp.zeros((steps, batch), bool))


@struct.dataclass
class DenoiseState:
  """Carry of the per-canvas loop."""

  step: jax.Array            # int32 [], next step to run (0-based)
  canvas_BC: jax.Array       # int32, the decoder input
  sc_logits_BCV: jax.Array   # processed logits of the previous step (self-conditioning), sc dtype
  argmax_BC: jax.Array       # int32, the latest argmax canvas (-1 before the first step)
  held_BC: jax.Array         # bool, accepted tokens kept on the canvas (renoise='low_confidence')
  stable_B: jax.Array        # int32, consecutive steps with an unchanged argmax canvas
  done_B: jax.Array          # bool, row finished (stable and confident, or inactive from the start)
  num_forwards_B: jax.Array  # int32, decoder passes the row needed
  traj: Optional[Trajectory] = None


# decode_fn(canvas_BC, sc_logits_BCV, sc_mask_B) -> logits_BCV
DecodeFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def canvas_result(state: DenoiseState, cfg: SamplerConfig) -> jax.Array:
  """The canvas a denoising run produced: the argmax canvas (released) or z_0 (ancestral, masked)."""
  return state.argmax_BC if cfg.sampler == "released" else state.canvas_BC


def initial_canvas(cfg: SamplerConfig, noise: Any, canvas_idx, canvas_len: int, vocab_size: int) -> jax.Array:
  """Step 1: uniform random tokens, or all mask tokens for sampler='masked'."""
  if cfg.sampler == "masked":
    batch = noise.init_canvas(canvas_idx, canvas_len, vocab_size).shape[0]
    return jnp.full((batch, canvas_len), cfg.mask_id, jnp.int32)
  return noise.init_canvas(canvas_idx, canvas_len, vocab_size)


def _released_update(state: DenoiseState, cfg: SamplerConfig, noise: Any, canvas_idx, s, ent_BC, logp_BCV,
                     sampled_BC, fixed_BC, fixed_mask_BC):
  """Steps 5-6 of the released sampler: (canvas', held', accepted, shown)."""
  batch, canvas_len = state.canvas_BC.shape
  vocab = logp_BCV.shape[-1]
  # renoise='low_confidence': held tokens stay while p(token) >= renoise_confidence
  keep_BC = jnp.zeros((batch, canvas_len), bool)
  if cfg.renoise == "low_confidence":
    p_current_BC = jnp.exp(jnp.take_along_axis(logp_BCV, state.canvas_BC[..., None], axis=-1)[..., 0])
    keep_BC = state.held_BC & (p_current_BC >= cfg.renoise_confidence)
  # 5. acceptance over the open positions (kept and infilled ones are outside the budget)
  closed_BC = keep_BC if fixed_mask_BC is None else keep_BC | fixed_mask_BC
  rank_ent_BC = jnp.where(closed_BC, jnp.inf, ent_BC)
  if cfg.acceptance == "entropy_bound":
    new_BC = accept_entropy_bound(rank_ent_BC, cfg.entropy_bound)
  elif cfg.acceptance == "fixed_k":
    new_BC = accept_fixed_k(rank_ent_BC, cfg.accept_k)
  else:
    new_BC = accept_confidence(rank_ent_BC, jnp.exp(jnp.max(logp_BCV, axis=-1)), cfg.accept_confidence)
  new_BC = new_BC & ~closed_BC
  # 6. re-noise the open non-accepted positions
  fresh_BC = noise.renoise(canvas_idx, s, canvas_len, vocab)
  other_BC = state.canvas_BC if cfg.renoise == "none" else fresh_BC
  canvas_BC = jnp.where(new_BC, sampled_BC, other_BC)
  canvas_BC = jnp.where(keep_BC, state.canvas_BC, canvas_BC)
  shown_BC = jnp.where(new_BC, sampled_BC, state.canvas_BC)
  accepted_BC = new_BC | keep_BC
  if fixed_mask_BC is not None:
    canvas_BC = jnp.where(fixed_mask_BC, fixed_BC, canvas_BC)
    shown_BC = jnp.where(fixed_mask_BC, fixed_BC, shown_BC)
    accepted_BC = accepted_BC | fixed_mask_BC
  held_BC = (new_BC | keep_BC) if cfg.renoise == "low_confidence" else state.held_BC
  return canvas_BC, held_BC, accepted_BC, shown_BC


def _step_alphas(cfg: SamplerConfig, s) -> tuple[jax.Array, jax.Array]:
  """(alpha_t, alpha_s) of step s on the ancestral time grid t = 1 - s/S -> s' = 1 - (s+1)/S."""
  n = jnp.float32(cfg.max_denoising_steps)
  step_f = jnp.asarray(s, jnp.float32)
  return alpha(cfg, 1.0 - step_f / n), alpha(cfg, 1.0 - (step_f + 1.0) / n)


def _ancestral_update(state: DenoiseState, cfg: SamplerConfig, noise: Any, canvas_idx, s, logp_BCV, argmax_BC,
                      fixed_BC, fixed_mask_BC):
  """One posterior draw z_s ~ q(z_s | z_t, x_theta) from t = 1 - s/S to s = 1 - (s+1)/S."""
  alpha_t, alpha_s = _step_alphas(cfg, s)
  q_BCV = uniform_posterior(jnp.exp(logp_BCV), state.canvas_BC, alpha_t, alpha_s)
  z_BC = noise.sample(canvas_idx, s, jnp.log(q_BCV))
  if cfg.greedy_last_step:
    z_BC = jnp.where(s == cfg.max_denoising_steps - 1, argmax_BC, z_BC)
  if fixed_mask_BC is not None:
    z_BC = jnp.where(fixed_mask_BC, fixed_BC, z_BC)
  return z_BC, state.held_BC, z_BC == argmax_BC, z_BC


def masked_posterior(x_BCV: jax.Array, z_BC: jax.Array, mask_id: int, alpha_t, alpha_s) -> jax.Array:
  """MDLM posterior q(z_s | z_t, x) [B, C, V] (fp32), s < t: a masked z_t is revealed as x with
  probability (alpha_s - alpha_t) / (1 - alpha_t) and stays masked otherwise; a revealed z_t is kept.
  x: a distribution with no mass on mask_id."""
  x_BCV = x_BCV.astype(jnp.float32)
  a_t, a_s = jnp.asarray(alpha_t, jnp.float32), jnp.asarray(alpha_s, jnp.float32)
  reveal = (a_s - a_t) / jnp.maximum(1.0 - a_t, jnp.finfo(jnp.float32).tiny)
  iota_V = jnp.arange(x_BCV.shape[-1], dtype=jnp.int32)
  is_mask_V = (iota_V == mask_id).astype(jnp.float32)
  from_mask_BCV = reveal * x_BCV + (1.0 - reveal) * is_mask_V
  keep_BCV = (iota_V == z_BC[..., None].astype(jnp.int32)).astype(jnp.float32)
  return jnp.where((z_BC == mask_id)[..., None], from_mask_BCV, keep_BCV)


def _masked_update(state: DenoiseState, cfg: SamplerConfig, noise: Any, canvas_idx, s, logp_BCV, argmax_BC,
                   fixed_BC, fixed_mask_BC):
  """One MDLM reveal step (module docstring); logp_BCV already excludes the mask token."""
  alpha_t, alpha_s = _step_alphas(cfg, s)
  q_BCV = masked_posterior(jnp.exp(logp_BCV), state.canvas_BC, cfg.mask_id, alpha_t, alpha_s)
  z_BC = noise.sample(canvas_idx, s, jnp.log(q_BCV))
  if cfg.greedy_last_step:  # the last step reveals every masked position with its argmax
    last_BC = (s == cfg.max_denoising_steps - 1) & (state.canvas_BC == cfg.mask_id)
    z_BC = jnp.where(last_BC, argmax_BC, z_BC)
  if fixed_mask_BC is not None:
    z_BC = jnp.where(fixed_mask_BC, fixed_BC, z_BC)
  return z_BC, state.held_BC, z_BC != cfg.mask_id, z_BC


def _denoise_step(state: DenoiseState, *, decode_fn: DecodeFn, cfg: SamplerConfig, noise: Any,
                  canvas_idx, fixed_BC, fixed_mask_BC, callback_id) -> DenoiseState:
  s = state.step
  batch = state.canvas_BC.shape[0]
  done_B = state.done_B

  # 2. decoder forward; no self-conditioning signal at the first step (reference doc, step 8)
  sc_mask_B = jnp.broadcast_to((s > 0) & cfg.self_conditioning, (batch,))
  logits_BCV = decode_fn(state.canvas_BC, state.sc_logits_BCV, sc_mask_B).astype(jnp.float32)
  # 3. temperature (+ optional shaping): HF's processed logits
  if cfg.sampler == "ancestral" and cfg.loo_logits:  # the x0 logits a loo objective trains
    alpha_t = jnp.broadcast_to(_step_alphas(cfg, s)[0], state.canvas_BC.shape)
    logits_BCV = objectives.loo_logits(logits_BCV, state.canvas_BC, alpha_t)
  if cfg.sampler == "masked":  # SUBS: the mask token is never predicted
    logits_BCV = jnp.where(jnp.arange(logits_BCV.shape[-1]) == cfg.mask_id, -jnp.inf, logits_BCV)
  proc_BCV = shape_logits(logits_BCV / temperature(cfg, s), cfg)
  argmax_BC = jnp.argmax(proc_BCV, axis=-1).astype(jnp.int32)
  if cfg.sampler in ("ancestral", "masked"):
    ent_BC, logp_BCV = entropy(proc_BCV)
    if fixed_mask_BC is not None:
      argmax_BC = jnp.where(fixed_mask_BC, fixed_BC, argmax_BC)
    update = _ancestral_update if cfg.sampler == "ancestral" else _masked_update
    canvas_BC, held_BC, accepted_BC, shown_BC = update(
        state, cfg, noise, canvas_idx, s, logp_BCV, argmax_BC, fixed_BC, fixed_mask_BC)
    sampled_BC = canvas_BC
  else:
    # 4. sample every position; the argmax canvas is the output
    sampled_BC = noise.sample(canvas_idx, s, proc_BCV)
    # 5. entropy (infilled positions: zero, for the stopping rule)
    ent_BC, logp_BCV = entropy(proc_BCV)
    if fixed_mask_BC is not None:
      ent_BC = jnp.where(fixed_mask_BC, 0.0, ent_BC)
      sampled_BC = jnp.where(fixed_mask_BC, fixed_BC, sampled_BC)
      argmax_BC = jnp.where(fixed_mask_BC, fixed_BC, argmax_BC)
    canvas_BC, held_BC, accepted_BC, shown_BC = _released_update(
        state, cfg, noise, canvas_idx, s, ent_BC, logp_BCV, sampled_BC, fixed_BC, fixed_mask_BC)

  # 7. finished rows stop changing (HF freezes canvas, argmax and self-conditioning logits)
  canvas_BC = jnp.where(done_B[:, None], state.canvas_BC, canvas_BC)
  argmax_BC = jnp.where(done_B[:, None], state.argmax_BC, argmax_BC)
  held_BC = jnp.where(done_B[:, None], state.held_BC, held_BC)
  # (stored in the embedding dtype, as HF does: `processed_logits.to(embed_tokens.weight.dtype)`)
  sc_BCV = jnp.where(done_B[:, None, None], state.sc_logits_BCV, proc_BCV.astype(state.sc_logits_BCV.dtype))
  #    stable: the argmax canvas equals the previous `stability_threshold` ones; confident: mean H
  same_B = jnp.all(argmax_BC == state.argmax_BC, axis=-1)
  stable_B = jnp.where(same_B, state.stable_B + 1, 0)
  if cfg.sampler != "released":  # the sample is complete only at t = 0: no early stopping
    new_done_B = done_B
  else:
    confident_B = jnp.mean(ent_BC, axis=-1) < cfg.confidence_threshold
    new_done_B = done_B | ((stable_B >= cfg.stability_threshold) & confident_B)

  active_B = ~done_B
  if cfg.show == "live":  # host view of the step (dgemma.sampling.live), in execution order
    view_result_BC = argmax_BC if cfg.sampler == "released" else canvas_BC
    jax.debug.callback(live.emit, callback_id, canvas_idx, s, shown_BC, accepted_BC, view_result_BC, active_B,
                       ordered=True)

  traj = state.traj
  if traj is not None:

    def put(buf_SBX, new_BX):
      mask = active_B.reshape((batch,) + (1,) * (new_BX.ndim - 1))
      return buf_SBX.at[s].set(jnp.where(mask, new_BX, buf_SBX[s]))

    traj = Trajectory(canvas_SBC=put(traj.canvas_SBC, state.canvas_BC),
                      sampled_SBC=put(traj.sampled_SBC, sampled_BC),
                      argmax_SBC=put(traj.argmax_SBC, argmax_BC),
                      accepted_SBC=put(traj.accepted_SBC, accepted_BC),
                      shown_SBC=put(traj.shown_SBC, shown_BC),
                      entropy_SBC=put(traj.entropy_SBC, ent_BC),
                      active_SB=traj.active_SB.at[s].set(active_B))

  # 8. this step's processed logits condition the next step
  return DenoiseState(step=s + 1, canvas_BC=canvas_BC, sc_logits_BCV=sc_BCV, argmax_BC=argmax_BC,
                      held_BC=held_BC, stable_B=stable_B.astype(jnp.int32), done_B=new_done_B,
                      num_forwards_B=state.num_forwards_B + active_B.astype(jnp.int32), traj=traj)


def init_state(init_canvas_BC: jax.Array, vocab_size: int, *, done_B: jax.Array | None = None,
               steps: int = 0, record: bool = False, sc_dtype=jnp.float32) -> DenoiseState:
  batch, canvas_len = init_canvas_BC.shape
  return DenoiseState(
      step=jnp.zeros((), jnp.int32),
      canvas_BC=init_canvas_BC.astype(jnp.int32),
      sc_logits_BCV=jnp.zeros((batch, canvas_len, vocab_size), sc_dtype),
      argmax_BC=jnp.full((batch, canvas_len), -1, jnp.int32),
      held_BC=jnp.zeros((batch, canvas_len), bool),
      stable_B=jnp.zeros((batch,), jnp.int32),
      done_B=jnp.zeros((batch,), bool) if done_B is None else done_B,
      num_forwards_B=jnp.zeros((batch,), jnp.int32),
      traj=Trajectory.empty(steps, batch, canvas_len) if record else None)


def denoise_canvas(decode_fn: DecodeFn, cfg: SamplerConfig, noise: Any, init_canvas_BC: jax.Array,
                   vocab_size: int, *, canvas_idx=0, done_B: jax.Array | None = None,
                   fixed_BC: jax.Array | None = None, fixed_mask_BC: jax.Array | None = None,
                   record: bool = False, sc_dtype=jnp.float32, callback_id=0) -> DenoiseState:
  """Denoises one canvas; traceable (call under `jax.jit`).

  decode_fn(canvas_BC, sc_logits_BCV, sc_mask_B) -> logits_BCV runs the decoder against the cache.
  noise: a source from `dgemma.sampling.noise` (draws indexed by `canvas_idx` and step).
  done_B: rows that take no step (e.g. already ended); they keep the initial state.
  fixed_BC / fixed_mask_BC: infilling; masked positions hold the given token throughout and in the
    output, are never re-noised, and do not count against the acceptance budget.
  sc_dtype: dtype the self-conditioning logits are kept in (HF: the embedding dtype).
  callback_id: with cfg.show == 'live', the `live.register` id whose function receives every step.
  Returns the final state: `canvas_result(state, cfg)` is the canvas result, `num_forwards_B` the
  passes per row, `traj` the per-step record when `record`.
  """
  steps = cfg.max_denoising_steps
  if fixed_mask_BC is not None:
    if fixed_mask_BC.shape != init_canvas_BC.shape or fixed_BC.shape != init_canvas_BC.shape:
      raise ValueError(f"fixed_BC / fixed_mask_BC: expected the canvas shape {init_canvas_BC.shape}, got "
                       f"{fixed_BC.shape} / {fixed_mask_BC.shape}")
    fixed_BC = fixed_BC.astype(jnp.int32)
    init_canvas_BC = jnp.where(fixed_mask_BC, fixed_BC, init_canvas_BC)
  state = init_state(init_canvas_BC, vocab_size, done_B=done_B, steps=steps, record=record, sc_dtype=sc_dtype)
  step_fn = lambda st: _denoise_step(st, decode_fn=decode_fn, cfg=cfg, noise=noise, canvas_idx=canvas_idx,
                                     fixed_BC=fixed_BC, fixed_mask_BC=fixed_mask_BC, callback_id=callback_id)
  if cfg.early_exit:
    state = jax.lax.while_loop(lambda st: (st.step < steps) & ~jnp.all(st.done_B), step_fn, state)
  else:
    state, _ = jax.lax.scan(lambda st, _: (step_fn(st), None), state, None, length=steps)
  return state
