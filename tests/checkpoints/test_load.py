"""dgemma/checkpoints/: one `kind` for every format, metadata without weights, and params-only loading."""

import json

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

import dgemma
from dgemma import checkpoints, quant
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter, params as params_ckpt, reader, workdir as workdir_ckpt
from dgemma.errors import CheckpointError
from dgemma.train import loop, optimizer as optimizer_lib, state as state_lib
from configs.models import tiny
from dgemma.model import ModelConfig
from tests.model_utils import save_random_hf


@pytest.fixture
def run(tiny_run):
  """A 3-step tiny run (its workdir and config; tests/conftest.py)."""
  return tiny_run


def test_kind_tells_every_format_apart(run, tmp_path):
  wd, config = run
  assert checkpoints.kind(wd) == "workdir"
  ckpt = checkpoints.load(wd)
  params_ckpt.save_params(tmp_path / "params", jax.device_get(ckpt.params), ckpt.model.to_dict())
  assert checkpoints.kind(tmp_path / "params") == "params"
  params_ckpt.save_params(tmp_path / "adapter", {"a": np.zeros(1, np.float32)}, ckpt.model.to_dict(),
                          extra_json={adapter.ADAPTER_CONFIG: {"mode": "lora", "base": str(tmp_path / "params"),
                                                               "lora": {}, "step": 1}})
  assert checkpoints.kind(tmp_path / "adapter") == "adapter"
  hf_dir = save_random_hf(ModelConfig.from_config_dict(tiny.get_config()), tmp_path / "hf")
  assert checkpoints.kind(hf_dir) == "hf"
  (tmp_path / "other").mkdir()
  with pytest.raises(FileNotFoundError, match=r"^path: .*other is none of: a training workdir"):
    checkpoints.kind(tmp_path / "other")
  with pytest.raises(FileNotFoundError, match=r"eval\.reference: .*missing does not exist"):
    checkpoints.kind(tmp_path / "missing", "eval.reference")


def test_header_reads_no_weights(run, monkeypatch):
  wd, config = run
  boom = lambda *a, **k: (_ for _ in ()).throw(AssertionError("read weights"))
  monkeypatch.setattr(workdir_ckpt, "restore_params", boom)
  monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", boom)
  head = checkpoints.header(wd)
  assert head.params is None and head.step == 3 and head.kind == "workdir"
  assert head.model == settings_lib.from_config(config).model
  assert json.loads(head.config_json)["train"]["num_steps"] == 3


def test_loading_a_run_reads_params_only(run, monkeypatch):
  """Sampling restores the params, never Adam's moments: every array the restore deserializes is a
  params leaf (and the full resume restore, through the same spy, does read the optimizer state)."""
  wd, config = run
  read = []
  original = ocp.type_handlers.ArrayHandler.deserialize

  def spy(self, infos, args=None):
    read.extend(info.name for info in infos)
    return original(self, infos, args)

  monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", spy)
  ckpt = checkpoints.load(wd)
  assert read and all(name.startswith("params.") for name in read), read[:5]
  assert len(read) == len(jax.tree.leaves(ckpt.params))
  read.clear()
  settings = settings_lib.from_config(config)
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps)
  _, abstract, _ = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer)
  manager = workdir_ckpt.make_manager(wd, read_only=True, async_save=False)
  workdir_ckpt.restore(manager, 3, abstract, with_data=False)
  assert any(name.startswith("opt_state.") for name in read)


def test_unknown_step_names_the_steps_there(run):
  wd, _ = run
  with pytest.raises(CheckpointError, match=r"sample\.checkpoint_step: step 7 not in .*have \[(\d, )*3\]"):
    checkpoints.load(wd, step=7)
  with pytest.raises(CheckpointError, match="has no training steps"):
    checkpoints.load(save_random_hf(ModelConfig.from_config_dict(tiny.get_config()), wd.parent / "hf_for_step"), step=3)


def test_an_adapter_loads_with_its_runs_settings_and_step(run, tmp_path):
  # dgemma.load(W/adapter) = dgemma.load(W): the run's dtype, data format and sampler, its step, the same text
  import copy
  import dgemma
  from dgemma import finetune
  from tests.model_utils import random_params
  wd, config = run
  config = copy.deepcopy(config)
  config.finetune.mode = "lora"
  config.model.update(dtype="bfloat16", param_dtype="bfloat16")  # not what the base's model_config.json says
  config.data.format = "sft"
  config.sample.sampler = "ancestral"
  config.train.init_from = str(wd)
  settings = settings_lib.from_config(config)
  params = jax.device_get(random_params(settings.model, 5))
  adapter.save_adapter(tmp_path / "adapter", params, settings.model, settings.finetune, base=str(wd), step=30,
                       run_config_json=settings.config_json)
  model = dgemma.load(str(tmp_path / "adapter"))
  assert model.step == 30 and "step=30" in repr(model)
  assert model.settings.model.param_dtype == "bfloat16" and model.settings.data.format == "sft"
  assert model.settings.sample.sampler == "ancestral"
  assert jax.tree.leaves(model.params)[0].dtype == jax.numpy.bfloat16
  trained = flax_flat(finetune.trained_leaves(params, settings.finetune))
  loaded = flax_flat(jax.device_get(model.params))
  base = flax_flat(jax.device_get(checkpoints.load(wd).params))
  for key, value in loaded.items():
    want = trained.get(key, base.get(key))
    np.testing.assert_array_equal(value, np.asarray(want).astype(value.dtype), err_msg="/".join(key))


def flax_flat(tree):
  import flax
  return flax.traverse_util.flatten_dict(tree)



@pytest.mark.parametrize("kind", ["hf", "params", "workdir"])
def test_quantized_load_streams_the_same_bits(run, tmp_path, monkeypatch, kind):
  """dgemma.load(path, quantize=...) quantizes each weight as it is read (sample.quantize, one tensor at a time):
  the same bits as quantizing the float model loaded whole (what load did before), while the device never holds the
  float model. The device's bytes are taken after each weight is quantized (`quant.quantize_array`) and after each
  is placed (`reader.put`), less what was live before; a read that put the float tree on the device first would
  hold all of it at those points. Bound: the quantized model (with the leaves it keeps float) plus its largest float
  weight (the one being quantized)."""
  wd, config = run
  path = wd if kind == "workdir" else tmp_path / kind
  if kind == "params":
    trained = checkpoints.load(wd)
    params_ckpt.save_params(path, jax.device_get(trained.params), trained.model.to_dict())
  elif kind == "hf":
    save_random_hf(checkpoints.header(wd).model, path)
  config = ml_collections.ConfigDict(config.to_dict())  # the run's (its byte tokenizer: the others store none)
  config.sample.quant_group_size = 16  # the tiny model's expert width (32) in two groups
  float_params = dgemma.load(str(path), config=config).params
  float_bytes = sum(x.nbytes for x in jax.tree.leaves(float_params))
  largest = max(x.nbytes for x in jax.tree.leaves(float_params))

  before, peak = {id(x) for x in jax.live_arrays()}, [0]

  def spied(fn):  # the bytes of the device arrays made since, after each weight is quantized and each is placed
    def call(*args, **kwargs):
      out = fn(*args, **kwargs)
      peak[0] = max(peak[0], sum(x.nbytes for x in jax.live_arrays() if id(x) not in before))
      return out
    return call
  monkeypatch.setattr(reader, "put", spied(reader.put))
  monkeypatch.setattr(quant, "quantize_array", spied(quant.quantize_array))
  got = dgemma.load(str(path), quantize="int4_experts", config=config)
  monkeypatch.undo()
  want = quant.quantize_params(float_params, got.settings.sample.quant)
  assert jax.tree.structure(want) == jax.tree.structure(got.params)
  for (key, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got.params)):
    assert w.dtype == g.dtype, jax.tree_util.keystr(key)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g), err_msg=jax.tree_util.keystr(key))
  # the model holds one tree: no float copy kept beside the quantized one
  assert all(a is b for a, b in zip(jax.tree.leaves(got.checkpoint.params), jax.tree.leaves(got.params)))
  if kind != "workdir":  # a run's float tree is restored whole by Orbax first, then quantized weight by weight
    quantized = quant.tree_bytes(got.params)
    assert quantized < float_bytes / 2
    assert peak[0] <= quantized + largest, (peak[0], quantized, largest, float_bytes)
