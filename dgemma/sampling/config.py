"""The `sample` group, declared once (dgemma/settings_fields.py), and the sampler as a compiled program sees it.

  SampleSettings    every key of `config.sample`: the request (prompt, rows, length, seed, checkpoint step, outputs),
                    the sampler's keys (`SamplerSettings`, laid into the group: `sample.t_max` is
                    `settings.sample.t_max`) and weight quantization at load (`sample.quantize`, ...: `.quant` is the
                    `dgemma.quant.QuantConfig` they describe)
  SamplerConfig     a runtime record, not settings: the sampler's keys plus the values derived from the other groups
                    (canvas_len, end_ids, pad_id, mask_id, loo_logits). Hashable: a `jax.jit` static argument, so
                    only what a compiled program depends on is in it (the request is not). `dgemma.settings` builds
                    it (`Settings.canvas_sampler`); tests and benchmarks build one directly:
                    `SamplerConfig(canvas_len=16, max_denoising_steps=8, sampler="ancestral")`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dgemma import quant, settings_fields
from dgemma.diffusion import schedules
from dgemma.sampling import rules
from dgemma.settings_fields import group, setting

PAD_ID = 0
EOS_ID = 1
END_OF_TURN_ID = 106  # `<turn|>` in the Gemma 4 vocabulary only


CONTEXT_LEN = 262_144  # DiffusionGemma's context in positions (reference doc, architecture table)

SHOW_MODES = ("none", "live")
WEIGHT_LAYOUTS = ("default", "auto")  # sample.weight_layouts
SEMANTICS = ("hf", "official")  # whose sampler the released rules follow (docs/model.md, "Two references")
BEGIN_OF_TOOL_RESPONSE_ID = 50  # an end token of the official sampler, Gemma 4 vocabulary only


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """The sampler's keys of the `sample` group; their defaults are the released sampler (HF 5.24).

  The 'official' semantics (google-deepmind/gemma's JAX sampler, docs/model.md "Two references"): the decoder's
  sliding window is per query (canvas token i reads W - 1 - i context positions, not W - 1 for all), the committed
  canvas is the last sampled (re-noised) one, not the argmax canvas, the self-conditioning signal is carried as
  the bf16 soft embedding instead of the logits, a row stops when the argmax equals the step's input canvas and
  the mean entropy is <= confidence_threshold (one step, no counter), and `<begin_of_tool_response>` (50) also
  ends a response with the Gemma 4 vocabulary.
  """
  GROUP: ClassVar[str] = "sample"
  max_denoising_steps: int = setting(48, "decoder passes per canvas at most", lo=1)
  entropy_bound: float = setting(0.1, "accept the lowest-entropy tokens while cumsum(H) - H_i <= this (nats)",
                                 lo=0.0, lo_open=True)
  t_max: float = setting(0.8, "temperature at the first step ...", lo=0.0, lo_open=True)
  t_min: float = setting(0.4, "... falling linearly towards t_min", lo=0.0)
  stability_threshold: int = setting(1, "stop: the argmax canvas unchanged this many steps ...", lo=0)
  confidence_threshold: float = setting(0.005, "... and mean entropy below this (0 = never stop early)", lo=0.0)
  sampler: str = setting("released", "'released' | 'ancestral' (uniform-state posterior q(z_s | z_t, x_theta) from "
                         "t=1 to 0) | 'pc' (predictor-corrector) | 'masked' (MDLM reveal sampling; for mdlm runs)",
                         choices=lambda: tuple(rules.KINDS))
  early_exit: bool = setting(True, "lax.while_loop exits when every row is done (else lax.scan over every step)")
  self_conditioning: bool = setting(True, "feed the previous step's logits back (False = a zero signal)")
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
  prompt_chunk: int = setting(0, "encode the prompt this many tokens at a time, each chunk reading the cache the ones "
                              "before wrote (the same attention; the prompt encode's activations and attention "
                              "scores for one chunk, not the whole prompt); 0 = the whole prompt at once", lo=0)
  max_context: int = setting(0, "positions the model may use: prompt + ceil(max_new_tokens / canvas_len) * "
                             "canvas_len <= this; 0 = 262,144 (DiffusionGemma)", lo=1, zero_means=CONTEXT_LEN)
  show: str = setting("none", "'none' | 'live': redraw the canvases in the terminal every step",
                      choices=SHOW_MODES)
  semantics: str = setting("hf", "whose released sampler: 'hf' (transformers 5.24, the tested default) | "
                           "'official' (google-deepmind/gemma's JAX sampler; class docstring)", choices=SEMANTICS)

  def __post_init__(self):
    settings_fields.check(self)
    need = settings_fields.need
    need(self.t_min <= self.t_max, "sample.t_min", f"must be <= sample.t_max (got t_min={self.t_min}, "
         f"t_max={self.t_max})")
    if self.sampler == "pc":
      need(self.max_denoising_steps % (1 + self.pc_corrector_steps) == 0, "sample.max_denoising_steps",
           f"{self.max_denoising_steps} with sample.sampler='pc' must be a multiple of 1 + sample.pc_corrector_steps"
           f" = {1 + self.pc_corrector_steps} (whole predictor-corrector rounds)")
    if self.semantics == "official":
      need(self.sampler == "released", "sample.semantics", f"'official' is the released sampler's; got "
           f"sample.sampler={self.sampler!r}")
      need(self.top_k == 0 and self.top_p == 1.0, "sample.semantics", "'official': the official sampler shapes no "
           f"logits; set sample.top_k=0 and sample.top_p=1.0 (got {self.top_k}, {self.top_p})")


@dataclasses.dataclass(frozen=True)
class SampleSettings:
  """`config.sample`: one generation request, the sampler's keys (`SamplerSettings`, read as attributes of this
  group) and weight-only quantization at load (`quant`)."""
  GROUP: ClassVar[str] = "sample"
  prompt: str = setting("", "text after BOS; with max_new_tokens it must fit max_context")
  num_samples: int = setting(1, "rows generated from the prompt", lo=1)
  max_new_tokens: int = setting(256, "response length cap, generated canvas by canvas", lo=1)
  seed: int = setting(0, "sampling seed (row b draws from fold_in(key(seed), b))")
  checkpoint_step: int = setting(-1, "a run's checkpoint step to sample (-1 = the latest)", lo=-1)
  trajectory_html: str = setting("", "write one denoising trajectory as HTML here")
  infill: tuple = setting((), "((response position, token id), ...) held fixed in every row", items="pair")
  end_ids: tuple = setting((), "tokens that end a response; () = auto: EOS (1), plus <turn|> (106) for a "
                           "tokenizer file (the ids in use: `Settings.end_ids`)", items=int)
  quantize: str = setting("none", "weight-only quantization at load: 'none' | 'int8' (one scale per output channel) "
                          "| 'int4' (one scale per group of quant_group_size inputs) | 'int4_experts' (experts int4, "
                          "everything else int8)", choices=quant.SCHEMES)
  quant_group_size: int = setting(64, "int4 group along the contracted axis (0 = per output channel); must divide "
                                  "it", lo=0)
  quantize_embedding: bool = setting(True, "also quantize the tied embedding / output table (per-row scales)")
  weight_layouts: str = setting("default", "the weights' memory layouts on the device: 'default' | 'auto' (those the "
                                "generate program picks, chosen at load by compiling it for one row: on a TPU its "
                                "compiler otherwise copies every stacked int4 weight into another layout inside "
                                "each program; docs/finetuning.md)", choices=WEIGHT_LAYOUTS)
  sampler_settings: SamplerSettings = group(SamplerSettings, "the sampler", flatten=True)

  def __post_init__(self):
    settings_fields.check(self)
    for pos, token in self.infill:
      settings_fields.need(pos >= 0 and token >= 0, "sample.infill",
                           f"positions and token ids are >= 0, got {(pos, token)}")
      settings_fields.need(pos < self.max_new_tokens, "sample.infill",
                           f"position {pos} is outside the response [0, sample.max_new_tokens={self.max_new_tokens})")

  def __getattr__(self, name: str):
    """The sampler's keys read as keys of this group (`settings.sample.t_max`)."""
    if name.startswith("__") or name == "sampler_settings":
      raise AttributeError(name)
    return getattr(self.sampler_settings, name)

  @property
  def quant(self) -> quant.QuantConfig:
    """The quantization sample.quantize / quant_group_size / quantize_embedding describe."""
    return quant.QuantConfig(self.quantize, self.quant_group_size, self.quantize_embedding,
                             group_field="sample.quant_group_size")


_DERIVED = ("canvas_len", "end_ids", "pad_id", "mask_id", "loo_logits")


@dataclasses.dataclass(frozen=True, init=False)
class SamplerConfig:
  """The sampler's keys (`settings`) and the values derived from the other groups: canvas_len (diffusion.canvas_len),
  end_ids (`Settings.end_ids`), pad_id (fills a row after its end token), mask_id (diffusion.mask_id, for
  sampler='masked') and loo_logits (the objective outputs leave-one-out logits, dgemma/sampling/sampler.py).
  A key reads as an attribute (`cfg.t_max`). Built from keyword arguments: the derived values and any sampler key
  (`SamplerConfig(canvas_len=16, sampler='ancestral')`), or `settings=` a SamplerSettings; checked when built."""
  settings: SamplerSettings
  canvas_len: int
  end_ids: tuple[int, ...]
  pad_id: int
  mask_id: int
  loo_logits: bool

  def __init__(self, settings: SamplerSettings | None = None, *, canvas_len: int = 256,
               end_ids=(EOS_ID, END_OF_TURN_ID), pad_id: int = PAD_ID, mask_id: int = 4, loo_logits: bool = False,
               **keys):
    settings = settings if settings is not None else SamplerSettings()
    if keys:  # dataclasses.replace passes every field; keys land on the settings
      settings = dataclasses.replace(settings, **keys)
    values = dict(settings=settings, canvas_len=canvas_len, end_ids=tuple(int(i) for i in end_ids), pad_id=pad_id,
                  mask_id=mask_id, loo_logits=bool(loo_logits))
    for name, value in values.items():
      object.__setattr__(self, name, value)
    need = settings_fields.need
    need(self.canvas_len > 0, "diffusion.canvas_len", f"must be positive, got {self.canvas_len}")
    need(all(i >= 0 for i in self.end_ids), "sample.end_ids", f"must be token ids >= 0, got {self.end_ids}")
    need(self.pad_id not in self.end_ids, "sample.end_ids", f"must not contain the pad id {self.pad_id}")
    need(self.mask_id >= 0, "diffusion.mask_id", f"must be a token id >= 0, got {self.mask_id}")
    need(settings.max_context > self.canvas_len, "sample.max_context",
         f"must exceed diffusion.canvas_len={self.canvas_len}, got {settings.max_context}")

  def __getattr__(self, name: str):
    if name.startswith("__") or name in ("settings",) + _DERIVED:
      raise AttributeError(name)
    return getattr(self.settings, name)
