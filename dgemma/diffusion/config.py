"""`config.diffusion` as typed settings: the corruption and the training objective that dgemma.diffusion.loss
reads. dgemma.settings builds and checks it from an experiment config; code that has no config (a benchmark on a
machine without ml_collections, a test) builds it directly.

  DiffusionSettings(canvas_len=256, objective="loo_ce")
"""

from __future__ import annotations

import dataclasses

from dgemma.diffusion import objectives


@dataclasses.dataclass(frozen=True)
class DiffusionSettings:
  """`config.diffusion`: the corruption and the training objective (dgemma.diffusion.loss reads it)."""
  canvas_len: int
  t_eps: float = 1e-4
  encoder_loss_weight: float = 1.0
  self_cond_prob: float = 0.5
  objective: str = "base_ce"
  schedule: str = "linear"
  schedule_eps: float = 1e-3
  reweight_cap: float = 10.0
  mask_id: int = 4
  antithetic_t: bool = False
  t_power: float = 1.0
  t_mixture: tuple[float, ...] = ()
  canvases_per_row: int = 1
  short_canvas_len: int = 0
  short_canvases_per_row: int = 0
  short_canvas_weight: float = 0.5
  curriculum_steps: int = 0
  curriculum_tau_start: float = 1e-3
  curriculum_tau_end: float = 1e-3
  curriculum_alpha_range: tuple[float, ...] = ()

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
