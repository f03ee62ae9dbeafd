"""Test helpers shared by the model-level test files."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.model import ModelConfig, param_shapes


@functools.cache
def random_params(cfg: ModelConfig, seed: int = 0):
  """Random params from `param_shapes` (no init compile): norm / router / layer scales != 1 and a
  spread router, so tests cannot pass by accident on identity scales."""
  g = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      v = g.uniform(0.7, 1.3, s.shape)
    elif "router" in name:
      v = g.normal(0.0, 1.0, s.shape)
    else:
      v = g.normal(0.0, 0.15, s.shape)
    return jnp.asarray(v, s.dtype)

  return jax.tree_util.tree_map_with_path(fill, param_shapes(cfg))


def save_random_run(config, workdir):
  """A "trained" run without training: random params (no init program to compile) saved as step 1 of
  `workdir` beside the run's config.json. Returns (model_cfg, train state)."""
  from dgemma import checkpointing, config as config_lib, trainer
  model_cfg = config_lib.validate(config)
  params = random_params(model_cfg)
  state = trainer.TrainState(step=jnp.ones((), jnp.int32), params=params,
                             opt_state=trainer.make_optimizer(config.opt, 1).init(params))
  checkpointing.write_text_atomic(workdir / "config.json", config_lib.to_json(config))
  manager = checkpointing.make_manager(workdir, async_save=False)
  checkpointing.save(manager, 1, state, None)
  manager.wait_until_finished()
  manager.close()
  return model_cfg, state
