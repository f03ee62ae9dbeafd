"""Static settings of the DiffusionGemma sampler: `SamplerConfig`, a frozen dataclass (hashable: a `jax.jit`
static argument) whose keys are declared once (dgemma/fields.py) and checked when built. `dgemma.settings` builds
it from the `sample` group of a config.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dgemma import fields
from dgemma.diffusion import schedules
from dgemma.fields import setting
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
  """Static sampler settings (hashable: a `jax.jit` static argument), checked when built. The declared fields are
  keys of the config's `sample` group (their docs: `python -m dgemma.settings`); the released sampler is their
  defaults (HF 5.24). canvas_len, end_ids, pad_id, mask_id and loo_logits are derived by dgemma.settings from the
  diffusion and data settings (`sample.end_ids`, () = the tokenizer's end tokens, is resolved there).

  The 'official' semantics (google-deepmind/gemma's JAX sampler, docs/model.md "Two references"): the decoder's
  sliding window is per query (canvas token i reads W - 1 - i context positions, not W - 1 for all), the committed
  canvas is the last sampled (re-noised) one, not the argmax canvas, the self-conditioning signal is carried as
  the bf16 soft embedding instead of the logits, a row stops when the argmax equals the step's input canvas and
  the mean entropy is <= confidence_threshold (one step, no counter), and `<begin_of_tool_response>` (50) also
  ends a response with the Gemma 4 vocabulary.
  """
  GROUP: ClassVar[str] = "sample"
  canvas_len: int = 256  # derived: diffusion.canvas_len
  max_denoising_steps: int = setting(48, "decoder passes per canvas at most", lo=1)
  entropy_bound: float = setting(0.1, "accept the lowest-entropy tokens while cumsum(H) - H_i <= this (nats)",
                                 lo=0.0, lo_open=True)
  t_max: float = setting(0.8, "temperature at the first step ...", lo=0.0, lo_open=True)
  t_min: float = setting(0.4, "... falling linearly towards t_min", lo=0.0)
  stability_threshold: int = setting(1, "stop: the argmax canvas unchanged this many steps ...", lo=0)
  confidence_threshold: float = setting(0.005, "... and mean entropy below this (0 = never stop early)", lo=0.0)
  end_ids: tuple[int, ...] = (EOS_ID, END_OF_TURN_ID)  # derived: sample.end_ids, or the tokenizer's end tokens
  pad_id: int = PAD_ID  # derived: fills a row after its end token
  early_exit: bool = setting(True, "lax.while_loop exits when every row is done (else lax.scan over every step)")
  self_conditioning: bool = setting(True, "feed the previous step's logits back (False = a zero signal)")
  sampler: str = setting("released", "'released' | 'ancestral' (uniform-state posterior q(z_s | z_t, x_theta) from "
                         "t=1 to 0) | 'pc' (predictor-corrector) | 'masked' (MDLM reveal sampling; for mdlm runs)",
                         choices=lambda: tuple(rules.KINDS))
  pc_corrector_steps: int = setting(1, "sampler='pc': corrector passes per predictor pass (max_denoising_steps "
                                    "must be a multiple of 1 + this)", lo=1)
  pc_corrector_fraction: float = setting(1.0, "sampler='pc': the share of positions a corrector pass re-draws",
                                         lo=0.0, hi=1.0, lo_open=True)
  acceptance: str = setting("entropy_bound", "'entropy_bound' | 'confidence' (top probability >= "
                            "accept_confidence) | 'fixed_k' (the accept_k lowest-entropy positions)",
                            choices=lambda: tuple(rules.ACCEPTANCE))
  accept_confidence: float = setting(0.9, "acceptance='confidence': top probability >= this", lo=0.0, hi=1.0)
  accept_k: int = setting(1, "acceptance='fixed_k': tokens accepted per step", lo=1)
  renoise: str = setting("non_accepted", "'non_accepted' (released: fresh tokens everywhere else) | 'none' "
                         "(non-accepted keep their token) | 'low_confidence' (accepted tokens stay until p(token) "
                         "< renoise_confidence)", choices=lambda: tuple(rules.RENOISE))
  renoise_confidence: float = setting(0.1, "renoise='low_confidence': re-noise a held token below this", lo=0.0,
                                      hi=1.0)
  top_k: int = setting(0, "logit shaping after the temperature (0 = off)", lo=0)
  top_p: float = setting(1.0, "nucleus shaping (1.0 = off)", lo=0.0, hi=1.0, lo_open=True)
  alpha_schedule: str = setting("linear", "samplers 'ancestral' / 'pc' / 'masked': a schedule of "
                                "dgemma/diffusion/schedules.py", choices=lambda: tuple(schedules.SCHEDULES))
  schedule_eps: float = setting(1e-3, "eps of the 'loglinear' schedule (alpha(1) = eps)", lo=0.0, hi=1.0,
                                lo_open=True, hi_open=True)
  greedy_last_step: bool = setting(True, "'ancestral' / 'pc': the last step takes argmax(x_theta)")
  mask_id: int = 4  # derived: diffusion.mask_id (sampler='masked')
  loo_logits: bool = False  # derived: the objective outputs leave-one-out logits (dgemma/sampling/sampler.py)
  max_context: int = setting(0, "positions the model may use: prompt + ceil(max_new_tokens / canvas_len) * "
                             "canvas_len <= this; 0 = 262,144 (DiffusionGemma)", lo=1, zero_means=CONTEXT_LEN)
  show: str = setting("none", "'none' | 'live': redraw the canvases in the terminal every step",
                      choices=SHOW_MODES)
  semantics: str = setting("hf", "whose released sampler: 'hf' (transformers 5.24, the tested default) | "
                           "'official' (google-deepmind/gemma's JAX sampler; class docstring)", choices=SEMANTICS)

  def __post_init__(self):
    object.__setattr__(self, "end_ids", tuple(int(i) for i in self.end_ids))
    self.validate()

  def validate(self) -> None:
    fields.check(self)
    need = fields.need
    need(self.canvas_len > 0, "diffusion.canvas_len", f"must be positive, got {self.canvas_len}")
    need(self.t_min <= self.t_max, "sample.t_min", f"must be <= sample.t_max (got t_min={self.t_min}, "
         f"t_max={self.t_max})")
    need(all(i >= 0 for i in self.end_ids), "sample.end_ids", f"must be token ids >= 0, got {self.end_ids}")
    need(self.pad_id not in self.end_ids, "sample.end_ids", f"must not contain the pad id {self.pad_id}")
    if self.sampler == "pc":
      need(self.max_denoising_steps % (1 + self.pc_corrector_steps) == 0, "sample.max_denoising_steps",
           f"{self.max_denoising_steps} with sample.sampler='pc' must be a multiple of 1 + sample.pc_corrector_steps"
           f" = {1 + self.pc_corrector_steps} (whole predictor-corrector rounds)")
    need(self.mask_id >= 0, "diffusion.mask_id", f"must be a token id >= 0, got {self.mask_id}")
    need(self.max_context > self.canvas_len, "sample.max_context",
         f"must exceed diffusion.canvas_len={self.canvas_len}, got {self.max_context}")
    if self.semantics == "official":
      need(self.sampler == "released", "sample.semantics", f"'official' is the released sampler's; got "
           f"sample.sampler={self.sampler!r}")
      need(self.top_k == 0 and self.top_p == 1.0, "sample.semantics", "'official': the official sampler shapes no "
           f"logits; set sample.top_k=0 and sample.top_p=1.0 (got {self.top_k}, {self.top_p})")
