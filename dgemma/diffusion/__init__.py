"""The diffusion process in one place (as md4 keeps it): its settings (`config.DiffusionSettings`), noise schedules
shared by training and sampling (`schedules`), the forward corruption (`corruption`) and its Gaussian relaxation
(`relaxation`: Duo's curriculum), the objectives and likelihood integrands as records of one registry
(`objectives`), and the training loss on packed rows (`loss`), and consistency distillation into a few-step
student (`distill`).

  from dgemma.diffusion import diffusion_loss, objectives, schedules
  alpha, dalpha = schedules.alpha_and_derivative("linear", t)
  objectives.get("nelbo").loss(...)
"""

from dgemma.diffusion import config, corruption, distill, objectives, relaxation, schedules
from dgemma.diffusion.config import DiffusionSettings
from dgemma.diffusion.corruption import corrupt_rows, split_context_canvas
from dgemma.diffusion.loss import batch_totals, diffusion_loss, sum_sown_router_losses, target_mask

__all__ = ["config", "DiffusionSettings", "corruption", "distill", "objectives", "relaxation", "schedules",
           "corrupt_rows", "split_context_canvas", "batch_totals", "diffusion_loss", "sum_sown_router_losses", "target_mask"]
