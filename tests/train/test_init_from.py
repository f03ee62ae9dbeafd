"""train.init_from from every checkpoint kind dgemma.load takes (a run, a params checkpoint, an adapter on its
base, a Hugging Face directory) into every finetune.mode: the step-0 params are the checkpoint's model (its
tensors copied bit for bit; a LoRA source's adapters kept or folded in), the run's new adapters start at
B = 0, and a head_only source's decoder-only adapters are refused where they would have to be folded in."""

import copy
import dataclasses

import flax
import jax
import numpy as np
import pytest

from dgemma import checkpoints, finetune, mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import convert
from dgemma.errors import ConfigError
from dgemma.model import lora
from dgemma.checkpoints import layout
from dgemma.train import loop, state as state_lib
from tests.model_utils import random_params

MODES = ("full", "lora", "head_only")


def _settings(config, mode):
  config = copy.deepcopy(config)
  config.finetune.mode = mode
  config.train.init_from = ""
  return settings_lib.from_config(config)


def _flat(tree):
  return flax.traverse_util.flatten_dict(jax.device_get(tree))


def _adapter_from(base, config, mode, path, seed):
  """An adapter checkpoint of `mode` on `base`, with random non-zero factors (B != 0: folding it in changes the
  weights) and, for head_only, a changed self-conditioning module. Returns (path, its trained leaves)."""
  settings = _settings(config, mode)
  params = jax.device_get(random_params(settings.model, seed))
  adapter_ckpt.save_adapter(path, params, settings.model, settings.finetune, base=str(base), step=7,
                            run_config_json=settings.config_json)
  return path, _flat(finetune.trained_leaves(params, settings.finetune))


@pytest.fixture(scope="module")
def sources(tiny_run, tmp_path_factory):
  """{kind: (path, the flat params dgemma.load gives for it)} and the run config."""
  workdir, config = tiny_run
  tmp = tmp_path_factory.mktemp("init_from_sources")
  base = _flat(checkpoints.load(workdir).params)
  convert.to_params(workdir, tmp / "params")
  convert.to_hf(workdir, tmp / "hf")
  out = {"workdir": (workdir, base), "params": (tmp / "params", base), "hf": (tmp / "hf", base)}
  out["adapter_lora"] = _adapter_from(workdir, config, "lora", tmp / "adapter_lora", 1)
  out["adapter_head_only"] = _adapter_from(workdir, config, "head_only", tmp / "adapter_head_only", 2)
  return out, config


def _init(path, settings):
  mesh = mesh_lib.make_mesh(settings.mesh.axis_sizes)
  optimizer, init_fn, _, shardings = state_lib.run_abstract_state(settings, mesh)
  state_lib.check_init_from(str(path), settings.model)
  return state_lib.state_from_checkpoint(str(path), settings.model, optimizer, shardings, settings.mesh.axis_rules,
                                         init_fn, jax.random.PRNGKey(0))


def _folded(factors, base, scale):
  """The base weights with the adapter's factors folded in (lora.merge: what merge_lora writes), no factors."""
  unflat = flax.traverse_util.unflatten_dict
  return _flat(lora.merge(unflat(dict(base)), unflat(dict(factors)), scale))


_SLOW = pytest.mark.slow  # the fast tier keeps a run (the README's case) and the refusal; the other kinds run in make test
KINDS = [pytest.param("workdir"), pytest.param("params", marks=_SLOW), pytest.param("hf", marks=_SLOW),
         pytest.param("adapter_lora", marks=_SLOW), pytest.param("adapter_head_only")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_every_kind_starts_every_mode_at_its_model(sources, kind, mode):
  found, config = sources
  path, source = found[kind]
  base = found["workdir"][1]
  settings = _settings(config, mode)
  if kind == "adapter_head_only" and mode != "head_only":
    with pytest.raises(ConfigError, match="train.init_from: .*head_only.*cannot be folded"):
      state_lib.check_init_from(str(path), settings.model)
    return
  state = _init(path, settings)
  got = _flat(state.params)
  assert int(state.step) == 0
  new_adapters = {k for k in got if lora.is_adapter(k[-1])}
  assert bool(new_adapters) == (mode != "full")
  if kind == "adapter_lora" and mode != "lora":  # another layout: its factors folded into their weights first
    expected = _folded(source, base, settings.finetune.lora_alpha / settings.finetune.lora_rank)
  elif kind.startswith("adapter"):  # the same layout: its leaves (adapters, head_only's self-conditioning) go on
    expected = {**base, **source}
  else:
    expected = source
  for key, value in got.items():
    if key in expected:
      np.testing.assert_array_equal(value, expected[key], err_msg="/".join(key))
    else:  # only the run's fresh adapters are new: A initialised, B zero (the run starts at the checkpoint)
      assert lora.is_adapter(key[-1]), key
      if key[-1].endswith(lora.LORA_B):
        assert not np.any(value), key
  assert not [k for k in expected if k not in got and not lora.is_adapter(k[-1])]


def test_folding_a_lora_source_equals_merge_lora(sources, tmp_path):
  # init_from a LoRA adapter into a full run = the params dgemma.tools.merge_lora writes for it
  from dgemma.tools import merge_lora
  found, config = sources
  path, _ = found["adapter_lora"]
  merge_lora.merge_checkpoints(str(path), str(tmp_path / "merged"), base_dir=str(found["params"][0]))
  convert.to_params(path, tmp_path / "converted")  # convert --from_ckpt ADAPTER folds it the same way
  state = _init(path, _settings(config, "full"))
  merged = _flat(checkpoints.load(tmp_path / "merged").params)
  converted = _flat(checkpoints.load(tmp_path / "converted").params)
  got = _flat(state.params)
  assert set(got) == set(merged) == set(converted)
  for key in got:
    np.testing.assert_array_equal(got[key], merged[key], err_msg="/".join(key))
    np.testing.assert_array_equal(converted[key], merged[key], err_msg="/".join(key))
  base = found["workdir"][1]
  assert any(not np.array_equal(got[k], base[k]) for k in got)  # the factors did change the weights


def test_an_architecture_mismatch_is_named_before_anything_is_read(sources):
  found, config = sources
  settings = _settings(config, "lora")
  wider = dataclasses.replace(settings.model, mlp_hidden=settings.model.mlp_hidden * 2)
  for kind in ("workdir", "params", "hf", "adapter_lora"):
    with pytest.raises(ConfigError, match="train.init_from: .*mlp_hidden"):
      state_lib.check_init_from(str(found[kind][0]), wider)


@pytest.mark.slow  # a fine-tuning run (its train step compiles): over the fast tier's budget
def test_fine_tuning_from_a_run_trains_and_writes_its_adapter(tiny_run, tmp_path, mode="lora"):
  # the README's command: train.py --config.train.init_from=RUN --config.finetune.mode=lora (head_only from a params
  # checkpoint: tests/test_finetune.py; from every kind: the state tests above)
  workdir, config = tiny_run
  config = copy.deepcopy(config)
  config.train.update(init_from=str(workdir), num_steps=2, eval_every=2, ckpt_every=2)
  config.finetune.mode = mode
  config.diffusion.self_cond_prob = 0.0  # one decoder pass: a smaller train step to trace and compile (~2 s less)
  state = loop.train_and_evaluate(config, str(tmp_path / "ft"))
  assert int(state.step) == 2
  meta = checkpoints.params.read_extra_json(tmp_path / "ft" / adapter_ckpt.ADAPTER_DIR, adapter_ckpt.ADAPTER_CONFIG)
  assert meta["mode"] == mode and meta["base"] == str(workdir.absolute()) and meta["step"] == 2


def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_no_workdir(tiny_run, tmp_path, monkeypatch):
  # a bad train.init_from fails before the workdir is made; a failure after it was made (here: reading the
  # checkpoint) removes the half-made workdir, and never a workdir that existed before the run
  workdir, config = tiny_run
  config = copy.deepcopy(config)
  config.train.update(init_from=str(tmp_path / "gone"), num_steps=2)
  with pytest.raises(FileNotFoundError, match="train.init_from: .*gone does not exist"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()

  def broken(*args, **kwargs):
    raise OSError("the disk went away")

  monkeypatch.setattr(state_lib, "state_from_checkpoint", broken)
  config.train.init_from = str(workdir)
  with pytest.raises(OSError, match="the disk went away"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("a user's file")
  with pytest.raises(OSError, match="the disk went away"):
    loop.train_and_evaluate(config, str(tmp_path / "mine"))
  assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"


@pytest.mark.parametrize("kind", ["workdir", "params", "hf", "adapter_lora"])
def test_the_fine_tuning_configs_take_any_checkpoint_kind(sources, kind):
  # configs/finetune_head_lora.py:PATH and configs/adapt_from_gemma4.py:PATH (configs/models/from_checkpoint.py)
  from configs import adapt_from_gemma4, finetune_head_lora
  found, config = sources
  path = str(found[kind][0])
  run = settings_lib.from_config(config)
  for module in (finetune_head_lora, adapt_from_gemma4):
    settings = settings_lib.from_config(module.get_config(path))
    assert settings.train.init_from == path
    assert not layout.differences_but_layout(settings.model, run.model)
    assert settings.model.remat == module.get_config().model.remat  # the recipe's compute choices stay
    assert settings.data.tokenizer == run.data.tokenizer  # the byte tokenizer of the run, named by its settings
    assert (settings.diffusion.canvas_len, settings.data.seq_len) == (run.diffusion.canvas_len, run.data.seq_len)
    state_lib.check_init_from(path, settings.model)
