"""`config.diffusion` as typed settings, each key declared once (dgemma/settings_fields.py): the corruption and the
training objective that dgemma.diffusion.loss reads. dgemma.settings builds it from an experiment config; code
that has no config (a benchmark, a test) builds it directly, checked the same way.

  DiffusionSettings(canvas_len=256, objective="loo_ce")
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dgemma import settings_fields
from dgemma.diffusion import objectives, schedules
from dgemma.settings_fields import setting


@dataclasses.dataclass(frozen=True)
class DiffusionSettings:
  """`config.diffusion`: the corruption and the training objective (dgemma.diffusion.loss reads it)."""
  GROUP: ClassVar[str] = "diffusion"
  canvas_len: int = setting(256, "tokens denoised in parallel (the block length)", lo=1)
  t_eps: float = setting(1e-4, "t ~ U(t_eps, 1)", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
  encoder_loss_weight: float = setting(1.0, "next-token CE on the encoder's causal logits (0 = off)", lo=0.0)
  self_cond_prob: float = setting(0.5, "two-pass self-conditioning training: P(second pass sees pass-1 logits)",
                                  lo=0.0, hi=1.0)
  objective: str = setting("base_ce", "the canvas objective, a record of dgemma/diffusion/objectives.py (released: "
                           "base_ce, plain CE at every canvas position; 'ar' trains the causal baseline)",
                           choices=lambda: tuple(objectives.OBJECTIVES))
  schedule: str = setting("linear", "alpha(t) of dgemma/diffusion/schedules.py: 'linear' 1 - t (released) | "
                          "'cosine' | 'loglinear' 1 - (1 - schedule_eps) t", choices=lambda: tuple(schedules.SCHEDULES))
  schedule_eps: float = setting(1e-3, "'loglinear': alpha(1) = schedule_eps", lo=0.0, hi=1.0, lo_open=True,
                                hi_open=True)
  reweight_cap: float = setting(10.0, "reweighted_*: cap on the time weight (reached at t = 1 - 1/cap)", lo=1.0)
  mask_id: int = setting(4, "objective='mdlm': the mask token (Gemma MASK = 4); must be unused", lo=0)
  antithetic_t: bool = setting(False, "t_b = eps + (1-eps) frac(u + b/B): low-variance t (NELBO eval)")
  t_power: float = setting(1.0, "training times t = eps + (1 - eps) u^t_power (1 = uniform; 2, 3: more low-noise "
                           "examples; the train-time canvas_nelbo is importance-weighted back to uniform t)",
                           lo=0.0, hi=10.0, lo_open=True)
  t_mixture: tuple = setting((), "(weight, t_lo, t_hi): each example's t is instead U(t_lo, t_hi) with probability "
                             "weight (0 < weight < 1); () = off", items=float)
  canvases_per_row: int = setting(1, "K: the row's last K * canvas_len tokens are K canvases denoised in one "
                                  "block-causal decoder pass (1 = a single canvas)", lo=1)
  short_canvas_len: int = setting(0, "short canvases (training only, dgemma/diffusion/loss.py): a second decoder "
                                  "pass on the same cache denoises A canvases of this length (0 = off)", lo=0)
  short_canvases_per_row: int = setting(0, "A (0 = as many as the K canvases' tokens cover)", lo=0)
  short_canvas_weight: float = setting(0.5, "loss = (1 - w) * the configured canvases' + w * the short ones'",
                                       lo=0.0, hi=1.0)
  curriculum_steps: int = setting(0, "Duo's curriculum (dgemma/diffusion/relaxation.py): for the first this many "
                                  "steps the decoder reads softmax(w / tau) of a Gaussian latent (0 = off)", lo=0)
  curriculum_tau_start: float = setting(1e-3, "the curriculum's tau at its start (geometric to tau_end)", lo=0.0,
                                        lo_open=True)
  curriculum_tau_end: float = setting(1e-3, "the curriculum's tau at its end", lo=0.0, lo_open=True)
  curriculum_alpha_range: tuple = setting((), "(alpha_lo, alpha_hi): the curriculum's times log-SNR uniform between "
                                          "those levels (Duo on GPT-2: about (0.04, 0.93)); () = alpha(t)",
                                          items=float)

  def __post_init__(self):
    settings_fields.check(self)
    ar = self.objective_record.autoregressive
    settings_fields.need(self.canvases_per_row == 1 or not ar, "diffusion.canvases_per_row",
                f"objective 'ar' has no canvases; use 1, got {self.canvases_per_row}")
    settings_fields.need(not self.short_canvas_len or not ar, "diffusion.short_canvas_len",
                f"objective 'ar' has no canvases; use 0, got {self.short_canvas_len}")
    mixture = self.t_mixture
    settings_fields.need(not mixture or (len(mixture) == 3 and 0.0 < mixture[0] < 1.0
                                and self.t_eps <= mixture[1] < mixture[2] <= 1.0), "diffusion.t_mixture",
                f"need () or (weight, t_lo, t_hi) with 0 < weight < 1 and diffusion.t_eps={self.t_eps} <= t_lo < "
                f"t_hi <= 1, got {mixture}")
    window = self.curriculum_alpha_range
    settings_fields.need(not window or (len(window) == 2 and 0.0 <= window[0] < window[1] < 1.0),
                "diffusion.curriculum_alpha_range",
                f"need () or (alpha_lo, alpha_hi) with 0 <= alpha_lo < alpha_hi < 1, got {window}")
    settings_fields.need(self.curriculum_steps == 0 or self.objective_record.corruption == objectives.UNIFORM,
                "diffusion.curriculum_steps", f"the Gaussian-relaxation curriculum is for uniform-state objectives; "
                f"objective {self.objective!r} corrupts with {self.objective_record.corruption!r} (use 0)")

  def check_row(self, seq_len: int) -> None:
    """The canvases fit a row of `seq_len` tokens with context before them (data.seq_len)."""
    settings_fields.need(self.canvas_len < seq_len, "diffusion.canvas_len",
                f"canvas of {self.canvas_len} tokens does not fit in data.seq_len={seq_len} "
                "(the sequence is context + canvas; the canvas must be shorter)")
    K = self.canvases_per_row
    settings_fields.need(K * self.canvas_len <= seq_len, "diffusion.canvases_per_row",
                f"{K} canvases of diffusion.canvas_len={self.canvas_len} do not fit in data.seq_len={seq_len}")
    if self.short_canvas_len:
      A = self.num_short_canvases
      settings_fields.need(A * self.short_canvas_len < seq_len, "diffusion.short_canvases_per_row",
                  f"{A} short canvases of diffusion.short_canvas_len={self.short_canvas_len} leave no context in "
                  f"data.seq_len={seq_len} (0 = as many as diffusion.canvases_per_row * canvas_len tokens cover)")

  @property
  def num_short_canvases(self) -> int:
    """A, the short canvases per row (dgemma/diffusion/loss.py docstring): 0 without them; short_canvases_per_row,
    or when that is 0 as many as the configured canvases' tokens cover."""
    if not self.short_canvas_len:
      return 0
    return self.short_canvases_per_row or max(1, self.canvases_per_row * self.canvas_len // self.short_canvas_len)

  def encoder_len(self, seq_len: int) -> int:
    """Tokens of a `seq_len` row the training encoder reads: the row up to the start of the last canvas of the
    shortest kind trained (the configured canvases, or the short ones when shorter)."""
    return seq_len - min(self.canvas_len, self.short_canvas_len or self.canvas_len)

  @property
  def objective_record(self) -> objectives.Objective:
    return objectives.get(self.objective)
