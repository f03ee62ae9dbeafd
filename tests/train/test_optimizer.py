"""dgemma/train/optimizer.py: the OPTIMIZERS records, and Muon's matrices read from the logical axis names."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import tiny_test
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.model.transformer import param_shapes
from dgemma.train import loop, optimizer as optimizer_lib
from dgemma.train.optimizer import MuonDimensionNumbers as Dims


@pytest.mark.parametrize("axes, want", [
    (("layers", "embed", "heads", "head_dim"), Dims(1, (2, 3))),          # q_proj: reads the residual stream
    (("layers", "heads", "head_dim", "embed"), Dims((1, 2), 3)),          # o_proj: writes it
    (("layers", "embed", "mlp"), Dims(1, 2)),
    (("layers", "mlp", "embed"), Dims(1, 2)),
    (("layers", "expert", "embed", "expert_mlp"), Dims(2, 3)),            # one matrix per layer group and expert
    (("layers", "expert", "expert_mlp", "embed"), Dims(2, 3)),
    (("embed", "mlp"), Dims(0, 1)),
    (("mlp", "embed_out"), Dims(0, 1)),
    (("layers", "embed", "expert"), None),                                # the router: one free axis, Adam
    (("vocab", "embed"), None),                                           # the embedding: Adam
    (("layers", "norm"), None),
    (("norm",), None),
    ((), None),
])
def test_matrix_dimensions_from_logical_axes(axes, want):
  assert optimizer_lib.matrix_dimensions(axes) == want


def test_muon_dimensions_cover_the_model_tree():
  settings = settings_lib.from_config(tiny_test.get_config())
  dims = optimizer_lib.muon_dimensions(settings.model)
  is_leaf = lambda x: x is None or isinstance(x, Dims)
  flat_dims = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_leaf)[0]}
  flat_shapes = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(
      param_shapes(settings.model))[0]}
  assert flat_dims.keys() == flat_shapes.keys()
  matrices = {k for k, v in flat_dims.items() if v is not None}
  assert matrices and all(len(flat_shapes[k].shape) >= 2 for k in matrices)
  assert not any("embedding" in k or "router" in k or "norm" in k for k in matrices)
  for name in ("q_proj", "o_proj", "experts']['gate_proj", "experts']['down_proj"):
    assert any(name in k for k in matrices), name


def _by_name(path):
  """The reference: each tiny_test parameter's (inputs, outputs) axes written out by its name and layout
  (dgemma/model/attention.py, layers.py, moe.py), not from the logical axis names the library reads."""
  names = [str(getattr(p, "key", "")) for p in path]
  name = names[-2] if names[-1] == "kernel" else names[-1]
  if name in ("q_proj", "k_proj", "v_proj"):                   # [layers, D, heads, head_dim]
    return Dims(1, (2, 3))
  if name == "o_proj":                                          # [layers, heads, head_dim, D]
    return Dims((1, 2), 3)
  if "experts" in names:                                        # [layers, E, in, out]
    return Dims(2, 3)
  if "mlp" in names:                                            # [layers, in, out]
    return Dims(1, 2)
  if "self_conditioning" in names and name.endswith("_proj"):   # its GeGLU: [in, out]
    return Dims(0, 1)
  if name.startswith("two_stream_") and not name.endswith("bias"):  # [in, out]
    return Dims(0, 1)
  return None                                                   # embedding, router, norms, scalars, biases


def _first_update(tx):
  """(params, grads) -> tx's first update from a fresh state, jitted: one compiled program per tree shape instead
  of one dispatch per operation (the Newton-Schulz iterations are dozens of them)."""
  def update(params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates
  return jax.jit(update)


def test_muon_update_is_the_two_dimensional_rule_on_each_matrix_slice():
  """The library's Muon on the tiny model's tree (stacked layers, experts, heads) against optax's plain 2D Muon on
  each slice reshaped to [inputs, outputs], and its AdamW on the other leaves, one step from a fresh state, in
  float64, with each matrix's input and output axes written out by hand (`_by_name`). Both sides do the same arithmetic on the same numbers, in another order (vmap over the batch axes,
  reshapes), so they agree to a few float64 ulps times the five Newton-Schulz iterations' growth (each multiplies
  by coefficients below 5 across three matmuls): far under rtol 1e-9. A swapped input / output would change the
  shape factor sqrt(max(1, fan_out / fan_in)) (sqrt 2 on the MLP), a wrong batch axis the orthogonalisation."""
  settings = settings_lib.from_config(tiny_test.get_config())
  opt = settings.opt.__class__(**{**settings.opt.__dict__, "optimizer": "muon", "warmup_steps": 0, "lr": 1e-3,
                                  "muon_lr": 0.05, "grad_clip": 1e9})   # no warmup: step 0 is at the peak
  with jax.enable_x64(True):
    shapes = param_shapes(settings.model)
    leaves, treedef = jax.tree.flatten(shapes)
    rng = np.random.default_rng(0)
    params = treedef.unflatten([jnp.asarray(rng.normal(size=s.shape), jnp.float64) for s in leaves])
    grads = treedef.unflatten([jnp.asarray(rng.normal(size=s.shape), jnp.float64) for s in leaves])
    got = _first_update(optimizer_lib.make_optimizer(opt, 10, model_cfg=settings.model))(params, grads)

    flat_dims = [_by_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    ref_2d = optax.contrib.muon(learning_rate=opt.muon_lr, beta=opt.muon_momentum, weight_decay=opt.weight_decay,
                                eps=opt.eps)
    ref_adam = optax.adamw(opt.lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=0.0, nesterov=True)
    ref_2d_update, ref_adam_update = _first_update(ref_2d), _first_update(ref_adam)
    checked = 0
    for p, g, u, d in zip(jax.tree.leaves(params), jax.tree.leaves(grads), jax.tree.leaves(got), flat_dims):
      if d is None:
        want = ref_adam_update({"w": p}, {"w": g})["w"]
      else:
        red = (d.reduction_axis,) if isinstance(d.reduction_axis, int) else tuple(d.reduction_axis)
        out = (d.output_axis,) if isinstance(d.output_axis, int) else tuple(d.output_axis)
        batch = tuple(i for i in range(p.ndim) if i not in red + out)
        order = batch + red + out
        to_2d = lambda x: jnp.transpose(x, order).reshape(
            (-1, int(np.prod([x.shape[i] for i in red])), int(np.prod([x.shape[i] for i in out]))))
        p3, g3 = to_2d(p), to_2d(g)
        u3 = jnp.stack([ref_2d_update({"w": p3[b]}, {"w": g3[b]})["w"] for b in range(p3.shape[0])])
        moved = u3.reshape([p.shape[i] for i in order])
        want = jnp.transpose(moved, np.argsort(order))
        checked += 1
      np.testing.assert_allclose(np.asarray(u), np.asarray(want), rtol=1e-9, atol=1e-12)
    assert checked >= 4


def test_unknown_optimizer_and_muon_with_frozen_parameters_are_config_errors(tmp_path):
  config = tiny_test.get_config()
  config.opt.optimizer = "sgd"
  with pytest.raises(ConfigError, match="opt.optimizer: unknown 'sgd'"):  # the loop checks before any work
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()
  config.opt.optimizer, config.finetune.mode = "muon", "lora"
  settings = settings_lib.from_config(config)
  with pytest.raises(ConfigError, match="opt.optimizer.*frozen"):
    optimizer_lib.check(settings.opt, settings.finetune)
  with pytest.raises(ConfigError, match="opt.optimizer.*frozen"):
    optimizer_lib.make_optimizer(settings.opt, 10, settings.finetune, settings.model)
  config.finetune.mode = "full"
  settings = settings_lib.from_config(config)
  assert optimizer_lib.check(settings.opt, settings.finetune).name == "muon"


def test_resuming_with_another_optimizer_is_an_architecture_difference():
  """The two optimizers' states have different layouts, so a run cannot resume with the other one (the loop
  refuses it before writing anything: tests/train/test_safety.py); a run saved before opt.optimizer existed
  reads as 'adamw'."""
  saved = tiny_test.get_config()
  new = tiny_test.get_config()
  new.opt.optimizer = "muon"
  assert settings_lib.architecture_differences(settings_lib.from_config(saved), settings_lib.from_config(new)) == [
      "opt.optimizer: 'adamw' -> 'muon'"]
  old_json = json.loads(settings_lib.to_json(saved))
  del old_json["opt"]["optimizer"]
  assert settings_lib.from_json(json.dumps(old_json)).opt.optimizer == "adamw"


def test_a_schedule_without_warmup_is_optaxs_cosine_bit_for_bit(caplog):
  """opt.warmup_steps=0 builds the cosine decay alone (optax's warmup schedule with no warmup logs a note about
  its empty linear part on every run): the same learning rate at every step, exactly, and no note."""
  import logging
  from types import SimpleNamespace
  for lr, fraction, steps in ((3e-4, 0.1, 100), (2e-3, 0.0, 8), (1e-3, 0.5, 1)):
    opt = SimpleNamespace(lr=lr, end_lr_fraction=fraction, warmup_steps=0)
    with caplog.at_level(logging.INFO):
      schedule = optimizer_lib.make_schedule(opt, steps)
      values = [float(schedule(step)) for step in range(steps + 3)]
    assert not [r for r in caplog.records if "transition_steps" in r.getMessage()]
    reference = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=0,
                                                   decay_steps=max(steps, 1), end_value=lr * fraction)
    assert values == [float(reference(step)) for step in range(steps + 3)]
