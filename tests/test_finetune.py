"""Fine-tuning runs: the shipped fine-tuning configs at tiny size through `train_and_evaluate` from a
params checkpoint (train.init_from); frozen leaves bit-unchanged, trained ones moved, optimizer state
only for trained leaves, the adapter checkpoint, and sampling from a head-only workdir."""

import flax
import jax
import numpy as np
import pytest

from configs import adapt_from_gemma4, finetune_head_lora
from dgemma import api
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import params as params_ckpt
from dgemma.train import loop
from dgemma.model import lora
from tests.model_utils import random_params


def _base_checkpoint(tiny_config, path, *, moe: bool = True):
  """A random-weights params checkpoint of a two-global-layer tiny model (a one-layer scanned block:
  half the compile time of tiny's sliding + global pattern); returns (path, flat params)."""
  tiny_config.model.num_layers, tiny_config.model.layer_types = 2, ("global", "global")
  if not moe:
    tiny_config.model.num_experts = 0
  cfg = settings_lib.from_config(tiny_config).model
  params = jax.device_get(random_params(cfg))
  params_ckpt.save_params(path, params, cfg.to_dict())
  return path, flax.traverse_util.flatten_dict(params)


def _tiny(config, tiny_config):
  """A shipped config shrunk to tiny_test's data / sizes (its model already comes from the checkpoint)."""
  config.data = tiny_config.data
  config.diffusion.canvas_len = tiny_config.diffusion.canvas_len
  config.model.remat, config.model.dtype = "none", "float32"
  config.train.update(num_steps=2, eval_every=2, ckpt_every=2, eval_batches=1, progress_bar=False,
                      async_checkpointing=False)
  config.opt.warmup_steps = 1  # settings require warmup <= num_steps (the schedule used min(warmup, num_steps - 1))
  return config


def _adam_mu(opt_state):
  """The Adam first moments (MaskedNode where a leaf has no optimizer state)."""
  found = []
  jax.tree.map(lambda s: found.append(s.mu) if hasattr(s, "mu") else None, opt_state,
               is_leaf=lambda s: hasattr(s, "mu"))
  (mu,) = found
  return flax.traverse_util.flatten_dict(mu)


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_adapt_from_gemma4_tiny_full_with_frozen_router(tiny_config, tmp_path):
  ckpt, base = _base_checkpoint(tiny_config, tmp_path / "base")
  config = _tiny(adapt_from_gemma4.get_config(str(ckpt)), tiny_config)
  config.diffusion.self_cond_prob = 0.0  # one decoder pass (compile time)
  config.finetune.freeze_router = True
  state = loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert int(state.step) == 2
  params = flax.traverse_util.flatten_dict(jax.device_get(state.params))
  assert set(params) == set(base)  # full mode: no adapters
  router = [k for k in base if "router" in k]
  assert len(router) == 3  # proj kernel, scale, per_expert_scale (stacked over the 2 blocks)
  for k in router:
    np.testing.assert_array_equal(params[k], base[k], err_msg="/".join(k))
  # everything else trains (self-conditioning gets no gradient: self_cond_prob = 0 gives it a zero signal)
  assert all(not np.array_equal(params[k], base[k]) for k in base if k not in router and k[0] != "self_conditioning")
  mu = _adam_mu(state.opt_state)
  assert {k for k, v in mu.items() if hasattr(v, "shape")} == set(base) - set(router)
  assert not (tmp_path / "wd" / adapter_ckpt.ADAPTER_DIR).exists()


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_finetune_head_lora_tiny_trains_only_head_and_samples(tiny_config, tmp_path):
  # no MoE branch here (compile time; its adapters are tested in tests/model/test_lora.py, and this config keeps
  # the router frozen); self-conditioning stays on: head_only trains it
  ckpt, base = _base_checkpoint(tiny_config, tmp_path / "base", moe=False)
  config = _tiny(finetune_head_lora.get_config(str(ckpt)), tiny_config)
  workdir = tmp_path / "wd"
  state = loop.train_and_evaluate(config, str(workdir))
  params = flax.traverse_util.flatten_dict(jax.device_get(state.params))
  adapters = [k for k in params if k not in base]
  assert adapters and all(lora.is_adapter(k[-1]) for k in adapters)
  assert not any("router" in k or k[0] == "self_conditioning" for k in adapters)  # freeze_router, SC in full
  head = [k for k in base if k[0] == "self_conditioning"]
  for k in base:
    if k not in head:  # the encoder / trunk / embedding: bit-unchanged
      np.testing.assert_array_equal(params[k], base[k], err_msg="/".join(k))
  assert all(not np.array_equal(params[k], base[k]) for k in head)  # trained in full
  assert all(np.any(params[k] != 0) for k in adapters if k[-1].endswith(lora.LORA_B))  # B left zero
  mu = _adam_mu(state.opt_state)
  assert {k for k, v in mu.items() if hasattr(v, "shape")} == set(head) | set(adapters)

  saved, model_dict, meta = adapter_ckpt.load_adapter(workdir / adapter_ckpt.ADAPTER_DIR)
  assert meta["mode"] == "head_only" and meta["base"] == str(ckpt) and meta["step"] == 2
  assert model_dict == settings_lib.from_config(config).model.to_dict()
  flat_saved = flax.traverse_util.flatten_dict(saved)
  assert set(flat_saved) == set(head) | set(adapters)
  for k, v in flat_saved.items():
    np.testing.assert_array_equal(v, params[k])

  printed = []
  samples = api.sample_command(str(workdir), steps=2, print_fn=printed.append)
  assert len(samples) == 1 and samples[0].num_forwards > 0
  assert "--- sample 0 (step 2, " in printed[0]  # sampled the step-2 checkpoint


@pytest.mark.slow  # a two-step LoRA run from a training run, then merges
def test_an_adapter_records_its_base_merges_from_a_run_and_refuses_another(tiny_run, tmp_path):
  """A 'lora' run whose train.init_from is a training run (the documented recipe): its adapter records the base's
  fingerprint (checkpoints.identity); merge_lora folds it into that run's weights (read by the cross-kind reader),
  bit for bit the direct fold, and into a copy of the run (the same fingerprint). Another checkpoint of the same
  architecture is refused by merge_lora --base and dgemma.load(adapter, base=...) in one line naming both, and
  accepted with any_base."""
  import shutil
  from dgemma import checkpoints
  from dgemma.errors import CheckpointError
  from dgemma.tools import merge_lora
  base_run, config = tiny_run
  config = config.copy_and_resolve_references()
  config.finetune.mode, config.finetune.lora_rank = "lora", 2
  config.train.init_from = str(base_run)
  config.train.update(num_steps=2, eval_every=2, ckpt_every=2, eval_batches=1, progress_bar=False)
  config.opt.warmup_steps = 1
  loop.train_and_evaluate(config, str(tmp_path / "wd"))
  adapter_dir = tmp_path / "wd" / adapter_ckpt.ADAPTER_DIR
  saved, _, meta = adapter_ckpt.load_adapter(adapter_dir)
  assert meta[adapter_ckpt.BASE_IDENTITY] == checkpoints.identity(str(base_run))

  base = flax.traverse_util.unflatten_dict(
      {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(checkpoints.load(str(base_run)).params).items()})
  expected = flax.traverse_util.flatten_dict(lora.merge(base, saved, float(meta["lora"]["alpha"]) / meta["lora"]["rank"]))
  copy = shutil.copytree(base_run, tmp_path / "copy_of_the_base")
  assert checkpoints.identity(str(copy)) == meta[adapter_ckpt.BASE_IDENTITY]
  for out, base_dir in (("merged", None), ("merged_on_copy", str(copy))):
    merge_lora.merge_checkpoints(str(adapter_dir), str(tmp_path / out), base_dir)
    merged, _ = params_ckpt.load_params(tmp_path / out)
    got = flax.traverse_util.flatten_dict(merged)
    assert set(got) == set(expected) and not any(lora.is_adapter(k[-1]) for k in got)
    for k, want in expected.items():
      np.testing.assert_array_equal(got[k], want, err_msg="/".join(k))

  other = tmp_path / "other"  # another model of the same architecture
  model_cfg = checkpoints.header(str(base_run)).model
  params_ckpt.save_params(other, jax.device_get(random_params(model_cfg)), model_cfg.to_dict())
  named = rf"{adapter_dir} was trained on {base_run} \(fingerprint \w+\), but the base given, {other}, is another"
  with pytest.raises(CheckpointError, match=named):
    merge_lora.merge_checkpoints(str(adapter_dir), str(tmp_path / "merged_other"), str(other))
  with pytest.raises(CheckpointError, match=named):
    api.load(str(adapter_dir), base=str(other))
  merge_lora.merge_checkpoints(str(adapter_dir), str(tmp_path / "merged_other"), str(other), any_base=True)
  assert api.load(str(adapter_dir), base=str(other), any_base=True).params is not None
