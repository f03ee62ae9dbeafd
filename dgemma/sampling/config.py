"""Static settings of the DiffusionGemma sampler: `SamplerConfig`, a frozen dataclass (hashable: a `jax.jit`
static argument), checked when built. `dgemma.settings` builds it from the `sample` group of a config.
"""

from __future__ import annotations

import dataclasses

from dgemma.diffusion import schedules
from dgemma.errors import ConfigError
from dgemma.sampling import rules

PAD_ID = 0
EOS_ID = 1
END_OF_TURN_ID = 106  # `<turn|>` in the Gemma 4 vocabulary only


CONTEXT_LEN = 262_144  # DiffusionGemma's context in positions (reference doc, architecture table)

SHOW_MODES = ("none", "live")
SEMANTICS = ("hf", "official")  # whose sampler the released rules follow (docs/model.md, "Two references")
BEGIN_OF_TOOL_RESPONSE_ID = 50  # an end token of the official sampler, Gemma 4 vocabulary only


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
    sampler: 'released' | 'ancestral' (uniform-state posterior sampling; module docstring) | 'pc'
      (predictor-corrector: ancestral predictor passes, each followed by pc_corrector_steps corrector
      passes at the new noise level (the last round's before its predictor to t = 0), within the same
      max_denoising_steps passes; rules._pc_alphas) |
      'masked' (MDLM, for mdlm-trained runs).
    pc_corrector_fraction: sampler='pc': the share of positions a corrector pass re-draws (the rest keep
      their token); 1 re-draws the whole canvas, smaller shares move towards the one-position Gibbs move
      that is exact (rules._pc_update). Drawn per position from the pass's re-noise draw, so the share is
      rounded to a multiple of 1 / vocab_size (at least one id).
    pc_corrector_steps: sampler='pc': corrector passes per predictor pass (>= 1; max_denoising_steps
      must be a multiple of 1 + this).
    acceptance: 'entropy_bound' | 'confidence' (positions whose top probability >= accept_confidence)
      | 'fixed_k' (the accept_k lowest-entropy positions). At least one open position is accepted.
    renoise: 'non_accepted' (released: every non-accepted position gets a fresh uniform token,
      accepted ones are re-predicted every step) | 'none' (non-accepted positions keep their
      token) | 'low_confidence' (an accepted token stays on the canvas on later steps, outside the
      acceptance budget, until the model's probability of it falls below renoise_confidence; then
      it is re-noised and its position is open again; open non-accepted positions get fresh tokens).
    top_k / top_p: logit shaping after the temperature (0 / 1.0 = off); the shaped logits are used
      for sampling, entropy, argmax, stopping and self-conditioning alike.
    alpha_schedule / schedule_eps / greedy_last_step: samplers 'ancestral', 'pc' and 'masked' (see `alpha`).
    mask_id: sampler='masked': the mask token (diffusion.mask_id of the mdlm training run).
    loo_logits: the model's output is the leave-one-out prior (a leave-one-out objective, set from
      diffusion.objective): samplers 'ancestral' / 'pc' read it as it is, and otherwise take the loo shift off
      a posterior output (dgemma/sampling/sampler.py docstring).
  Limits and display:
    max_context: positions the model may use: prompt + every canvas must fit (`check_request`).
    show: 'none' | 'live' (a host callback per denoising step, `dgemma.sampling.live`).
  Reference:
    semantics: 'hf' (Hugging Face transformers 5.24, the tested default) | 'official' (google-deepmind/gemma's
      JAX sampler): the decoder's sliding window is per query (q - p < W: canvas token i reads W - 1 - i
      context positions, not W - 1 for all), the committed canvas is the last sampled (re-noised) one, not
      the argmax canvas, the self-conditioning signal is carried as the bf16 soft embedding
      (softmax(logits) @ table * sqrt(D)) instead of the logits, a row stops when the argmax equals the
      step's input canvas and the mean entropy is <= confidence_threshold (one step, no counter), and
      `<begin_of_tool_response>` (50) also ends a response with the Gemma 4 vocabulary.
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
  pc_corrector_steps: int = 1
  pc_corrector_fraction: float = 1.0
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
  semantics: str = "hf"

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
    one_of("sampler", tuple(rules.KINDS))
    need(self.pc_corrector_steps >= 1, f"sample.pc_corrector_steps must be >= 1, got {self.pc_corrector_steps}")
    need(0.0 < self.pc_corrector_fraction <= 1.0,
         f"sample.pc_corrector_fraction must be in (0, 1], got {self.pc_corrector_fraction}")
    if self.sampler == "pc":
      need(self.max_denoising_steps % (1 + self.pc_corrector_steps) == 0,
           f"sample.sampler='pc': sample.max_denoising_steps={self.max_denoising_steps} must be a multiple of "
           f"1 + sample.pc_corrector_steps = {1 + self.pc_corrector_steps} (whole predictor-corrector rounds)")
    one_of("acceptance", tuple(rules.ACCEPTANCE))
    need(0.0 <= self.accept_confidence <= 1.0,
         f"sample.accept_confidence must be in [0, 1], got {self.accept_confidence}")
    need(self.accept_k >= 1, f"sample.accept_k must be >= 1, got {self.accept_k}")
    one_of("renoise", tuple(rules.RENOISE))
    need(0.0 <= self.renoise_confidence <= 1.0,
         f"sample.renoise_confidence must be in [0, 1], got {self.renoise_confidence}")
    need(self.top_k >= 0, f"sample.top_k must be >= 0 (0 = off), got {self.top_k}")
    need(0.0 < self.top_p <= 1.0, f"sample.top_p must be in (0, 1] (1 = off), got {self.top_p}")
    one_of("alpha_schedule", tuple(schedules.SCHEDULES))
    need(0.0 < self.schedule_eps < 1.0, f"sample.schedule_eps must be in (0, 1), got {self.schedule_eps}")
    need(self.mask_id >= 0, f"diffusion.mask_id must be a token id >= 0, got {self.mask_id}")
    need(self.max_context > self.canvas_len,
         f"sample.max_context must exceed diffusion.canvas_len={self.canvas_len}, got {self.max_context}")
    one_of("show", SHOW_MODES)
    one_of("semantics", SEMANTICS)
    if self.semantics == "official":
      need(self.sampler == "released", f"sample.semantics='official' is the released sampler's; got sample.sampler="
           f"{self.sampler!r}")
      need(self.top_k == 0 and self.top_p == 1.0, "sample.semantics='official': the official sampler shapes no "
           f"logits; set sample.top_k=0 and sample.top_p=1.0 (got {self.top_k}, {self.top_p})")
