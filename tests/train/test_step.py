"""dgemma.train.step / evaluate: the validation pass scores every run on the same draws, whatever its training time
sampler or training seed."""

import jax

from dgemma import data, mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.diffusion import loss as diffusion_loss_lib
from dgemma.train import evaluate, loop
from tests.model_utils import random_params
from tests.train.test_loop import _quick


def _validation(config, *, seed=0, eval_seed=0, train_times=False, **diffusion_overrides):
  """Validation metrics of one set of weights under `config` with the overrides, as the loop computes them: the
  loop's eval step (loop.run_programs, in its mesh context) on the first two batches of eval.split with
  `validation_rng`. The weights are random_params of the model (no init program: the runs compared differ in their
  time samplers and seeds, not their architecture); the model is _quick's (tests/train/test_loop.py), whose eval
  step the loop tests compile. train_times: the same with the training step's loss (its time sampler) instead."""
  config = _quick(config.copy_and_resolve_references())
  config.seed, config.eval.seed = seed, eval_seed
  for key, value in diffusion_overrides.items():
    setattr(config.diffusion, key, value)
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  params = random_params(settings.model)
  batches = data.make_iterator(settings, data.prepare(settings), settings.eval.split)
  with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
    if train_times:
      eval_step = jax.jit(lambda p, b, r: diffusion_loss_lib.diffusion_loss(
          p, b, r, model_cfg=settings.model, loss_cfg=settings.diffusion, eval_metrics=True)[1])
    else:
      eval_step = loop.run_programs(settings, mesh).eval_step
    return evaluate.validation_metrics(eval_step, params, batches, 2,
                                       mesh_lib.batch_sharding(mesh, settings.mesh.axis_rules),
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
