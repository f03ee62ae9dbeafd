"""The RL step of the train loop (rl.algorithm = 'grpo'): rollouts with the jitted sampler, rewards on the host,
and GRPO updates of the policy (the method and its loss: dgemma/rl/grpo.py; the log-likelihoods:
dgemma/rl/policy.py).

`GRPO(settings, optimizer, schedule, state_shardings).bind(tokenizer)` is what the loop calls in place of the
supervised step: (state: RLState, batch of data rows, base_rng) -> (state, metrics), one rollout and
rl.num_iterations optimizer updates (train.num_steps counts updates, `steps_per_call` per call). The prompts are the
batch rows' contexts, their canvases the references rewards may read.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import finetune
from dgemma.errors import ConfigError
from dgemma.model import Transformer
from dgemma.rl import grpo, policy, reward as reward_lib
from dgemma.rl.policy import Rollout
from dgemma.sampling import generation
from dgemma.sampling.config import SamplerConfig
from dgemma.train import step as step_lib
from dgemma.train.state_types import RLState

# Streams of the run's base key (the update draws from fold_in(base, step), as the supervised step does): the
# rollout's sampling keys (row n: fold_in(stream key, n)) and the ELBO's noise.
_ROLLOUT_STREAM, _ELBO_STREAM = 0x5A3, 0xE1B0


def reference_params(params, ref_leaves):
  """The frozen reference: `params` with its trained leaves replaced by the run's start (`RLState.ref_params`)."""
  return finetune.replace_leaves(params, ref_leaves)


def make_update(settings, optimizer, schedule):
  """The jittable update (state: RLState, rollout: Rollout, base_rng) -> (state, metrics): one optimizer step on
  the GRPO loss of `rollout`."""
  model_cfg, rl, ft = settings.model, settings.rl, settings.finetune
  sampler_cfg: SamplerConfig = settings.canvas_sampler
  model = Transformer(model_cfg)
  steps = sampler_cfg.max_denoising_steps
  scored = min(rl.steps_per_update or steps, steps)
  has_frozen = finetune.has_frozen(ft)

  def loss_fn(params, ref, rollout: Rollout, rng):
    if rl.log_likelihood == "elbo":
      ll_N = policy.elbo(model, params, rollout, settings.diffusion, rl.elbo_samples)
      ref_ll_N = jax.lax.stop_gradient(policy.elbo(model, ref, rollout, settings.diffusion, rl.elbo_samples))
      old_ll_N = jax.lax.stop_gradient(ll_N) if rollout.old_ll_N is None else rollout.old_ll_N
      length_N = jnp.sum(rollout.valid_NC, axis=-1)
      return grpo.sequence_loss(ll_N, old_ll_N, ref_ll_N, length_N, rollout.advantages_N, rl)
    decode = policy.prompt_decoder(model, params, rollout.prompt_NP, rollout.lengths_N, rollout.tokens_NC.shape[-1])
    ref_decode = policy.prompt_decoder(model, ref, rollout.prompt_NP, rollout.lengths_N, rollout.tokens_NC.shape[-1])
    chosen_K = (jnp.arange(steps, dtype=jnp.int32) if scored == steps
                else jax.random.permutation(rng, steps)[:scored].astype(jnp.int32))

    def one(_, s):
      logp_NCV, lp_NC = policy.step_draws(decode, rollout, sampler_cfg, s)
      ref_logp_NCV, _ = policy.step_draws(ref_decode, rollout, sampler_cfg, s)
      kl_NC = grpo.position_kl(logp_NCV, jax.lax.stop_gradient(ref_logp_NCV))
      return None, (lp_NC, kl_NC)

    _, (lp_KNC, kl_KNC) = jax.lax.scan(one, None, chosen_K)
    old_KNC = jax.lax.stop_gradient(lp_KNC) if rollout.old_lp_SNC is None else rollout.old_lp_SNC[chosen_K]
    draws_total_N = jnp.sum(rollout.draws_SNC, axis=(0, 2)).astype(jnp.float32)
    return grpo.trajectory_loss(lp_KNC, old_KNC, rollout.draws_SNC[chosen_K], kl_KNC, rollout.advantages_N,
                           draws_total_N, steps / scored, rl)

  def update(state: RLState, rollout: Rollout, base_rng):
    rng = jax.random.fold_in(base_rng, state.step)
    ref = reference_params(state.params, state.ref_params)
    if has_frozen:
      trainable, frozen = finetune.split(state.params, finetune.trainable_mask(state.params, ft))
      objective = lambda t: loss_fn(finetune.join(t, frozen), ref, rollout, rng)
    else:
      trainable, objective = state.params, lambda p: loss_fn(p, ref, rollout, rng)
    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return step_lib.apply_gradients(state, grads, dict(metrics, loss=loss), optimizer, schedule, ft,
                                    settings.train.nonfinite == "skip")
  return update


def prompts_of(batch: dict, canvas_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(prompts [B, P] right-padded, lengths [B], reference canvases [B, C]) of a batch of data rows: the prompt is
  a row's context (its tokens before the last canvas whose segment id is not 0; left padding dropped), the
  reference the row's canvas."""
  tokens = np.asarray(batch["tokens"])
  seg = np.asarray(batch["segment_ids"])
  context, ctx_seg = tokens[:, :-canvas_len], seg[:, :-canvas_len]
  lengths = (ctx_seg != 0).sum(axis=1).astype(np.int32)
  prompts = np.full(context.shape, pad_id, np.int32)
  for b in range(tokens.shape[0]):
    prompts[b, :lengths[b]] = context[b][ctx_seg[b] != 0]
  return prompts, np.maximum(lengths, 1), tokens[:, -canvas_len:]


def texts(tokenizer, tokens_NT, lengths_N=None) -> list[str]:
  """Each row's text: its first lengths_N[n] tokens (all without lengths), BOS, PAD and -1 left out."""
  drop = {getattr(tokenizer, "bos_id", None), getattr(tokenizer, "pad_id", None)}
  out = []
  for n, row in enumerate(np.asarray(tokens_NT)):
    ids = row[:lengths_N[n]] if lengths_N is not None else row
    out.append(tokenizer.decode([int(t) for t in ids if t >= 0 and int(t) not in drop]))
  return out


def check(settings) -> None:
  """What the run needs before anything is built: one process (the rollout's rewards are scored on one host), and
  the reward function (rl.reward_fn is imported here, so a typo fails at once)."""
  if jax.process_count() > 1:
    raise ConfigError(f"rl.algorithm={settings.rl.algorithm!r}: runs in one process (got {jax.process_count()})")
  reward_lib.scorer(settings.rl)


class GRPO:
  """The RL step of the train loop (module docstring): (state, batch of data rows, base_rng) -> (state, metrics),
  advancing state.step by rl.num_iterations (`steps_per_call`)."""

  def __init__(self, settings, optimizer, schedule, state_shardings):
    self.settings = settings
    self.rl = settings.rl
    self.sampler_cfg = settings.canvas_sampler
    self.model = Transformer(settings.model)
    self.canvas_len = settings.diffusion.canvas_len
    self.steps_per_call = settings.rl.num_iterations
    self.score = reward_lib.scorer(settings.rl)
    self.update = jax.jit(make_update(settings, optimizer, schedule), in_shardings=(state_shardings, None, None),
                          out_shardings=(state_shardings, None), donate_argnums=(0,))
    model = self.model
    sampler_cfg = self.sampler_cfg
    self._replay = jax.jit(lambda params, rollout: policy.replay(model, params, rollout, sampler_cfg))
    self._old_elbo = jax.jit(lambda params, rollout: policy.elbo(model, params, rollout, settings.diffusion,
                                                                 settings.rl.elbo_samples))

  def bind(self, tokenizer):
    """The loop's step: (state, batch, base_rng) -> (state, metrics) with the run's tokenizer (rewards read text)."""
    step = functools.partial(self.__call__, tokenizer=tokenizer)
    step.steps_per_call = self.steps_per_call
    return step

  def rollout(self, state: RLState, batch: dict, base_rng, tokenizer) -> tuple[Rollout, np.ndarray]:
    """(the samples of one RL step with their advantages, their rewards)."""
    rl, C = self.rl, self.canvas_len
    host = jax.device_get(batch)
    prompts, lengths, references = prompts_of(host, C, tokenizer.pad_id)
    live = np.asarray(host["segment_ids"]).any(axis=1)  # a topped-up batch's padding rows are not prompts
    prompts, lengths, references = prompts[live], lengths[live], references[live]
    prompt_NP, lengths_N = np.repeat(prompts, rl.group_size, 0), np.repeat(lengths, rl.group_size, 0)
    step = int(state.step)
    rng = jax.random.fold_in(jax.random.fold_in(base_rng, _ROLLOUT_STREAM), step)
    out = generation.generate(self.model, state.params, prompt_NP, lengths_N, self.sampler_cfg, rng, C,
                              return_trajectory="first")
    traj = jax.tree.map(lambda x: x[0], out.trajectory)
    draws_SNC = policy.kept_draws(traj)
    tokens_NC = np.asarray(out.tokens_BN)
    valid_NC = np.arange(C)[None] < np.asarray(out.lengths_B)[:, None]
    # each prompt and reference decoded once, then repeated for its group
    group = lambda items: [item for item in items for _ in range(rl.group_size)]
    prompt_texts, ref_texts = group(texts(tokenizer, prompts, lengths)), group(texts(tokenizer, references))
    rewards = self.score(prompt_texts, texts(tokenizer, tokens_NC, np.asarray(out.lengths_B)), ref_texts)
    advantages = grpo.group_advantages(rewards, rl.group_size, rl.advantage_eps)
    rollout = Rollout(prompt_NP=jnp.asarray(prompt_NP), lengths_N=jnp.asarray(lengths_N),
                      canvas_SNC=traj.canvas_SBC, sampled_SNC=traj.sampled_SBC, draws_SNC=draws_SNC,
                      tokens_NC=jnp.asarray(tokens_NC), valid_NC=jnp.asarray(valid_NC),
                      advantages_N=jnp.asarray(advantages, jnp.float32),
                      elbo_key=jax.random.fold_in(jax.random.fold_in(base_rng, _ELBO_STREAM), step))
    if rl.log_likelihood == "trajectory" and (rl.num_iterations > 1 or self.settings.model.self_conditioning):
      old_lp, sc = self._replay(state.params, rollout)
      rollout = rollout.replace(old_lp_SNC=old_lp if rl.num_iterations > 1 else None, sc_SNCV=sc)
    if rl.log_likelihood == "elbo" and rl.num_iterations > 1:
      rollout = rollout.replace(old_ll_N=self._old_elbo(state.params, rollout))
    return rollout, rewards

  def __call__(self, state: RLState, batch: dict, base_rng, *, tokenizer):
    start = time.perf_counter()
    rollout, rewards = self.rollout(state, batch, base_rng, tokenizer)
    per_update = []
    for _ in range(self.rl.num_iterations):
      state, metrics = self.update(state, rollout, base_rng)
      per_update.append(metrics)
    metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *per_update)
    metrics["nonfinite"] = jnp.max(jnp.stack([m["nonfinite"] for m in per_update]))
    draws = float(jnp.sum(rollout.draws_SNC)) / rewards.shape[0]
    groups = rewards.reshape(-1, self.rl.group_size)
    metrics.update(reward_mean=float(rewards.mean()), reward_std=float(groups.std(axis=1, ddof=1).mean()),
                   # GRPO's effective batch: a group whose rewards are all equal has advantage 0 and teaches nothing
                   groups_with_signal=float(np.mean(groups.max(axis=1) > groups.min(axis=1))),
                   draws_per_sample=draws, samples_per_sec=rewards.shape[0] / (time.perf_counter() - start))
    return state, metrics
