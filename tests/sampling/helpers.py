"""Shared pieces of the sampler tests: a synthetic decoder, a tiny random model, compile counting."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import settings as settings_lib
from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.sampling import JaxNoise, SamplerConfig, denoise_canvas, entropy, row_keys


def sampler_of(config) -> SamplerConfig:
  """The SamplerConfig a config's settings give, checked against its training objective."""
  return settings_lib.from_config(config).canvas_sampler


# ---- the denoising loop with a synthetic decoder ---------------------------------------------------

V_SYN, C_SYN, B_SYN = 32, 6, 3


def synthetic_decode(canvas_BC, sc_logits_BCV, sc_mask_B):
  """Row 0: one token at margin 40 (confident); rows 1, 2: flat-ish logits that follow the canvas."""
  del sc_logits_BCV, sc_mask_B
  target = jnp.full((C_SYN,), 5)
  row0 = 40.0 * jax.nn.one_hot(target, V_SYN)
  rest = 1.5 * jax.nn.one_hot(canvas_BC[1:], V_SYN) + 0.3 * jnp.sin(jnp.arange(V_SYN) * 1.7)
  return jnp.concatenate([row0[None], rest], axis=0)


@functools.partial(jax.jit, static_argnums=0)
def denoise_synthetic(cfg, init_BC, done_B, fixed_BC, fixed_mask_BC):
  noise = JaxNoise(row_keys(jax.random.key(3), B_SYN))
  return denoise_canvas(synthetic_decode, cfg, noise, init_BC, V_SYN, done_B=done_B, fixed_BC=fixed_BC,
                        fixed_mask_BC=fixed_mask_BC, record=True)


def run_synthetic(cfg, done=None, fixed_BC=None, fixed_mask_BC=None):
  """(final state as numpy, initial canvas); one compilation per cfg."""
  init = JaxNoise(row_keys(jax.random.key(3), B_SYN)).init_canvas(0, C_SYN, V_SYN)
  done = jnp.zeros((B_SYN,), bool) if done is None else done
  if fixed_mask_BC is None:
    fixed_BC, fixed_mask_BC = jnp.zeros((B_SYN, C_SYN), jnp.int32), jnp.zeros((B_SYN, C_SYN), bool)
  st = denoise_synthetic(cfg, init, done, fixed_BC, fixed_mask_BC)
  return jax.tree.map(np.asarray, st), np.asarray(init)


# ---- generate with a real (tiny, random) model ------------------------------------------------------

C, S, N = 8, 6, 20         # canvas, steps, max_new_tokens (3 canvases, the last one truncated)
PROMPTS = [[2, 40, 41, 42, 43, 44], [2, 50], [2, 60, 61, 62]]
P = max(map(len, PROMPTS))


def tiny_model(**changes):
  """(Transformer, random params) of a 2-layer model; `changes` override its ModelConfig fields."""
  mcfg = ModelConfig(**{**dict(vocab_size=128, d_model=32, num_layers=2, layer_types=("sliding", "global"),
                               num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=6, global_num_kv_heads=1,
                               global_head_dim=16, mlp_hidden=48, num_experts=0), **changes})
  rs = np.random.RandomState(0)

  def leaf(path, s):
    name = jax.tree_util.keystr(path)
    if "scale" in name or "layer_scalar" in name:
      value = rs.uniform(0.7, 1.3, s.shape)
      if "final_norm" in name:
        value *= 6.0  # sharp logits, so the sampler accepts several tokens and rows can stop
      return jnp.asarray(value, jnp.float32)
    return jnp.asarray(rs.normal(size=s.shape) / np.sqrt(mcfg.d_model), jnp.float32)

  return Transformer(mcfg), jax.tree_util.tree_map_with_path(leaf, param_shapes(mcfg))


class Messages(logging.Handler):
  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def count_compiles(fn):
  """(fn(), the 'Compiling ...' messages JAX logged while running it)."""
  handler, logger = Messages(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      out = jax.block_until_ready(fn())
  finally:
    logger.removeHandler(handler)
  return out, [m for m in handler.messages if m.startswith("Compiling")]


@functools.partial(jax.jit, static_argnums=(0, 1))
def denoise_fixed(decode_fn, cfg, noise, init_BC):
  return denoise_canvas(decode_fn, cfg, noise, init_BC, noise.gumbel_NSBCV.shape[-1], record=True)


def continuation_entropy(model, params, t0):
  """A jitted reference for a canvas's first decoder pass after a committed context: a fresh cache holding
  ctx_1L[:, :length] contiguously (generate's cache has the prompt padding inside it), then `decode` of
  canvas_1C at positions length .. length + C - 1; returns its tempered entropies [C]."""
  @jax.jit
  def reference(ctx_1L, length, canvas_1C):
    L, width = ctx_1L.shape[1], canvas_1C.shape[1]
    iota = jnp.arange(L)[None]
    cache = init_cache(model.cfg, 1, L)
    _, cache = model.apply({"params": params}, ctx_1L, iota, (iota < length).astype(jnp.int32), cache,
                           return_logits=False, method="encode")
    logits = model.apply({"params": params}, canvas_1C, length + jnp.arange(width)[None], jnp.ones_like(canvas_1C),
                         cache, method="decode")
    return entropy(logits / t0)[0][0]
  return reference


def check_first_steps(out, reference_entropy) -> tuple[int, int]:
  """Every row's first and second canvas (where the row got there): the first step's recorded tempered entropies
  against reference_entropy(context padded to P + C, its length, the canvas), the context being the prompt and
  the committed first canvas; fp32 round-off of another cache layout (see test_batch_invariance): atol 1e-4.
  Returns (canvases checked, second canvases among them)."""
  traj, checked, second = out.trajectory, 0, 0
  for b in range(len(PROMPTS)):
    for k in (0, 1):
      if not traj.active_SB[k, 0, b]:
        continue
      ctx = np.concatenate([PROMPTS[b], out.tokens_BN[b, :k * C]])
      length = len(ctx)
      h = reference_entropy(np.pad(ctx, (0, P + C - length))[None], length, traj.canvas_SBC[k, 0, b][None])
      np.testing.assert_allclose(np.asarray(h), traj.entropy_SBC[k, 0, b], atol=1e-4, err_msg=f"row {b} canvas {k}")
      checked, second = checked + 1, second + k
  return checked, second
