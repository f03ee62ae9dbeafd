"""dgemma/checkpoints/layout.py: stacked (model.scan_layers=True) <-> unrolled parameter trees, and
train.init_from across the two layouts. (That the relaid params give the same logits is
tests/model/test_transformer.py::test_scan_matches_unscanned, which builds its unrolled tree with
`layout.relayout`.)"""

import dataclasses

import chex
import jax
import numpy as np
import optax
import pytest

from configs.models import tiny
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import layout, workdir as workdir_ckpt
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, param_shapes
from dgemma.train import optimizer as optimizer_lib, state as state_lib
from tests.model_utils import random_params

STACKED = ModelConfig.from_config_dict(tiny.get_config())   # 4 layers: 2 blocks of (sliding, global)
UNROLLED = dataclasses.replace(STACKED, scan_layers=False)  # 1 block of 4 layers


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def test_layer_l_moves_to_its_own_slot_and_back_exactly():
  assert (STACKED.block_period, STACKED.num_blocks, UNROLLED.block_period, UNROLLED.num_blocks) == (2, 2, 4, 1)
  stacked = _host(random_params(STACKED))
  unrolled = layout.relayout(stacked, STACKED, UNROLLED)
  chex.assert_trees_all_equal_shapes(unrolled, param_shapes(UNROLLED))
  # model layer l = row l // 2 of the stacked layer_{l % 2}; in the unrolled tree, row 0 of layer_l
  for l in range(4):
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], unrolled["blocks"][f"layer_{l}"]),
                                jax.tree.map(lambda x, l=l: x[l // 2], stacked["blocks"][f"layer_{l % 2}"]))
  for name in set(stacked) - {"blocks"}:  # everything outside the blocks is untouched
    chex.assert_trees_all_equal(unrolled[name], stacked[name])
  chex.assert_trees_all_equal(layout.relayout(unrolled, UNROLLED, STACKED), stacked)
  assert layout.relayout(stacked, STACKED, STACKED) is stacked


def test_adam_state_relays_like_the_params():
  # mu / nu mirror the params inside optax's named tuples; the count stays a scalar
  params = _host(random_params(STACKED))
  optimizer = optax.adamw(1e-3)
  state = optimizer.init(params)
  adam = state[0]._replace(mu=params, nu=jax.tree.map(lambda x: x * x, params))
  state = (adam,) + tuple(state[1:])
  relaid = layout.relayout(state, STACKED, UNROLLED)
  unrolled_params = layout.relayout(params, STACKED, UNROLLED)
  assert jax.tree.structure(relaid) == jax.tree.structure(optimizer.init(unrolled_params))
  chex.assert_trees_all_equal(relaid[0].mu, unrolled_params)
  chex.assert_trees_all_equal(relaid[0].nu, jax.tree.map(lambda x: x * x, unrolled_params))
  assert int(relaid[0].count) == 0


def test_only_the_layout_may_differ_and_a_wrong_tree_is_named():
  params = _host(random_params(STACKED))
  with pytest.raises(ConfigError, match="d_model"):
    layout.relayout(params, STACKED, dataclasses.replace(UNROLLED, d_model=STACKED.d_model * 2))
  with pytest.raises(ConfigError, match=r"model.scan_layers: the tree's blocks hold \['layer_0', 'layer_1'\]"):
    layout.relayout(params, UNROLLED, STACKED)  # a stacked tree described as unrolled


def test_init_from_a_stacked_run_starts_an_unrolled_one_at_its_params(tiny_run):
  # train.init_from across the layouts: the check lets scan_layers differ (and nothing else), and the
  # step-0 state holds the checkpoint's params relaid, with a fresh optimizer state
  workdir, config = tiny_run
  config = config.copy_and_resolve_references()
  config.model.scan_layers = False
  settings = settings_lib.from_config(config)
  saved = ModelConfig.from_config_dict(settings_lib.from_json(workdir_ckpt.read_config_json(workdir)).model)
  assert saved.scan_layers and not settings.model.scan_layers
  state_lib.check_init_from(str(workdir), settings.model)
  # a compute choice may differ as well (here the experts' implementation): it does not change the tree
  config.model.moe_impl = "dense" if saved.moe_impl != "dense" else "capacity"
  settings = settings_lib.from_config(config)
  assert settings.model.moe_impl != saved.moe_impl
  wider = dataclasses.replace(settings.model, mlp_hidden=settings.model.mlp_hidden * 2)
  with pytest.raises(ConfigError, match="mlp_hidden"):
    state_lib.check_init_from(str(workdir), wider)

  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps)
  init_fn, abstract, shardings = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules,
                                                                optimizer)
  state = state_lib.state_from_checkpoint(str(workdir), settings.model, optimizer, shardings, settings.mesh.axis_rules)
  _, saved_abstract, _ = state_lib.abstract_train_state(saved, mesh, settings.mesh.axis_rules, optimizer)
  step = workdir_ckpt.steps(workdir)[-1]
  saved_params = _host(workdir_ckpt.restore_params(workdir, step, saved_abstract.params))
  chex.assert_trees_all_equal(_host(state.params), layout.relayout(saved_params, saved, settings.model))
  assert int(state.step) == 0
  chex.assert_trees_all_equal(_host(state.opt_state), _host(optimizer.init(state.params)))
