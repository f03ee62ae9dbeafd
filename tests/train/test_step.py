"""dgemma.train.step / evaluate: the validation pass scores every run on the same draws, whatever its training time
sampler or training seed."""

import functools

import jax
import optax

from dgemma import data, mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.diffusion import loss as diffusion_loss_lib
from dgemma.train import evaluate, state as state_lib, step as step_lib


@functools.lru_cache(maxsize=1)
def _initial_params(model_cfg, mesh, axis_rules):
  """The weights every _validation call scores: the model initialised from key 0 (the runs compared differ in
  their time samplers and seeds, not their architecture), made once."""
  state, _ = state_lib.create_train_state(model_cfg, mesh, axis_rules, optax.sgd(0.0), jax.random.PRNGKey(0))
  return state.params


def _validation(config, *, seed=0, eval_seed=0, train_times=False, **diffusion_overrides):
  """Validation metrics of one set of weights (always initialised from key 0) under `config` with the overrides,
  as the loop computes them: the eval step on the first two batches of eval.split with `validation_rng`.
  train_times: the same with the training step's loss (its time sampler) instead of the eval step."""
  config = config.copy_and_resolve_references()
  config.seed, config.eval.seed = seed, eval_seed
  for key, value in diffusion_overrides.items():
    setattr(config.diffusion, key, value)
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  params = _initial_params(settings.model, mesh, settings.mesh.axis_rules)
  if train_times:
    eval_step = jax.jit(lambda p, b, r: diffusion_loss_lib.diffusion_loss(
        p, b, r, model_cfg=settings.model, loss_cfg=settings.diffusion, eval_metrics=True)[1])
  else:
    eval_step = jax.jit(step_lib.make_eval_step(settings.model, settings.diffusion))
  batches = data.make_iterator(settings, data.prepare(settings), settings.eval.split)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return evaluate.validation_metrics(eval_step, params, batches, 2, sharding,
                                     evaluate.validation_rng(settings))


def test_validation_draws_uniform_times_from_the_eval_seed(tiny_config):
  # The same weights and batches: the validation pass of a run that trains with another time sampler (90% of
  # the times in [0.4, 0.5], the rest t = u^3) and another training seed must be the very same computation as
  # the uniform seed-0 run's (same times, same noise), so every metric agrees exactly.
  sampler = dict(t_mixture=(0.9, 0.4, 0.5), t_power=3.0)
  plain = _validation(tiny_config)
  other = _validation(tiny_config, seed=1, **sampler)
  assert plain.keys() == other.keys() and "canvas_nelbo" in plain
  for name in plain:
    assert other[name] == plain[name], (name, other[name], plain[name])
  # ... and the comparison has power: the training sampler's times, or another eval seed, move the draws (the
  # corrupted fraction is a mean over 128 canvas tokens: any other draw of t or z_t changes it)
  assert _validation(tiny_config, train_times=True, **sampler)["corrupted_fraction"] != plain["corrupted_fraction"]
  assert _validation(tiny_config, eval_seed=1)["corrupted_fraction"] != plain["corrupted_fraction"]
