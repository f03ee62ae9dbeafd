"""The MoE layer's ragged, dense, capacity and tokamax paths vs a dense GeGLU FFN of equal ACTIVE size.

  .venv/bin/python bench/moe.py [--reps=3] [--sizes=small,larger]

`dgemma.model.moe.MoE` (router + experts) with cfg.moe_impl = 'ragged' (tokens sorted by expert,
`jax.lax.ragged_dot`), 'dense' (every expert on every token), 'capacity' (per-expert slabs of
--capacity_factor x the mean load, doubled per call until the busiest expert fits; batched matmuls) and 'tokamax' (the ragged
sorting on `tokamax.ragged_dot`: its XLA implementation on CPU), and `layers.GeGLU` with hidden =
top_k * expert_hidden (the FLOPs a token really needs), at two sizes: the `small` preset and a larger
layer. Forward and forward+backward (grads of params and input), jitted, compile excluded. The
variants are timed interleaved in one process (rounds of: each variant once), so machine load hits
them alike; the table gives the median per call and the ratio to the GeGLU baseline, plus XLA's own
FLOP count of each compiled program (which shows what the CPU lowering really computes).
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

from configs.models import small
from dgemma.model import ModelConfig
from dgemma.model import layers
from dgemma.model.moe import MoE

_REPS = flags.DEFINE_integer("reps", 3, "Interleaved rounds (each round times every variant).")
_MIN_TIME = flags.DEFINE_float("min_time", 0.3, "Seconds each timing spans at least (calls are repeated).")
_CAPACITY = flags.DEFINE_float("capacity_factor", 2.0, "moe_impl='capacity' variant: rows per expert / mean load.")
_SIZES = flags.DEFINE_list("sizes", ["small", "larger"], "Which layer sizes to time: 'small' (preset), 'larger' "
                           "('tiny': a smoke run).")

# (label, d_model, num_experts, top_k, expert_hidden, tokens)
_SMALL = small.get_config()
SIZES = (
    ("small", _SMALL.d_model, _SMALL.num_experts, _SMALL.experts_per_token, _SMALL.expert_hidden, 2048),
    ("larger", 512, 16, 2, 512, 4096),
    ("tiny", 32, 4, 2, 16, 64),
)


def _cost_flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", float("nan")))


def build(label: str, D: int, E: int, k: int, F: int, T: int):
  """{variant: (fwd, fwd_bwd)} jitted closures over fixed inputs, plus XLA FLOP counts."""
  base = small.get_config()
  base.update(dict(d_model=D, num_experts=E, experts_per_token=k, expert_hidden=F))
  g = np.random.default_rng(0)
  x_1TD = jnp.asarray(g.normal(0, 1, (1, T, D)), jnp.float32)
  ct_1TD = jnp.asarray(g.normal(0, 1, (1, T, D)), jnp.float32)
  valid_1T = jnp.ones((1, T), bool)
  modules = {}
  for impl, factor in (("ragged", None), ("dense", None), ("capacity", _CAPACITY.value), ("tokamax", None)):
    cfg_d = base.copy_and_resolve_references()
    cfg_d.moe_impl = impl
    if factor is not None:
      cfg_d.moe_capacity_factor = factor
    cfg = ModelConfig.from_config_dict(cfg_d)
    modules[f"MoE {impl}"] = (MoE(cfg), lambda m, p, x: m.apply({"params": p}, x, x, valid_1T)[0])
  modules["GeGLU (k*Fe)"] = (layers.GeGLU(D, k * F), lambda m, p, x: m.apply({"params": p}, x))

  out = {}
  for name, (module, call) in modules.items():
    init_args = (x_1TD, x_1TD, valid_1T) if name.startswith("MoE") else (x_1TD,)
    params = jax.jit(module.init)(jax.random.key(0), *init_args)["params"]
    if name.startswith("MoE"):  # a spread router, so tokens really go to different experts
      params = jax.tree_util.tree_map_with_path(
          lambda p, v: jnp.asarray(g.normal(0, 1, v.shape), v.dtype) if "router" in jax.tree_util.keystr(p)
          and "proj" in jax.tree_util.keystr(p) else v, params)
    fwd = jax.jit(lambda p, x, m=module, c=call: c(m, p, x))
    loss = lambda p, x, m=module, c=call: jnp.sum(c(m, p, x) * ct_1TD)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    flops = (_cost_flops(fwd.lower(params, x_1TD).compile()), _cost_flops(bwd.lower(params, x_1TD).compile()))
    out[name] = (lambda f=fwd, p=params: f(p, x_1TD), lambda f=bwd, p=params: f(p, x_1TD), flops)
  return out


def measure(variants, reps: int, min_time: float):
  """Median seconds per call for each (variant, pass), timed in interleaved rounds."""
  times = {(n, i): [] for n in variants for i in (0, 1)}
  calls = {}
  for n, (f, b, _) in variants.items():  # compile, warm up, and size the repeats
    for i, fn in enumerate((f, b)):
      jax.block_until_ready(fn())
      t = time.perf_counter()
      jax.block_until_ready(fn())
      calls[(n, i)] = max(1, round(min_time / (time.perf_counter() - t)))
  for _ in range(reps):
    for n, (f, b, _) in variants.items():
      for i, fn in enumerate((f, b)):
        t = time.perf_counter()
        for _ in range(calls[(n, i)]):
          r = fn()
        jax.block_until_ready(r)
        times[(n, i)].append((time.perf_counter() - t) / calls[(n, i)])
  return {key: statistics.median(v) for key, v in times.items()}


def main(argv):
  del argv
  print(f"command: {' '.join(sys.argv)}")
  print(f"devices: {jax.devices()[0].platform} x{jax.device_count()}, float32; "
        f"capacity factor {_CAPACITY.value:g}")
  for label, D, E, k, F, T in SIZES:
    if label not in _SIZES.value:
      continue
    variants = build(label, D, E, k, F, T)
    med = measure(variants, _REPS.value, _MIN_TIME.value)
    ref = "GeGLU (k*Fe)"
    title = "small preset" if label == "small" else label
    print(f"\n{title}: d={D}, {E} experts top-{k}, expert hidden {F} (GeGLU hidden {k * F}), {T} tokens")
    print(f"{'variant':<14} {'fwd ms':>8} {'x GeGLU':>8} {'fwd+bwd ms':>11} {'x GeGLU':>8} "
          f"{'XLA GFLOP fwd':>14} {'fwd+bwd':>8}")
    for n, (_, _, (ff, fb)) in variants.items():
      f_ms, b_ms = med[(n, 0)] * 1e3, med[(n, 1)] * 1e3
      print(f"{n:<14} {f_ms:>8.2f} {f_ms / (med[(ref, 0)] * 1e3):>8.2f} {b_ms:>11.2f} "
            f"{b_ms / (med[(ref, 1)] * 1e3):>8.2f} {ff / 1e9:>14.2f} {fb / 1e9:>8.2f}")


if __name__ == "__main__":
  app.run(main)
