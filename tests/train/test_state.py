"""dgemma/train/state.py: the abstract train state is what its init_fn makes, without a second trace of the model."""

import jax
import jax.numpy as jnp
import pytest

from configs import tiny_test
from dgemma import finetune, mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.model.sharding import place
from dgemma.train import optimizer as optimizer_lib
from dgemma.train import state as state_lib


@pytest.mark.parametrize("optimizer_name, finetune_mode, state_dtype, base_quant", [
    ("adamw", "full", "float32", "none"),
    ("adamw", "full", "bfloat16", "none"),   # Adam moments stored in bf16: the state's dtypes differ from the params'
    ("muon", "full", "float32", "none"),
    ("adamw", "lora", "float32", "none"),    # frozen leaves: optax.masked leaves empty boxes, dropped by the function
    ("adamw", "head_only", "float32", "int4_experts"),  # QLoRA: QArray leaves whose qvalue and scale are boxed
])
def test_abstract_state_equals_the_shapes_init_fn_makes(optimizer_name, finetune_mode, state_dtype, base_quant):
  config = tiny_test.get_config()
  config.opt.optimizer, config.finetune.mode, config.opt.state_dtype = optimizer_name, finetune_mode, state_dtype
  config.finetune.base_quant, config.finetune.base_quant_group_size = base_quant, 16
  if finetune_mode != "full":
    config.finetune.lora_rank = 2
  settings = settings_lib.from_config(config)
  # An abstract mesh with every axis of size 2 (nothing runs on it): on the 1-device mesh of a test process every
  # spec would fit to replicated, and the comparison below could not see a lost logical axis name.
  names = mesh_lib.make_mesh(settings.mesh.axis_sizes).axis_names
  mesh = jax.sharding.AbstractMesh((2,) * len(names), names)
  optimizer = optimizer_lib.make_optimizer(settings.opt, 10, settings.finetune, settings.model)
  init_fn, abstract, shardings = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules,
                                                                optimizer, finetune.base_quantizer(settings.finetune))
  # The reference: trace init_fn itself (the model's init and the optimizer's), drop the boxes optax.masked leaves
  # around nothing, and place the logical axis names on the mesh, as the function did before it read the cached
  # parameter shapes (so the shardings below come from init_fn's own boxes, not from `abstract`).
  boxed = state_lib.drop_empty_boxes(jax.eval_shape(init_fn, jax.random.PRNGKey(0)))
  traced, traced_shardings = place(boxed, mesh, settings.mesh.axis_rules)
  assert jax.tree.structure(shardings) == jax.tree.structure(traced_shardings)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a == b, shardings, traced_shardings)))
  assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(shardings.opt_state))  # split ones
  assert jax.tree.structure(abstract) == jax.tree.structure(traced)
  same = jax.tree.map(lambda a, t: (a.shape, a.dtype, a.sharding) == (t.shape, t.dtype, t.sharding), abstract, traced)
  assert all(jax.tree.leaves(same))
  assert (abstract.step.shape, abstract.step.dtype) == ((), jnp.int32)


@pytest.mark.parametrize("mode, base_quant, rl", [("head_only", "int4_experts", False), ("lora", "int8", False),
                                                   ("lora", "none", False), ("full", "none", False),
                                                   ("lora", "int4_experts", True), ("head_only", "int4", False)])
def test_the_train_step_lays_out_only_a_qlora_runs_frozen_base(mode, base_quant, rl):
  """step_shardings: in a QLoRA run (finetune.base_quant set) every frozen leaf, quantized or not, is left to the
  step's compiler to lay out (Layout.AUTO on its own sharding) and every trained leaf and the optimizer state keep
  their shardings; any other run (no quantized base, or an RL run, whose reference copies trained leaves) gets
  its shardings back unchanged, the same object; so does, on CPU, an all-int4 base with plain int4 leaves (the
  embedding: packed bytes are only the stacked layers'), which no CPU array can be put in a laid-out format for."""
  from jax.experimental.layout import Format, Layout
  config = tiny_test.get_config()
  config.finetune.mode, config.finetune.base_quant, config.finetune.base_quant_group_size = mode, base_quant, 16
  config.finetune.lora_rank = 2
  if rl:
    config.rl.algorithm, config.rl.reward = "grpo", "exact_match"
  settings = settings_lib.from_config(config)
  _, _, abstract, shardings = state_lib.run_abstract_state(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))
  laid_out = state_lib.step_shardings(settings, shardings, abstract)
  if base_quant == "int4":
    assert any(x.dtype == jnp.int4 for x in jax.tree.leaves(abstract.params)) and jax.default_backend() == "cpu"
  if base_quant in ("none", "int4") or rl:
    assert laid_out is shardings
    return
  assert laid_out.opt_state is shardings.opt_state and laid_out.step is shardings.step
  labels = jax.tree.leaves(finetune.param_labels(shardings.params, settings.finetune))
  pairs = list(zip(jax.tree.leaves(shardings.params), jax.tree.leaves(laid_out.params), labels, strict=True))
  assert {label for *_, label in pairs} == {finetune.TRAINABLE, finetune.FROZEN}
  for plain, step, label in pairs:
    if label == finetune.TRAINABLE:
      assert step is plain
    else:
      assert isinstance(step, Format) and step.layout == Layout.AUTO and step.sharding == plain
