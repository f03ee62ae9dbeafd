"""Train-step speed of the `medium` preset (configs/models/medium.py: 1.95B parameters, the released structure) on
one accelerator, per MoE path, as MFU against a matmul measured in the same run (issue #17 item 8).

  python bench/gpu_train_step.py --out=docs/experiments/gpu/train_step.json    # moe_impl tokamax and dense
  python bench/gpu_train_step.py --preset=tiny --out=/tmp/tiny_train.json    # CPU smoke run of the same path

The step is the library's (`dgemma.train.step.make_train_step`: the diffusion loss of `DiffusionSettings`, its
gradient, the non-finite guard) with the released recipe's loss (base_ce, self-conditioning p = 0.5, encoder
next-token loss), one canvas per row, bf16 compute on fp32 weights, and AdamW with clipping at 1.0 built with optax
here (dgemma.train.optimizer's settings come from an experiment config, which needs ml_collections; the update
costs the same). Rows are random tokens (speed does not depend on them). Per `moe_impl`: the first step (compile
included), then the median of `reps` timed steps; `model_tflop_per_s` counts `dgemma.tools.model_size.train_step_flops`
(6 per active parameter per token, 2 for the self-conditioning pass), `mfu` is that over a bf16 matmul's rate from
bench/gpu_full_model.py's measurement. The loss of the steps is printed, so a broken step shows. Figures print as
measured and the JSON (--out) is rewritten after each path. Imports only jax, flax, optax and numpy (plus configs/
for --preset=tiny and tokamax / qwix for moe_impl='tokamax'), as the GPU image has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.gpu_full_model import matmul_flops_per_s, random_params_on_device
from bench.timing import median_seconds
from dgemma.diffusion.config import DiffusionSettings
from dgemma.files import write_json_atomic
from dgemma.model import ModelConfig, count_params
from dgemma.model import moe_kernels
from dgemma.tools import model_size
from dgemma.train import step as step_lib
from dgemma.train.state_types import TrainState

# configs/models/medium.py's fields (a test checks they are that preset) on ModelConfig's defaults, the released trunk
MEDIUM = dict(d_model=1536, num_layers=12, layer_types=(("sliding",) * 5 + ("global",)) * 2, num_heads=8,
              num_kv_heads=4, global_num_kv_heads=1, mlp_hidden=1152, num_experts=64, expert_hidden=384,
              dtype="bfloat16", param_dtype="float32")


TINY_PRESETS = ("tiny", "tiny1")  # CPU smoke runs


def model_config(preset: str, moe_impl: str) -> ModelConfig:
  """'medium': configs/models/medium.py; 'tiny': the test preset with bf16 compute (CPU smoke run); 'tiny1': the
  same with one (global) layer, the same code path at about half the compile time (the tests' CPU rehearsal)."""
  if preset == "medium":
    cfg = ModelConfig(**MEDIUM)
  elif preset in TINY_PRESETS:
    from configs.models import tiny  # ml_collections: only for the CPU smoke run
    cfg = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), dtype="bfloat16")
    if preset == "tiny1":
      cfg = dataclasses.replace(cfg, num_layers=1, layer_types=("global",))
  else:
    raise ValueError(f"--preset: {preset!r} not in {('medium',) + TINY_PRESETS}")
  return dataclasses.replace(cfg, moe_impl=moe_impl)


def random_rows(vocab_size: int, rows: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
  """One packed batch of random ids (5 .. V - 1), a single document per row."""
  g = np.random.default_rng(seed)
  return {"tokens": g.integers(5, vocab_size, (rows, seq_len)).astype(np.int32),
          "segment_ids": np.ones((rows, seq_len), np.int32),
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1))}


def run(moe_impls: tuple[str, ...] = ("tokamax", "dense"), preset: str = "medium", rows: int = 8,
        seq_len: int = 1024, canvas: int = 256, reps: int = 5, lr: float = 1e-4, matmul_n: int = 8192,
        seed: int = 0, out: str | None = None, progress: bool = True) -> dict:
  t_start = time.perf_counter()

  def note(msg):
    if progress:
      print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  device = jax.devices()[0]
  diffusion = DiffusionSettings(canvas_len=canvas)  # the released recipe: base_ce, self-conditioning p = 0.5
  counts = count_params(model_config(preset, "dense"))
  result = dict(device=f"{device.platform} {getattr(device, 'device_kind', '')}".strip(), jax=jax.__version__,
                preset=preset, params_total=counts["total"], params_active=counts["active"], rows=rows,
                seq_len=seq_len, canvas=canvas, reps=reps, paths={})
  result["matmul_tflop_per_s"] = matmul_flops_per_s(matmul_n, jnp.bfloat16, device) / 1e12
  note(f"bf16 {matmul_n}^3 matmul {result['matmul_tflop_per_s']:.2f} TFLOP/s; {preset}: "
       f"{counts['total'] / 1e9:.2f}B parameters, {counts['active'] / 1e9:.2f}B active")
  batch = jax.device_put(random_rows(model_config(preset, "dense").vocab_size, rows, seq_len, seed), device)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.01))

  def save():
    if out:
      write_json_atomic(out, result)

  for impl in moe_impls:
    if impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
      result["paths"][impl] = dict(skipped="tokamax is not installed")
      note(f"moe_impl={impl}: skipped (tokamax is not installed)")
      continue
    if impl == "tokamax":
      moe_kernels.absl_flags_parsed()
    cfg = model_config(preset, impl)
    t0 = time.perf_counter()
    params = random_params_on_device(cfg, device, seed)  # fp32 weights, as training keeps them
    # device_put commits every leaf (the step counter too), as the step's outputs are: an uncommitted input has
    # another jit cache key, which compiled the step a second time on the second call
    state = jax.block_until_ready(jax.device_put(TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                                            opt_state=jax.jit(optimizer.init)(params)), device))
    note(f"moe_impl={impl}: random weights and optimizer state in {time.perf_counter() - t0:.1f} s")
    step = jax.jit(step_lib.make_train_step(cfg, diffusion, optimizer, lambda s: lr), donate_argnums=(0,))
    rng = jax.random.key(seed + 1)
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batch, rng))
    first_s = time.perf_counter() - t0
    losses = [float(metrics["loss"])]

    def one_step():
      nonlocal state
      state, m = step(state, batch, rng)
      losses.append(m["loss"])
      return m["loss"]

    sec = median_seconds(one_step, reps)
    flops = model_size.train_step_flops(cfg, diffusion, rows, seq_len)
    row = dict(moe_impl=impl, first_step_s=first_s, ms_per_step=sec * 1e3, tokens_per_s=rows * seq_len / sec,
               model_tflop_per_s=flops / sec / 1e12, mfu=flops / sec / (result["matmul_tflop_per_s"] * 1e12),
               losses=[float(x) for x in losses], compiles=step._cache_size())  # 1: no step recompiled
    result["paths"][impl] = row
    note(f"moe_impl={impl}: first step {first_s:.1f} s; {row['ms_per_step']:.1f} ms per step, "
         f"{row['tokens_per_s']:,.0f} tokens/s, {row['model_tflop_per_s']:.2f} model TFLOP/s, MFU {row['mfu']:.3f}; "
         f"losses {', '.join(f'{x:.3f}' for x in row['losses'])}")
    save()
    del state, params, step
  result["wall_s"] = time.perf_counter() - t_start
  save()
  return result


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--moe_impls", default="tokamax,dense", help="comma-separated model.moe_impl values")
  ap.add_argument("--preset", default="medium", choices=("medium",) + TINY_PRESETS)
  ap.add_argument("--rows", type=int, default=0, help="rows per step (0: 8, tiny: 2)")
  ap.add_argument("--seq_len", type=int, default=0, help="tokens per row (0: 1024, tiny: 32)")
  ap.add_argument("--canvas", type=int, default=0, help="canvas tokens, the row's last (0: 256, tiny: 8)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--matmul_n", type=int, default=0, help="matmul size for the peak rate (0: 8192, tiny: 256)")
  ap.add_argument("--out", default="", help="write the figures as JSON here (rewritten after each path)")
  a = ap.parse_args(argv)
  tiny = a.preset in TINY_PRESETS
  r = run(tuple(i for i in a.moe_impls.split(",") if i), a.preset, a.rows or (2 if tiny else 8),
          a.seq_len or (32 if tiny else 1024), a.canvas or (8 if tiny else 256), a.reps,
          matmul_n=a.matmul_n or (256 if tiny else 8192), out=a.out or None)
  print(f"command: {' '.join(sys.argv)}")
  for impl, v in r["paths"].items():
    print(f"{impl:<10} " + (v["skipped"] if "skipped" in v else
                            f"{v['ms_per_step']:.1f} ms/step  {v['tokens_per_s']:,.0f} tokens/s  MFU {v['mfu']:.3f}"))
  return r


if __name__ == "__main__":
  main()
