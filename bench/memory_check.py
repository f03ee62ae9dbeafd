"""dgemma.tools.memory's estimates against XLA's compiled buffer assignment, on this machine.

  .venv/bin/python bench/memory_check.py [--config=configs/models/small.py] [--context=256] [--canvas=256]

For one denoising step (inference, fp32 and int8 weights) and for value_and_grad of the training loss
(a `--batch` x `--seq_len` batch, canvas `--train_canvas`, remat none and full), the estimate
(`activation_peak` of the jaxpr, shapes only) is compared with `jit(...).lower(...).compile()
.memory_analysis()`: temp = XLA's scratch buffers beside arguments and outputs (what the runtime
allocates for the program; on CPU `memory_stats()` is unavailable). Both exclude the arguments.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
from absl import app, flags
from ml_collections import config_flags

from dgemma import quant
from dgemma.model import ModelConfig
from dgemma.tools import memory, params as params_tool

_CONFIG = config_flags.DEFINE_config_file("config", "configs/models/small.py", "Model preset.")
_CONTEXT = flags.DEFINE_integer("context", 256, "KV cache slots.")
_CANVAS = flags.DEFINE_integer("canvas", 256, "Canvas tokens (inference).")
_BATCH = flags.DEFINE_integer("batch", 2, "Training rows.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Training row length.")
_TRAIN_CANVAS = flags.DEFINE_integer("train_canvas", 32, "Training canvas length.")
_SKIP_TRAIN = flags.DEFINE_bool("skip_train", False, "Only the inference rows.")


def compiled_bytes(fn, args):
  t = time.perf_counter()
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  return m, time.perf_counter() - t


def main(argv):
  del argv
  from configs import base
  group = params_tool.model_group(_CONFIG.value)
  cfg = ModelConfig.from_config_dict(group)
  rows = []
  for scheme in ("none", "int8"):
    fn, args = memory.canvas_step_program(cfg, quant.QuantConfig(scheme), _CONTEXT.value, _CANVAS.value)
    est = memory.activation_peak(jax.make_jaxpr(fn)(*args)) - memory.tree_bytes(args[:2])
    m, secs = compiled_bytes(fn, args)
    rows.append((f"canvas step, {scheme} weights", est, m, secs))
  if not _SKIP_TRAIN.value:
    for remat in ("none", "full"):
      config = base.get_config()
      config.model = group
      config.model.remat = remat
      config.data.batch_size, config.data.seq_len = _BATCH.value, _SEQ.value
      config.diffusion.canvas_len = _TRAIN_CANVAS.value
      fn, args, _ = memory.train_grad_program(config, dict(data=1, fsdp=1, expert=1, tensor=1))
      est = memory.activation_peak(jax.make_jaxpr(fn)(*args)) - memory.tree_bytes(args)
      m, secs = compiled_bytes(fn, args)
      rows.append((f"value_and_grad, remat={remat}", est, m, secs))
  print(f"command: {' '.join(sys.argv)}")
  print(f"model: {group.get('preset', '?')}; inference context {_CONTEXT.value}, canvas {_CANVAS.value}; training "
        f"{_BATCH.value}x{_SEQ.value}, canvas {_TRAIN_CANVAS.value}")
  print(f"{'program':<30} {'estimate MiB':>12} {'XLA temp+out MiB':>16} {'ratio':>6} {'XLA args MiB':>12} {'compile s':>9}")
  for name, est, m, secs in rows:
    xla = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    print(f"{name:<30} {est / 2**20:>12.1f} {xla / 2**20:>16.1f} {est / xla:>6.2f} "
          f"{m.argument_size_in_bytes / 2**20:>12.1f} {secs:>9.1f}")


if __name__ == "__main__":
  app.run(main)
