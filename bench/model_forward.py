"""One decoder forward (the diffusion head over a canvas) against an encoded context, on this machine.

  .venv/bin/python bench/model_forward.py [--config=configs/models/small.py] [--canvas=256] [--context=256]

The model preset's random weights; a `context`-token prompt is encoded into the KV cache once, then
the jitted `Transformer.decode` runs over a `canvas`-token canvas (with self-conditioning logits, as
at every sampler step after the first). Compile excluded; median of timed calls. In the same process,
to show where the time goes: the other MoE path, a zero self-conditioning signal, the MoE branch
removed, the causal `encode` of the context, and a large f32 matmul: the useful FLOP rate as a
fraction of that matmul rate says how close a pass is to the machine's practical peak.
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.tools import model_size
from bench.timing import matmul_gflops, median_seconds

from bench.model_flags import CANVAS as _CANVAS, CONFIG as _CONFIG, CONTEXT as _CONTEXT
_REPS = flags.DEFINE_integer("reps", 20, "Timed calls per measurement.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Size of the f32 matmul the rates are put against.")


def random_params(cfg: ModelConfig, seed: int = 0):
  """Random weights of the preset's shapes (std 0.02 matrices, scales near 1); no init compile."""
  g = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    v = g.uniform(0.8, 1.2, s.shape) if "scale" in name else g.normal(0.0, 0.02, s.shape)
    return jnp.asarray(v, s.dtype)

  return jax.tree_util.tree_map_with_path(fill, param_shapes(cfg))


def xla_flops(jitted, *args) -> float:
  """FLOPs XLA counts in the compiled program (what the lowering really computes)."""
  cost = jitted.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", float("nan")))


def main(argv):
  del argv
  config = _CONFIG.value
  group = model_size.model_group(config)
  base = ModelConfig.from_config_dict(group)
  C, S = _CANVAS.value, _CONTEXT.value
  g = np.random.default_rng(1)
  ctx_1S = jnp.asarray(g.integers(0, base.vocab_size, (1, S)), jnp.int32)
  canvas_1C = jnp.asarray(g.integers(0, base.vocab_size, (1, C)), jnp.int32)
  sc = jnp.asarray(g.normal(0, 1, (1, C, base.vocab_size)), jnp.float32)
  pos_1S = jnp.arange(S, dtype=jnp.int32)[None]
  pos_1C = S + jnp.arange(C, dtype=jnp.int32)[None]
  ones_1S, ones_1C = jnp.ones((1, S), jnp.int32), jnp.ones((1, C), jnp.int32)
  other = "dense" if base.moe_impl == "ragged" else "ragged"
  no_moe = dataclasses.replace(base, num_experts=0)

  # (pass, label, cfg, self-conditioning signal): the preset first; the rest say where the time goes
  variants = [
      ("decode", f"MoE {base.moe_impl} (preset)", base, True),
      ("decode", f"MoE {other}", dataclasses.replace(base, moe_impl=other), True),
      ("decode", f"MoE {base.moe_impl}, zero self-cond signal", base, False),
      ("decode", "MoE branch removed", no_moe, True),
      ("encode", f"MoE {base.moe_impl} (preset)", base, False),
      ("encode", f"MoE {other}", dataclasses.replace(base, moe_impl=other), False),
      ("encode", "MoE branch removed", no_moe, False),
  ]
  params_of = {base.num_experts: random_params(base), 0: random_params(no_moe)}
  fns, caches = [], {}
  for kind, label, cfg, with_sc in variants:
    model, params = Transformer(cfg), params_of[cfg.num_experts]

    @jax.jit
    def encode(params, tokens, model=model, cfg=cfg):
      cache = init_cache(cfg, 1, S, jnp.dtype(cfg.dtype))
      _, cache = model.apply({"params": params}, tokens, pos_1S, ones_1S, cache, return_logits=False,
                             method=Transformer.encode)
      return cache

    @jax.jit
    def decode(params, canvas, cache, sc_logits, model=model):
      return model.apply({"params": params}, canvas, pos_1C, ones_1C, cache, sc_logits_BCV=sc_logits,
                         method=Transformer.decode)

    key = (cfg.num_experts, cfg.moe_impl)
    if key not in caches:
      caches[key] = jax.block_until_ready(encode(params, ctx_1S))
    t0 = time.perf_counter()
    if kind == "decode":
      args = (params, canvas_1C, caches[key], sc if with_sc else None)
      fn, n, flops = decode, C, model_size.forward_flops(cfg, C, S + C, True, with_sc)
    else:
      args = (params, ctx_1S)
      fn, n, flops = encode, S, model_size.forward_flops(cfg, S, S, False, False)
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    fns.append((kind, label, n, flops, xla_flops(fn, *args), compile_s, lambda fn=fn, args=args: fn(*args)))

  reps = _REPS.value
  peak = matmul_gflops(_MATMUL_N.value)
  times = [median_seconds(call, reps) for *_, call in fns]
  peak2 = matmul_gflops(_MATMUL_N.value)  # again after: the machine is shared, bracket the measurement
  peak = (peak + peak2) / 2
  counts = model_size.summarize(base)

  print(f"command: {' '.join(sys.argv)}")
  print(f"model: {group.get('preset', '?')}  params total={counts['total'] / 1e6:.2f}M "
        f"active={counts['active'] / 1e6:.2f}M  dtype={base.dtype}  devices={jax.devices()[0].platform} "
        f"x{jax.device_count()}; canvas {C}, context {S} (decode reads the {S}-slot cache)")
  print(f"{'pass':<7} {'variant':<36} {'ms':>7} {'tokens/s':>9} {'GFLOP':>6} {'XLA':>6} {'GFLOP/s':>8} "
        f"{'/matmul':>8} {'x preset':>8} {'compile s':>9}")
  first = {}
  for (kind, label, n, flops, xf, comp, _), t in zip(fns, times):
    first.setdefault(kind, t)
    gf = flops / t / 1e9
    print(f"{kind:<7} {label:<36} {t * 1e3:>7.1f} {n / t:>9,.0f} {flops / 1e9:>6.2f} {xf / 1e9:>6.2f} "
          f"{gf:>8.1f} {gf / peak:>8.2f} {first[kind] / t:>8.2f} {comp:>9.1f}")
  print(f"f32 2048^2 matmul in the same run: {peak:.1f} GFLOP/s (mean of before/after; {peak2:.1f} after)")
  print("GFLOP = useful FLOPs (active experts only); XLA = FLOPs of the compiled program (all experts, and "
        "ragged_dot's CPU lowering multiplies every (token, slot) row by every expert); GFLOP/s = useful / time")


if __name__ == "__main__":
  app.run(main)
