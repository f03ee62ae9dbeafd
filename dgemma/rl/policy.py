"""The policy's log-likelihoods of its own samples, under any parameters: what GRPO's ratio and KL read
(dgemma/rl/grpo.py).

Trajectory (`rl.log_likelihood='trajectory'`). The released sampler (dgemma/sampling/sampler.py) draws, at step s,
a token at every canvas position from p_s = softmax(shape(logits_theta(canvas_s) / T_s)), accepts the lowest-entropy
draws and re-noises the rest with fresh uniform tokens (or, renoise='none', leaves them). Given the canvas, the
acceptance set and the argmax output are functions of the model, not of the draws, and the re-noise tokens do not
depend on it; the draws that were not accepted never reach the canvas, and their factor sums to one. So the
probability of the canvases the sampler went through is, exactly,

  log p_theta(trajectory) = sum_s sum_{i accepted at s} log p_s(sampled_{s,i})  (+ terms free of theta)

and (away from the measure-zero ties where a small change of theta changes an acceptance set or the argmax) its
gradient is the score-function gradient of any reward of the output, as DDPO (Black et al. 2023) uses for image
diffusion. Masked-diffusion RL (d1 / diffu-GRPO, wd1) must approximate this quantity; the uniform-state sampler
gives it. `replay` recomputes it step by step from a recorded trajectory (its canvases, draws and acceptance masks);
a model with self-conditioning also reads the previous step's tempered logits, recomputed in `replay` under the
parameters given and then held fixed as inputs of each step (`step_draws`), so that an update may score a random
subset of the steps (`rl.steps_per_update`).

ELBO (`rl.log_likelihood='elbo'`, ESPO / wd1 style): the completion's log-likelihood bounded below by the canvas
NELBO of the training objective (dgemma.diffusion.likelihood.canvas_bound_terms), estimated at `rl.elbo_samples`
antithetic times with noise fixed per sample, so the policy, the rollout policy and the reference are compared on
the same draws.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from dgemma.diffusion import likelihood
from dgemma.model import Transformer, init_cache, layers
from dgemma.sampling import rules
from dgemma.sampling.config import SamplerConfig
from dgemma.sampling.generation import last_valid_logits


@struct.dataclass
class Rollout:
  """One batch of samples, N = prompts x group_size rows (a group's rows are contiguous).

  prompt_NP / lengths_N: the right-padded prompts; canvas_SNC: the decoder input of step s; sampled_SNC: the
  step's draws; draws_SNC: the draws that went onto the canvas (accepted, not infilled, the row still running);
  tokens_NC / valid_NC: the output (cut after its end token); advantages_N: group-normalised rewards;
  old_lp_SNC: the draws' log-probabilities under the rollout's parameters (None: the update's own, held fixed:
  one update per rollout); sc_SNCV: self-conditioning inputs of each step (None without self-conditioning);
  old_ll_N: the rollout policy's ELBO of the output ('elbo'; None with one update per rollout); elbo_key: the key
  of the ELBO's times and noise."""
  prompt_NP: jax.Array
  lengths_N: jax.Array
  canvas_SNC: jax.Array
  sampled_SNC: jax.Array
  draws_SNC: jax.Array
  tokens_NC: jax.Array
  valid_NC: jax.Array
  advantages_N: jax.Array
  elbo_key: jax.Array
  old_lp_SNC: Optional[jax.Array] = None
  sc_SNCV: Optional[jax.Array] = None
  old_ll_N: Optional[jax.Array] = None


def kept_draws(traj) -> jax.Array:
  """[S, N, C] the draws of a recorded trajectory (`dgemma.sampling.sampler.Trajectory` of one canvas) that went
  onto the canvas: accepted at a step the row ran (the sampler's `accepted` also holds infilled positions: rollouts
  infill none)."""
  return traj.accepted_SBC & traj.active_SB[..., None]


def prompt_decoder(model: Transformer, params: Any, prompt_NP: jax.Array, lengths_N: jax.Array,
                   canvas_len: int) -> Callable:
  """decode(canvas_NC, sc_logits_NCV | None, sc_mask_N | None) -> logits [N, C, V] in at least fp32 of the first canvas after
  each prompt, as the sampler decodes it (the prompt encoded once into a cache, the canvas at positions
  length + [0, C))."""
  cfg = model.cfg
  batch, prompt_len = prompt_NP.shape
  apply = lambda *a, **k: model.apply({"params": params}, *a, **k)
  cache = init_cache(cfg, batch, prompt_len, dtype=jnp.dtype(cfg.dtype))
  iota_P = jnp.arange(prompt_len, dtype=jnp.int32)
  seg_NP = (iota_P[None] < lengths_N[:, None]).astype(jnp.int32)
  enc_NPV, cache = apply(prompt_NP, jnp.broadcast_to(iota_P, (batch, prompt_len)), seg_NP, cache,
                         return_logits=cfg.decoder_shift, method="encode")
  prev = last_valid_logits(enc_NPV, lengths_N)[:, None].astype(jnp.float32) if cfg.decoder_shift else None
  pos_NC = lengths_N[:, None] + jnp.arange(canvas_len, dtype=jnp.int32)[None]
  ones_NC = jnp.ones((batch, canvas_len), jnp.int32)

  def decode(canvas_NC, sc_NCV=None, sc_mask_N=None):
    signal = dict(sc_logits_BCV=sc_NCV, sc_mask_B=sc_mask_N) if cfg.self_conditioning else {}
    logits = apply(canvas_NC, pos_NC, ones_NC, cache, method="decode", prev_logits_BKV=prev, **signal)
    return logits.astype(layers.at_least_f32(logits.dtype))
  return decode


def tempered_log_probs(logits_NCV: jax.Array, cfg: SamplerConfig, step) -> tuple[jax.Array, jax.Array]:
  """(log p_s [N, C, V], the tempered and shaped logits) of step `step`: what the released sampler draws from."""
  proc_NCV = rules.shape_logits(logits_NCV / rules.temperature(cfg, step), cfg)
  return jax.nn.log_softmax(proc_NCV, axis=-1), proc_NCV


def draw_log_probs(logp_NCV: jax.Array, sampled_NC: jax.Array) -> jax.Array:
  """log p of each position's draw [N, C] (positions without a draw, -1, read id 0: mask them)."""
  return jnp.take_along_axis(logp_NCV, jnp.maximum(sampled_NC, 0)[..., None], axis=-1)[..., 0]


def sc_mask(cfg: SamplerConfig, step, batch: int) -> jax.Array:
  """Whether step `step` reads a self-conditioning signal [N]: from the second step on, unless the sampler's
  sample.self_conditioning turns it off (as the sampler's loop decides)."""
  return jnp.broadcast_to((step > 0) & cfg.self_conditioning, (batch,))


def replay(model: Transformer, params: Any, rollout: Rollout, cfg: SamplerConfig) -> tuple[jax.Array, Any]:
  """(log-probabilities of every step's draws [S, N, C] under `params` (0 where no draw), self-conditioning inputs
  [S, N, C, V] or None): the recorded trajectory replayed step by step, each step's self-conditioning input being
  the previous step's tempered logits under the same params (none at step 0), as the sampler formed them."""
  decode = prompt_decoder(model, params, rollout.prompt_NP, rollout.lengths_N, rollout.canvas_SNC.shape[-1])
  steps, batch = rollout.canvas_SNC.shape[:2]
  use_sc = bool(model.cfg.self_conditioning)
  sc_dtype = jnp.dtype(model.cfg.param_dtype)  # the sampler keeps the signal in the embedding's dtype (HF)

  def one(sc_NCV, xs):
    s, canvas_NC, sampled_NC, draws_NC = xs
    logits = decode(canvas_NC, sc_NCV, sc_mask(cfg, s, batch)) if use_sc else decode(canvas_NC)
    logp_NCV, proc_NCV = tempered_log_probs(logits, cfg, s)
    lp_NC = jnp.where(draws_NC, draw_log_probs(logp_NCV, sampled_NC), 0.0)
    return (proc_NCV.astype(sc_dtype) if use_sc else sc_NCV), (lp_NC, sc_NCV if use_sc else None)

  vocab = model.cfg.vocab_size
  sc0 = jnp.zeros((batch, rollout.canvas_SNC.shape[-1], vocab), sc_dtype) if use_sc else None
  _, (lp_SNC, sc_SNCV) = jax.lax.scan(one, sc0, (jnp.arange(steps, dtype=jnp.int32), rollout.canvas_SNC,
                                                   rollout.sampled_SNC, rollout.draws_SNC))
  return lp_SNC, sc_SNCV


def step_draws(decode: Callable, rollout: Rollout, cfg: SamplerConfig, step):
  """(log p_s [N, C, V], log-probabilities of the step's draws [N, C]) of one recorded step `step` (a traced int)
  under the decoder `decode` (`prompt_decoder`), reading the rollout's self-conditioning input of that step (a
  model with self-conditioning has them: `replay` stored them)."""
  canvas_NC = rollout.canvas_SNC[step]
  if rollout.sc_SNCV is not None:
    logits = decode(canvas_NC, rollout.sc_SNCV[step], sc_mask(cfg, step, canvas_NC.shape[0]))
  else:
    logits = decode(canvas_NC)
  logp_NCV, _ = tempered_log_probs(logits, cfg, step)
  return logp_NCV, draw_log_probs(logp_NCV, rollout.sampled_SNC[step])


def elbo(model: Transformer, params: Any, rollout: Rollout, loss_cfg, num_t: int) -> jax.Array:
  """The ELBO of each output [N] under `params` (nats, a lower bound on log p(output | prompt)): minus the canvas
  NELBO over its valid tokens at `num_t` antithetic times, the times and noise from `rollout.elbo_key` (row n:
  fold_in(key, n)). With self-conditioning, training's second pass (the first pass's logits as the signal)."""
  decode = prompt_decoder(model, params, rollout.prompt_NP, rollout.lengths_N, rollout.tokens_NC.shape[-1])
  use_sc = bool(model.cfg.self_conditioning)

  def logits_fn(noisy_NC, alpha_N):
    del alpha_N
    logits = decode(noisy_NC)
    return decode(noisy_NC, logits, None) if use_sc else logits

  keys_N = jax.vmap(lambda n: jax.random.fold_in(rollout.elbo_key, n))(
      jnp.arange(rollout.tokens_NC.shape[0], dtype=jnp.int32))
  integrand_NM, recon_N = likelihood.canvas_bound_terms(logits_fn, rollout.tokens_NC, rollout.valid_NC, keys_N,
                                                        num_t=num_t, loss_cfg=loss_cfg,
                                                        vocab_size=model.cfg.vocab_size)
  return -((1.0 - loss_cfg.t_eps) * jnp.mean(integrand_NM, axis=-1) + recon_N)
