"""How much faster bf16 matmuls are than f32 on this CPU, at the reference size and at a model's own shapes.

  .venv/bin/python bench/matmul_dtypes.py [--shapes=2048x2048x2048,1536x128x512,1536x128x8192,1536x512x128]

Each `MxKxN` is an [M, K] x [K, N] matmul, timed alone (bench/dot_ceiling.py `time_dot`: jitted, best of three
trials) with f32 inputs and with bf16 inputs accumulated into f32 (`preferred_element_type`, what a bf16-compute
model's dots ask for). Prints GFLOP/s of each and the bf16 / f32 speed ratio. On CPUs with AMX (Intel Sapphire
Rapids and later) bf16 dots run on the tile units; elsewhere the ratio is about 1 or below.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags

from bench.dot_ceiling import Dot, time_dot
from bench.timing import host_cpu

_SHAPES = flags.DEFINE_list("shapes", ["2048x2048x2048", "1536x128x512", "1536x128x8192", "1536x512x128"],
                            "MxKxN matmuls: [M, K] x [K, N].")


def matmul(m: int, k: int, n: int, dtype: str) -> Dot:
  """[m, k] x [k, n] in `dtype`, accumulated into f32."""
  return Dot((m, k), (k, n), dtype, dtype, (((1,), (0,)), ((), ())), "float32")


def main(argv):
  del argv
  print(f"cpu: {host_cpu()}")
  print(f"{'M x K x N':>20} {'f32 GFLOP/s':>12} {'bf16 GFLOP/s':>13} {'bf16 / f32':>10}")
  for spec in _SHAPES.value:
    m, k, n = (int(x) for x in spec.lower().split("x"))
    rates = {}
    for dtype in ("float32", "bfloat16"):
      dot = matmul(m, k, n, dtype)
      rates[dtype] = dot.flops / time_dot(dot, reps=10) / 1e9
    print(f"{spec:>20} {rates['float32']:>12.1f} {rates['bfloat16']:>13.1f} {rates['bfloat16'] / rates['float32']:>10.2f}")


if __name__ == "__main__":
  app.run(main)
