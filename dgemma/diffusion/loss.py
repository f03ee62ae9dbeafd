"""Uniform-state discrete diffusion: corruption and the DiffusionGemma training loss.

Recipe (../shared/reference/diffusiongemma.md, "Training recipe"): one diffusion time per example
t ~ U(eps, 1), alpha(t) = 1 - t; every canvas token is replaced by a uniformly random vocabulary token
with probability 1 - alpha(t) = t; the loss is the plain cross-entropy of the clean token at every
canvas position (corrupted or not), plus a next-token loss on the encoder's causal logits over the
clean context. A packed row of `seq_len` tokens is split into a clean context (the first
seq_len - canvas_len tokens) and one canvas (the last canvas_len tokens), so the model learns
block-autoregressive generation.

Block-causal multi-canvas training (`diffusion.canvases_per_row` = K > 1): the last K * canvas_len
tokens of the row are K canvases, each noised independently (its own t) and all denoised in ONE
decoder pass whose mask lets canvas k see itself and the clean cache before its start
(dgemma/model/attention.py). The encoder pass is the same as for K = 1 (clean row up to the last
canvas), so canvas k is conditioned on the clean text before it and never on any noisy token:
the loss equals the single-canvas loss of each row cut after canvas k, summed over k (noise of
canvas k drawn as for example `id * K + k`); K = 1 is exactly the single-canvas loss.

Short canvases (`diffusion.short_canvas_len` = S > 0): a second decoder pass over the same encoder cache
denoises the row's last A * S tokens as A canvases of S tokens each (A = `diffusion.short_canvases_per_row`, 0 =
as many as the configured canvases cover), block-causally as above, with their own noise; the loss adds
`short_canvas_weight` * (their canvas loss) to (1 - short_canvas_weight) * (the configured canvases' loss). The
encoder then reads the row up to the last canvas of the shorter kind, and each decoder pass reads the cache
only up to its own canvases' start, so every canvas still sees exactly the clean text before it. Short
canvases put every target within S tokens of clean text: on the Markov source (docs/experiments/likelihood_small.md) a 32-token canvas loss alone leaves the decoder predicting letter frequencies
for hundreds of steps, and two-token canvases in every step teach it to read its context. The short pass
has no self-conditioning (its signal is zero, as at the sampler's first step) and is training only:
evaluation (`eval_metrics`) scores the configured canvases alone, so runs with and without it compare.

Shifted decoder output (`model.decoder_shift`, dgemma/model/config.py): the encoder's logits are computed even
without the encoder loss, and those at the clean token before each canvas (`logits_before_canvases`) score the
canvas's first position; every decoder pass above (the short one and the self-conditioning one included) shifts.

Per-token targets: a batch may carry `loss_mask` [B, L] (SFT: 1 on response tokens, 0 on the
prompt). Canvas tokens are scored only where it is 1, and the encoder's next-token loss only on
targets where it is 1. Without it every non-padding token is a target.

Infilled canvas tokens: a batch may carry `infill_mask` [B, L] (1 on canvas tokens that are given,
e.g. a puzzle's givens, which a study's data source may mark). Those tokens stay clean at every t and
are never scored, so training matches sampling with the same tokens held by the sampler's infilling
(`generate(..., infill_tokens_BN, infill_mask_BN)`): the model learns to denoise the rest around them.

`diffusion.objective` swaps the canvas loss (dgemma/diffusion/objectives.py): base_ce (released), reweighted_ce,
loo_ce, reweighted_loo_ce, loo_replaced_ce (reads the corruption's draw mask), nelbo (uniform-state NELBO),
mdlm (masked-diffusion baseline: tokens replaced by `mask_id` with probability 1 - alpha) and ar (no canvas:
next-token CE of the causal encoder over the whole row). On Duo's curriculum steps the draw mask is the
argmax's z != x, so loo_replaced_ce is not exact there.

Duo's curriculum (`diffusion.curriculum_steps` > 0, dgemma/diffusion/relaxation.py): for the first training
steps the canvas is drawn as the argmax of a Gaussian latent with exactly the uniform-state marginal at
alpha(t), and the decoder reads the latent's tempered softmax instead of the argmax's one-hot; the objective
is scored at the argmax as usual (at Duo's times, log-SNR uniform on a window, with
`curriculum_alpha_range`). Later steps draw the ordinary corruption and feed it as one-hot rows, the
discrete recipe exactly. `corrupted_fraction` counts z != x on relaxed steps (a uniform draw of the clean
token itself counts as replaced on discrete ones).

Randomness is drawn per example from fold_in(rng, global example index), so a batch split into
micro-batches (gradient accumulation) sees exactly the noise of the whole batch; losses are sums
divided by whole-batch token counts (`batch_totals`), so micro-batch losses add up to the batch loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dgemma import reductions
from dgemma.diffusion import objectives, relaxation, schedules
from dgemma.diffusion.corruption import corrupt_rows, split_context_canvas
from dgemma.model import ModelConfig, Transformer, init_cache


def masked_cross_entropy(logits_BNV: jax.Array, targets_BN: jax.Array, weights_BN: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (sum of weighted CE, sum of weights, sum of weighted correct argmax), all fp32."""
  ce_BN = objectives.cross_entropy(logits_BNV, targets_BN)
  weights_BN = weights_BN.astype(jnp.float32)
  correct_BN = (reductions.argmax(logits_BNV) == targets_BN).astype(jnp.float32)
  return jnp.sum(ce_BN * weights_BN), jnp.sum(weights_BN), jnp.sum(correct_BN * weights_BN)


def next_token_weights(segment_ids_BT: jax.Array, targets_BT: jax.Array | None = None) -> jax.Array:
  """w[:, i] for target i+1 predicted at i: both tokens in the same (non-padding) document, and
  token i+1 a target (`targets_BT`, e.g. `target_mask`; None = every token)."""
  w = (segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & (segment_ids_BT[:, 1:] != 0)
  return w if targets_BT is None else w & targets_BT[:, 1:]


def target_mask(batch: dict[str, jax.Array]) -> jax.Array:
  """[B, L] bool: tokens the losses may score (non-padding, `loss_mask` where the batch has one, and
  not an infilled token of `infill_mask`)."""
  mask = batch["segment_ids"] != 0
  if "loss_mask" in batch:
    mask = mask & (batch["loss_mask"] != 0)
  if "infill_mask" in batch:
    mask = mask & (batch["infill_mask"] == 0)
  return mask


def training_only(loss_cfg):
  """`loss_cfg` as evaluation reads it: the configured canvases, without the training-only short ones."""
  return dataclasses.replace(loss_cfg, short_canvas_len=0) if loss_cfg.short_canvas_len else loss_cfg


def batch_totals(batch: dict[str, jax.Array], loss_cfg) -> dict[str, jax.Array]:
  """Whole-batch normalisers: examples, scored canvas tokens (and short canvas tokens, when trained), encoder
  next-token targets (fp32)."""
  seg_BL = batch["segment_ids"]
  tgt_BL = target_mask(batch)
  f32 = lambda x: jnp.sum(x.astype(jnp.float32))
  out = {"examples": jnp.asarray(seg_BL.shape[0], jnp.float32)}
  if objectives.get(loss_cfg.objective).autoregressive:
    enc_w = next_token_weights(seg_BL, tgt_BL)
    canvas_w = enc_w[:, -loss_cfg.canvas_len:]
  else:
    ctx_len = loss_cfg.encoder_len(seg_BL.shape[1])
    enc_w = next_token_weights(seg_BL[:, :ctx_len], tgt_BL[:, :ctx_len])
    canvas_w = tgt_BL[:, -loss_cfg.canvas_len * loss_cfg.canvases_per_row:]
    if loss_cfg.short_canvas_len:
      out["short_canvas_tokens"] = f32(tgt_BL[:, -loss_cfg.short_canvas_len * loss_cfg.num_short_canvases:])
  return dict(out, canvas_tokens=f32(canvas_w), encoder_tokens=f32(enc_w))


def sample_times(keys_B: jax.Array, example_ids_B: jax.Array, rng: jax.Array, num_examples: jax.Array,
                 loss_cfg) -> jax.Array:
  """t = t_eps + (1 - t_eps) u^p per example, u ~ U(0, 1), p = diffusion.t_power (1: t ~ U(t_eps, 1));
  antithetic: u_b = frac(u + id_b / B), one u per batch. With diffusion.t_mixture = (w, lo, hi), each example
  instead takes t ~ U(lo, hi) with probability w (its own two draws, from its key folded with 7)."""
  if loss_cfg.antithetic_t:
    u_B = jnp.mod(jax.random.uniform(rng, ()) + example_ids_B.astype(jnp.float32) / num_examples, 1.0)
  else:
    u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
  if loss_cfg.t_power != 1.0:
    u_B = u_B ** loss_cfg.t_power
  t_B = loss_cfg.t_eps + (1.0 - loss_cfg.t_eps) * u_B
  if not loss_cfg.t_mixture:
    return t_B
  weight, lo, hi = loss_cfg.t_mixture
  mix_keys_B = jax.vmap(lambda k: jax.random.fold_in(k, 7))(keys_B)
  pick_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(mix_keys_B) < weight
  v_B = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), ()))(mix_keys_B)
  return jnp.where(pick_B, lo + (hi - lo) * v_B, t_B)


def uniform_time_weight(t_B: jax.Array, loss_cfg) -> jax.Array:
  """1 / (density of `sample_times` relative to U(t_eps, 1)): weighting a per-example quantity by it turns an
  average over the training times into one over uniform t. The power law's relative density is
  v^(1/p - 1) / p, v = (t - t_eps) / (1 - t_eps); a mixture (w, lo, hi) takes (1 - w) of that plus
  w (1 - t_eps) / (hi - lo) inside [lo, hi]."""
  p = loss_cfg.t_power
  v_B = jnp.clip((t_B - loss_cfg.t_eps) / (1.0 - loss_cfg.t_eps), 0.0, 1.0)
  if not loss_cfg.t_mixture:
    return jnp.ones_like(t_B) if p == 1.0 else p * v_B ** (1.0 - 1.0 / p)
  weight, lo, hi = loss_cfg.t_mixture
  power_density_B = jnp.ones_like(t_B) if p == 1.0 else v_B ** (1.0 / p - 1.0) / p
  window_density_B = jnp.where((t_B >= lo) & (t_B <= hi), (1.0 - loss_cfg.t_eps) / (hi - lo), 0.0)
  return 1.0 / ((1.0 - weight) * power_density_B + weight * window_density_B)


def sum_sown_router_losses(intermediates: Any) -> dict[str, jax.Array]:
  """Sums the sown (already weighted) router losses of one or more apply calls by name."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
    names = [getattr(p, "key", None) for p in path]
    name = next((n for n in names if n in ("router_aux_loss", "router_z_loss")), None)
    if name is not None:
      flat[name] = flat.get(name, 0.0) + jnp.sum(leaf)
  return flat


def canvas_keys(rng_examples: jax.Array, example_ids_B: jax.Array, num_canvases: int) -> tuple[jax.Array, jax.Array]:
  """(per-canvas ids [B*K], per-canvas keys [B*K, 3]: time, corruption, self-conditioning). Canvas k of row b
  draws its noise as example b * K + k would (module docstring); K = 1: the row's own id."""
  K = num_canvases
  ids = (example_ids_B[:, None] * K + jnp.arange(K, dtype=jnp.int32)[None, :]).reshape(-1)
  return ids, jax.vmap(lambda i: jax.random.split(jax.random.fold_in(rng_examples, i), 3))(ids)


def canvas_times(rng: jax.Array, row_ids_B: jax.Array, num_canvases: int, totals: dict[str, jax.Array], loss_cfg):
  """The per-canvas draws of K = `num_canvases` canvases per row: (canvas ids [B*K], keys [B*K, 3] (`canvas_keys`),
  t, alpha(t), alpha'(t) [B*K]); `rng` splits into the per-example and the batch (antithetic) streams."""
  rng_examples, rng_batch = jax.random.split(rng)
  ids_B, keys_B3 = canvas_keys(rng_examples, row_ids_B, num_canvases)
  t_B = sample_times(keys_B3[:, 0], ids_B, rng_batch, totals["examples"] * num_canvases, loss_cfg)
  alpha_B, dalpha_B = schedules.alpha_and_derivative(loss_cfg.schedule, t_B, loss_cfg.schedule_eps)
  return ids_B, keys_B3, t_B, alpha_B, dalpha_B


def encode_context(apply, ctx: dict, *, model_cfg: ModelConfig, want_enc_logits: bool = False):
  """The encoder over the clean context `ctx` into a fresh KV cache. Returns (next-token logits or None, cache,
  encoder vars)."""
  batch_size, ctx_len = ctx["tokens"].shape
  cache = init_cache(model_cfg, batch_size, ctx_len, dtype=jnp.dtype(model_cfg.dtype))
  (enc_logits_BTV, cache), enc_vars = apply(ctx["tokens"], ctx["positions"], ctx["segment_ids"], cache,
                                            return_logits=want_enc_logits, method=Transformer.encode)
  return enc_logits_BTV, cache, enc_vars


def logits_before_canvases(enc_logits_BTV: jax.Array | None, seq_len: int, canvas_len: int, num_canvases: int):
  """`model.decoder_shift`: the encoder's logits at the clean token before each of the K canvases of
  `canvas_len` that end a row of `seq_len` ([B, K, V]; None without encoder logits)."""
  if enc_logits_BTV is None:
    return None
  starts = [seq_len - (num_canvases - k) * canvas_len for k in range(num_canvases)]
  return jnp.stack([enc_logits_BTV[:, start - 1] for start in starts], axis=1)


def cache_before(cache, seq_len: int, canvas_len: int):
  """`cache` as canvases of `canvas_len` tokens ending a row of `seq_len` read it: slots before the last
  canvas's start (the block-causal mask counts each canvas's start back from there; attention.py)."""
  return cache.replace(length=jnp.asarray(seq_len - canvas_len, jnp.int32))


def denoise(apply, cache, canvas: dict, noisy_BC: jax.Array, sc_keys_B: jax.Array, *, model_cfg: ModelConfig,
            loss_cfg, num_canvases: int, probs_BCV: jax.Array | None = None, self_condition: bool = True,
            prev_logits_BKV: jax.Array | None = None):
  """The training decoder pass over the noisy canvases `noisy_BC` [B, K*C] (or their soft rows `probs_BCV`),
  K = `num_canvases`, reading `cache` (`encode_context`, cut by `cache_before`). Returns (canvas logits,
  scored pass vars).

  Self-conditioning training (`self_condition` and the model has it): a first decoder pass without it; its
  logits (no gradient) feed the scored second pass for each canvas with probability self_cond_prob (drawn
  from `sc_keys_B`, one key per canvas; zeros otherwise). The first pass's router losses carry no gradient
  and are not returned. Otherwise one pass with a zero signal. `prev_logits_BKV`: `model.decoder_shift`'s
  encoder logits before each canvas (`logits_before_canvases`)."""
  batch_size = noisy_BC.shape[0]
  K = num_canvases

  def decode(sc_logits_BCV, sc_mask_B):
    return apply(noisy_BC, canvas["positions"], canvas["segment_ids"], cache, sc_logits_BCV=sc_logits_BCV,
                 sc_mask_B=sc_mask_B, num_canvases=K, canvas_probs_BCV=probs_BCV, prev_logits_BKV=prev_logits_BKV,
                 method=Transformer.decode)

  if self_condition and model_cfg.self_conditioning and loss_cfg.self_cond_prob > 0:
    first_BCV, _ = decode(None, None)
    first_BCV = jax.lax.stop_gradient(first_BCV)
    sc_mask_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(sc_keys_B) < loss_cfg.self_cond_prob
    if K > 1:  # per canvas -> per token of the row
      sc_mask_B = jnp.repeat(sc_mask_B.reshape(batch_size, K), noisy_BC.shape[1] // K, axis=1)
    return decode(first_BCV, sc_mask_B)
  return decode(None, None)


def diffusion_loss(params: Any, batch: dict[str, jax.Array], rng: jax.Array, *, model_cfg: ModelConfig,
                   loss_cfg, example_ids_B: jax.Array | None = None,
                   totals: dict[str, jax.Array] | None = None,
                   eval_metrics: bool = False, step: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DiffusionGemma SFT/pretraining loss on packed rows `{tokens, segment_ids, positions}` [B, L].

  Returns (scalar loss, metrics). The canvas loss sums the objective's per-token loss over every
  non-padding canvas token and divides by totals['canvas_tokens'] (this batch's count by default).
  example_ids_B: global row indices (noise is drawn per example from them; default arange(B)).
  totals: `batch_totals` of the whole batch when this is a micro-batch. Then every loss and metric
  (router losses included, scaled by B / totals['examples']) is additive over micro-batches.
  eval_metrics: also report 'canvas_nelbo', the objective's NELBO integrand at the sampled t
  averaged over canvas tokens (uniform objectives: with the objective's x0 logits; mdlm: its NELBO;
  ar: the canvas next-token NLL), an unbiased estimate of the diffusion part of the NLL bound.
  step: the training step; with diffusion.curriculum_steps > 0, steps before it read the Gaussian
  relaxation of the canvas (module docstring). None (evaluation) is the discrete process.
  """
  model = Transformer(model_cfg)
  batch_size, seq_len = batch["tokens"].shape
  if eval_metrics:
    loss_cfg = training_only(loss_cfg)
  if example_ids_B is None:
    example_ids_B = jnp.arange(batch_size, dtype=jnp.int32)
  if totals is None:
    totals = batch_totals(batch, loss_cfg)
  router_scale = batch_size / totals["examples"]
  apply = lambda *a, **k: model.apply({"params": params}, *a, mutable=["intermediates"], **k)
  metrics: dict[str, jax.Array] = {}

  objective = objectives.get(loss_cfg.objective)
  if objective.autoregressive:
    return _ar_loss(apply, batch, model_cfg, loss_cfg, totals, router_scale, eval_metrics)

  # Clean context = the row up to the last canvas (of the shortest kind trained); decoder input = the last K
  # canvases (K = 1: one).
  K, C = loss_cfg.canvases_per_row, loss_cfg.canvas_len
  ctx = {k: v[:, :loss_cfg.encoder_len(seq_len)] for k, v in batch.items()}
  _, canvas = split_context_canvas(batch, K * C)
  _, keys_B3, t_B, alpha_B, dalpha_B = canvas_times(rng, example_ids_B, K, totals, loss_cfg)
  mask_id = loss_cfg.mask_id if objective.masked else None
  V = model_cfg.vocab_size
  clean_BC = canvas["tokens"].reshape(-1, C)

  def discrete_noise(_):
    return corrupt_rows(keys_B3[:, 1], clean_BC, 1.0 - alpha_B, V, mask_id=mask_id)

  probs_BCV = None
  if loss_cfg.curriculum_steps and step is not None:  # Duo's curriculum (dgemma/diffusion/relaxation.py)
    in_curriculum = jnp.asarray(step) < loss_cfg.curriculum_steps
    if loss_cfg.curriculum_alpha_range:  # Duo's times: log-SNR uniform on a window
      cur_alpha_B, cur_dalpha_B = relaxation.curriculum_alpha(t_B, loss_cfg, V)
      alpha_B = jnp.where(in_curriculum, cur_alpha_B, alpha_B)
      dalpha_B = jnp.where(in_curriculum, cur_dalpha_B, dalpha_B)
    tau = relaxation.curriculum_tau(step, loss_cfg)

    def relaxed_noise(_):
      z_BC, soft_BCV = relaxation.relaxed_rows(keys_B3[:, 1], clean_BC, alpha_B, V, tau)
      return z_BC, z_BC != clean_BC, soft_BCV

    def one_hot_noise(_):  # after the curriculum: the discrete draw, read as exact one-hot rows
      z_BC, replaced_BC = discrete_noise(None)
      return z_BC, replaced_BC, jax.nn.one_hot(z_BC, V, dtype=jnp.float32)

    noisy_BC, replaced_BC, probs_BCV = jax.lax.cond(in_curriculum, relaxed_noise, one_hot_noise, None)
    probs_BCV = probs_BCV.reshape(batch_size, K * C, V)
    metrics["relaxation_tau"] = jnp.where(in_curriculum, tau, 0.0) * router_scale  # additive over micro-batches
  else:
    noisy_BC, replaced_BC = discrete_noise(None)
  noisy_BC, replaced_BC = noisy_BC.reshape(batch_size, K * C), replaced_BC.reshape(batch_size, K * C)
  noisy_BC, replaced_BC, probs_BCV = hold_infilled(canvas, noisy_BC, replaced_BC, probs_BCV, V)

  want_enc_logits = loss_cfg.encoder_loss_weight > 0
  enc_logits_BTV, cache, enc_vars = encode_context(apply, ctx, model_cfg=model_cfg,
                                                   want_enc_logits=want_enc_logits or model_cfg.decoder_shift)
  shift_source_BTV = enc_logits_BTV if model_cfg.decoder_shift else None
  logits_BCV, dec_vars = denoise(apply, cache_before(cache, seq_len, C), canvas, noisy_BC, keys_B3[:, 2],
                                 model_cfg=model_cfg, loss_cfg=loss_cfg, num_canvases=K, probs_BCV=probs_BCV,
                                 prev_logits_BKV=logits_before_canvases(shift_source_BTV, seq_len, C, K))

  # Canvas objective (dgemma/diffusion/objectives.py), per token, at each example's (alpha, alpha').
  targets_BC = canvas["tokens"]
  canvas_w_BC = target_mask(canvas).astype(jnp.float32)
  per_token = lambda x_B: jnp.repeat(x_B.reshape(batch_size, K), C, axis=1)  # per canvas -> [B, K*C]
  alpha_BC, dalpha_BC = per_token(alpha_B), per_token(dalpha_B)
  loss_BC = objective.loss(logits_BCV, targets_BC, noisy_BC, alpha_BC, dalpha_BC,
                           reweight_cap=loss_cfg.reweight_cap, mask_id=loss_cfg.mask_id, replaced_N=replaced_BC)
  n_canvas = jnp.maximum(totals["canvas_tokens"], 1.0)
  canvas_loss = jnp.sum(loss_BC * canvas_w_BC) / n_canvas
  ce_sum, n_local, correct = masked_cross_entropy(logits_BCV, targets_BC, canvas_w_BC)
  metrics.update(canvas_loss=canvas_loss, canvas_ce=ce_sum / n_canvas, canvas_accuracy=correct / n_canvas,
                 canvas_tokens=n_local,
                 corrupted_fraction=jnp.sum(replaced_BC * canvas_w_BC) / n_canvas)
  if eval_metrics:  # (an unbiased estimate under uniform t whatever diffusion.t_power is)
    nelbo_BC = loss_BC if objective.loss_is_nelbo else objective.nelbo_per_token(
        logits_BCV, targets_BC, noisy_BC, alpha_BC, dalpha_BC, mask_id=loss_cfg.mask_id)
    nelbo_BC = nelbo_BC * per_token(uniform_time_weight(t_B, loss_cfg))
    metrics["canvas_nelbo"] = jnp.sum(nelbo_BC * canvas_w_BC) / n_canvas
  loss = canvas_loss
  scored_vars = [enc_vars, dec_vars]
  if loss_cfg.short_canvas_len:
    short_loss, short_ce, short_vars = _short_canvas_loss(
        apply, cache, batch, jax.random.fold_in(rng, 1), example_ids_B, totals, model_cfg=model_cfg, loss_cfg=loss_cfg,
        shift_source_BTV=shift_source_BTV)
    w = loss_cfg.short_canvas_weight
    loss = (1.0 - w) * canvas_loss + w * short_loss
    metrics.update(short_canvas_loss=short_loss, short_canvas_ce=short_ce)
    scored_vars.append(short_vars)
  if want_enc_logits:
    encoder_loss = encoder_next_token_loss(enc_logits_BTV, ctx, totals)
    metrics["encoder_loss"] = encoder_loss
    loss = loss + loss_cfg.encoder_loss_weight * encoder_loss
  loss = loss + add_router_losses(metrics, scored_vars, model_cfg, router_scale)
  metrics["loss"] = loss
  return loss, metrics


def hold_infilled(canvas: dict, noisy_BC: jax.Array, replaced_BC: jax.Array, probs_BCV: jax.Array | None, V: int):
  """Given canvas tokens (`infill_mask`, module docstring) stay clean and are not counted as replaced."""
  if "infill_mask" not in canvas:
    return noisy_BC, replaced_BC, probs_BCV
  held_BC = canvas["infill_mask"] != 0
  noisy_BC = jnp.where(held_BC, canvas["tokens"], noisy_BC)
  if probs_BCV is not None:
    probs_BCV = jnp.where(held_BC[..., None], jax.nn.one_hot(canvas["tokens"], V, dtype=jnp.float32), probs_BCV)
  return noisy_BC, replaced_BC & ~held_BC, probs_BCV


def _short_canvas_loss(apply, cache, batch: dict, rng: jax.Array, row_ids_B: jax.Array, totals: dict, *,
                       model_cfg: ModelConfig, loss_cfg, shift_source_BTV: jax.Array | None = None):
  """(loss, CE, decoder vars) of the row's last A canvases of S = short_canvas_len tokens: the objective on
  their own noise (canvas k of row b drawn as example b * A + k of `rng`), one decoder pass (zero
  self-conditioning signal) over `cache`; sums divided by totals['short_canvas_tokens'] (module docstring)."""
  batch_size, seq_len = batch["tokens"].shape
  S, A = loss_cfg.short_canvas_len, loss_cfg.num_short_canvases
  objective = objectives.get(loss_cfg.objective)
  _, canvas = split_context_canvas(batch, A * S)
  _, keys_B3, _, alpha_B, dalpha_B = canvas_times(rng, row_ids_B, A, totals, loss_cfg)
  V = model_cfg.vocab_size
  noisy_BC, replaced_BC = corrupt_rows(keys_B3[:, 1], canvas["tokens"].reshape(-1, S), 1.0 - alpha_B, V,
                                       mask_id=loss_cfg.mask_id if objective.masked else None)
  noisy_BC, replaced_BC, _ = hold_infilled(canvas, noisy_BC.reshape(batch_size, A * S),
                                           replaced_BC.reshape(batch_size, A * S), None, V)
  logits_BCV, dec_vars = denoise(apply, cache_before(cache, seq_len, S), canvas, noisy_BC, keys_B3[:, 2],
                                 model_cfg=model_cfg, loss_cfg=loss_cfg, num_canvases=A, self_condition=False,
                                 prev_logits_BKV=logits_before_canvases(shift_source_BTV, seq_len, S, A))
  per_token = lambda x_B: jnp.repeat(x_B.reshape(batch_size, A), S, axis=1)
  loss_BC = objective.loss(logits_BCV, canvas["tokens"], noisy_BC, per_token(alpha_B), per_token(dalpha_B),
                           reweight_cap=loss_cfg.reweight_cap, mask_id=loss_cfg.mask_id, replaced_N=replaced_BC)
  w_BC = target_mask(canvas).astype(jnp.float32)
  n = jnp.maximum(totals["short_canvas_tokens"], 1.0)
  ce_sum, _, _ = masked_cross_entropy(logits_BCV, canvas["tokens"], w_BC)
  return jnp.sum(loss_BC * w_BC) / n, ce_sum / n, dec_vars


def encoder_next_token_loss(enc_logits_BTV: jax.Array, ctx: dict, totals: dict[str, jax.Array]) -> jax.Array:
  """The encoder's next-token CE over the clean context, divided by the whole batch's target count."""
  w_BT = next_token_weights(ctx["segment_ids"], target_mask(ctx))
  enc_sum, _, _ = masked_cross_entropy(enc_logits_BTV[:, :-1], ctx["tokens"][:, 1:], w_BT)
  return enc_sum / jnp.maximum(totals["encoder_tokens"], 1.0)


def add_router_losses(metrics: dict, variables: list, model_cfg: ModelConfig, scale: jax.Array) -> jax.Array:
  """MoE aux losses sown by the scored passes (transformer.py docstring); reported and returned."""
  if not (model_cfg.num_experts and (model_cfg.router_aux_loss_weight or model_cfg.router_z_loss_weight)):
    return jnp.zeros((), jnp.float32)
  sums = sum_sown_router_losses([v.get("intermediates", {}) for v in variables])
  total = jnp.zeros((), jnp.float32)
  for name, value in sums.items():
    metrics[name] = value * scale
    total = total + metrics[name]
  return total


def _ar_loss(apply, batch, model_cfg: ModelConfig, loss_cfg, totals, router_scale,
             eval_metrics: bool):
  """objective='ar': causal next-token CE over the whole packed row (no canvas, no noise). canvas_*
  metrics score the targets that fall in the canvas region (the last canvas_len positions), for
  comparison with the diffusion objectives' canvas NELBO."""
  batch_size, seq_len = batch["tokens"].shape
  cache = init_cache(model_cfg, batch_size, seq_len, dtype=jnp.dtype(model_cfg.dtype))
  (logits_BLV, _), enc_vars = apply(batch["tokens"], batch["positions"], batch["segment_ids"], cache,
                                    return_logits=True, method=Transformer.encode)
  w_BT = next_token_weights(batch["segment_ids"], target_mask(batch))
  ce_BT = objectives.cross_entropy(logits_BLV[:, :-1], batch["tokens"][:, 1:])
  correct_BT = (reductions.argmax(logits_BLV[:, :-1]) == batch["tokens"][:, 1:]).astype(jnp.float32)
  w_BT = w_BT.astype(jnp.float32)
  encoder_loss = jnp.sum(ce_BT * w_BT) / jnp.maximum(totals["encoder_tokens"], 1.0)
  C = loss_cfg.canvas_len
  canvas_w_BC = w_BT[:, -C:]
  n_canvas = jnp.maximum(totals["canvas_tokens"], 1.0)
  canvas_nll = jnp.sum(ce_BT[:, -C:] * canvas_w_BC) / n_canvas
  metrics = {"encoder_loss": encoder_loss, "canvas_loss": canvas_nll, "canvas_ce": canvas_nll,
             "canvas_accuracy": jnp.sum(correct_BT[:, -C:] * canvas_w_BC) / n_canvas,
             "canvas_tokens": jnp.sum(canvas_w_BC)}
  if eval_metrics:
    metrics["canvas_nelbo"] = canvas_nll
  loss = encoder_loss + add_router_losses(metrics, [enc_vars], model_cfg, router_scale)
  metrics["loss"] = loss
  return loss, metrics
