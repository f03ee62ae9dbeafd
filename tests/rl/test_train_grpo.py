"""GRPO through the train loop (train.py's `loop.train_and_evaluate`): learning a toy reward, the KL term's hold,
exact resume, and a QLoRA policy.

The toy: a tiny random policy, prompts from the test corpus, reward = the share of digits 1-8 in the output
(tests/rl/toy_rewards.py; a random byte model emits them about 3% of the time). Its sampler accepts every position
at each of 2 steps (acceptance 'confidence' at 0), so the output is read from the draws the update reinforces: with
the released entropy bound a random model accepts one position a step and its output is mostly the argmax of
re-noised positions, a credit-assignment problem this test is not about.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import dgemma
from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.errors import ConfigError
from dgemma.train import loop


def toy_config(tiny_config, **changes):
  config = tiny_config
  config.model.num_experts = 0
  config.rl.algorithm = "grpo"
  config.rl.reward = "python"
  config.rl.reward_fn = "tests.rl.toy_rewards:share_of_digits"
  config.rl.group_size = 4
  config.sample.acceptance = "confidence"
  config.sample.accept_confidence = 0.0
  config.sample.max_denoising_steps = 2
  config.opt.lr = 3e-3
  config.opt.warmup_steps = 0
  config.train.num_steps = 20
  config.train.log_every = 1
  config.train.eval_every = 1000
  config.train.ckpt_every = 20
  for key, value in changes.items():
    settings_lib.set_key(config, key, value)
  return config


def train_rows(workdir) -> list[dict]:
  return [r for r in map(json.loads, open(workdir / "metrics.jsonl")) if r["split"] == "train"]


@pytest.mark.slow  # two 20-step runs (one compile each): about 50 s on 2 cores
@pytest.mark.parametrize("log_likelihood", ["trajectory", "elbo"])
def test_grpo_raises_a_toy_reward(tiny_config, tmp_path, log_likelihood):
  """The first rollout's mean reward (the initial policy's, about 0.03) rises above 0.5 over the last 5 of 20
  updates of 16 samples each (measured: above 0.95 for both log-likelihoods)."""
  loop.train_and_evaluate(toy_config(tiny_config, **{"rl.log_likelihood": log_likelihood}), str(tmp_path / "wd"))
  rows = train_rows(tmp_path / "wd")
  assert [r["step"] for r in rows] == list(range(1, 21))
  assert rows[0]["reward_mean"] < 0.1
  assert np.mean([r["reward_mean"] for r in rows[-5:]]) > rows[0]["reward_mean"] + 0.5, rows
  for key in ("kl", "clip_fraction", "samples_per_sec", "draws_per_sample", "grad_norm", "pg_loss"):
    assert all(np.isfinite(r[key]) for r in rows), key
  # the first rollout's groups: 4 random samples each, digits 3% of the time, so rewards differ within a group
  assert rows[0]["groups_with_signal"] > 0.5 and all(0 <= r["groups_with_signal"] <= 1 for r in rows)
  if log_likelihood == "trajectory":  # a random byte policy: a draw's surprisal is near ln 256 (5.5 nats)
    assert all(r["trajectory_nll"] > 0 for r in rows) and rows[0]["trajectory_nll"] > 2.0 * rows[0]["draws_per_sample"]


@pytest.mark.slow  # a 20-step run
def test_a_large_kl_weight_holds_the_policy_at_its_reference(tiny_config, tmp_path):
  """With kl_weight 20 the same 20 updates leave the reward near where it started (measured below 0.04 throughout)
  and the KL to the reference small, where kl_weight 0.04 passes 0.95 (above)."""
  loop.train_and_evaluate(toy_config(tiny_config, **{"rl.kl_weight": 20.0}), str(tmp_path / "wd"))
  rows = train_rows(tmp_path / "wd")
  assert np.mean([r["reward_mean"] for r in rows[-5:]]) < 0.15, rows
  assert max(r["kl"] for r in rows) < 0.05


@pytest.mark.slow  # three runs of one compiled program
def test_rl_resumes_exactly_with_several_updates_per_rollout(tiny_config, tmp_path):
  """num_iterations 2: the rollout's log-probabilities are replayed and the ratio moves (clipping acts); a run
  stopped after one rollout and resumed equals the straight run bit for bit, reference included."""
  config = toy_config(tiny_config, **{"rl.num_iterations": 2, "train.num_steps": 4, "train.ckpt_every": 2,
                                      "train.log_every": 2, "opt.lr": 3e-2})
  straight = loop.train_and_evaluate(config, str(tmp_path / "straight"))
  loop.train_and_evaluate(config, str(tmp_path / "resumed"), stop_after_steps=2)
  assert workdir_ckpt.steps(tmp_path / "resumed") == [2]
  resumed = loop.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 4
  for a, b in zip(jax.tree.leaves(jax.device_get(straight)), jax.tree.leaves(jax.device_get(resumed))):
    np.testing.assert_array_equal(a, b)
  rows = train_rows(tmp_path / "straight")
  assert [r["step"] for r in rows] == [2, 4]
  assert rows[-1]["ratio_mean"] != 1.0  # the second update of a rollout sees a moved policy
  # the reference is the run's start: every trained leaf, unchanged
  np.testing.assert_array_equal(jax.tree.leaves(straight.ref_params)[0], jax.tree.leaves(resumed.ref_params)[0])
  # dgemma.load reads an RL run as any run: its policy
  loaded = dgemma.load(str(tmp_path / "straight"))
  for a, b in zip(jax.tree.leaves(jax.device_get(loaded.params)), jax.tree.leaves(jax.device_get(straight.params))):
    np.testing.assert_array_equal(a, b)
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_per_sec")} for r in rs]
  assert untimed(train_rows(tmp_path / "resumed")) == untimed(rows)  # the same rewards, losses, ratios


@pytest.mark.slow  # a 2-step run
def test_a_qlora_policy_keeps_its_quantized_base(tiny_config, tmp_path):
  """LoRA adapters on an int8 base: the reference holds the adapters only, the base is bit-identical after the
  updates and the adapters moved."""
  config = toy_config(tiny_config, **{"finetune.mode": "lora", "finetune.base_quant": "int8", "train.num_steps": 2,
                                      "train.ckpt_every": 2, "train.log_every": 1})
  settings = settings_lib.from_config(config)
  programs = loop.run_programs(settings, dgemma.mesh.make_mesh(settings.mesh.axis_sizes))
  start = jax.device_get(programs.init_state(jax.random.PRNGKey(settings.seed)))
  state = jax.device_get(loop.train_and_evaluate(config, str(tmp_path / "wd")))
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  before, after, ref = flat(start.params), flat(state.params), flat(state.ref_params)
  assert ref and all("lora" in k for k in ref)
  base = [k for k in before if "lora" not in k and "qvalue" in k]
  assert base and all(np.array_equal(before[k], after[k]) for k in base)
  assert any(not np.array_equal(before[k], after[k]) for k in before if "lora_b" in k)


def test_rl_settings_are_checked_against_the_other_groups(tiny_config):
  for key, value, message in (
      ("sample.sampler", "ancestral", "sample.sampler: rl samples with the released sampler"),
      ("sample.renoise", "low_confidence", "sample.renoise: rl reads each step's accepted draws"),
      ("rl.num_iterations", 3, "train.num_steps: 20 updates are not a whole number of rollouts"),
      ("opt.grad_accum_steps", 2, "opt.grad_accum_steps: rl takes one gradient per update"),
  ):
    config = toy_config(tiny_config.copy_and_resolve_references(), **{key: value})
    with pytest.raises(ConfigError, match=message):
      settings_lib.from_config(config)
