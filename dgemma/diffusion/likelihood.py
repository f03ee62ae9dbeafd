"""The likelihood a checkpoint gives text: the block-autoregressive NELBO bound of a diffusion model, or the
exact NLL of an AR one, in nats/token and bits per UTF-8 byte with standard errors. `eval.likelihood` (the
CLI) and `dgemma.load(...).score(...)` both call `score_documents`, so they report the same numbers.

Block-autoregressive factorisation. A document becomes [BOS] + ids + [EOS] (as in training); the tokens
after BOS are cut into canvases of diffusion.canvas_len, and canvas k is scored given the clean text
before it: log p(x) = sum_k log p(canvas_k | earlier text), each canvas conditioned on at most
eval.context_len earlier tokens (default: the training context, data.seq_len - canvas_len; the row is then
exactly a training row, positions restarting at 0 where the window starts). The bound is the sum over
canvases of

  (1 - t_eps) E_{t ~ U(t_eps, 1), z_t}[ sum_i integrand_i(t) ]  +  E_{z_t_eps}[ -log p(x | z_t_eps) ]

(docs/model.md, "The likelihood bound"): the continuous-time NELBO integrated over [t_eps, 1] (the
objective record's `nelbo_per_token`: the uniform-state integrand of the model's leave-one-out prediction
x_theta = p(x_i | z_-i), or MDLM's for masked models; objectives.py docstring: feeding the posterior
p(x_i | z) instead counts z_i twice), Monte-Carlo over eval.num_t_samples antithetic times
t_m = t_eps + (1 - t_eps) frac(u + m/M) per canvas, plus the reconstruction term at t_eps. The prior term
KL(q(z_1 | x) || p(z_1)) is 0 (alpha(1) = 0: z_1 is uniform, or all-mask for MDLM). Reconstruction: the
model's last reverse step q(z_0 | z_t_eps, x_theta) is proportional to x_theta(x) q(z_t_eps | x), i.e. the CE
of the model's posterior p(x | z_t_eps) (`Objective.reconstruction_per_token`); for MDLM it is x_theta's CE
on the still-masked tokens and 0 elsewhere. It is computed, not assumed ~0.

AR models (diffusion.objective='ar') get the exact NLL of the same canvases given the same context
windows, in the same units. Standard errors are over canvases (ratio estimator of total nats / tokens),
so they include both the text's variation and the Monte-Carlo noise of t and z_t. Two models scored on the
same canvases compare per canvas (`paired_ratio`; `eval.likelihood --reference=AR_RUN`), which removes the
text's variation from the comparison's error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import mesh as mesh_lib
from dgemma.diffusion import objectives, schedules
from dgemma.diffusion.corruption import corrupt_rows, split_context_canvas
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer, init_cache, sharding

LN2 = math.log(2.0)


# ---- documents -> rows ---------------------------------------------------------------------------

@dataclasses.dataclass
class Document:
  """A scored text: `text` (what bits/byte counts), `tokens` = [BOS] + ids (+ [EOS] when complete)."""
  text: str
  tokens: np.ndarray
  complete: bool

  @property
  def num_bytes(self) -> int:
    return len(self.text.encode("utf-8"))

  @property
  def num_scored(self) -> int:
    return len(self.tokens) - 1


def cut_document(text: str, tokenizer, max_tokens: int) -> Document:
  """[BOS] + ids + [EOS] of `text`; with max_tokens > 0 and more scored tokens than that, the longest
  prefix cut at whitespace whose ids fit (no EOS: the document does not end there)."""
  ids = tokenizer.encode(text)
  if max_tokens <= 0 or len(ids) + 1 <= max_tokens:
    return Document(text, np.asarray([tokenizer.bos_id] + ids + [tokenizer.eos_id], np.int32), True)
  cuts = [i for i, ch in enumerate(text) if ch.isspace()]
  lo, hi, best = 0, len(cuts) - 1, None
  while lo <= hi:  # the longest whitespace cut whose encoding fits
    mid = (lo + hi) // 2
    n = len(tokenizer.encode(text[:cuts[mid]]))
    if n <= max_tokens:
      best, lo = mid, mid + 1
    else:
      hi = mid - 1
  if best is None or cuts[best] == 0:
    raise ValueError(f"eval.max_tokens={max_tokens}: the document's first word ({text[:40]!r}...) alone needs "
                     "more tokens; raise eval.max_tokens")
  prefix = text[:cuts[best]]
  return Document(prefix, np.asarray([tokenizer.bos_id] + tokenizer.encode(prefix), np.int32), False)


@dataclasses.dataclass
class Rows:
  """One row per canvas: tokens/segment_ids/positions [R, context_len + canvas_len] (context left-padded),
  and which document / canvas of it each row is."""
  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  doc_index: np.ndarray
  canvas_index: np.ndarray

  def __len__(self) -> int:
    return len(self.tokens)

  def batch(self, start: int, size: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Rows [start, start + size), topped up with all-padding rows (weight 0) to `size`."""
    sl = slice(start, start + size)
    parts = dict(tokens=self.tokens[sl], segment_ids=self.segment_ids[sl], positions=self.positions[sl])
    doc, can = self.doc_index[sl], self.canvas_index[sl]
    missing = size - len(doc)
    if missing:
      parts = {k: np.concatenate([v, np.zeros((missing, v.shape[1]), np.int32)]) for k, v in parts.items()}
      doc = np.concatenate([doc, np.full((missing,), -1, np.int32)])
      can = np.concatenate([can, np.zeros((missing,), np.int32)])
    return parts, doc, can


def block_rows(docs: Sequence[np.ndarray], canvas_len: int, context_len: int, pad_id: int,
               starts: Sequence[int] | None = None) -> Rows:
  """Canvas k of a document covers tokens [s + k C, s + (k + 1) C), s = starts[d] (default 1: everything after
  BOS; a continuation's first token when scoring it given its context), and is conditioned on the (at most
  context_len) tokens before it, placed at the end of the context part of the row."""
  C, K = canvas_len, context_len
  toks, segs, poss, doc_ids, canvas_ids = [], [], [], [], []
  for d, tokens in enumerate(docs):
    for k, s in enumerate(range(1 if starts is None else starts[d], len(tokens), C)):
      ctx = tokens[max(0, s - K):s]
      canvas = tokens[s:s + C]
      row = np.full((K + C,), pad_id, np.int32)
      seg = np.zeros((K + C,), np.int32)
      pos = np.zeros((K + C,), np.int32)
      row[K - len(ctx):K], seg[K - len(ctx):K], pos[K - len(ctx):K] = ctx, 1, np.arange(len(ctx))
      row[K:K + len(canvas)], seg[K:K + len(canvas)] = canvas, 1
      pos[K:K + len(canvas)] = len(ctx) + np.arange(len(canvas))
      toks.append(row), segs.append(seg), poss.append(pos), doc_ids.append(d), canvas_ids.append(k)
  as_array = lambda xs, shape: np.stack(xs) if xs else np.zeros(shape, np.int32)
  return Rows(as_array(toks, (0, K + C)), as_array(segs, (0, K + C)), as_array(poss, (0, K + C)),
              np.asarray(doc_ids, np.int32), np.asarray(canvas_ids, np.int32))


# ---- the bound for one batch of canvases ---------------------------------------------------------

def antithetic_times(key: jax.Array, num_t: int, t_eps: float) -> jax.Array:
  """t_m = t_eps + (1 - t_eps) frac(u + m / M), u ~ U(0, 1): M stratified times with uniform marginals."""
  u = jax.random.uniform(key, ())
  return t_eps + (1.0 - t_eps) * jnp.mod(u + jnp.arange(num_t, dtype=jnp.float32) / num_t, 1.0)


def canvas_keys(seed: int, doc_B: jax.Array, canvas_B: jax.Array) -> jax.Array:
  """One key per (document, canvas): a canvas's noise does not depend on batching."""
  base = jax.random.key(seed)
  return jax.vmap(lambda d, c: jax.random.fold_in(jax.random.fold_in(base, d), c))(doc_B, canvas_B)


def canvas_bound_terms(logits_fn: Callable, canvas_BC: jax.Array, weights_BC: jax.Array, keys_B: jax.Array, *,
                       num_t: int, loss_cfg, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Per canvas: (sum over tokens of the NELBO integrand at each of num_t antithetic times [B, M],
  sum over tokens of the reconstruction term at t_eps [B]).

  logits_fn(noisy_BC, alpha_B) -> the network's canvas logits [B, C, V], read through the objective record
  (`loo_prior_logits` for the integrand, `posterior_logits` for the reconstruction). Row b draws t from key
  split(keys_B[b])[0] and z_t for sample m (m = num_t: the reconstruction at t_eps) from fold_in(split(keys_B[b])[1], m).
  """
  objective = objectives.get(loss_cfg.objective)
  mask_id = loss_cfg.mask_id if objective.masked else None
  split_B2 = jax.vmap(lambda k: jax.random.split(k))(keys_B)
  t_BM = jax.vmap(lambda k: antithetic_times(k, num_t, loss_cfg.t_eps))(split_B2[:, 0])
  t_MB = jnp.concatenate([t_BM, jnp.full((keys_B.shape[0], 1), loss_cfg.t_eps, jnp.float32)], axis=1).T
  weights_BC = weights_BC.astype(jnp.float32)

  def one(_, xs):
    m, t_B = xs
    alpha_B, dalpha_B = schedules.alpha_and_derivative(loss_cfg.schedule, t_B, loss_cfg.schedule_eps)
    noise_keys_B = jax.vmap(lambda k: jax.random.fold_in(k, m))(split_B2[:, 1])
    noisy_BC, _ = corrupt_rows(noise_keys_B, canvas_BC, 1.0 - alpha_B, vocab_size, mask_id=mask_id)
    logits_BCV = logits_fn(noisy_BC, alpha_B)
    alpha_BC = jnp.broadcast_to(alpha_B[:, None], canvas_BC.shape)
    dalpha_BC = jnp.broadcast_to(dalpha_B[:, None], canvas_BC.shape)
    integrand_BC = objective.nelbo_per_token(logits_BCV, canvas_BC, noisy_BC, alpha_BC, dalpha_BC,
                                             mask_id=loss_cfg.mask_id)
    recon_BC = objective.reconstruction_per_token(logits_BCV, canvas_BC, noisy_BC, alpha_BC, mask_id=loss_cfg.mask_id)
    return None, (jnp.sum(integrand_BC * weights_BC, -1), jnp.sum(recon_BC * weights_BC, -1))

  _, (integrand_MB, recon_MB) = jax.lax.scan(one, None, (jnp.arange(num_t + 1), t_MB))
  return integrand_MB[:num_t].T, recon_MB[num_t]


def canvas_estimate(integrand_BM: np.ndarray, recon_B: np.ndarray, t_eps: float) -> np.ndarray:
  """Bound per canvas (nats): (1 - t_eps) mean_m integrand + reconstruction."""
  return (1.0 - t_eps) * np.mean(integrand_BM, axis=-1) + recon_B


@functools.partial(sharding.jit_with_axis_rules, static_argnames=("model_cfg", "loss_cfg", "num_t", "self_conditioning"))
def _diffusion_batch(params, rows, doc_B, canvas_B, seed, *, model_cfg: ModelConfig, loss_cfg,
                     num_t: int, self_conditioning: bool):
  model = Transformer(model_cfg)
  ctx, canvas = split_context_canvas(rows, loss_cfg.canvas_len)
  batch = rows["tokens"].shape[0]
  cache = init_cache(model_cfg, batch, ctx["tokens"].shape[1], dtype=jnp.dtype(model_cfg.dtype))
  enc_logits_BTV, cache = model.apply({"params": params}, ctx["tokens"], ctx["positions"], ctx["segment_ids"],
                                      cache, return_logits=model_cfg.decoder_shift, method=Transformer.encode)
  prev_BKV = enc_logits_BTV[:, -1:] if model_cfg.decoder_shift else None  # the token before the canvas

  def logits_fn(noisy_BC, alpha_B):
    decode = lambda sc: model.apply({"params": params}, noisy_BC, canvas["positions"], canvas["segment_ids"], cache,
                                    sc_logits_BCV=sc, prev_logits_BKV=prev_BKV, method=Transformer.decode)
    logits_BCV = decode(None)
    if self_conditioning and model_cfg.self_conditioning:  # training's second pass: pass-1 logits as the signal
      logits_BCV = decode(logits_BCV)
    return logits_BCV

  keys_B = canvas_keys(seed, doc_B, canvas_B)
  return canvas_bound_terms(logits_fn, canvas["tokens"], canvas["segment_ids"] != 0, keys_B, num_t=num_t,
                            loss_cfg=loss_cfg, vocab_size=model_cfg.vocab_size)


@functools.partial(sharding.jit_with_axis_rules, static_argnames=("model_cfg",))
def causal_scores(params, rows, target_weights_BL, *, model_cfg: ModelConfig):
  """(exact NLL in nats [B], greedy [B]) per row of the tokens at positions j >= 1 with target_weights_BL[:, j]
  != 0, each predicted by the causal encoder from everything before it in the row (AR checkpoints, and the
  reference model of eval/samples.py); greedy: every such token is its prediction's argmax."""
  model = Transformer(model_cfg)
  batch, length = rows["tokens"].shape
  cache = init_cache(model_cfg, batch, length, dtype=jnp.dtype(model_cfg.dtype))
  logits_BLV, _ = model.apply({"params": params}, rows["tokens"], rows["positions"], rows["segment_ids"], cache,
                              return_logits=True, method=Transformer.encode)
  targets_BT, weights_BT = rows["tokens"][:, 1:], target_weights_BL[:, 1:] != 0
  ce_BT = objectives.cross_entropy(logits_BLV[:, :-1], targets_BT)
  greedy_BT = jnp.argmax(logits_BLV[:, :-1], axis=-1) == targets_BT
  return jnp.sum(ce_BT * weights_BT.astype(jnp.float32), axis=-1), jnp.all(greedy_BT | ~weights_BT, axis=-1)


def causal_nll(params, rows, target_weights_BL, *, model_cfg: ModelConfig):
  """The exact NLL of `causal_scores`."""
  return causal_scores(params, rows, target_weights_BL, model_cfg=model_cfg)[0]


# ---- whole evaluation ----------------------------------------------------------------------------

def ratio_stderr(values_R: np.ndarray, counts_R: np.ndarray) -> float:
  """Standard error of sum(values) / sum(counts) over R units (delta method for a ratio of means)."""
  values_R, counts_R = np.asarray(values_R, np.float64), np.asarray(counts_R, np.float64)
  R = len(values_R)
  if R < 2:
    return float("nan")
  ratio = values_R.sum() / counts_R.sum()
  resid = values_R - ratio * counts_R
  return float(np.sqrt(np.sum(resid ** 2) / (R * (R - 1))) / counts_R.mean())


def paired_ratio(canvas_nats_R: np.ndarray, reference_nats_R: np.ndarray, canvas_tokens_R: np.ndarray) -> dict:
  """Two models scored on the same canvases: the ratio of their totals and the excess nats/token, with
  standard errors over canvases from the per-canvas pairs. Text difficulty is shared by both members of a
  pair, so these errors are far below the two bounds' own (each of which mostly measures the text)."""
  nats_R, ref_R = np.asarray(canvas_nats_R, np.float64), np.asarray(reference_nats_R, np.float64)
  tokens_R = np.asarray(canvas_tokens_R, np.float64)
  excess_R = nats_R - ref_R
  return {"ratio_to_reference": float(nats_R.sum() / ref_R.sum()),
          "ratio_to_reference_se": ratio_stderr(nats_R, ref_R),
          "excess_nats_per_token": float(excess_R.sum() / tokens_R.sum()),
          "excess_nats_per_token_se": ratio_stderr(excess_R, tokens_R)}


def summarize(canvas_nats_R: np.ndarray, canvas_tokens_R: np.ndarray, num_bytes: int) -> dict:
  """nats/token, bits per UTF-8 byte and perplexity (bound) with standard errors, and the per-canvas nats and
  tokens they come from (for `paired_ratio`)."""
  tokens = float(np.sum(canvas_tokens_R))
  nats = float(np.sum(canvas_nats_R))
  nll = nats / tokens
  se = ratio_stderr(canvas_nats_R, canvas_tokens_R)
  bpb_per_nat = tokens / (num_bytes * LN2)  # nats/token -> bits/byte
  return {"nats_per_token": nll, "nats_per_token_se": se, "bits_per_byte": nll * bpb_per_nat,
          "bits_per_byte_se": se * bpb_per_nat, "perplexity": math.exp(nll), "perplexity_se": math.exp(nll) * se,
          "tokens": int(tokens), "bytes": int(num_bytes), "total_nats": nats,
          "canvas_nats": [float(x) for x in canvas_nats_R], "canvas_tokens": [int(x) for x in canvas_tokens_R]}


def check_request(model_cfg: ModelConfig, *, context_len: int, canvas_len: int, batch_size: int,
                  max_positions: int) -> None:
  """Before anything is allocated: the rows fit the model's positions, and one batch's attention scores
  (the largest buffer of the encoder pass: batch x heads x T x T fp32, T = context_len) fit in memory."""
  if context_len + canvas_len > max_positions:
    raise ConfigError(f"eval.context_len: {context_len} context + {canvas_len} canvas tokens exceed the model's "
                      f"{max_positions} positions")
  scores = 4 * batch_size * model_cfg.num_heads * context_len * context_len
  memory = mesh_lib.free_memory_bytes()
  if scores > memory:
    raise ConfigError(f"eval.context_len: {context_len} needs about {scores / 2**30:.0f} GiB for the attention scores "
                      f"of one batch (eval.batch_size={batch_size} x {model_cfg.num_heads} heads x {context_len}^2 "
                      f"fp32), more than the {memory / 2**30:.0f} GiB of free memory; lower eval.context_len or "
                      "eval.batch_size")


def context_length(ev, *, seq_len: int, canvas_len: int) -> int:
  """The clean tokens a canvas is conditioned on: eval.context_len, or the training context (seq_len minus the
  canvas) when it is 0."""
  context_len = ev.context_len or seq_len - canvas_len
  if context_len <= 0:
    raise ConfigError(f"eval.context_len: must be > 0, got {context_len}")
  return context_len


def canvas_scores(params, model_cfg: ModelConfig, diffusion, ev, rows: Rows, *, context_len: int,
                  key_ids: np.ndarray | None = None, on_batch: Callable | None = None) -> dict[str, np.ndarray]:
  """Per row of `rows` (one canvas each), in eval.batch_size batches of one compiled shape:
  nats: the canvas's bound (diffusion) or exact NLL (AR); tokens: its scored tokens; mc_se: the Monte-Carlo
  standard error of its bound over the eval.num_t_samples times (std / sqrt(M), conservative: the antithetic
  times are stratified, which this ignores; 0 for an AR model, nan for M = 1); reconstruction: its
  reconstruction term (diffusion); greedy: every token the argmax of its causal prediction (AR; False for a
  diffusion model, where greedy decoding is not a property of a canvas: eval/lm_eval.py).

  key_ids: the id each row's noise is keyed by with its canvas index (default: its document index). Rows
  given the same id and canvas index see the same times and noise positions (common random numbers: the
  choices of one question, scored with one id, differ only by their tokens). on_batch(rows done, rows): called
  after each batch (a progress bar)."""
  canvas_len = diffusion.canvas_len
  objective = objectives.get(diffusion.objective)
  keyed = rows if key_ids is None else dataclasses.replace(rows, doc_index=np.asarray(key_ids, np.int32))
  nats, mc_se, recon, greedy, tokens = [], [], [], [], []
  for i in range(0, len(rows), ev.batch_size):
    batch, doc_B, canvas_B = keyed.batch(i, ev.batch_size)
    n = min(ev.batch_size, len(rows) - i)
    tokens.append((batch["segment_ids"][:n, -canvas_len:] != 0).sum(-1))
    if objective.autoregressive:
      canvas_w_BL = (batch["segment_ids"] != 0) & (np.arange(batch["tokens"].shape[1]) >= context_len)
      nll_B, greedy_B = jax.device_get(causal_scores(params, batch, canvas_w_BL, model_cfg=model_cfg))
      nats.append(np.asarray(nll_B)[:n]), greedy.append(np.asarray(greedy_B)[:n])
      mc_se.append(np.zeros((n,))), recon.append(np.zeros((n,)))
    else:
      integrand_BM, recon_B = jax.device_get(_diffusion_batch(
          params, batch, doc_B, canvas_B, np.int32(ev.seed), model_cfg=model_cfg, loss_cfg=diffusion,
          num_t=ev.num_t_samples, self_conditioning=bool(ev.self_conditioning)))
      nats.append(canvas_estimate(integrand_BM, recon_B, diffusion.t_eps)[:n])
      M = integrand_BM.shape[-1]
      se_B = ((1.0 - diffusion.t_eps) * np.std(np.asarray(integrand_BM, np.float64), axis=-1, ddof=1) / np.sqrt(M)
              if M > 1 else np.full((len(recon_B),), np.nan))
      mc_se.append(se_B[:n]), recon.append(np.asarray(recon_B)[:n]), greedy.append(np.zeros((n,), bool))
    if on_batch is not None:
      on_batch(min(i + ev.batch_size, len(rows)), len(rows))
  cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros((0,), dtype)
  return {"nats": cat(nats, np.float64), "tokens": cat(tokens, np.int64), "mc_se": cat(mc_se, np.float64),
          "reconstruction": cat(recon, np.float64), "greedy": cat(greedy, bool)}


def score_documents(params, model_cfg: ModelConfig, diffusion, ev, docs: Sequence[Document], *, seq_len: int,
                    pad_id: int, max_positions: int, log=None) -> dict:
  """The bound (diffusion) or exact NLL (AR) of `docs` (module docstring).

  diffusion: the model's DiffusionSettings (objective, canvas_len, schedule, t_eps); ev: EvalSettings
  (context_len, num_t_samples, batch_size, self_conditioning, seed); seq_len: the training row length
  (the default context is seq_len - canvas_len)."""
  canvas_len = diffusion.canvas_len
  context_len = context_length(ev, seq_len=seq_len, canvas_len=canvas_len)
  if not docs:
    raise ConfigError("eval.data: no documents to score")
  check_request(model_cfg, context_len=context_len, canvas_len=canvas_len, batch_size=ev.batch_size,
                max_positions=max_positions)
  rows = block_rows([d.tokens for d in docs], canvas_len, context_len, pad_id)
  objective = objectives.get(diffusion.objective)
  start = time.perf_counter()
  on_batch = None if log is None else lambda done, total: log(f"  {done}/{total} canvases")
  scores = canvas_scores(params, model_cfg, diffusion, ev, rows, context_len=context_len, on_batch=on_batch)
  nats_R, tokens_R = scores["nats"], scores["tokens"]
  out = {"objective": objective.name, "measure": "exact_nll" if objective.autoregressive else "nelbo_bound",
         "documents": len(docs), "complete_documents": sum(d.complete for d in docs), "canvases": len(rows),
         "canvas_len": canvas_len, "context_len": context_len}
  out.update(summarize(nats_R, tokens_R, sum(d.num_bytes for d in docs)))
  out["uniform_nats_per_token"] = math.log(model_cfg.vocab_size)  # a model that knows nothing: log V
  if not objective.autoregressive:
    out.update(num_t_samples=ev.num_t_samples, t_eps=diffusion.t_eps,
               reconstruction_nats_per_token=float(np.sum(scores["reconstruction"]) / np.sum(tokens_R)))
  out["wall_s"] = time.perf_counter() - start
  return out
