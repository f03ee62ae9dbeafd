"""Discrete consistency distillation (DCD): a few-step student from a trained uniform-state teacher.

Duo (Sahoo et al., ICML 2025, "The Diffusion Duality", arXiv 2506.10892, section 4). Consistency distillation
needs pairs of noisy inputs on one deterministic trajectory, and uniform-state diffusion has no probability-flow
ODE. Its Gaussian relaxation does (dgemma/diffusion/relaxation.py): the DDIM path through the clean x keeps
one eps, w_t = a_t e_x + s_t eps, and the argmax of every point on it is a uniform-state latent with exactly
the marginal of our corruption (`relaxation.coupled_rows`). For a training row:

  t = min(u + dt, 1) with u ~ the training times,  s = t - dt         (so t = 1, pure noise, has mass dt)
  z_t, z_s = argmax of one Gaussian trajectory at alpha(t), alpha(s)
  loss = D(teacher(z_s) || student(z_t)) per canvas token             (`DIVERGENCES`, forward KL by default)

so the student learns to predict from z_t what the teacher predicts one step of size dt closer to the data,
i.e. to jump dt in one pass. Both predictions are the network's own softmax (whatever the objective's output
stands for), each from the full training forward pass (clean-context encoder, then the self-conditioned
decoder with the same per-canvas self-conditioning draw), the teacher's under stop_gradient.

Rounds (`distill.round_steps` training steps each): the teacher is a frozen copy of the student taken at the
start of every round (round 0: the trained run the student starts from, `train.init_from`), and dt doubles
each round from 1 / teacher_steps up to 1 / student_steps: with teacher_steps = 64 and student_steps = 4, five
rounds distil a 64-step teacher into a 4-step student, each round halving the steps the last one needed.
The teacher's parameters live in the train state (`dgemma.train.state_types.DistillState`), so a resumed run
continues with exactly the teacher it was using.

Given (infilled) canvas tokens stay clean in both latents and are not scored, as in training. The student's
encoder keeps the run's next-token loss (diffusion.encoder_loss_weight) and its router losses.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dgemma.diffusion import loss as loss_lib
from dgemma.diffusion import relaxation, schedules
from dgemma.diffusion.corruption import split_context_canvas
from dgemma.model import ModelConfig, Transformer


# ---- divergences between the teacher's and the student's token distributions -----------------------------

def kl_forward(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
  """KL(teacher || student) per token over the last axis, fp32 (mode-covering; Duo's default)."""
  log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def kl_backward(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
  """KL(student || teacher) per token, fp32 (mode-seeking)."""
  return kl_forward(student_logits, teacher_logits)


# distill.divergence -> (teacher logits, student logits) -> per-token divergence
DIVERGENCES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "kl_fwd": kl_forward,
    "kl_bwd": kl_backward,
}

METHODS = ("none", "dcd")


def enabled(distill_cfg) -> bool:
  return distill_cfg is not None and distill_cfg.method == "dcd"


def num_rounds(distill_cfg) -> int:
  """Rounds until dt reaches 1 / student_steps: log2(teacher_steps / student_steps) + 1."""
  return int(round(math.log2(distill_cfg.teacher_steps / distill_cfg.student_steps))) + 1


def round_index(step: jax.Array, distill_cfg) -> jax.Array:
  return jnp.asarray(step, jnp.int32) // distill_cfg.round_steps


def step_size(step: jax.Array, distill_cfg) -> jax.Array:
  """dt of training step `step`: 2^round / teacher_steps, at most 1 / student_steps (fp32 scalar)."""
  doubled = jnp.exp2(jnp.minimum(round_index(step, distill_cfg), num_rounds(distill_cfg) - 1).astype(jnp.float32))
  return doubled / distill_cfg.teacher_steps


def refresh_teacher(teacher_params: Any, params: Any, step: jax.Array, distill_cfg) -> Any:
  """The teacher for training step `step`: the student's parameters at the first step of each round, else the
  teacher as it was."""
  new_round = (jnp.asarray(step, jnp.int32) % distill_cfg.round_steps) == 0
  return jax.tree.map(lambda p, t: jnp.where(new_round, p, t), params, teacher_params)


def pair_times(u_B: jax.Array, dt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(t, s) = (min(u + dt, 1), t - dt): the student's time and the teacher's, one step of size dt apart."""
  t_B = jnp.minimum(u_B + dt, 1.0)
  return t_B, t_B - dt


def dcd_loss(params: Any, batch: dict[str, jax.Array], rng: jax.Array, *, teacher_params: Any, model_cfg: ModelConfig,
             loss_cfg, distill_cfg, step: jax.Array, example_ids_B: jax.Array | None = None,
             totals: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The DCD loss of the student `params` against `teacher_params` on packed rows (module docstring).

  Same contract as `dgemma.diffusion.loss.diffusion_loss` (per-example noise from the global row index,
  whole-batch normalisers in `totals`, so micro-batches add up). Returns (loss, metrics): `distill_divergence`
  (the scored term), `distill_dt`, the student's `canvas_ce` / `canvas_accuracy` against the clean tokens at t,
  the teacher's `teacher_canvas_ce` at s, `encoder_loss` and router losses.
  """
  model = Transformer(model_cfg)
  batch_size = batch["tokens"].shape[0]
  if example_ids_B is None:
    example_ids_B = jnp.arange(batch_size, dtype=jnp.int32)
  if totals is None:
    totals = loss_lib.batch_totals(batch, loss_cfg)
  router_scale = batch_size / totals["examples"]
  rng_examples, rng_batch = jax.random.split(rng)
  K, C, V = loss_cfg.canvases_per_row, loss_cfg.canvas_len, model_cfg.vocab_size
  ctx, _ = split_context_canvas(batch, C)
  _, canvas = split_context_canvas(batch, K * C)
  example_ids_B, keys_B3 = loss_lib.canvas_keys(rng_examples, example_ids_B, K)

  dt = step_size(step, distill_cfg)
  u_B = loss_lib.sample_times(keys_B3[:, 0], example_ids_B, rng_batch, totals["examples"] * K, loss_cfg)
  t_B, s_B = pair_times(u_B, dt)
  alpha_t_B, _ = schedules.alpha_and_derivative(loss_cfg.schedule, t_B, loss_cfg.schedule_eps)
  alpha_s_B, _ = schedules.alpha_and_derivative(loss_cfg.schedule, s_B, loss_cfg.schedule_eps)
  clean_BC = canvas["tokens"].reshape(-1, C)
  z_t, z_s = relaxation.coupled_rows(keys_B3[:, 1], clean_BC, alpha_t_B, alpha_s_B, V)
  z_t, z_s = z_t.reshape(batch_size, K * C), z_s.reshape(batch_size, K * C)
  if "infill_mask" in canvas:  # given canvas tokens stay clean in both latents
    held_BC = canvas["infill_mask"] != 0
    z_t = jnp.where(held_BC, canvas["tokens"], z_t)
    z_s = jnp.where(held_BC, canvas["tokens"], z_s)

  def forward(p, noisy_BC, want_enc_logits):
    apply = lambda *a, **k: model.apply({"params": p}, *a, mutable=["intermediates"], **k)
    enc_logits_BTV, cache, enc_vars = loss_lib.encode_context(
        apply, ctx, model_cfg=model_cfg, want_enc_logits=want_enc_logits or model_cfg.decoder_shift)
    prev_BKV = (loss_lib.logits_before_canvases(enc_logits_BTV, batch["tokens"].shape[1], C, K)
                if model_cfg.decoder_shift else None)
    logits_BCV, dec_vars = loss_lib.denoise(apply, cache, canvas, noisy_BC, keys_B3[:, 2], model_cfg=model_cfg,
                                            loss_cfg=loss_cfg, num_canvases=K, prev_logits_BKV=prev_BKV)
    return logits_BCV, enc_logits_BTV, (enc_vars, dec_vars)

  teacher_BCV, _, _ = forward(jax.lax.stop_gradient(teacher_params), z_s, False)
  teacher_BCV = jax.lax.stop_gradient(teacher_BCV)
  want_enc_logits = loss_cfg.encoder_loss_weight > 0
  student_BCV, enc_logits_BTV, (enc_vars, dec_vars) = forward(params, z_t, want_enc_logits)

  canvas_w_BC = loss_lib.target_mask(canvas).astype(jnp.float32)
  n_canvas = jnp.maximum(totals["canvas_tokens"], 1.0)
  divergence_BC = DIVERGENCES[distill_cfg.divergence](teacher_BCV, student_BCV)
  divergence = jnp.sum(divergence_BC * canvas_w_BC) / n_canvas
  targets_BC = canvas["tokens"]
  ce_sum, n_local, correct = loss_lib.masked_cross_entropy(student_BCV, targets_BC, canvas_w_BC)
  teacher_ce_sum, _, _ = loss_lib.masked_cross_entropy(teacher_BCV, targets_BC, canvas_w_BC)
  metrics = {"distill_divergence": divergence, "canvas_loss": divergence, "canvas_ce": ce_sum / n_canvas,
             "canvas_accuracy": correct / n_canvas, "teacher_canvas_ce": teacher_ce_sum / n_canvas,
             "canvas_tokens": n_local,
             "corrupted_fraction": jnp.sum((z_t != targets_BC) * canvas_w_BC) / n_canvas,
             "distill_dt": dt * router_scale}  # (additive over micro-batches, like the router losses)
  loss = divergence
  if want_enc_logits:
    metrics["encoder_loss"] = loss_lib.encoder_next_token_loss(enc_logits_BTV, ctx, totals)
    loss = loss + loss_cfg.encoder_loss_weight * metrics["encoder_loss"]
  loss = loss + loss_lib.add_router_losses(metrics, [enc_vars, dec_vars], model_cfg, router_scale)
  metrics["loss"] = loss
  return loss, metrics


def make_loss_fn(teacher_params: Any, *, model_cfg: ModelConfig, loss_cfg, distill_cfg, step: jax.Array):
  """`dcd_loss` with the teacher and the step bound: loss_fn(params, batch, rng, example_ids_B=, totals=)."""
  return functools.partial(dcd_loss, teacher_params=teacher_params, model_cfg=model_cfg, loss_cfg=loss_cfg,
                           distill_cfg=distill_cfg, step=step)
