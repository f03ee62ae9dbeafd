"""What the block-causal decoder would save by scoring each canvas against its own canvas's keys only.

  .venv/bin/python bench/attention_layout.py [--rows=16 --canvases=3 --canvas_len=32 --context=96]

Training with K canvases per row (`diffusion.canvases_per_row`) decodes the K canvases in one pass: each query
scores every cache slot and all K * C canvas keys (`dgemma.model.attention.attend` on the masks of
`decoder_masks(..., num_canvases=K)`), though a query may read only its own canvas's C keys. This times, for one
sliding layer of the likelihood recipe (4 heads of 32, 2 key-value heads), the forward and backward of that
attention against the same attention computed per canvas: scores [rows, kv heads, K, group, C, context + C], one
softmax over both key sets, no key of another canvas. It checks both give the same output (the maximum difference
is printed) and prints the median milliseconds of each and their ratio (docs/benchmarks.md, 2026-12-06).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench.timing import host_cpu, median_seconds
from dgemma.model import attention

_ROWS = flags.DEFINE_integer("rows", 16, "Rows of the batch.")
_CANVASES = flags.DEFINE_integer("canvases", 3, "Canvases per row (K).")
_CANVAS_LEN = flags.DEFINE_integer("canvas_len", 32, "Tokens per canvas (C).")
_CONTEXT = flags.DEFINE_integer("context", 96, "Cache slots (the clean row before the last canvas).")
_HEADS, _KV_HEADS, _HEAD_DIM = 4, 2, 32  # configs/likelihood_small.py's sliding layers


def all_keys_attend(q_BTNH, k_cache, v_cache, k_canvas, v_canvas, mask_BTS, dtype):
  """What training runs today: `attention.attend` over [cache; every canvas key], `mask_BTS` over both."""
  return attention.attend(q_BTNH, jnp.concatenate([k_cache, k_canvas], 1), jnp.concatenate([v_cache, v_canvas], 1),
                          mask_BTS, dtype)


def per_canvas_attend(q_BTNH, k_cache, v_cache, k_canvas, v_canvas, mask_cache_BTS, mask_own_BTC, num_canvases):
  """`attention.attend` of the canvas queries over [cache; their own canvas's keys] (the other canvases' keys are
  masked out in the full layout, so they are skipped here); one softmax over both key sets."""
  B, T, N, H = q_BTNH.shape
  S, Kh = k_cache.shape[1], k_cache.shape[2]
  K, G = num_canvases, N // Kh
  C = T // K
  q = jnp.transpose(q_BTNH.reshape(B, K, C, Kh, G, H), (0, 3, 1, 4, 2, 5))  # [B, Kh, K, G, C, H]
  own_k = jnp.transpose(k_canvas.reshape(B, K, C, Kh, H), (0, 3, 1, 2, 4))  # [B, Kh, K, C, H]
  own_v = jnp.transpose(v_canvas.reshape(B, K, C, Kh, H), (0, 3, 1, 2, 4))
  s_cache = jnp.einsum("bxkgch,bxsh->bxkgcs", q, jnp.transpose(k_cache, (0, 2, 1, 3)))
  s_own = jnp.einsum("bxkgch,bxkjh->bxkgcj", q, own_k)
  s_cache = jnp.where(mask_cache_BTS.reshape(B, K, C, S)[:, None, :, None], s_cache, attention._NEG)
  s_own = jnp.where(mask_own_BTC.reshape(B, K, C, C)[:, None, :, None], s_own, attention._NEG)
  top = jax.lax.stop_gradient(jnp.maximum(s_cache.max(-1), s_own.max(-1)))[..., None]
  e_cache, e_own = jnp.exp(s_cache - top), jnp.exp(s_own - top)
  total = e_cache.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)
  out = (jnp.einsum("bxkgcs,bxsh->bxkgch", e_cache, jnp.transpose(v_cache, (0, 2, 1, 3)))
         + jnp.einsum("bxkgcj,bxkjh->bxkgch", e_own, own_v)) / total
  return jnp.transpose(out, (0, 2, 4, 1, 3, 5)).reshape(B, T, N, H)


def main(argv):
  del argv
  B, K, C, S = _ROWS.value, _CANVASES.value, _CANVAS_LEN.value, _CONTEXT.value
  T = K * C
  g = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(g.normal(size=shape), jnp.float32)
  q, cotangent = normal(B, T, _HEADS, _HEAD_DIM), normal(B, T, _HEADS, _HEAD_DIM)
  k_cache, v_cache = normal(B, S, _KV_HEADS, _HEAD_DIM), normal(B, S, _KV_HEADS, _HEAD_DIM)
  k_canvas, v_canvas = normal(B, T, _KV_HEADS, _HEAD_DIM), normal(B, T, _KV_HEADS, _HEAD_DIM)
  block_T = np.arange(T) // C
  limit_T = S - (K - 1 - block_T) * C  # canvas k reads the cache before its own start (attention.decoder_masks)
  mask_cache = np.broadcast_to(np.arange(S)[None] < limit_T[:, None], (B, T, S))
  forward_T = np.arange(T)[None, :] <= np.arange(T)[:, None]  # the forward stream's canvas mask, as in training
  mask_canvas = np.broadcast_to((block_T[:, None] == block_T[None, :]) & forward_T, (B, T, T))
  mask_own = np.broadcast_to(np.arange(C)[None, :] <= (np.arange(T) % C)[:, None], (B, T, C))
  mask_full = jnp.asarray(np.concatenate([mask_cache, mask_canvas], -1))
  mask_cache, mask_own = jnp.asarray(mask_cache), jnp.asarray(mask_own)

  def full(*a):
    return all_keys_attend(*a, mask_full, jnp.float32)

  def own(*a):
    return per_canvas_attend(*a, mask_cache, mask_own, K)

  args = (q, k_cache, v_cache, k_canvas, v_canvas)
  print(f"cpu: {host_cpu()}")
  print(f"rows {B}, {K} canvases of {C}, {S} cache slots; heads {_HEADS}, kv heads {_KV_HEADS}, head dim {_HEAD_DIM}")
  diff = float(jnp.abs(jax.jit(full)(*args) - jax.jit(own)(*args)).max())
  print(f"max |difference| of the outputs: {diff:.2e}")
  ms = {}
  for name, fn in (("all canvas keys (attention.attend)", full), ("own canvas keys", own)):
    step = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * cotangent), argnums=(0, 1, 2, 3, 4)))
    ms[name] = median_seconds(lambda: step(*args), reps=50) * 1e3
    print(f"{name:>36}: {ms[name]:.2f} ms forward + backward")
  base, new = ms.values()
  print(f"own / all: {new / base:.3f}")


if __name__ == "__main__":
  app.run(main)
