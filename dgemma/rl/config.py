"""`config.rl` as typed settings, each key declared once (dgemma/settings_fields.py): reinforcement learning of the
diffusion model on its own samples (dgemma/rl/__init__.py). dgemma.settings builds it from an experiment config.

  RLSettings(algorithm="grpo", reward="exact_match", group_size=8)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dgemma import settings_fields
from dgemma.settings_fields import setting
from dgemma.rl import reward as reward_lib

ALGORITHMS = ("none", "grpo")
LOG_LIKELIHOODS = ("trajectory", "elbo")


@dataclasses.dataclass(frozen=True)
class RLSettings:
  """`config.rl`: GRPO on the sampler's own denoising trajectories (dgemma/rl/grpo.py)."""
  GROUP: ClassVar[str] = "rl"
  algorithm: str = setting("none", "'none' (supervised training) | 'grpo' (train.py trains the policy on rewards of "
                           "its own samples)", choices=ALGORITHMS)
  reward: str = setting("", "a record of dgemma.rl.reward: 'exact_match' | 'python' (rl.reward_fn) | a study's "
                        "(registered by a module of `imports`)", choices=lambda: ("",) + reward_lib.names())
  reward_fn: str = setting("", "reward 'python': 'module.path:function', called with the completion's text (and "
                           "prompt=, reference= when it takes them), returning a float")
  group_size: int = setting(8, "G: samples drawn per prompt (a group); advantages are normalised within it", lo=2)
  log_likelihood: str = setting("trajectory", "the policy's log-likelihood: 'trajectory' (exact: the sampler's "
                                "accepted draws at every step) | 'elbo' (the completion's diffusion ELBO)",
                                choices=LOG_LIKELIHOODS)
  steps_per_update: int = setting(0, "'trajectory': denoising steps scored per update, drawn at random and "
                                  "weighted S / K (0 = every step)", lo=0)
  elbo_samples: int = setting(4, "'elbo': diffusion times per completion (antithetic, the same for the policy, "
                              "the rollout policy and the reference)", lo=1)
  num_iterations: int = setting(1, "mu: optimizer updates on each batch of samples (the importance ratio and its "
                                "clipping act from the second)", lo=1)
  clip_eps: float = setting(0.2, "the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]", lo=0.0, hi=1.0,
                            lo_open=True, hi_open=True)
  clip_eps_high: float = setting(0.0, "the upper clip (0 = clip_eps; DAPO: 0.28)", lo=0.0)
  kl_weight: float = setting(0.04, "beta: weight of the KL divergence to the frozen reference (the run's start)",
                             lo=0.0)
  advantage_eps: float = setting(1e-6, "advantage = (r - group mean) / (group std + advantage_eps)", lo=0.0,
                                 lo_open=True)

  def __post_init__(self):
    settings_fields.check(self)
    if self.algorithm != "none":
      settings_fields.need(bool(self.reward), "rl.reward", f"rl.algorithm={self.algorithm!r} needs a reward: one of "
                  f"{reward_lib.names()}")
    settings_fields.need(self.reward != "python" or bool(self.reward_fn), "rl.reward_fn",
                "rl.reward='python' needs the function: 'module.path:function'")

  @property
  def enabled(self) -> bool:
    return self.algorithm != "none"

  @property
  def upper_clip(self) -> float:
    return self.clip_eps_high or self.clip_eps
