"""Training throughput of a config on this machine, as a ratio to a matmul reference from the same run.

  .venv/bin/python bench/train_throughput.py --config=configs/demo.py [--steps=20]

Prints tokens/s of the jitted train step (data already on device, compile excluded), the model
FLOP rate it implies (`dgemma.tools.model_size.train_step_flops`: 6 x active parameters per encoder and decoder
token, K canvases of C tokens per row, plus 2 per parameter per canvas token for the no-grad
self-conditioning pass when enabled; attention's score FLOPs are not counted), and that rate as a fraction of a large f32 matmul's rate
measured in the same process (the machine's practical peak). Then, with --dots (default), the step's matmul
ceiling (bench/dot_ceiling.py): every dot_general of the step's jaxpr timed alone, their FLOPs over their summed
time, as a ratio to the same peak: the most the ratio above could reach with these matmul shapes if nothing else
in the step took time. (A bound for these shapes, not for the machine: two dots the step runs side by side on
the two cores can each beat their isolated time a little.)
With --sources=N, also where the step's time goes: three steps traced by jax.profiler, each op's time summed by
the source it was compiled from (bench/profiling.py `by_source`: forward or backward, model path, layers folded),
the N largest printed. The ops of XLA CPU's two threads overlap, so the total exceeds the step's wall time.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
from absl import app, flags
from ml_collections import config_flags

from bench import dot_ceiling, profiling
from bench.timing import host_cpu, matmul_gflops
from bench.train_setup import train_step_inputs
from dgemma import settings as settings_lib
from dgemma.model import count_params
from dgemma.tools import model_size

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.")
_DOTS = flags.DEFINE_bool("dots", True, "Also time the step's matmuls alone (bench/dot_ceiling.py).")
_SOURCES = flags.DEFINE_integer("sources", 0, "Also print the N largest sources of a profiled step's time (0: no).")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Size of the f32 matmul the rate is put against.")


def source_table(step, state, batch, rng, top: int, steps: int = 3):
  """(table, state): the `top` sources of the step's op time, per step, over `steps` traced steps (module
  docstring), and the state after them (the one passed in is donated to the steps)."""
  sources = profiling.hlo_sources(step.lower(state, batch, rng).compile().as_text())
  box = [state]

  def run():
    for _ in range(steps):
      box[0], metrics = step(box[0], batch, rng)
    jax.block_until_ready(metrics)

  rows = profiling.by_source(profiling.summarize(profiling.trace_events(run), top=None), sources)
  table = profiling.format_by_source(profiling.by_group(rows, profiling.TRAIN_STEP_PARTS), per=steps) + "\n\n" + \
      profiling.format_by_source(rows, per=steps, top=top)
  return f"where the step's time goes ({steps} steps traced; ms per step):\n{table}", box[0]


def main(argv):
  del argv
  config = _CONFIG.value
  settings = settings_lib.from_config(config)
  model_cfg = settings.model
  step, state, batch, rng = train_step_inputs(settings)
  t0 = time.perf_counter()
  state, m = step(state, batch, rng)
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(_STEPS.value):
    state, m = step(state, batch, rng)
  jax.block_until_ready(m)
  sec_per_step = (time.perf_counter() - t0) / _STEPS.value
  tokens = config.data.batch_size * config.data.seq_len
  counts = count_params(model_cfg)
  total, active = counts['total'], counts['active']
  model_flops = model_size.train_step_flops(model_cfg, settings.diffusion, config.data.batch_size, config.data.seq_len)
  model_gflops = model_flops / sec_per_step / 1e9
  peak = matmul_gflops(_MATMUL_N.value)
  print(f"cpu: {host_cpu()}")
  print(f"config: {config.model.get('preset', '?')}  params total={total/1e6:.2f}M active={active/1e6:.2f}M  "
        f"batch={config.data.batch_size}x{config.data.seq_len}")
  print(f"compile (first step): {compile_s:.1f} s")
  print(f"train step: {sec_per_step*1e3:.1f} ms  -> {tokens/sec_per_step:,.0f} tokens/s")
  print(f"model FLOP rate: {model_gflops:.1f} GFLOP/s; f32 {_MATMUL_N.value}^2 matmul in the same run: {peak:.1f} GFLOP/s; "
        f"ratio (MFU vs matmul peak): {model_gflops/peak:.3f}")
  if _SOURCES.value:
    table, state = source_table(step, state, batch, rng, _SOURCES.value)
    print(table)
  if _DOTS.value:
    dots, loops_unknown = dot_ceiling.step_dots(step, state, batch, rng)
    rows = dot_ceiling.time_dots(dots)
    alone_gflops, dot_gflop, dot_s = dot_ceiling.ceiling_gflops(rows)
    print(f"the step's matmuls: {sum(d.count for d in dots)} dot_generals ({len(dots)} distinct), "
          f"{dot_gflop:.2f} GFLOP per step (the model count above: {model_flops/1e9:.2f})"
          + (f"; {loops_unknown} while-loop bodies counted once" if loops_unknown else ""))
    print(f"  each timed alone: {dot_s*1e3:.1f} ms in all = {alone_gflops:.1f} GFLOP/s; "
          f"matmul ceiling of the ratio: {alone_gflops/peak:.3f} (the model FLOPs at that speed: "
          f"{model_flops/dot_s/1e9/peak:.3f})")
    slowest = sorted(rows, key=lambda r: -r[1] * r[0].count)[:8]
    for d, sec in slowest:
      print(f"  {d.count:3d} x {d.lhs_shape} . {d.rhs_shape} {d.dimension_numbers}: {sec*1e3:.2f} ms each, "
            f"{d.flops/sec/1e9:.1f} GFLOP/s")


if __name__ == "__main__":
  app.run(main)
