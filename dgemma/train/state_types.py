"""The train state's pytree types, apart from dgemma.train.state (which builds, places and restores them and so
imports the settings, checkpoint and data stack): dgemma.train.step and a benchmark on a bare accelerator image
need only these.

  TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
"""

from __future__ import annotations

from typing import Any

import flax
import jax


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@flax.struct.dataclass
class DistillState(TrainState):
  """The state of a consistency-distillation run (distill.method='dcd', dgemma/diffusion/distill.py): the
  student's TrainState plus the frozen teacher of the current round, checkpointed with it so that a resumed
  run distils from exactly the teacher it had."""
  teacher_params: Any


@flax.struct.dataclass
class RLState(TrainState):
  """The state of a reinforcement-learning run (rl.algorithm, dgemma/rl/grpo.py): the policy's TrainState plus the
  frozen reference its KL term is measured against, the trained leaves at the run's start
  (`dgemma.finetune.trained_leaves`: the adapters of a LoRA / QLoRA run, every weight of a full one), checkpointed
  with it so that a resumed run keeps its reference."""
  ref_params: Any
