"""Block-autoregressive generation: prompt -> canvas after canvas, the whole loop one jitted program.

Reference doc, "Two modes" and "Sampler (released defaults)" / "Commit"; HF 5.24
`DiffusionGemmaGenerationMixin.generate`:
  1. The right-padded prompts are encoded once (causal) into a fixed-size KV cache of
     P + (num_canvases - 1) * C slots (padding slots get segment 0 and are never attended); sliding
     layers keep a ring of min(W, slots) of them (`dgemma.model.transformer.KVCache`). With
     sample.prompt_chunk the encode runs a chunk of the prompt at a time (`encode_prompt`; the same attention).
  2. Each canvas is denoised (`sampler.denoise_canvas`) at positions len_b + committed_b + [0, C):
     row b's canvas follows its own valid tokens, as HF does for a single unpadded prompt.
  3. The canvas result (`sampler.canvas_result`: the argmax canvas, or z_0 for the ancestral
     sampler) is cut after its first end token, the rest padded (PAD); the valid tokens are
     appended to the cache by a causal encode pass at the positions they were denoised at (the pad
     tail gets segment 0, so the next canvas's positions continue right after the valid tokens).
     The last canvas is never committed. With `model.decoder_shift` the prompt encode and each commit also
     keep the encoder's logits at the row's last valid token: they score the next canvas's first position.
  4. Rows that ended stay PAD and take no more decoder passes; the loop stops early when every row
     ended (`early_exit`, `lax.while_loop`) or runs all canvases (`lax.scan`).
Shapes are static: one compilation per (batch, prompt length, max_new_tokens, settings). `bucketed_shape` rounds
a request's batch and prompt length up to a few sizes; callers pad to them (padding rows start ended:
`row_active_B`), so new prompts reuse compiled programs with the same tokens (dgemma.load's Model does).
Every request is checked on the host (`check_request`: positions, and the memory its cache and prompt encode
need) before anything is traced or compiled.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.layout import Format, Layout

from dgemma import mesh as mesh_lib
from dgemma.model import init_cache, sharding
from dgemma.errors import ConfigError
from dgemma.sampling import live
from dgemma.sampling.noise import as_noise
from dgemma.sampling.config import SamplerConfig
from dgemma.sampling.sampler import Trajectory, canvas_result, denoise_canvas, initial_canvas


@struct.dataclass
class GenerateOutput:
  """tokens_BN: generated ids [B, max_new_tokens], PAD after the end token.
  lengths_B: tokens generated up to and including the first end token (max_new_tokens if none).
  ended_B: whether an end token was generated.
  num_forwards_B: decoder passes the row needed (passes after the row stopped or ended not counted).
  tokens_per_forward_B: lengths / num_forwards (HF's `tokens_per_forward`, which counts non-PAD
    tokens, differs only if the model emits PAD inside a response).
  trajectory: per-step record [K, S, B, C] (K = 1 for the first canvas, or every canvas); None
    unless asked for.
  """

  tokens_BN: jax.Array
  lengths_B: jax.Array
  ended_B: jax.Array
  num_forwards_B: jax.Array
  tokens_per_forward_B: jax.Array
  trajectory: Optional[Trajectory] = None


@struct.dataclass
class _GenState:
  canvas_idx: jax.Array  # int32 []
  cache: Any
  committed_B: jax.Array  # valid tokens appended to the cache after the prompt
  ended_B: jax.Array
  tokens_BM: jax.Array    # [B, num_canvases * C]
  num_forwards_B: jax.Array
  traj: Optional[Trajectory] = None
  prev_logits_BV: Optional[jax.Array] = None  # model.decoder_shift: the encoder's logits at the last valid token


def last_valid_logits(logits_BTV: jax.Array, valid_count_B: jax.Array, previous_BV: jax.Array | None = None):
  """The logits at each row's last valid token (index valid_count - 1); rows with no valid token keep
  `previous_BV` (or index 0 without one)."""
  idx_B = jnp.maximum(valid_count_B - 1, 0)
  out_BV = jnp.take_along_axis(logits_BTV, idx_B[:, None, None], axis=1)[:, 0]
  if previous_BV is None:
    return out_BV
  return jnp.where((valid_count_B > 0)[:, None], out_BV, previous_BV)


def num_canvases(max_new_tokens: int, canvas_len: int) -> int:
  return math.ceil(max_new_tokens / canvas_len)


def cache_size(prompt_len: int, max_new_tokens: int, canvas_len: int) -> int:
  """Prompt slots plus every canvas that gets committed (all but the last)."""
  return prompt_len + (num_canvases(max_new_tokens, canvas_len) - 1) * canvas_len


def check_request(cfg: SamplerConfig, *, batch: int, prompt_len: int, max_new_tokens: int,
                  model_cfg=None) -> None:
  """Host-side checks of one generation request (before any tracing); errors name the field.

  Context rule: every position the sampler uses must be < cfg.max_context. The cache holds the
  (padded) prompt and every committed canvas, and the canvas being denoised follows them, so
  prompt_len + num_canvases(max_new_tokens) * canvas_len <= max_context (max_new_tokens rounded up
  to whole canvases: the last canvas is denoised whole even when it is cut).
  With `model_cfg`, the request's largest buffers (`request_bytes`) must also fit the free memory.
  """
  if batch <= 0:
    raise ConfigError(f"sample.num_samples: need at least one prompt row, got batch {batch}")
  if prompt_len <= 0:
    raise ConfigError(f"prompt: needs at least one token (e.g. BOS), got prompt length {prompt_len}")
  if int(max_new_tokens) <= 0:
    raise ConfigError(f"sample.max_new_tokens must be positive, got {max_new_tokens}")
  k, c = num_canvases(int(max_new_tokens), cfg.canvas_len), cfg.canvas_len
  if k * c + 1 > cfg.max_context:
    raise ConfigError(f"sample.max_new_tokens={max_new_tokens} (rounded up to {k} canvas(es) of {c}) does not fit "
                      f"sample.max_context={cfg.max_context} positions even after a one-token prompt; lower it to at "
                      f"most {(cfg.max_context - 1) // c * c}")
  needed = prompt_len + k * c
  if needed > cfg.max_context:
    raise ConfigError(
        f"prompt: {prompt_len} prompt tokens + sample.max_new_tokens={max_new_tokens} (rounded up to {k} "
        f"canvas(es) of {c}) need {needed} positions > sample.max_context={cfg.max_context}; shorten the "
        f"prompt to at most {cfg.max_context - k * c} tokens or lower sample.max_new_tokens")
  if model_cfg is not None:
    need = request_bytes(model_cfg, cfg, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens)
    free = mesh_lib.free_memory_bytes()
    if sum(need.values()) > free:
      parts = ", ".join(f"{name.replace('_', ' ')} {size / 2**30:.1f} GiB" for name, size in need.items())
      raise ConfigError(f"prompt: {batch} row(s) of a {prompt_len}-token prompt + {k} canvas(es) of {c} need about "
                        f"{sum(need.values()) / 2**30:.1f} GiB ({parts}), more than the {free / 2**30:.1f} GiB of free "
                        "memory; shorten the prompt, generate fewer rows at once or lower sample.max_new_tokens"
                        + (", or encode the prompt in chunks (sample.prompt_chunk=1024)"
                           if "prompt_attention_scores" in need and prompt_len > 1024
                           and not 0 < cfg.prompt_chunk <= 1024 else ""))


def request_bytes(model_cfg, cfg: SamplerConfig, *, batch: int, prompt_len: int, max_new_tokens: int) -> dict:
  """The largest buffers of one generate call, in bytes, on one device: the KV cache (every layer's keys and
  values over the prompt and committed canvases; sliding layers a window-sized ring) and the attention scores of
  the prompt encode (batch x heads x the prompt or its longest chunk, sample.prompt_chunk x cache slots, fp32) when
  the encoder's attention materialises them (attention_impl 'xla'; tokamax's flash kernels do not)."""
  from dgemma.model import attention  # pylint: disable=g-import-not-at-top  (the model imports sampling's config)
  slots = cache_size(prompt_len, max_new_tokens, cfg.canvas_len)
  cache = jax.eval_shape(lambda: init_cache(model_cfg, batch, slots, jnp.dtype(model_cfg.dtype), sliding_ring=True))
  out = {"kv_cache": sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))}
  if attention.resolve_impl(model_cfg.attention_impl) == "xla":
    out["prompt_attention_scores"] = 4 * batch * model_cfg.num_heads * min(prompt_len, cfg.prompt_chunk or prompt_len) * slots
  return out


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # larger batches are rounded up to a multiple of 64
MIN_PROMPT_BUCKET = 32  # prompt lengths are rounded up to a power of two, at least this


def bucketed_shape(*, batch: int, prompt_len: int, max_new_tokens: int, canvas_len: int,
                   max_context: int) -> tuple[int, int]:
  """(batch, prompt length) rounded up to the buckets a caller pads a request to, so requests of nearby sizes
  share one compiled program: the batch to BATCH_BUCKETS (then multiples of 64), the prompt length to a power of
  two >= MIN_PROMPT_BUCKET, or kept where the rounded length and the response (whole canvases of canvas_len; 1
  for an AR model) would not fit max_context. Padding changes no
  token: rows draw from fold_in(key, row), padding rows start ended (`generate`'s row_active_B) and padded prompt
  slots are never attended (tests/sampling/test_generation_buckets.py)."""
  rows = next((b for b in BATCH_BUCKETS if b >= batch), -(-batch // 64) * 64)
  length = max(MIN_PROMPT_BUCKET, 1 << max(prompt_len - 1, 0).bit_length())
  if length + num_canvases(int(max_new_tokens), canvas_len) * canvas_len > max_context:
    length = prompt_len
  return rows, length


def infill_arrays(pairs, batch: int, max_new_tokens: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(infill_tokens_BN, infill_mask_BN) from (response position, token id) pairs, the same for every row.

  Positions count from the first generated token (0 <= position < max_new_tokens); errors name
  `sample.infill`.
  """
  tokens_BN = np.zeros((batch, max_new_tokens), np.int32)
  mask_BN = np.zeros((batch, max_new_tokens), bool)
  for pair in pairs:
    if len(pair) != 2:
      raise ConfigError(f"sample.infill: expected (position, token_id) pairs, got {tuple(pair)!r}")
    pos, tok = int(pair[0]), int(pair[1])
    if not 0 <= pos < max_new_tokens:
      raise ConfigError(f"sample.infill: position {pos} is outside the response "
                        f"[0, sample.max_new_tokens={max_new_tokens})")
    if not 0 <= tok < vocab_size:
      raise ConfigError(f"sample.infill: token id {tok} at position {pos} is outside the vocabulary "
                        f"[0, {vocab_size})")
    tokens_BN[:, pos], mask_BN[:, pos] = tok, True
  return tokens_BN, mask_BN


def cut_after_end(tokens_BC: jax.Array, end_ids: tuple[int, ...], pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(tokens with PAD after the first end token, valid mask [B, C], has_end [B])."""
  canvas_len = tokens_BC.shape[-1]
  is_end_BC = jnp.isin(tokens_BC, jnp.asarray(end_ids, jnp.int32)) if end_ids else jnp.zeros(tokens_BC.shape, bool)
  has_end_B = jnp.any(is_end_BC, axis=-1)
  last_B = jnp.where(has_end_B, jnp.argmax(is_end_BC, axis=-1), canvas_len - 1)
  valid_BC = jnp.arange(canvas_len)[None, :] <= last_B[:, None]
  return jnp.where(valid_BC, tokens_BC, pad_id), valid_BC, has_end_B


def _model_cfg(model):
  for name in ("cfg", "config"):
    if hasattr(model, name):
      return getattr(model, name)
  raise ValueError("generate: the model has no `cfg`/`config` attribute (expected a dgemma Transformer)")


def prompt_chunks(prompt_len: int, chunk: int) -> tuple[int, int]:
  """(first, n): the prompt is encoded as a first chunk of `first` tokens (the remainder; 0 when `chunk` divides the
  prompt), then n chunks of `chunk` (sample.prompt_chunk; 0 or a chunk >= the prompt: the whole prompt at once,
  (prompt_len, 0))."""
  if not chunk or chunk >= prompt_len:
    return prompt_len, 0
  first = prompt_len % chunk
  return first, (prompt_len - first) // chunk


def encode_prompt(apply, prompt_BP, pos_BP, seg_BP, cache, *, chunk: int, shift: bool, vocab: int):
  """The prompt written into `cache` by causal encode passes, a chunk of tokens at a time (`prompt_chunks`): each
  chunk is appended at the next slots and attends to the slots before it, so every token reads what the whole prompt's
  pass would give it, while one chunk's activations and attention scores are live, not the prompt's. Returns the
  cache and, with `shift` (model.decoder_shift), the fp32 logits at each row's last valid token (`vocab` wide; a
  row's first token is valid, so the first chunk sets every row's)."""
  first, n = prompt_chunks(prompt_BP.shape[1], chunk)

  def one(carry, xs):
    cache, prev_BV = carry
    tokens_BT, pos_BT, seg_BT = xs
    logits_BTV, cache = apply(tokens_BT, pos_BT, seg_BT, cache, return_logits=shift, method="encode")
    if shift:  # the row's valid tokens in this chunk are a prefix of it
      count_B = jnp.sum(seg_BT != 0, axis=1, dtype=jnp.int32)
      prev_BV = last_valid_logits(logits_BTV, count_B, prev_BV).astype(jnp.float32)
    return (cache, prev_BV), None

  batch = prompt_BP.shape[0]
  prev_BV = jnp.zeros((batch, vocab), jnp.float32) if shift else None
  if first:  # the remainder first, then whole chunks in one scanned program (the encode traced once when it divides)
    head = lambda x: x[:, :first]
    (cache, prev_BV), _ = one((cache, prev_BV), (head(prompt_BP), head(pos_BP), head(seg_BP)))
  if n:
    rest = lambda x: jnp.moveaxis(x[:, first:].reshape(batch, n, chunk), 1, 0)  # [n, B, chunk]
    (cache, prev_BV), _ = jax.lax.scan(one, (cache, prev_BV), (rest(prompt_BP), rest(pos_BP), rest(seg_BP)))
  return cache, prev_BV


def _generate_impl(model, cfg: SamplerConfig, max_new_tokens: int, trajectory: str,
                   params, prompt_BP, lengths_B, rng, fixed_BN, fixed_mask_BN, active_B, callback_id) -> GenerateOutput:
  mcfg = _model_cfg(model)
  vocab = int(mcfg.vocab_size)
  batch, prompt_len = prompt_BP.shape
  noise = as_noise(rng, batch)
  C = cfg.canvas_len
  K = num_canvases(max_new_tokens, C)
  M = K * C
  use_sc = bool(getattr(mcfg, "self_conditioning", True))
  apply = functools.partial(model.apply, {"params": params})
  official = cfg.semantics == "official"
  # Official semantics carry the self-conditioning signal as its soft embedding, kept in bf16.
  sc_signal_fn = (lambda proc_BCV: apply(proc_BCV, method="self_conditioning_embedding").astype(jnp.bfloat16)
                  ) if official and use_sc else None
  lengths_B = lengths_B.astype(jnp.int32)

  # 1. prompt -> cache (slots [0, P)); right padding is segment 0
  # sliding layers keep a window-sized ring (transformer.KVCache): the same attention, less memory
  cache = init_cache(mcfg, batch, cache_size(prompt_len, max_new_tokens, C), dtype=jnp.dtype(mcfg.dtype),
                     sliding_ring=True)
  iota_P = jnp.arange(prompt_len, dtype=jnp.int32)
  prompt_seg_BP = (iota_P[None, :] < lengths_B[:, None]).astype(jnp.int32)
  prompt_pos_BP = jnp.broadcast_to(iota_P, (batch, prompt_len))
  shift = bool(getattr(mcfg, "decoder_shift", False))
  # model.decoder_shift: the first canvas position is scored by the logits at the token before it
  cache, prev_logits_BV = encode_prompt(apply, prompt_BP.astype(jnp.int32), prompt_pos_BP, prompt_seg_BP, cache,
                                        chunk=cfg.prompt_chunk, shift=shift, vocab=vocab)

  # infilling targets, padded to whole canvases (an all-False mask when not infilling: one program)
  pad = M - max_new_tokens
  fixed_BM = jnp.pad(fixed_BN.astype(jnp.int32), ((0, 0), (0, pad)))
  fixed_mask_BM = jnp.pad(fixed_mask_BN.astype(bool), ((0, 0), (0, pad)))

  record = trajectory in ("first", "all")
  iota_C = jnp.arange(C, dtype=jnp.int32)
  ones_BC = jnp.ones((batch, C), jnp.int32)

  def body(st: _GenState) -> _GenState:
    k = st.canvas_idx
    # 2. canvas positions follow the row's valid tokens
    pos_BC = (lengths_B + st.committed_B)[:, None] + iota_C[None, :]

    def decode_fn(canvas_BC, sc_BCX, sc_mask_B):
      signal = {}
      if use_sc:  # the logits (HF) or their soft embedding (official), as the sampler carries it
        signal = dict(sc_embeddings_BCD=sc_BCX) if official else dict(sc_logits_BCV=sc_BCX)
        signal["sc_mask_B"] = sc_mask_B
      if shift:
        signal["prev_logits_BKV"] = st.prev_logits_BV[:, None]
      return apply(canvas_BC, pos_BC, ones_BC, st.cache, per_query_window=official, method="decode", **signal)

    fixed_BC = jax.lax.dynamic_slice_in_dim(fixed_BM, k * C, C, axis=1)
    fixed_mask_BC = jax.lax.dynamic_slice_in_dim(fixed_mask_BM, k * C, C, axis=1)
    den = denoise_canvas(decode_fn, cfg, noise, initial_canvas(cfg, noise, k, C, vocab), vocab, canvas_idx=k,
                         done_B=st.ended_B, fixed_BC=fixed_BC, fixed_mask_BC=fixed_mask_BC, record=record,
                         sc_dtype=jnp.dtype(mcfg.param_dtype), sc_signal_fn=sc_signal_fn, callback_id=callback_id)

    # 3. cut after the first end token; ended rows contribute nothing
    cut_BC, valid_BC, has_end_B = cut_after_end(canvas_result(den, cfg), cfg.end_ids, cfg.pad_id)
    valid_BC = valid_BC & ~st.ended_B[:, None]
    cut_BC = jnp.where(valid_BC, cut_BC, cfg.pad_id)
    tokens_BM = jax.lax.dynamic_update_slice_in_dim(st.tokens_BM, cut_BC, k * C, axis=1)

    n_valid_B = jnp.sum(valid_BC, axis=-1, dtype=jnp.int32)

    def commit(carry):
      cache, prev_BV = carry
      logits_BCV, cache = apply(cut_BC, pos_BC, valid_BC.astype(jnp.int32), cache, return_logits=shift,
                                method="encode")
      if shift:  # valid tokens are a prefix of the canvas
        prev_BV = last_valid_logits(logits_BCV, n_valid_B, prev_BV).astype(jnp.float32)
      return cache, prev_BV

    carry = (st.cache, st.prev_logits_BV)
    cache, prev_logits_BV = jax.lax.cond(k < K - 1, commit, lambda c: c, carry) if K > 1 else carry

    traj = st.traj
    if trajectory == "all":
      traj = jax.tree.map(lambda buf, new: buf.at[k].set(new), traj, den.traj)
    elif trajectory == "first":
      traj = jax.tree.map(lambda buf, new: jnp.where(k == 0, new[None], buf), traj, den.traj)

    return _GenState(canvas_idx=k + 1, cache=cache, committed_B=st.committed_B + n_valid_B,
                     ended_B=st.ended_B | has_end_B, tokens_BM=tokens_BM,
                     num_forwards_B=st.num_forwards_B + den.num_forwards_B, traj=traj, prev_logits_BV=prev_logits_BV)

  traj0 = None
  if record:
    n_traj = K if trajectory == "all" else 1
    traj0 = jax.tree.map(lambda x: jnp.broadcast_to(x, (n_traj,) + x.shape),
                         Trajectory.empty(cfg.max_denoising_steps, batch, C))
  state = _GenState(canvas_idx=jnp.zeros((), jnp.int32), cache=cache, committed_B=jnp.zeros((batch,), jnp.int32),
                    ended_B=~active_B, tokens_BM=jnp.full((batch, M), cfg.pad_id, jnp.int32),
                    num_forwards_B=jnp.zeros((batch,), jnp.int32), traj=traj0, prev_logits_BV=prev_logits_BV)
  # 4. canvas after canvas
  if cfg.early_exit:
    state = jax.lax.while_loop(lambda st: (st.canvas_idx < K) & ~jnp.all(st.ended_B), body, state)
  else:
    state, _ = jax.lax.scan(lambda st, _: (body(st), None), state, None, length=K)

  tokens_BN, valid_BN, ended_B = cut_after_end(state.tokens_BM[:, :max_new_tokens], cfg.end_ids, cfg.pad_id)
  valid_BN = valid_BN & active_B[:, None]
  lengths_out_B = jnp.sum(valid_BN, axis=-1, dtype=jnp.int32)
  tpf_B = lengths_out_B.astype(jnp.float32) / jnp.maximum(state.num_forwards_B, 1).astype(jnp.float32)
  return GenerateOutput(tokens_BN=tokens_BN, lengths_B=lengths_out_B, ended_B=ended_B,
                        num_forwards_B=state.num_forwards_B, tokens_per_forward_B=tpf_B, trajectory=state.traj)


_generate_jit = sharding.jit_with_axis_rules(_generate_impl, static_argnums=(0, 1, 2, 3))


def lower(model, params, sampler_cfg: SamplerConfig, *, batch: int, prompt_len: int, max_new_tokens: int,
          weight_formats: Any = None):
  """The program `generate` compiles for a request of `batch` rows of `prompt_len` prompt tokens, lowered from
  shapes (nothing runs): `params` may be arrays or jax.ShapeDtypeStructs on their shardings. weight_formats: a tree
  like params of jax Formats the weights are held in (`compiled_weight_formats`), or of `Layout.AUTO` ones to leave
  them to the compiler; None = the weights' own (the default layouts for shapes)."""
  in_shardings = None if weight_formats is None else (weight_formats,) + (None,) * 7
  program = (_generate_jit if in_shardings is None else
             sharding.jit_with_axis_rules(_generate_impl, static_argnums=(0, 1, 2, 3), in_shardings=in_shardings))
  shape = lambda *dims, dtype=jnp.int32: jax.ShapeDtypeStruct(dims, dtype)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  return program.lower(model, sampler_cfg, int(max_new_tokens), "none", params, shape(batch, prompt_len),
                       shape(batch), rng, shape(batch, max_new_tokens), shape(batch, max_new_tokens, dtype=bool),
                       shape(batch, dtype=bool), shape())


def compiled_weight_formats(model, params, sampler_cfg: SamplerConfig, *, max_new_tokens: int, batch: int = 1,
                            prompt_len: int = MIN_PROMPT_BUCKET) -> Any:
  """The memory layouts the generate program picks for the weights when they are left to the compiler
  (`Layout.AUTO`), compiled for one request shape (`lower`; nothing runs): a tree like `params` (arrays or
  jax.ShapeDtypeStructs on their shardings) of jax Formats. Weights held in them (`lay_out`) are read as they are
  by every later program: jit compiles for the layouts of committed arrays, so the programs of other request shapes
  (prompt buckets) and other uses (scoring) share them. On a TPU this keeps its compiler from copying every stacked
  int4 weight into a tiled layout inside each program (sample.weight_layouts; docs/finetuning.md, "Sampling
  plans")."""
  auto = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), params)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  compiled = lower(model, abstract, sampler_cfg, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                   weight_formats=auto).compile()
  return compiled.input_formats[0][0]


def lay_out(leaves: list, formats: list) -> None:
  """Moves each array of `leaves` (a list, changed in place) into its jax Format, one at a time: where the list held
  the only reference to a weight, its old buffer is let go as the next is copied, so the device holds the weights
  and one more weight at most (a 26B model relaid on a 16 GB chip)."""
  if len(leaves) != len(formats):
    raise ValueError(f"lay_out: {len(leaves)} arrays, {len(formats)} formats")
  for i, fmt in enumerate(formats):
    leaves[i] = jax.device_put(leaves[i], fmt)


def generate(model, params, prompt_tokens_BP, prompt_lengths_B, sampler_cfg: SamplerConfig, rng,
             max_new_tokens: int, return_trajectory: bool | str = False, *,
             infill_tokens_BN=None, infill_mask_BN=None, step_callback=None, row_active_B=None,
             check: bool = True) -> GenerateOutput:
  """Generates up to `max_new_tokens` per prompt with the DiffusionGemma sampler.

  model / params: a dgemma `Transformer` and its params.
  prompt_tokens_BP: int [B, P] prompts, right-padded (anything after prompt_lengths_B[b] is ignored);
    every prompt needs at least one token (e.g. BOS). P + max_new_tokens rounded up to whole
    canvases must fit in sampler_cfg.max_context (`check_request`).
  rng: a PRNG key (row b uses fold_in(rng, b)), per-row keys [B] (a row's tokens then do not depend
    on its batch), or a noise source from `dgemma.sampling.noise` (e.g. `FixedNoise` for replays).
  return_trajectory: False, True / 'first' (first canvas), or 'all' (every canvas).
  infill_tokens_BN / infill_mask_BN [B, max_new_tokens]: positions of the response fixed by the caller
    (never re-noised; they appear in the output as given); `infill_arrays` builds them from pairs.
  step_callback: with sampler_cfg.show == 'live', called on the host with a `live.StepView` after
    every executed denoising step, in order (e.g. a `live.LivePrinter`); None prints token ids.
    The call returns once every step has been delivered.
  row_active_B: bool [B] (default all True); a False row is padding (`bucketed_shape`): it starts ended, takes
    no decoder pass and returns no tokens.
  check: whether to run `check_request` on the request (False: the caller checked it, e.g. dgemma.load's Model).
  Bad requests raise (ConfigError / ValueError naming the field) before anything is compiled.
  """
  if not isinstance(sampler_cfg, SamplerConfig):
    raise TypeError(f"sampler_cfg: expected a SamplerConfig, got {type(sampler_cfg).__name__}")
  prompt_shape = np.shape(prompt_tokens_BP)
  if len(prompt_shape) != 2:
    raise ValueError(f"prompt_tokens_BP: expected [batch, prompt_len], got shape {prompt_shape}")
  batch, prompt_len = prompt_shape
  if check:
    check_request(sampler_cfg, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens)
  max_new_tokens = int(max_new_tokens)
  if np.shape(prompt_lengths_B) != (batch,):
    raise ValueError(f"prompt_lengths_B: expected shape ({batch},), got {np.shape(prompt_lengths_B)}")
  if not isinstance(prompt_lengths_B, jax.core.Tracer):
    host_lengths = np.asarray(prompt_lengths_B)
    if host_lengths.min() < 1 or host_lengths.max() > prompt_len:
      raise ValueError(f"prompt_lengths_B: every length must be in [1, {prompt_len}], got {host_lengths}")
  if return_trajectory is True:
    return_trajectory = "first"
  traj = return_trajectory or "none"
  if traj not in ("none", "first", "all"):
    raise ValueError(f"return_trajectory: expected False, True, 'first' or 'all', got {return_trajectory!r}")
  if (infill_tokens_BN is None) != (infill_mask_BN is None):
    raise ValueError("infill_tokens_BN and infill_mask_BN go together")
  if infill_mask_BN is None:
    infill_tokens_BN = np.zeros((batch, max_new_tokens), np.int32)
    infill_mask_BN = np.zeros((batch, max_new_tokens), bool)
  for name, x in (("infill_tokens_BN", infill_tokens_BN), ("infill_mask_BN", infill_mask_BN)):
    if np.shape(x) != (batch, max_new_tokens):
      raise ValueError(f"{name}: expected shape {(batch, max_new_tokens)} (one entry per response position), "
                       f"got {np.shape(x)}")
  if not isinstance(infill_tokens_BN, jax.core.Tracer) and not isinstance(infill_mask_BN, jax.core.Tracer):
    host_tokens, host_mask = np.asarray(infill_tokens_BN), np.asarray(infill_mask_BN, bool)
    vocab = int(_model_cfg(model).vocab_size)
    bad = host_mask & ((host_tokens < 0) | (host_tokens >= vocab))
    if bad.any():
      b, n = np.argwhere(bad)[0]
      raise ValueError(f"infill_tokens_BN: token {host_tokens[b, n]} at row {b}, position {n} is outside the "
                       f"vocabulary [0, {vocab})")
  if step_callback is not None and sampler_cfg.show != "live":
    raise ValueError("step_callback: needs sampler_cfg.show='live' (config.sample.show); the callback is "
                     "compiled into the program only then")
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  row_active_B = np.ones((batch,), bool) if row_active_B is None else row_active_B
  if np.shape(row_active_B) != (batch,):
    raise ValueError(f"row_active_B: expected shape ({batch},), got {np.shape(row_active_B)}")
  args = (model, sampler_cfg, max_new_tokens, traj, params, jnp.asarray(prompt_tokens_BP, jnp.int32),
          jnp.asarray(prompt_lengths_B, jnp.int32), rng, jnp.asarray(infill_tokens_BN, jnp.int32),
          jnp.asarray(infill_mask_BN, bool), jnp.asarray(row_active_B, bool))
  if sampler_cfg.show != "live":
    return _generate_jit(*args, np.int32(0))
  printer = step_callback or live.LivePrinter(total_steps=sampler_cfg.max_denoising_steps,
                                              end_ids=sampler_cfg.end_ids)
  with live.registered(printer) as cb_id:
    out = jax.block_until_ready(_generate_jit(*args, np.int32(cb_id)))
    jax.effects_barrier()  # every step delivered before the callback is unregistered
  return out


def trajectory_steps(traj: Trajectory, row: int = 0, canvas: int = 0):
  """One row's record of one canvas as numpy, the steps it ran only: (tokens_SC, accepted_SC,
  entropy_SC), tokens being what the step produced before re-noising (`Trajectory.shown`):
  the inputs of `dgemma.run_report.trajectory_html`. `canvas` indexes the trajectory's leading axis
  (always 0 for return_trajectory='first')."""
  t = jax.tree.map(lambda x: np.asarray(x[canvas]), traj)
  steps = np.flatnonzero(t.active_SB[:, row])
  return t.shown_SBC[steps, row], t.accepted_SBC[steps, row], t.entropy_SBC[steps, row]
