"""The jitted train step, its fresh state and one training batch of a config: what bench/train_throughput.py and
bench/train_ab.py time. (A module of its own, without flags: both scripts define --config.)"""

import jax

from dgemma import data, mesh as mesh_lib
from dgemma.train import optimizer as optimizer_lib, state as state_lib, step as step_lib


def train_step_inputs(settings):
  """(step, state, batch, rng): `step(state, batch, rng) -> (state, metrics)` jitted with the state donated
  (not yet compiled), the state initialised from PRNGKey(0), the config's first training batch on device."""
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps, model_cfg=settings.model)
  step = jax.jit(step_lib.make_train_step(settings.model, settings.diffusion, optimizer,
                                          optimizer_lib.make_schedule(settings.opt, 10)), donate_argnums=(0,))
  batch = jax.device_put(next(data.make_iterator(settings, data.prepare(settings), "train")))
  state, _ = state_lib.create_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer,
                                          jax.random.PRNGKey(0))
  return step, state, batch, jax.random.PRNGKey(1)
