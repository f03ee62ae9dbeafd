"""Plain autoregressive decoding on the DiffusionGemma trunk (encoder mode only, KV cache).

  from dgemma.sampling.autoregressive import ar_generate
  tokens_BN, lengths_B = ar_generate(model, params, prompts_BP, lengths_B, jax.random.key(0),
                                     max_new_tokens=64, temperature=0.0, end_ids=(1,))

The causal encoder is plain Gemma 4 next-token prediction (reference doc, "Two modes"), so the same
weights decode one token at a time. One jitted program per (batch, prompt length, max_new_tokens,
temperature, number of end ids):
  1. Prefill: the right-padded prompts are encoded into a cache of P + N slots, all but each row's
     last prompt token (that slot and the right padding get segment 0 and are never attended).
  2. Step t = 0 .. N-1 (`lax.while_loop`, leaving when every row ended): encode one token per row
     (T=1) at slot P + t and position len_b - 1 + t -- the last prompt token at t = 0, then the
     previous output -- and pick the next token from its logits (argmax, or a categorical draw at
     `temperature` with key fold_in(row key, t), so a row's draws do not depend on its batch).
  Slots are shared by the batch, positions are per row; masks go by segment and position, so rows
  of different prompt lengths decode exactly as they would alone.
After the first end token a row is PAD (its later steps still run, their results discarded).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma import reductions
from dgemma.model import init_cache, sharding
from dgemma.sampling.noise import row_keys


@struct.dataclass
class _State:
  step: jax.Array      # int32 [], tokens produced so far
  cache: object
  input_B: jax.Array   # int32, the token each row encodes next
  ended_B: jax.Array   # bool, an end token was produced
  tokens_BN: jax.Array
  lengths_B: jax.Array  # int32, tokens produced up to and including the first end token


def _ar_impl(model, max_new_tokens: int, temperature: float, pad_id: int, params, prompt_BP, lengths_B,
             keys_B, end_ids_E):
  cfg = model.cfg
  batch, prompt_len = prompt_BP.shape
  N = max_new_tokens
  apply = functools.partial(model.apply, {"params": params})
  # sliding layers keep a window-sized ring (transformer.KVCache): the same attention, less memory
  cache = init_cache(cfg, batch, prompt_len + N, dtype=jnp.dtype(cfg.dtype), sliding_ring=True)

  # 1. prefill everything but the last prompt token (no logits)
  iota_P = jnp.arange(prompt_len, dtype=jnp.int32)
  seg_BP = (iota_P[None, :] < lengths_B[:, None] - 1).astype(jnp.int32)
  pos_BP = jnp.broadcast_to(iota_P, (batch, prompt_len))
  _, cache = apply(prompt_BP, pos_BP, seg_BP, cache, return_logits=False, method="encode")
  last_B = jnp.take_along_axis(prompt_BP, (lengths_B - 1)[:, None], axis=1)[:, 0]
  ones_B1 = jnp.ones((batch, 1), jnp.int32)

  # 2. one token per step
  def body(st: _State) -> _State:
    pos_B1 = (lengths_B - 1 + st.step)[:, None]
    logits_B1V, cache = apply(st.input_B[:, None], pos_B1, ones_B1, st.cache, method="encode")
    logits_BV = logits_B1V[:, 0].astype(jnp.float32)
    if temperature > 0:
      step_keys = jax.vmap(lambda k: jax.random.fold_in(k, st.step))(keys_B)
      next_B = jax.vmap(jax.random.categorical)(step_keys, logits_BV / temperature)
    else:
      next_B = reductions.argmax(logits_BV)
    next_B = next_B.astype(jnp.int32)
    out_B = jnp.where(st.ended_B, pad_id, next_B)
    tokens_BN = jax.lax.dynamic_update_slice_in_dim(st.tokens_BN, out_B[:, None], st.step, axis=1)
    is_end_B = jnp.isin(next_B, end_ids_E) & ~st.ended_B
    lengths_out_B = jnp.where(st.ended_B, st.lengths_B, st.step + 1)
    return _State(step=st.step + 1, cache=cache, input_B=next_B, ended_B=st.ended_B | is_end_B,
                  tokens_BN=tokens_BN, lengths_B=lengths_out_B)

  state = _State(step=jnp.zeros((), jnp.int32), cache=cache, input_B=last_B.astype(jnp.int32),
                 ended_B=jnp.zeros((batch,), bool), tokens_BN=jnp.full((batch, N), pad_id, jnp.int32),
                 lengths_B=jnp.zeros((batch,), jnp.int32))
  state = jax.lax.while_loop(lambda st: (st.step < N) & ~jnp.all(st.ended_B), body, state)
  return state.tokens_BN, state.lengths_B


_ar_jit = sharding.jit_with_axis_rules(_ar_impl, static_argnums=(0, 1, 2, 3))


def ar_generate(model, params, prompts_BP, lengths_B, rng, max_new_tokens: int, temperature: float = 0.0,
                end_ids=(1,), *, pad_id: int = 0):
  """Autoregressive decoding with the causal encoder and its KV cache.

  model / params: a dgemma `Transformer` and its params.
  prompts_BP: int [B, P] right-padded prompts; lengths_B: valid tokens per row (each >= 1).
  rng: a PRNG key (row b uses fold_in(rng, b)) or per-row keys [B]; unused when temperature == 0.
  temperature: 0 = greedy (argmax), else categorical sampling from softmax(logits / temperature).
  end_ids: tokens that end a row (included in the output; PAD after them). () never ends.
  Returns (tokens_BN [B, max_new_tokens], lengths_B: tokens up to and including the first end token,
  max_new_tokens if none).
  """
  prompt_BP = jnp.asarray(prompts_BP, jnp.int32)
  if prompt_BP.ndim != 2:
    raise ValueError(f"prompts_BP: expected [batch, prompt_len], got shape {prompt_BP.shape}")
  batch, prompt_len = prompt_BP.shape
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  if lengths_B.shape != (batch,):
    raise ValueError(f"lengths_B: expected shape ({batch},), got {lengths_B.shape}")
  if not isinstance(lengths_B, jax.core.Tracer):
    host = np.asarray(lengths_B)
    if host.size and (host.min() < 1 or host.max() > prompt_len):
      raise ValueError(f"lengths_B: every length must be in [1, {prompt_len}], got {host}")
  if int(max_new_tokens) <= 0:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if rng is None:
    rng = jax.random.key(0)
  elif isinstance(rng, int):
    rng = jax.random.key(rng)
  keys_B = row_keys(rng, batch)
  end_ids_E = jnp.asarray(tuple(int(i) for i in end_ids), jnp.int32).reshape(-1)
  return _ar_jit(model, int(max_new_tokens), float(temperature), int(pad_id), params, prompt_BP, lengths_B,
                 keys_B, end_ids_E)
