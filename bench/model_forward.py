"""One decoder forward (the diffusion head over a canvas) against an encoded context, on this machine.

  .venv/bin/python bench/model_forward.py [--config=configs/models/small.py] [--canvas=256] [--context=256]

The model preset's random weights; a `context`-token prompt is encoded into the KV cache once, then
the jitted `Transformer.decode` runs over a `canvas`-token canvas (with self-conditioning logits, as
at every sampler step after the first). Compile excluded; median of timed calls. Also times the
causal `encode` of the context and a large f32 matmul in the same process: the model's FLOP rate
as a fraction of that matmul rate says how close the forward is to the machine's practical peak.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.model import layers
from dgemma.tools import params as params_tool

_CONFIG = config_flags.DEFINE_config_file("config", "configs/models/small.py", "Model preset (or experiment config).")
_CANVAS = flags.DEFINE_integer("canvas", 256, "Canvas tokens.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Encoded context tokens in the KV cache.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed calls per measurement.")


def random_params(cfg: ModelConfig, seed: int = 0):
  """Random weights of the preset's shapes (std 0.02 matrices, scales near 1); no init compile."""
  g = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    v = g.uniform(0.8, 1.2, s.shape) if "scale" in name else g.normal(0.0, 0.02, s.shape)
    return jnp.asarray(v, s.dtype)

  return jax.tree_util.tree_map_with_path(fill, param_shapes(cfg))


def time_call(fn, reps: int) -> float:
  """Median seconds per call of a warmed-up fn()."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def matmul_gflops(n: int = 2048, reps: int = 10) -> float:
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  return 2 * n**3 / time_call(lambda: f(a), reps) / 1e9


def forward_flops(cfg: ModelConfig, tokens: int, keys: int, self_cond: bool) -> float:
  """Matmul FLOPs of one pass over `tokens` queries attending `keys` keys (dense masks: all keys)."""
  s = params_tool.summarize(cfg)
  comps = s["components"]
  trunk = sum(comps[c][1] for c in ("attention", "dense_mlp", "experts", "router"))
  per_token = 2 * trunk + 2 * cfg.vocab_size * cfg.d_model  # + output logits
  if self_cond and cfg.self_conditioning:
    per_token += 2 * comps["self_conditioning"][1] + 2 * cfg.vocab_size * cfg.d_model  # + soft embedding
  attn = 0
  for kind in cfg.layer_types:
    _, H = layers.attn_dims(cfg, kind)
    attn += 4 * cfg.num_heads * H * keys  # q.k and p.v per query
  return tokens * (per_token + attn)


def main(argv):
  del argv
  config = _CONFIG.value
  group = params_tool.model_group(config)
  cfg = ModelConfig.from_config_dict(group)
  C, S = _CANVAS.value, _CONTEXT.value
  model = Transformer(cfg)
  params = random_params(cfg)
  g = np.random.default_rng(1)
  ctx_1S = jnp.asarray(g.integers(0, cfg.vocab_size, (1, S)), jnp.int32)
  canvas_1C = jnp.asarray(g.integers(0, cfg.vocab_size, (1, C)), jnp.int32)
  pos_1S = jnp.arange(S, dtype=jnp.int32)[None]
  pos_1C = S + jnp.arange(C, dtype=jnp.int32)[None]
  ones_1S, ones_1C = jnp.ones((1, S), jnp.int32), jnp.ones((1, C), jnp.int32)

  @jax.jit
  def encode(params, tokens):
    cache = init_cache(cfg, 1, S, jnp.dtype(cfg.dtype))
    _, cache = model.apply({"params": params}, tokens, pos_1S, ones_1S, cache, return_logits=False,
                           method=Transformer.encode)
    return cache

  @jax.jit
  def decode(params, canvas, cache, sc_logits):
    return model.apply({"params": params}, canvas, pos_1C, ones_1C, cache, sc_logits_BCV=sc_logits,
                       method=Transformer.decode)

  t0 = time.perf_counter()
  cache = jax.block_until_ready(encode(params, ctx_1S))
  enc_compile = time.perf_counter() - t0
  sc = jnp.asarray(g.normal(0, 1, (1, C, cfg.vocab_size)), jnp.float32)
  t0 = time.perf_counter()
  jax.block_until_ready(decode(params, canvas_1C, cache, sc))
  dec_compile = time.perf_counter() - t0

  reps = _REPS.value
  peak = matmul_gflops()
  dec_s = time_call(lambda: decode(params, canvas_1C, cache, sc), reps)
  enc_s = time_call(lambda: encode(params, ctx_1S), reps)
  peak2 = matmul_gflops()  # again after: the machine is shared, bracket the measurement
  peak = (peak + peak2) / 2
  dec_gf = forward_flops(cfg, C, S + C, True) / dec_s / 1e9
  enc_gf = forward_flops(cfg, S, S, False) / enc_s / 1e9
  counts = params_tool.summarize(cfg)

  print(f"command: {' '.join(sys.argv)}")
  print(f"model: {group.get('preset', '?')}  params total={counts['total'] / 1e6:.2f}M "
        f"active={counts['active'] / 1e6:.2f}M  dtype={cfg.dtype}  moe_impl={cfg.moe_impl}  "
        f"devices={jax.devices()[0].platform} x{jax.device_count()}")
  print(f"compile: decode {dec_compile:.1f} s, encode {enc_compile:.1f} s (excluded below)")
  print(f"{'pass':<34} {'ms':>8} {'tokens/s':>10} {'GFLOP/s':>8} {'/matmul':>8}")
  print(f"{f'decode: canvas {C}, cache {S}, self-cond':<34} {dec_s * 1e3:>8.1f} {C / dec_s:>10,.0f} "
        f"{dec_gf:>8.1f} {dec_gf / peak:>8.2f}")
  print(f"{f'encode: {S} tokens (causal, no logits)':<34} {enc_s * 1e3:>8.1f} {S / enc_s:>10,.0f} "
        f"{enc_gf:>8.1f} {enc_gf / peak:>8.2f}")
  print(f"f32 2048^2 matmul in the same run: {peak:.1f} GFLOP/s (mean of before/after: {peak2:.1f} after)")
  print("(encode GFLOP/s counts the output-logit matmul, which return_logits=False skips: an upper bound)")


if __name__ == "__main__":
  app.run(main)
