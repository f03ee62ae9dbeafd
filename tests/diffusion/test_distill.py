"""Discrete consistency distillation (dgemma/diffusion/distill.py) and its training run.

References: the uniform-state marginal of each latent of a coupled pair, the monotone coupling itself, the
round schedule by hand, KL in float64 numpy, the loss at its fixed point (teacher = student, dt -> 0), the
loss recomputed from separate teacher and student passes, and the training loop's state (teacher refreshed
to the student at each round, exact resume, the student loadable as an ordinary run).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill_dcd
from configs.models import tiny
from dgemma import checkpoints
from dgemma import settings as settings_lib
from dgemma.diffusion import distill, loss as loss_lib, relaxation
from dgemma.diffusion.corruption import split_context_canvas
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer
from dgemma.diffusion.config import DiffusionSettings
from dgemma.settings import DistillSettings
from dgemma.train import loop
from tests.model_utils import random_params, random_rows, save_random_run


def test_coupled_rows_have_the_uniform_state_marginals_and_never_move_away_from_the_data():
  vocab, length = 8, 20_000
  alpha_t = jnp.array([0.0, 0.2, 0.5, 0.9])
  alpha_s = jnp.array([0.3, 0.2, 0.8, 0.999])
  clean = jnp.tile((jnp.arange(length) % vocab)[None], (4, 1)).astype(jnp.int32)
  z_t, z_s = (np.asarray(z) for z in relaxation.coupled_rows(jax.random.split(jax.random.PRNGKey(0), 4), clean,
                                                             alpha_t, alpha_s, vocab))
  clean = np.asarray(clean)
  for b in range(4):
    for z, a in ((z_t[b], float(alpha_t[b])), (z_s[b], float(alpha_s[b]))):
      p_keep = a + (1 - a) / vocab  # q(z = x) of the discrete corruption at alpha
      assert abs(np.mean(z == clean[b]) - p_keep) < 5 * np.sqrt(p_keep * (1 - p_keep) / length)  # 5 sigma
    # one eps: from t to s only x's score grows, so a token that is x at t stays x at s, and a token that
    # changes between t and s can only change to x
    assert np.all(z_s[b][z_t[b] == clean[b]] == clean[b][z_t[b] == clean[b]])
    moved = z_t[b] != z_s[b]
    assert np.all(z_s[b][moved] == clean[b][moved])
  np.testing.assert_array_equal(z_t[1], z_s[1])  # equal levels: the same latent


def test_dt_doubles_each_round_up_to_the_student_and_the_teacher_is_refreshed_at_each_start():
  cfg = DistillSettings(method="dcd", teacher_steps=32, student_steps=4, round_steps=3)
  assert distill.num_rounds(cfg) == 4
  dts = [float(distill.step_size(jnp.asarray(s), cfg)) for s in range(15)]
  assert dts == [1 / 32] * 3 + [1 / 16] * 3 + [1 / 8] * 3 + [1 / 4] * 6  # capped at 1 / student_steps
  teacher, student = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
  for step, refreshed in ((0, True), (1, False), (2, False), (3, True), (7, False), (9, True)):
    got = distill.refresh_teacher(teacher, student, jnp.asarray(step), cfg)["w"]
    np.testing.assert_array_equal(got, student["w"] if refreshed else teacher["w"])


def test_pair_times_are_one_step_apart_inside_the_unit_interval():
  u = jnp.linspace(0.0, 1.0, 101)
  t, s = distill.pair_times(u, jnp.float32(0.25))
  t, s = np.asarray(t), np.asarray(s)
  np.testing.assert_allclose(t - s, 0.25, atol=1e-7)
  assert t.min() == pytest.approx(0.25) and t.max() == 1.0 and s.min() >= 0.0
  assert np.mean(t == 1.0) == pytest.approx(0.25, abs=0.02)  # pure noise (the sampler's first step) has mass dt


def test_divergences_match_float64_numpy():
  g = np.random.default_rng(0)
  p_logits, q_logits = g.normal(0, 3, (5, 50)), g.normal(0, 3, (5, 50))
  logp = p_logits - np.log(np.exp(p_logits).sum(-1, keepdims=True))
  logq = q_logits - np.log(np.exp(q_logits).sum(-1, keepdims=True))
  want_fwd = np.sum(np.exp(logp) * (logp - logq), -1)
  want_bwd = np.sum(np.exp(logq) * (logq - logp), -1)
  # fp32 log-softmax of logits within ~|10| carries ~10 * 6e-8 absolute error per entry; weighted by
  # probabilities that sum to 1 the KL errs by a few 1e-6 at most: 2e-5 leaves a margin, while a swapped
  # argument or a missing normalisation changes the value by O(1)
  for name, want in (("kl_fwd", want_fwd), ("kl_bwd", want_bwd)):
    got = distill.DIVERGENCES[name](jnp.asarray(p_logits, jnp.float32), jnp.asarray(q_logits, jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5)
  assert np.all(want_fwd > 0) and not np.allclose(want_fwd, want_bwd)


def test_settings_refuse_a_distillation_without_teacher_or_of_another_kind():
  from configs import demo
  config = demo.get_config()
  config.distill.method = "dcd"
  with pytest.raises(ConfigError, match=r"train\.init_from"):
    settings_lib.from_config(config)
  config.train.init_from = "/somewhere"
  config.distill.teacher_steps = 48
  with pytest.raises(ConfigError, match=r"distill\.teacher_steps.*power of 2"):
    settings_lib.from_config(config)
  config.distill.teacher_steps = 64
  config.diffusion.objective = "ar"
  config.diffusion.canvases_per_row = 1  # (an AR run has no canvases: that check would fire first)
  with pytest.raises(ConfigError, match=r"distill\.method.*uniform-state"):
    settings_lib.from_config(config)
  # the config file validates on its own (describing the demo) and names distill.method as a resume key
  plain, dcd = demo.get_config(), distill_dcd.get_config()
  dcd.train.init_from = "/somewhere"
  assert settings_lib.from_config(dcd).distill.method == "dcd"
  assert any(d.startswith("distill.method") for d in settings_lib.architecture_differences(
      settings_lib.from_config(plain), settings_lib.from_config(dcd)))
  with pytest.raises(FileNotFoundError, match="distill_dcd.py:TEACHER"):
    distill_dcd.get_config("/no/such/workdir")


# ---- the loss on a tiny model ---------------------------------------------------------------------------

CFG = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), vocab_size=64, num_experts=0)
B, L, C = 2, 24, 8


def _batch():
  return random_rows(CFG.vocab_size, B, L)


@pytest.mark.slow  # compiles the tiny model's loss three times
def test_dcd_loss_is_zero_at_its_fixed_point_and_is_the_kl_of_separate_passes():
  loss_cfg = DiffusionSettings(canvas_len=C, self_cond_prob=0.5, encoder_loss_weight=0.0)
  student, other = random_params(CFG, 0), random_params(CFG, 1)
  batch, rng = _batch(), jax.random.PRNGKey(3)
  run = jax.jit(lambda p, t, cfg_steps: distill.dcd_loss(
      p, batch, rng, teacher_params=t, model_cfg=CFG, loss_cfg=loss_cfg, step=jnp.asarray(0),
      distill_cfg=DistillSettings(method="dcd", teacher_steps=cfg_steps, student_steps=1)), static_argnums=2)

  # dt = 2^-24: alpha(s) - alpha(t) ~ 6e-8, so z_s = z_t for all 16 tokens except with probability ~1e-6, and a
  # teacher equal to the student then predicts what the student does: the divergence vanishes up to fp32
  # round-off. The two passes are fused differently (one is differentiated), so their log-probabilities
  # differ by a few ulp of values up to ~10 (~1e-6), and the fp32 KL's first-order term sum p (lp - lq) is of
  # that size at most; 1e-5 bounds it, while any other input or teacher gives a KL of 1e-3 or more.
  value, metrics = run(student, student, 2 ** 24)
  assert abs(float(metrics["distill_divergence"])) < 1e-5 and float(value) == float(metrics["loss"])

  # dt = 1: t = 1 (pure noise) for the student and s = 0 (the clean canvas) for the teacher. Recompute both
  # predictions with separate passes and the KL in float64 numpy.
  _, metrics = run(student, other, 1)
  rng_examples, _ = jax.random.split(rng)
  _, keys_B3 = loss_lib.canvas_keys(rng_examples, jnp.arange(B, dtype=jnp.int32), 1)
  ctx, _ = split_context_canvas(batch, C)
  _, canvas = split_context_canvas(batch, C)
  z_t, z_s = relaxation.coupled_rows(keys_B3[:, 1], jnp.asarray(canvas["tokens"]), jnp.zeros(B), jnp.ones(B),
                                     CFG.vocab_size)
  np.testing.assert_array_equal(z_s, canvas["tokens"])  # alpha(0) = 1: the clean canvas

  def logits(params, noisy):
    apply = lambda *a, **k: Transformer(CFG).apply({"params": params}, *a, mutable=["intermediates"], **k)
    _, cache, _ = loss_lib.encode_context(apply, ctx, model_cfg=CFG)
    out, _ = loss_lib.denoise(apply, cache, canvas, noisy, keys_B3[:, 2], model_cfg=CFG, loss_cfg=loss_cfg,
                              num_canvases=1)
    return np.asarray(out, np.float64)
  log_softmax = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
  lp, lq = log_softmax(logits(other, z_s)), log_softmax(logits(student, z_t))
  want = np.mean(np.sum(np.exp(lp) * (lp - lq), -1))
  # the same fp32 programs inside and outside one jit differ by fusion round-off (~1e-6 relative on logits of
  # a random model, amplified little by a KL of O(1)): 1e-4 relative, against an O(1) value
  assert float(metrics["distill_divergence"]) == pytest.approx(want, rel=1e-4)
  assert float(metrics["distill_dt"]) == 1.0 and float(metrics["corrupted_fraction"]) > 0.8


# ---- the training run --------------------------------------------------------------------------------------

def _distill_config(teacher_dir, tiny_config):
  config = distill_dcd.get_config(str(teacher_dir))
  config.data.files, config.data.cache_dir = tiny_config.data.files, tiny_config.data.cache_dir
  config.distill.teacher_steps, config.distill.student_steps, config.distill.round_steps = 4, 2, 2
  config.train.num_steps, config.train.ckpt_every, config.train.eval_every = 4, 1, 4
  config.train.async_checkpointing, config.train.keep_checkpoints = False, 10
  config.opt.warmup_steps = 1
  return config


@pytest.mark.slow  # three short training runs of the tiny model
def test_distillation_run_refreshes_its_teacher_resumes_exactly_and_loads_as_a_run(tiny_config, tmp_path):
  tiny_config.model.num_experts = 0  # the loop's state, not the model, is under test: a quicker compile
  teacher_dir = tmp_path / "teacher"
  _, teacher_state = save_random_run(tiny_config, teacher_dir)
  config = _distill_config(teacher_dir, tiny_config)
  assert config.model == tiny_config.model and config.train.init_from == str(teacher_dir)

  start = loop.train_and_evaluate(config, str(tmp_path / "start"), stop_after_steps=0)
  # round 0: the student and its teacher both start as the teacher run's params (train.init_from a workdir)
  chex.assert_trees_all_equal(jax.device_get(start.params), jax.device_get(teacher_state.params))
  chex.assert_trees_all_equal(jax.device_get(start.teacher_params), jax.device_get(teacher_state.params))

  full = loop.train_and_evaluate(config, str(tmp_path / "full"))
  # two rounds of two steps: the last round's teacher is the student as it was after step 2
  model_cfg = settings_lib.from_config(config).model
  at_2 = checkpoints.load(tmp_path / "full", step=2).params
  chex.assert_trees_all_equal(jax.device_get(full.teacher_params), jax.device_get(at_2))
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(full.params)),
                                                      jax.tree.leaves(jax.device_get(at_2))))

  loop.train_and_evaluate(config, str(tmp_path / "resumed"), stop_after_steps=3)  # stops inside round 1
  resumed = loop.train_and_evaluate(config, str(tmp_path / "resumed"))
  chex.assert_trees_all_equal(jax.device_get(resumed.params), jax.device_get(full.params))
  chex.assert_trees_all_equal(jax.device_get(resumed.teacher_params), jax.device_get(full.teacher_params))
  chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), jax.device_get(full.opt_state))

  # the student is an ordinary run to every reader (params only: the teacher is never read back)
  loaded = checkpoints.load(tmp_path / "full")
  assert loaded.step == 4 and loaded.model == model_cfg
  chex.assert_trees_all_equal(jax.device_get(loaded.params), jax.device_get(full.params))
  records = (tmp_path / "full" / "metrics.jsonl").read_text()
  assert '"distill_dt": 0.25' in records and '"distill_dt": 0.5' in records
  # resuming the student without distillation is refused, naming the key
  plain = _distill_config(teacher_dir, tiny_config)
  plain.distill.method = "none"
  with pytest.raises(ConfigError, match=r"distill\.method"):
    loop.train_and_evaluate(plain, str(tmp_path / "full"))
