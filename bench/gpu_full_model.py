"""The full DiffusionGemma 26B-A4B trunk on one accelerator: seconds per denoising step, tokens/s, MFU.

  python bench/gpu_full_model.py                    # the 26B-A4B config, random bf16 weights (~47 GiB)
  python bench/gpu_full_model.py --preset=tiny --prompt_len=64 --canvas=32 --steps=2,4   # CPU smoke run

Random bf16 weights are created directly on the device (one jitted init with an output sharding on
that device: no host copy of the 50 GB). A `prompt_len`-token random prompt is encoded into the KV
cache, then `dgemma.sampling.generate` denoises one `canvas`-token canvas with a fixed number of steps
(early stopping off: confidence_threshold 0, no end tokens, `lax.scan` loop) for each step count.
Times are medians of `reps` calls after a warm-up call (which compiles). Per denoising step:
  s/step   = (t(S_max) - t(S_min)) / (S_max - S_min)  (the prompt encode cancels), also per S as
             (t(S) - t_encode) / S with the encode timed alone;
  tokens/s = canvas / t(S) for the whole call (prompt encode included) and canvas / (S * s/step);
  MFU      = useful FLOPs of one decoder pass (active experts, `dgemma.tools.params.forward_flops`)
             / s/step / the bf16 matmul rate measured in the same run (an n x n x n bf16 matmul).
Imports only jax, flax and numpy (plus configs/ for --preset=tiny): runs on an image without
ml_collections, grain, tfds, tensorboardX or sentencepiece.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.sampling import SamplerConfig, generate
from dgemma.tools import params as params_tool
from bench.timing import median_seconds


def model_config(preset: str, moe_impl: str = "ragged", capacity_factor: float | None = None) -> ModelConfig:
  """'full': ModelConfig's defaults, which are the released 26B-A4B trunk, in bf16 (tests check it
  equals configs/models/diffusiongemma_26b_a4b.py); 'tiny': the test preset in bf16."""
  if preset == "full":
    cfg = ModelConfig(dtype="bfloat16", param_dtype="bfloat16")
  elif preset == "tiny":
    from configs.models import tiny  # ml_collections: only for the CPU smoke run
    cfg = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), dtype="bfloat16",
                              param_dtype="bfloat16")
  else:
    raise ValueError(f"--preset: {preset!r} not in ('full', 'tiny')")
  cfg = dataclasses.replace(cfg, moe_impl=moe_impl)
  return cfg if capacity_factor is None else dataclasses.replace(cfg, moe_capacity_factor=capacity_factor)


def random_params_on_device(cfg: ModelConfig, device, seed: int = 0):
  """Random weights made by one jitted program whose outputs live on `device`: matrices N(0, 0.02),
  norm / router scales and layer scalars U(0.8, 1.2)."""
  shapes = param_shapes(cfg)
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

  def init(key):
    keys = jax.random.split(key, len(paths_and_leaves))
    out = []
    for k, (path, s) in zip(keys, paths_and_leaves):
      name = jax.tree_util.keystr(path)
      if "scale" in name:  # also 'layer_scalar'
        out.append(jax.random.uniform(k, s.shape, s.dtype, 0.8, 1.2))
      else:
        out.append((0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)

  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.jit(init, out_shardings=sharding)(jax.random.key(seed))


def matmul_flops_per_s(n: int, dtype, device, reps: int = 10) -> float:
  """Measured FLOP/s of an n x n @ n x n matmul in `dtype` on `device` (chained 4 times per call so
  the launch overhead is amortised)."""
  a = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype), device)

  @jax.jit
  def chain(x):
    for _ in range(4):
      x = (x @ a) * jnp.asarray(1.0 / np.sqrt(n), dtype)
    return x

  return 4 * 2 * n**3 / median_seconds(lambda: chain(a), reps)


def run(preset: str = "full", prompt_len: int = 1024, canvas: int = 256, steps: tuple[int, ...] = (16, 48),
        reps: int = 3, moe_impl: str = "ragged", matmul_n: int = 8192, seed: int = 0,
        capacity_factor: float | None = None, progress: bool = False) -> dict:
  """Builds, times and returns the figures (a dict; `main` prints them). progress=True also prints each
  figure as soon as it is measured, so a run stopped by a time limit still leaves its partial figures."""
  t_start = time.perf_counter()

  def note(msg):
    if progress:
      print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  steps = tuple(sorted(set(int(s) for s in steps)))
  cfg = model_config(preset, moe_impl, capacity_factor)
  device = jax.devices()[0]
  t0 = time.perf_counter()
  params = jax.block_until_ready(random_params_on_device(cfg, device, seed))
  init_s = time.perf_counter() - t0
  note(f"random weights made on {device} in {init_s:.1f} s ({cfg.moe_impl} MoE)")
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  model = Transformer(cfg)
  g = np.random.default_rng(seed)
  prompt_1P = jax.device_put(np.asarray(g.integers(2, cfg.vocab_size, (1, prompt_len)), np.int32), device)
  lengths_1 = jax.device_put(np.array([prompt_len], np.int32), device)

  @jax.jit
  def encode(params, tokens_1P):
    """The prompt encode `generate` starts with, alone (its cache, no logits)."""
    cache = init_cache(cfg, 1, prompt_len, jnp.dtype(cfg.dtype))
    pos = jnp.arange(prompt_len, dtype=jnp.int32)[None]
    _, cache = model.apply({"params": params}, tokens_1P, pos, jnp.ones_like(tokens_1P), cache,
                           return_logits=False, method=Transformer.encode)
    return cache

  t_encode = median_seconds(lambda: encode(params, prompt_1P), reps)
  note(f"prompt encode {t_encode * 1e3:.1f} ms")
  cache = encode(params, prompt_1P)
  canvas_1C = jax.device_put(np.asarray(g.integers(2, cfg.vocab_size, (1, canvas)), np.int32), device)
  sc_1CV = jax.device_put(np.asarray(g.normal(0, 1, (1, canvas, cfg.vocab_size)), np.float32), device)

  @jax.jit
  def decode(params, canvas_1C, sc_1CV):
    """One decoder pass of the canvas against the prompt cache, with a self-conditioning signal: the
    model's share of a denoising step (the rest is the sampler's vocab-sized work)."""
    pos = prompt_len + jnp.arange(canvas, dtype=jnp.int32)[None]
    return model.apply({"params": params}, canvas_1C, pos, jnp.ones_like(canvas_1C), cache, sc_1CV,
                       method=Transformer.decode)

  t_decode = median_seconds(lambda: decode(params, canvas_1C, sc_1CV), reps)
  note(f"one decoder pass {t_decode * 1e3:.2f} ms")
  del sc_1CV
  timings, compile_s = {}, {}
  for s in steps:
    scfg = SamplerConfig(canvas_len=canvas, max_denoising_steps=s, confidence_threshold=0.0, early_exit=False,
                         end_ids=(), max_context=prompt_len + canvas + 1)
    call = lambda scfg=scfg: generate(model, params, prompt_1P, lengths_1, scfg, jax.random.key(seed), canvas)
    t0 = time.perf_counter()
    out = jax.block_until_ready(call())
    compile_s[s] = time.perf_counter() - t0
    assert int(out.num_forwards_B[0]) == s, (int(out.num_forwards_B[0]), s)  # fixed step count
    timings[s] = median_seconds(call, reps)
    note(f"{s} denoising steps: first call (compile) {compile_s[s]:.1f} s, then {timings[s]:.3f} s per call")
  if len(steps) > 1:
    s_step = (timings[steps[-1]] - timings[steps[0]]) / (steps[-1] - steps[0])
  else:
    s_step = (timings[steps[0]] - t_encode) / steps[0]
  dec_flops = params_tool.forward_flops(cfg, canvas, prompt_len + canvas, decoder=True, sc_signal=True)
  enc_flops = params_tool.forward_flops(cfg, prompt_len, prompt_len, decoder=False, sc_signal=False)
  matmul_dtype = jnp.bfloat16
  peak = matmul_flops_per_s(matmul_n, matmul_dtype, device)
  stats = device.memory_stats() or {}
  per_s = {s: dict(total_s=timings[s], s_per_step=(timings[s] - t_encode) / s, tokens_per_s=canvas / timings[s],
                   compile_s=compile_s[s]) for s in steps}
  return dict(
      preset=preset, device=f"{device.platform} {getattr(device, 'device_kind', '')}".strip(),
      jax=jax.__version__, params_gib=param_bytes / 2**30, init_s=init_s, prompt_len=prompt_len, canvas=canvas,
      steps=steps, per_steps=per_s, encode_s=t_encode, decode_s=t_decode, s_per_step=s_step,
      denoise_tokens_per_s={s: canvas / (s * s_step) for s in steps},
      decoder_flops=dec_flops, encoder_flops=enc_flops, matmul_flops_per_s=peak, matmul_n=matmul_n,
      mfu_decoder=dec_flops / s_step / peak, mfu_encoder=enc_flops / t_encode / peak,
      peak_bytes_in_use=stats.get("peak_bytes_in_use"), wall_s=time.perf_counter() - t_start, moe_impl=moe_impl,
      moe_capacity_factor=cfg.moe_capacity_factor)


def report(r: dict) -> str:
  lines = [f"command: {' '.join(sys.argv)}",
           f"device: {r['device']} (jax {r['jax']}); preset {r['preset']}, random bf16 weights "
           f"{r['params_gib']:.2f} GiB made on device in {r['init_s']:.1f} s; MoE {r['moe_impl']}"
           + (f" (capacity factor {r['moe_capacity_factor']:g})" if r["moe_impl"] == "capacity" else ""),
           f"prompt {r['prompt_len']} tokens encoded in {r['encode_s'] * 1e3:.1f} ms "
           f"({r['encoder_flops'] / 1e9:.4g} GFLOP, MFU {r['mfu_encoder']:.3f}); canvas {r['canvas']} tokens",
           f"{'steps':>5} {'call s':>8} {'s/step*':>9} {'tokens/s (call)':>16} {'compile s':>10}"]
  for s in r["steps"]:
    p = r["per_steps"][s]
    lines.append(f"{s:>5} {p['total_s']:>8.3f} {p['s_per_step']:>9.4f} {p['tokens_per_s']:>16.1f} {p['compile_s']:>10.1f}")
  lines += [
      f"one decoder pass alone (canvas vs the prompt cache, self-conditioning on): {r['decode_s'] * 1e3:.2f} ms "
      f"(MFU {r['decoder_flops'] / r['decode_s'] / r['matmul_flops_per_s']:.3f})",
      f"s/step (difference of the step counts): {r['s_per_step'] * 1e3:.2f} ms; denoising-only tokens/s: " +
      ", ".join(f"{s} steps {v:.0f}" for s, v in r["denoise_tokens_per_s"].items()),
      f"decoder pass: {r['decoder_flops'] / 1e9:.4g} GFLOP useful; bf16 {r['matmul_n']}^3 matmul in this run: "
      f"{r['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s; MFU {r['mfu_decoder']:.3f}",
      f"peak device memory: " + (f"{r['peak_bytes_in_use'] / 2**30:.2f} GiB" if r["peak_bytes_in_use"] else "n/a")
      + f"; wall {r['wall_s']:.0f} s",
      "* per step count: (call - prompt encode) / steps"]
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="full", choices=("full", "tiny"))
  ap.add_argument("--prompt_len", type=int, default=1024)
  ap.add_argument("--canvas", type=int, default=256)
  ap.add_argument("--steps", default="16,48", help="comma-separated denoising step counts")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--moe_impl", default="ragged", choices=("ragged", "dense", "capacity"))
  ap.add_argument("--capacity_factor", type=float, default=None,
                  help="moe_impl=capacity: rows per expert / mean load (default: the config's)")
  ap.add_argument("--matmul_n", type=int, default=0, help="matmul size for the peak rate (0: 8192, tiny: 512)")
  a = ap.parse_args(argv)
  n = a.matmul_n or (8192 if a.preset == "full" else 512)
  r = run(a.preset, a.prompt_len, a.canvas, tuple(int(s) for s in a.steps.split(",")), a.reps, a.moe_impl, n,
          capacity_factor=a.capacity_factor, progress=True)
  print(report(r))
  return r


if __name__ == "__main__":
  main()
