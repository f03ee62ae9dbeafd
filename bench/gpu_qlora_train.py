"""QLoRA of the released model's head on one GPU: configs/finetune_head_qlora.py's step on the 26B-A4B with random
int4_experts weights made on the device, its peak device memory and seconds per step (issue #55 item 7).

  python bench/gpu_qlora_train.py --out=docs/experiments/gpu/qlora_train.json  # one GPU, about 5 minutes
  python bench/gpu_qlora_train.py --preset=tiny --out=/tmp/qlora_tiny.json     # CPU smoke run of the same path

The step is the library's (`dgemma.train.step.make_train_step` with finetune.mode='head_only': gradients of the
self-conditioning module and the decoder-only adapters only, the frozen leaves passed through) on the state the
recipe trains: the base quantized as `finetune.base_quant='int4_experts'` holds it (experts int4 in groups of 64,
every other matrix int8 per channel; random values, made on the device by one program as
bench/gpu_full_model.py makes them), the adapters (rank 8 on attention and the dense MLP) and the self-conditioning
module in float32 with their Adam moments; bf16 compute, full rematerialisation, one row of `--seq_len` tokens whose
last `--canvas` are the canvas, the recipe's loss (no encoder loss). `--steps` steps: the first (compile included),
then the median of the rest. Peak device memory is the runtime's `peak_bytes_in_use` after them (the weights
included). Prints each figure as it is measured; the JSON (--out: device, peak_gib, s_per_step, tokens_per_s) is
rewritten after each. Imports only jax, flax, optax and numpy (plus tokamax / qwix, which dgemma's quantized type
is), as the GPU image has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.gpu_full_model import random_params_on_device
from bench.gpu_train_step import TINY_PRESETS, model_config, random_rows
from dgemma import finetune, quant
from dgemma.diffusion.config import DiffusionSettings
from dgemma.files import write_json_atomic
from dgemma.model import ModelConfig, count_params
from dgemma.model.lora import LoraConfig
from dgemma.train import step as step_lib
from dgemma.train.state_types import TrainState

# configs/finetune_head_qlora.py's choices (a test checks them against the config)
RECIPE = dict(mode="head_only", freeze_router=True, base_quant="int4_experts", group_size=64, lora_rank=8,
              lora_alpha=16.0, lora_targets=("attn", "mlp"), moe_impl="dense", remat="full", lr=1.5e-4)


def qlora_model(preset: str) -> ModelConfig:
  """The released 26B-A4B ('full', ModelConfig's defaults) or a tiny test preset (bench/gpu_train_step.py's 'tiny',
  'tiny1'), as the recipe computes it."""
  cfg = ModelConfig() if preset == "full" else model_config(preset, RECIPE["moe_impl"])
  lora = LoraConfig(rank=RECIPE["lora_rank"], alpha=RECIPE["lora_alpha"], targets=RECIPE["lora_targets"],
                    decoder_only=True)
  return dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32", remat=RECIPE["remat"],
                             moe_impl=RECIPE["moe_impl"], lora=lora)


def run(preset: str = "full", seq_len: int = 512, canvas: int = 256, steps: int = 20, seed: int = 0,
        out: str | None = None) -> dict:
  t_start = time.perf_counter()
  note = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)
  device = jax.devices()[0]
  cfg = qlora_model(preset)
  ft = types.SimpleNamespace(mode=RECIPE["mode"], freeze_router=RECIPE["freeze_router"])
  group = RECIPE["group_size"] if preset == "full" else 16
  result = dict(device=f"{device.platform} {getattr(device, 'device_kind', '')}".strip(), jax=jax.__version__,
                preset=preset, params_total=count_params(cfg)["total"], base_quant=RECIPE["base_quant"],
                mode=RECIPE["mode"], rows=1, seq_len=seq_len, canvas=canvas, steps=steps)
  save = lambda: write_json_atomic(out, result) if out else None

  t0 = time.perf_counter()
  params = random_params_on_device(cfg, device, seed, RECIPE["base_quant"], group, finetune.frozen_base(ft))
  optimizer = optax.multi_transform(
      {finetune.TRAINABLE: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(RECIPE["lr"], 0.95, 0.99,
                                                                                   weight_decay=1e-4)),
       finetune.FROZEN: optax.set_to_zero()}, lambda p: finetune.param_labels(p, ft))
  state = jax.block_until_ready(jax.device_put(TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                                          opt_state=jax.jit(optimizer.init)(params)), device))
  result["state_gib"] = quant.tree_bytes(state) / 2**30
  result["base_quantized_gib"] = sum(quant.tree_bytes(x) for x in jax.tree.leaves(params, is_leaf=quant.is_quantized)
                                     if quant.is_quantized(x)) / 2**30
  note(f"{preset}: random {RECIPE['base_quant']} base and float32 head in {time.perf_counter() - t0:.1f} s: state "
       f"{result['state_gib']:.2f} GiB (quantized base {result['base_quantized_gib']:.2f})")
  save()

  diffusion = DiffusionSettings(canvas_len=canvas, encoder_loss_weight=0.0)
  step = jax.jit(step_lib.make_train_step(cfg, diffusion, optimizer, lambda s: RECIPE["lr"], finetune_cfg=ft),
                 donate_argnums=(0,))
  batch = jax.device_put(random_rows(cfg.vocab_size, 1, seq_len, seed), device)
  rng = jax.random.key(seed + 1)
  times, losses = [], []
  for i in range(steps):
    t0 = time.perf_counter()
    state, metrics = step(state, batch, rng)
    losses.append(float(metrics["loss"]))  # waits for the step
    times.append(time.perf_counter() - t0)
    if i == 0:
      result["first_step_s"] = times[0]
      note(f"first step (compile included) {times[0]:.1f} s, loss {losses[0]:.3f}")
  result["s_per_step"] = float(np.median(times[1:])) if steps > 1 else times[0]
  result["tokens_per_s"] = seq_len / result["s_per_step"]
  result["losses"] = losses
  note(f"{result['s_per_step']:.3f} s per step (median of {steps - 1}), {result['tokens_per_s']:,.0f} tokens/s")
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    result["peak_gib"] = stats["peak_bytes_in_use"] / 2**30
    note(f"peak device memory {result['peak_gib']:.2f} GiB (weights included)")
  else:
    result["peak_gib"] = None
    note("peak device memory: this backend reports none (CPU)")
  result["wall_s"] = time.perf_counter() - t_start
  save()
  return result


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="full", choices=("full",) + TINY_PRESETS)
  ap.add_argument("--seq_len", type=int, default=0, help="tokens of the one row (0: 512, tiny: 32)")
  ap.add_argument("--canvas", type=int, default=0, help="canvas tokens, the row's last (0: 256, tiny: 8)")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--out", default="", help="write the figures as JSON here (rewritten as they are measured)")
  a = ap.parse_args(argv)
  tiny = a.preset in TINY_PRESETS
  r = run(a.preset, a.seq_len or (32 if tiny else 512), a.canvas or (8 if tiny else 256), a.steps, out=a.out or None)
  print(f"command: {' '.join(sys.argv)}")
  return r


if __name__ == "__main__":
  main()
