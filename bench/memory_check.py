"""dgemma.tools.memory's estimates against XLA's compiled buffer assignment and the measured peak, on CPU.

  .venv/bin/python bench/memory_check.py [--config=configs/models/small.py] [--context=256] [--canvas=256]

For one denoising step (inference, fp32 and int8 weights) and for value_and_grad of the training loss
(a `--batch` x `--seq_len` batch, canvas `--train_canvas`, remat none and full), the estimate
(`activation_peak` of the jaxpr, shapes only) is compared with `jit(...).lower(...).compile()
.memory_analysis()`: temp = XLA's scratch buffers beside arguments and outputs (what the runtime
allocates for the program; on CPU `memory_stats()` is unavailable), and with the measured peak: each
program runs once in a fresh process (`--row`), its arguments made and the program compiled first, with
the resident-set high-water mark reset just before the run (Linux `/proc/self/clear_refs`); peak =
VmHWM - VmRSS before the run. All three exclude the arguments.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dgemma import quant
from dgemma.model import ModelConfig
from dgemma.tools import memory, model_size

from bench.model_flags import CANVAS as _CANVAS, CONFIG as _CONFIG, CONTEXT as _CONTEXT
_BATCH = flags.DEFINE_integer("batch", 2, "Training rows.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Training row length.")
_TRAIN_CANVAS = flags.DEFINE_integer("train_canvas", 32, "Training canvas length.")
_SKIP_TRAIN = flags.DEFINE_bool("skip_train", False, "Only the inference rows.")


_ROW = flags.DEFINE_integer("row", -1, "Internal: measure only this program, in this process (a child run).")


def _programs():
  """[(name, thunk -> (fn, abstract args, estimate bytes))] in table order."""
  from configs import base
  group = model_size.model_group(_CONFIG.value)
  cfg = ModelConfig.from_config_dict(group)
  out = []
  for scheme in ("none", "int8"):
    def canvas(scheme=scheme):
      fn, args = memory.canvas_step_program(cfg, quant.QuantConfig(scheme), _CONTEXT.value, _CANVAS.value)
      return fn, args, memory.activation_peak(jax.make_jaxpr(fn)(*args)) - quant.tree_bytes(args[:2])
    out.append((f"canvas step, {scheme} weights", canvas))
  if not _SKIP_TRAIN.value:
    for remat in ("none", "full"):
      def train(remat=remat):
        config = base.get_config()
        config.model = group
        config.model.remat = remat
        config.data.batch_size, config.data.seq_len = _BATCH.value, _SEQ.value
        config.diffusion.canvas_len = _TRAIN_CANVAS.value
        fn, args, _ = memory.train_grad_program(config, dict(data=1, fsdp=1, expert=1, tensor=1))
        return fn, args, memory.activation_peak(jax.make_jaxpr(fn)(*args)) - quant.tree_bytes(args)
      out.append((f"value_and_grad, remat={remat}", train))
  return group, out


def _zeros(s):
  """A concrete array for an abstract one (PRNG keys: key(0) broadcast)."""
  if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
    return jax.random.split(jax.random.key(0), max(1, int(np.prod(s.shape)))).reshape(s.shape)
  return jnp.zeros(s.shape, s.dtype)


def _status_kib(field: str) -> int:
  return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure_row(i: int) -> dict:
  """Estimate, XLA's buffer assignment and the measured peak of program i, in this process.

  Measured: the arguments are made (zeros) and the program compiled first; then the kernel's
  resident-set high-water mark is reset (`/proc/self/clear_refs` = 5) and the program runs once:
  peak = VmHWM after - VmRSS before, i.e. the memory its first run touched (temporaries + outputs)."""
  name, thunk = _programs()[1][i]
  fn, abstract, est = thunk()
  args = jax.tree.map(_zeros, abstract)
  t = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  secs = time.perf_counter() - t
  m = compiled.memory_analysis()
  jax.block_until_ready(args)
  rss_before = _status_kib("VmRSS")
  Path("/proc/self/clear_refs").write_text("5")
  jax.block_until_ready(compiled(*args))
  measured = (_status_kib("VmHWM") - rss_before) * 1024
  return dict(name=name, estimate=est, xla=m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes,
              args=m.argument_size_in_bytes, measured=measured, compile_s=secs)


def main(argv):
  del argv
  if _ROW.value >= 0:  # child: one program, a fresh process (no allocator state from another program)
    print("ROW " + json.dumps(measure_row(_ROW.value)), flush=True)
    return
  group, programs = _programs()
  rows = []
  for i in range(len(programs)):
    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], f"--row={i}"], capture_output=True, text=True)
    line = [l for l in child.stdout.splitlines() if l.startswith("ROW ")]
    if child.returncode or not line:
      sys.exit(f"memory_check: program {programs[i][0]!r} failed:\n{child.stderr[-3000:]}")
    rows.append(json.loads(line[-1][4:]))
  print(f"command: {' '.join(sys.argv)}")
  print(f"model: {group.get('preset', '?')}; inference context {_CONTEXT.value}, canvas {_CANVAS.value}; training "
        f"{_BATCH.value}x{_SEQ.value}, canvas {_TRAIN_CANVAS.value}")
  print(f"{'program':<30} {'estimate MiB':>12} {'XLA temp+out MiB':>16} {'measured MiB':>12} {'est/meas':>8} "
        f"{'XLA/meas':>8} {'XLA args MiB':>12} {'compile s':>9}")
  for r in rows:
    print(f"{r['name']:<30} {r['estimate'] / 2**20:>12.1f} {r['xla'] / 2**20:>16.1f} {r['measured'] / 2**20:>12.1f} "
          f"{r['estimate'] / r['measured']:>8.2f} {r['xla'] / r['measured']:>8.2f} {r['args'] / 2**20:>12.1f} "
          f"{r['compile_s']:>9.1f}")


if __name__ == "__main__":
  app.run(main)
