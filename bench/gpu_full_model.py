"""The full DiffusionGemma 26B-A4B trunk on one accelerator, per variant: ms per denoising step, tokens/s,
peak memory with a 4k prompt, achieved weight bandwidth, and a profile of a step (issue #17 item 5).

  python bench/gpu_full_model.py --out=docs/experiments/gpu/full_model.json     # the four variants below
  python bench/gpu_full_model.py --variants=dense_bf16,capacity:none        # any moe_impl:scheme pair too
  python bench/gpu_full_model.py --preset=tiny --out=/tmp/tiny.json         # CPU smoke run of the same path

Variants (`VARIANTS`): dense_bf16 (moe_impl='dense', every expert on every token), fast_bf16 (moe_impl='tokamax',
tokamax's grouped GEMM), fast_int8 and fast_int4_experts (the same with `dgemma.quant` presets, the expert
QArrays reaching tokamax's quantized kernels as they are). A variant whose MoE path needs tokamax is skipped
(with the reason in the JSON) where tokamax is not installed.

What it does. Random weights are made on the device by one jitted program per weight format (bf16 normal
N(0, 0.02); quantized presets directly as random int8 / int4 values and scales of the preset's layout, so no
bf16 copy of the 47 GiB ever exists beside them); variants of one format share them, and one format is on the
device at a time. Compiles run on a thread pool (XLA compiles release the GIL; they dominate a cold run): the
4k-prompt programs from shapes, in the background from the start; the timed programs of one weight format all
at once on their first calls, once those weights exist. Per variant, `dgemma.sampling.generate` denoises one `canvas`-token canvas after a `prompt_len`-token
random prompt at each of `steps` (fixed step counts: confidence threshold 0, no end tokens), `reps` timed calls
after a warm-up call, median:
  ms_per_step        (t(S_max) - t(S_min)) / (S_max - S_min): the prompt encode cancels;
  tokens_per_s_S     canvas / t(S), the whole call (1k-prompt encode included), for S = 16 and 48;
  peak_gib_4k        the generate program with a `memory_prompt_len` (4k) prompt as XLA assigned its buffers:
                     arguments (weights, prompt) + outputs + temporaries - aliased bytes (compiled, not run;
                     the process-wide peak mixes variants, so it is reported once, as process_peak_gib);
  bandwidth_fraction weight bytes read per step (every expert is touched by 256 tokens x top-8, so all of them;
                     int4 counts half a byte) / step time / the card's copy bandwidth measured in the same run
                     (bytes read + written per second by a jitted x + 1 over `copy_gib`).
With the bf16 weights, the prompt encode of the `memory_prompt_len` prompt alone is timed and its program peak
read for each `model.attention_impl` (xla: the scores materialised; tokamax: its flash-attention kernel), issue
#17 item 4 (`prompt_encode` in the JSON). Then one 16-step call of the first fast variant (or of the first variant) is traced with `jax.profiler` and
its top ops by device time are printed per step (bench/profiling.py). Every figure is printed as it is
measured, and the JSON (--out) is rewritten after each variant, so a run stopped by a time limit keeps what it
measured. JSON: {"device", "jax", "copy_gb_per_s", "matmul_tflop_per_s", "variants": {name: {"ms_per_step",
"tokens_per_s_16", "tokens_per_s_48", "peak_gib_4k", "bandwidth_fraction", ...}}, "profile": {...}}.
Imports only jax, flax and numpy (plus configs/ for --preset=tiny, and tokamax / qwix for the fast variants):
runs on an image without ml_collections, grain, tfds, tensorboardX or sentencepiece.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from bench import profiling
from bench.timing import median_seconds
from dgemma import quant
from dgemma.files import write_json_atomic
from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.model.qarray import QArray
from dgemma.sampling import SamplerConfig, generate
from dgemma.tools import model_size

# name -> (model.moe_impl, quant scheme); "fast" is the grouped-GEMM path of issue #17 (tokamax.ragged_dot)
VARIANTS = {
    "dense_bf16": ("dense", "none"),
    "fast_bf16": ("tokamax", "none"),
    "fast_int8": ("tokamax", "int8"),
    "fast_int4_experts": ("tokamax", "int4_experts"),
}
NEEDS_TOKAMAX = ("tokamax",)


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


def variant_spec(name: str) -> tuple[str, str]:
  """(moe_impl, scheme) of a `VARIANTS` name or of an 'impl:scheme' pair (e.g. 'capacity:int8')."""
  if name in VARIANTS:
    return VARIANTS[name]
  impl, sep, scheme = name.partition(":")
  if not sep or impl not in ("dense", "ragged", "capacity", "tokamax") or scheme not in quant.SCHEMES:
    raise ValueError(f"--variants: {name!r} is neither one of {tuple(VARIANTS)} nor 'impl:scheme' with impl in "
                     f"(dense, ragged, capacity, tokamax) and scheme in {quant.SCHEMES}")
  return impl, scheme


def quantized_shapes(cfg: ModelConfig, scheme: str, group_size: int, only=None):
  """The parameter tree's shapes in a quant scheme (QArray leaves where the preset quantizes, among the leaves
  `only(key path)` picks: a QLoRA run's frozen base)."""
  shapes = param_shapes(cfg)
  if scheme == "none":
    return shapes
  qcfg = quant.QuantConfig(scheme=scheme, group_size=group_size)
  return jax.eval_shape(lambda p: quant.quantize_params(p, qcfg, only), shapes)


def _random_tree(shapes, key):
  """Random values for a (possibly quantized) shape tree: matrices N(0, 0.02), norm / router scales and layer
  scalars U(0.8, 1.2); a QArray gets uniform values in [-qmax, qmax] and scales about those of an
  N(0, 0.02) weight (0.06 / qmax: the largest of a group is about 3 standard deviations); a packed int4 weight
  random bytes (two uniform int4 values each) with the same scales."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, (QArray, quant.PackedInt4)))
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, (path, s) in zip(keys, leaves):
    if isinstance(s, quant.PackedInt4):
      packed = jax.random.randint(k, s.packed.shape, 0, 256, jnp.int32).astype(jnp.uint8)
      out.append(dataclasses.replace(s, packed=packed, scale=jnp.full(s.scale.shape, 0.06 / 7, s.scale.dtype)))
    elif isinstance(s, QArray):
      qmax = 7 if jnp.dtype(s.qvalue.dtype) == jnp.dtype(jnp.int4) else 127
      q = jax.random.randint(k, s.qvalue.shape, -qmax, qmax + 1, jnp.int8).astype(s.qvalue.dtype)
      out.append(QArray(qvalue=q, scale=jnp.full(s.scale.shape, 0.06 / qmax, s.scale.dtype)))
    elif "scale" in jax.tree_util.keystr(path):  # also 'layer_scalar'
      out.append(jax.random.uniform(k, s.shape, s.dtype, 0.8, 1.2))
    else:
      out.append((0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def random_params_on_device(cfg: ModelConfig, device, seed: int = 0, scheme: str = "none", group_size: int = 64,
                            only=None):
  """Random weights in `scheme`'s format (of the leaves `only` picks), made by one jitted program whose outputs
  live on `device`."""
  shapes = quantized_shapes(cfg, scheme, group_size, only)
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.jit(lambda key: _random_tree(shapes, key), out_shardings=sharding)(jax.random.key(seed))


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


def copy_bytes_per_s(nbytes: int, device, reps: int = 10) -> float:
  """Bytes read + written per second by a jitted x + 1 over an nbytes bf16 array on `device`."""
  x = jax.device_put(jnp.zeros((nbytes // 2,), jnp.bfloat16), device)
  inc = jax.jit(lambda v: v + jnp.asarray(1, v.dtype))
  return 2 * x.size * 2 / median_seconds(lambda: inc(x), reps)


def program_peak_bytes(compiled) -> int | None:
  """Arguments + outputs + temporaries - aliased bytes of a compiled program (its buffer assignment)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def encode_program(cfg: ModelConfig, batch: int, prompt_len: int):
  """The sampler's prompt encode alone (dgemma.sampling.generation step 1: a ring cache for the sliding layers),
  jitted: (params, prompt [B, P]) -> the cache."""
  model = Transformer(cfg)

  def encode(params, prompt_BP):
    cache = init_cache(cfg, batch, prompt_len, dtype=jnp.dtype(cfg.dtype), sliding_ring=True)
    pos_BP = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt_BP.shape)
    return model.apply({"params": params}, prompt_BP, pos_BP, jnp.ones_like(prompt_BP), cache, return_logits=False,
                       method=Transformer.encode)[1]

  return jax.jit(encode)


def measure_prompt_encode(cfg: ModelConfig, params, prompt_BP, impls: tuple[str, ...], reps: int, note) -> dict:
  """Issue #17 item 4: ms and program peak (GiB, buffer assignment as for peak_gib_4k) of the prompt encode with
  each `model.attention_impl` in `impls`, on the same weights; an implementation that fails is recorded with its
  error, so the rest still runs."""
  out = {}
  for impl in impls:
    try:
      program = encode_program(dataclasses.replace(cfg, attention_impl=impl), *prompt_BP.shape)
      compiled = program.lower(params, prompt_BP).compile()
      jax.block_until_ready(compiled(params, prompt_BP))
      ms = median_seconds(lambda: jax.block_until_ready(compiled(params, prompt_BP)), reps) * 1e3
      peak = program_peak_bytes(compiled)
      out[impl] = dict(ms=ms, peak_gib=None if peak is None else peak / 2**30)
      note(f"prompt encode, {prompt_BP.shape[1]} tokens, attention_impl={impl}: {ms:.2f} ms, program peak "
           + (f"{out[impl]['peak_gib']:.2f} GiB" if peak is not None else "n/a"))
    except Exception as e:  # pylint: disable=broad-except  (a kernel that cannot take these shapes)
      out[impl] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      note(f"prompt encode, attention_impl={impl}: failed: {out[impl]['error']}")
  return out


def _sampler(canvas: int, steps: int, prompt_len: int) -> SamplerConfig:
  return SamplerConfig(canvas_len=canvas, max_denoising_steps=steps, confidence_threshold=0.0, early_exit=False,
                       end_ids=(), max_context=prompt_len + canvas + 1)


def run_variants(variants: tuple[str, ...] = tuple(VARIANTS), preset: str = "full", prompt_len: int = 1024,
                 memory_prompt_len: int = 4096, canvas: int = 256, steps: tuple[int, ...] = (16, 48), reps: int = 3,
                 matmul_n: int = 8192, copy_gib: float = 4.0, group_size: int = 64, seed: int = 0,
                 out: str | None = None, profile_top: int = 25, compile_workers: int = 0, progress: bool = True,
                 capacity_factor: float | None = None, attention_impls: tuple[str, ...] = ("xla", "tokamax")) -> dict:
  """Measures every variant (module docstring) and returns the figures; `out`: the JSON, rewritten as they come."""
  t_start = time.perf_counter()

  def note(msg):
    if progress:
      print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  steps = tuple(sorted(set(int(s) for s in steps)))
  specs = {name: variant_spec(name) for name in variants}  # bad names fail before any device work
  device = jax.devices()[0]
  result = dict(device=f"{device.platform} {getattr(device, 'device_kind', '')}".strip(), jax=jax.__version__,
                preset=preset, prompt_len=prompt_len, memory_prompt_len=memory_prompt_len, canvas=canvas,
                steps=list(steps), reps=reps, group_size=group_size, variants={})

  def save():
    if out:
      write_json_atomic(out, result)

  result["copy_gb_per_s"] = copy_bytes_per_s(int(copy_gib * 2**30), device) / 1e9
  note(f"copy bandwidth (read + write) {result['copy_gb_per_s']:.1f} GB/s over {copy_gib:g} GiB")
  result["matmul_tflop_per_s"] = matmul_flops_per_s(matmul_n, jnp.bfloat16, device) / 1e12
  note(f"bf16 {matmul_n}^3 matmul {result['matmul_tflop_per_s']:.1f} TFLOP/s")
  save()

  g, vocab = np.random.default_rng(seed), model_config(preset).vocab_size
  prompts = {P: jax.device_put(np.asarray(g.integers(2, vocab, (1, P)), np.int32), device)
             for P in sorted({prompt_len, memory_prompt_len})}
  lengths = {P: jax.device_put(np.array([P], np.int32), device) for P in prompts}
  plans = {}
  for name, (impl, scheme) in specs.items():
    if impl in NEEDS_TOKAMAX and importlib.util.find_spec("tokamax") is None:
      result["variants"][name] = dict(moe_impl=impl, scheme=scheme, skipped="tokamax is not installed")
      note(f"{name}: skipped (tokamax is not installed)")
      continue
    cfg = model_config(preset, impl, capacity_factor)
    model = Transformer(cfg)
    programs = {}
    for key, (S, P) in {**{s: (s, prompt_len) for s in steps}, "memory": (steps[0], memory_prompt_len)}.items():
      scfg = _sampler(canvas, S, P)
      programs[key] = jax.jit(lambda params, prompt, lens, model=model, scfg=scfg: generate(
          model, params, prompt, lens, scfg, jax.random.key(seed), canvas).tokens_BN)
    plans[name] = dict(cfg=cfg, scheme=scheme, shapes=quantized_shapes(cfg, scheme, group_size), programs=programs)
  if any(p["cfg"].moe_impl in NEEDS_TOKAMAX for p in plans.values()):
    from dgemma.model import moe_kernels  # tokamax's import and its absl flags once, here, not in the threads
    import tokamax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    moe_kernels.absl_flags_parsed()

  # Compiles run on a thread pool (XLA releases the GIL). The 4k-prompt programs are only compiled, from the
  # shapes, for their buffer assignment; the timed programs compile on their first call, all programs of one
  # weight format at once, once those weights exist (an AOT executable from shapes can want other input
  # layouts than the arrays have, e.g. packed int4).
  pool = concurrent.futures.ThreadPoolExecutor(compile_workers or max(1, os.cpu_count() or 1))
  memory = {name: pool.submit(lambda p=p: p["programs"]["memory"].lower(
      p["shapes"], prompts[memory_prompt_len], lengths[memory_prompt_len]).compile()) for name, p in plans.items()}
  profiled = None
  fast_names = [n for n in plans if plans[n]["cfg"].moe_impl in NEEDS_TOKAMAX] or list(plans)
  schemes = list(dict.fromkeys(p["scheme"] for p in plans.values()))
  for scheme in schemes:  # one weight format on the device at a time
    names = [n for n, p in plans.items() if p["scheme"] == scheme]
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_params_on_device(plans[names[0]]["cfg"], device, seed, scheme, group_size))
    weight_bytes = quant.tree_bytes(params)
    note(f"random {scheme} weights ({weight_bytes / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
    calls = {(n, s): (lambda n=n, s=s: plans[n]["programs"][s](params, prompts[prompt_len], lengths[prompt_len]))
             for n in names for s in steps}
    t0 = time.perf_counter()
    first = {k: pool.submit(lambda c=c: jax.block_until_ready(c())) for k, c in calls.items()}
    for f in first.values():
      f.result()
    note(f"compiled and ran {len(calls)} programs ({', '.join(names)}) in {time.perf_counter() - t0:.1f} s")
    if scheme == "none" and attention_impls and "prompt_encode" not in result:
      impls = tuple(i for i in attention_impls if i != "tokamax" or importlib.util.find_spec("tokamax") is not None)
      result["prompt_encode"] = dict(prompt_len=memory_prompt_len, **measure_prompt_encode(
          plans[names[0]]["cfg"], params, prompts[memory_prompt_len], impls, reps, note))
      save()
    for name in names:
      cfg = plans[name]["cfg"]
      t = {}
      for s in steps:
        t[s] = median_seconds(calls[(name, s)], reps)
        note(f"{name}: {s} steps, {prompt_len}-token prompt: {t[s]:.4f} s per call ({canvas / t[s]:.1f} tokens/s)")
      if len(steps) > 1:
        s_step = (t[steps[-1]] - t[steps[0]]) / (steps[-1] - steps[0])
      else:
        s_step = t[steps[0]] / steps[0]  # one step count: the encode is not separated
      peak = program_peak_bytes(memory[name].result())
      row = dict(moe_impl=cfg.moe_impl, scheme=scheme, ms_per_step=s_step * 1e3,
                 **{f"tokens_per_s_{s}": canvas / t[s] for s in steps}, call_s={str(s): t[s] for s in steps},
                 peak_gib_4k=None if peak is None else peak / 2**30, weight_gib=weight_bytes / 2**30,
                 bandwidth_fraction=weight_bytes / s_step / (result["copy_gb_per_s"] * 1e9),
                 mfu=model_size.forward_flops(cfg, canvas, prompt_len + canvas, decoder=True, sc_signal=True)
                 / s_step / (result["matmul_tflop_per_s"] * 1e12))
      result["variants"][name] = row
      note(f"{name}: {row['ms_per_step']:.2f} ms per step; peak with a {memory_prompt_len}-token prompt "
           + (f"{row['peak_gib_4k']:.2f} GiB" if peak is not None else "n/a")
           + f"; weights {row['weight_gib']:.2f} GiB at {row['bandwidth_fraction']:.3f} of the copy bandwidth;"
             f" MFU {row['mfu']:.3f}")
      if profiled is None and name == fast_names[0] and profile_top:
        rows = profiling.top_ops(lambda: jax.block_until_ready(calls[(name, steps[0])]()), profile_top)
        profiled = dict(variant=name, call=f"{steps[0]} steps, {prompt_len}-token prompt",
                        per_step_ms=[[op, ms / steps[0], n, what] for op, ms, n, what in rows])
        result["profile"] = profiled
        note(f"profile of {name}, one {steps[0]}-step call, ms per step:\n"
             + profiling.format_top_ops(rows, per=steps[0]))
      save()
    del params, calls
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    result["process_peak_gib"] = stats["peak_bytes_in_use"] / 2**30
    note(f"process peak (every variant's weights and calls, one format at a time): {result['process_peak_gib']:.2f} GiB")
  pool.shutdown()
  result["wall_s"] = time.perf_counter() - t_start
  save()
  return result


def report(r: dict) -> str:
  lines = [f"device: {r['device']} (jax {r['jax']}); preset {r['preset']}; prompt {r['prompt_len']} tokens, canvas "
           f"{r['canvas']}; copy {r['copy_gb_per_s']:.1f} GB/s; bf16 matmul {r['matmul_tflop_per_s']:.1f} TFLOP/s",
           f"{'variant':<20} {'ms/step':>9} " + " ".join(f"{f'tok/s@{s}':>10}" for s in r["steps"])
           + f" {'peak GiB 4k':>12} {'weights GiB':>12} {'bw frac':>8} {'MFU':>6}"]
  for name, v in r["variants"].items():
    if "skipped" in v:
      lines.append(f"{name:<20} skipped: {v['skipped']}")
      continue
    peak = f"{v['peak_gib_4k']:.2f}" if v["peak_gib_4k"] is not None else "n/a"
    lines.append(f"{name:<20} {v['ms_per_step']:>9.2f} " + " ".join(f"{v[f'tokens_per_s_{s}']:>10.1f}" for s in r["steps"])
                 + f" {peak:>12} {v['weight_gib']:>12.2f} {v['bandwidth_fraction']:>8.3f} {v['mfu']:>6.3f}")
  encode = r.get("prompt_encode", {})
  for impl, v in encode.items():
    if impl != "prompt_len":
      lines.append(f"prompt encode, {encode['prompt_len']} tokens, attention_impl={impl}: " + (
          v["error"] if "error" in v else f"{v['ms']:.2f} ms, program peak "
          + (f"{v['peak_gib']:.2f} GiB" if v["peak_gib"] is not None else "n/a")))
  lines.append(f"wall {r.get('wall_s', 0):.0f} s")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default=",".join(VARIANTS),
                  help=f"comma-separated: {', '.join(VARIANTS)} or moe_impl:scheme pairs")
  ap.add_argument("--preset", default="full", choices=("full", "tiny"))
  ap.add_argument("--prompt_len", type=int, default=0, help="prompt tokens for the timings (0: 1024, tiny: 16)")
  ap.add_argument("--memory_prompt_len", type=int, default=0, help="prompt tokens for peak memory (0: 4096, tiny: 64)")
  ap.add_argument("--canvas", type=int, default=0, help="canvas tokens (0: 256, tiny: 16)")
  ap.add_argument("--steps", default="", help="comma-separated step counts (default 16,48; tiny: 2,4)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--matmul_n", type=int, default=0, help="matmul size for the peak rate (0: 8192, tiny: 256)")
  ap.add_argument("--copy_gib", type=float, default=0, help="copy-bandwidth buffer (0: 4 GiB, tiny: 0.0625)")
  ap.add_argument("--group_size", type=int, default=0, help="int4 group size (0: 64, tiny: 16)")
  ap.add_argument("--capacity_factor", type=float, default=None, help="moe_impl=capacity: slab rows / mean load")
  ap.add_argument("--attention_impls", default="xla,tokamax",
                  help="model.attention_impl values whose prompt encode (memory_prompt_len tokens) is timed; '' skips")
  ap.add_argument("--profile_top", type=int, default=25, help="ops in the profile summary (0: no profile)")
  ap.add_argument("--out", default="", help="write the figures as JSON here (rewritten after each variant)")
  a = ap.parse_args(argv)
  tiny = a.preset == "tiny"
  r = run_variants(
      tuple(v for v in a.variants.split(",") if v), a.preset, a.prompt_len or (16 if tiny else 1024),
      a.memory_prompt_len or (64 if tiny else 4096), a.canvas or (16 if tiny else 256),
      tuple(int(s) for s in (a.steps or ("2,4" if tiny else "16,48")).split(",")), a.reps,
      a.matmul_n or (256 if tiny else 8192), a.copy_gib or (0.0625 if tiny else 4.0),
      a.group_size or (16 if tiny else 64), out=a.out or None, profile_top=a.profile_top,
      capacity_factor=a.capacity_factor, attention_impls=tuple(i for i in a.attention_impls.split(",") if i))
  print(f"command: {' '.join(sys.argv)}")
  print(report(r))
  return r


if __name__ == "__main__":
  main()
