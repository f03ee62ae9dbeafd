"""Block-autoregressive generation: prompt -> canvas after canvas, the whole loop one jitted program.

Reference doc, "Two modes" and "Sampler (released defaults)" / "Commit"; HF 5.24
`DiffusionGemmaGenerationMixin.generate`:
  1. The right-padded prompts are encoded once (causal) into a fixed-size KV cache of
     P + (num_canvases - 1) * C slots (padding slots get segment 0 and are never attended).
  2. Each canvas is denoised (`sampler.denoise_canvas`) at positions len_b + committed_b + [0, C):
     row b's canvas follows its own valid tokens, as HF does for a single unpadded prompt.
  3. The argmax canvas is cut after its first end token, the rest padded (PAD); the valid tokens are
     appended to the cache by a causal encode pass at the positions they were denoised at (the pad
     tail gets segment 0, so the next canvas's positions continue right after the valid tokens).
     The last canvas is never committed.
  4. Rows that ended stay PAD and take no more decoder passes; the loop stops early when every row
     ended (`early_exit`, `lax.while_loop`) or runs all canvases (`lax.scan`).
Shapes are static: one compilation per (batch, prompt length, max_new_tokens, settings).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma.model import init_cache
from dgemma.sampling.noise import as_noise
from dgemma.sampling.sampler import SamplerConfig, Trajectory, denoise_canvas


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


def num_canvases(max_new_tokens: int, canvas_len: int) -> int:
  return math.ceil(max_new_tokens / canvas_len)


def cache_size(prompt_len: int, max_new_tokens: int, canvas_len: int) -> int:
  """Prompt slots plus every canvas that gets committed (all but the last)."""
  return prompt_len + (num_canvases(max_new_tokens, canvas_len) - 1) * canvas_len


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


def _generate_impl(model, cfg: SamplerConfig, max_new_tokens: int, trajectory: str,
                   params, prompt_BP, lengths_B, rng, fixed_BN, fixed_mask_BN) -> GenerateOutput:
  mcfg = _model_cfg(model)
  vocab = int(mcfg.vocab_size)
  batch, prompt_len = prompt_BP.shape
  noise = as_noise(rng, batch)
  C = cfg.canvas_len
  K = num_canvases(max_new_tokens, C)
  M = K * C
  use_sc = bool(getattr(mcfg, "self_conditioning", True))
  apply = functools.partial(model.apply, {"params": params})
  lengths_B = lengths_B.astype(jnp.int32)

  # 1. prompt -> cache (slots [0, P)); right padding is segment 0
  cache = init_cache(mcfg, batch, cache_size(prompt_len, max_new_tokens, C), dtype=jnp.dtype(mcfg.dtype))
  iota_P = jnp.arange(prompt_len, dtype=jnp.int32)
  prompt_seg_BP = (iota_P[None, :] < lengths_B[:, None]).astype(jnp.int32)
  prompt_pos_BP = jnp.broadcast_to(iota_P, (batch, prompt_len))
  _, cache = apply(prompt_BP.astype(jnp.int32), prompt_pos_BP, prompt_seg_BP, cache,
                   return_logits=False, method="encode")

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

    def decode_fn(canvas_BC, sc_logits_BCV, sc_mask_B):
      if not use_sc:
        sc_logits_BCV = sc_mask_B = None
      return apply(canvas_BC, pos_BC, ones_BC, st.cache, sc_logits_BCV=sc_logits_BCV, sc_mask_B=sc_mask_B,
                   method="decode")

    fixed_BC = jax.lax.dynamic_slice_in_dim(fixed_BM, k * C, C, axis=1)
    fixed_mask_BC = jax.lax.dynamic_slice_in_dim(fixed_mask_BM, k * C, C, axis=1)
    den = denoise_canvas(decode_fn, cfg, noise, noise.init_canvas(k, C, vocab), vocab, canvas_idx=k,
                         done_B=st.ended_B, fixed_BC=fixed_BC, fixed_mask_BC=fixed_mask_BC, record=record,
                         sc_dtype=jnp.dtype(mcfg.param_dtype))

    # 3. cut after the first end token; ended rows contribute nothing
    cut_BC, valid_BC, has_end_B = cut_after_end(den.argmax_BC, cfg.end_ids, cfg.pad_id)
    valid_BC = valid_BC & ~st.ended_B[:, None]
    cut_BC = jnp.where(valid_BC, cut_BC, cfg.pad_id)
    tokens_BM = jax.lax.dynamic_update_slice_in_dim(st.tokens_BM, cut_BC, k * C, axis=1)

    def commit(cache):
      _, cache = apply(cut_BC, pos_BC, valid_BC.astype(jnp.int32), cache, return_logits=False, method="encode")
      return cache

    cache = jax.lax.cond(k < K - 1, commit, lambda c: c, st.cache) if K > 1 else st.cache

    traj = st.traj
    if trajectory == "all":
      traj = jax.tree.map(lambda buf, new: buf.at[k].set(new), traj, den.traj)
    elif trajectory == "first":
      traj = jax.tree.map(lambda buf, new: jnp.where(k == 0, new[None], buf), traj, den.traj)

    return _GenState(canvas_idx=k + 1, cache=cache,
                     committed_B=st.committed_B + jnp.sum(valid_BC, axis=-1, dtype=jnp.int32),
                     ended_B=st.ended_B | has_end_B, tokens_BM=tokens_BM,
                     num_forwards_B=st.num_forwards_B + den.num_forwards_B, traj=traj)

  traj0 = None
  if record:
    n_traj = K if trajectory == "all" else 1
    traj0 = jax.tree.map(lambda x: jnp.broadcast_to(x, (n_traj,) + x.shape),
                         Trajectory.empty(cfg.max_denoising_steps, batch, C))
  state = _GenState(canvas_idx=jnp.zeros((), jnp.int32), cache=cache, committed_B=jnp.zeros((batch,), jnp.int32),
                    ended_B=jnp.zeros((batch,), bool), tokens_BM=jnp.full((batch, M), cfg.pad_id, jnp.int32),
                    num_forwards_B=jnp.zeros((batch,), jnp.int32), traj=traj0)
  # 4. canvas after canvas
  if cfg.early_exit:
    state = jax.lax.while_loop(lambda st: (st.canvas_idx < K) & ~jnp.all(st.ended_B), body, state)
  else:
    state, _ = jax.lax.scan(lambda st, _: (body(st), None), state, None, length=K)

  tokens_BN, valid_BN, ended_B = cut_after_end(state.tokens_BM[:, :max_new_tokens], cfg.end_ids, cfg.pad_id)
  lengths_out_B = jnp.sum(valid_BN, axis=-1, dtype=jnp.int32)
  tpf_B = lengths_out_B.astype(jnp.float32) / jnp.maximum(state.num_forwards_B, 1).astype(jnp.float32)
  return GenerateOutput(tokens_BN=tokens_BN, lengths_B=lengths_out_B, ended_B=ended_B,
                        num_forwards_B=state.num_forwards_B, tokens_per_forward_B=tpf_B, trajectory=state.traj)


_generate_jit = jax.jit(_generate_impl, static_argnums=(0, 1, 2, 3))


def generate(model, params, prompt_tokens_BP, prompt_lengths_B, sampler_cfg: SamplerConfig, rng,
             max_new_tokens: int, return_trajectory: bool | str = False, *,
             infill_tokens_BN=None, infill_mask_BN=None) -> GenerateOutput:
  """Generates up to `max_new_tokens` per prompt with the DiffusionGemma sampler.

  model / params: a dgemma `Transformer` and its params.
  prompt_tokens_BP: int [B, P] prompts, right-padded (anything after prompt_lengths_B[b] is ignored);
    every prompt needs at least one token (e.g. BOS).
  rng: a PRNG key (row b uses fold_in(rng, b)), per-row keys [B] (a row's tokens then do not depend
    on its batch), or a noise source from `dgemma.sampling.noise` (e.g. `FixedNoise` for replays).
  return_trajectory: False, True / 'first' (first canvas), or 'all' (every canvas).
  infill_tokens_BN / infill_mask_BN [B, max_new_tokens]: positions of the response fixed by the caller
    (never re-noised; they appear in the output as given).
  """
  prompt_BP = jnp.asarray(prompt_tokens_BP, jnp.int32)
  if prompt_BP.ndim != 2:
    raise ValueError(f"prompt_tokens_BP: expected [batch, prompt_len], got shape {prompt_BP.shape}")
  batch = prompt_BP.shape[0]
  lengths_B = jnp.asarray(prompt_lengths_B, jnp.int32)
  if lengths_B.shape != (batch,):
    raise ValueError(f"prompt_lengths_B: expected shape ({batch},), got {lengths_B.shape}")
  if not isinstance(lengths_B, jax.core.Tracer):
    host_lengths = np.asarray(lengths_B)
    if host_lengths.size and (host_lengths.min() < 1 or host_lengths.max() > prompt_BP.shape[1]):
      raise ValueError(f"prompt_lengths_B: every length must be in [1, {prompt_BP.shape[1]}], got {host_lengths}")
  if int(max_new_tokens) <= 0:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
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
  infill_tokens_BN = jnp.asarray(infill_tokens_BN, jnp.int32)
  infill_mask_BN = jnp.asarray(infill_mask_BN, bool)
  for name, x in (("infill_tokens_BN", infill_tokens_BN), ("infill_mask_BN", infill_mask_BN)):
    if x.shape != (batch, max_new_tokens):
      raise ValueError(f"{name}: expected shape {(batch, max_new_tokens)}, got {x.shape}")
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  return _generate_jit(model, sampler_cfg, int(max_new_tokens), traj, params, prompt_BP, lengths_B, rng,
                       infill_tokens_BN, infill_mask_BN)


def trajectory_steps(traj: Trajectory, row: int = 0, canvas: int = 0):
  """One row's record of one canvas as numpy, the steps it ran only: (tokens_SC, accepted_SC,
  entropy_SC), tokens being what the step produced before re-noising (where(accepted, sampled,
  canvas)): the inputs of `dgemma.report.trajectory_html`. `canvas` indexes the trajectory's
  leading axis (always 0 for return_trajectory='first')."""
  t = jax.tree.map(lambda x: np.asarray(x[canvas]), traj)
  steps = np.flatnonzero(t.active_SB[:, row])
  accepted = t.accepted_SBC[steps, row]
  tokens = np.where(accepted, t.sampled_SBC[steps, row], t.canvas_SBC[steps, row])
  return tokens, accepted, t.entropy_SBC[steps, row]
