"""The vocabulary-sized buffers of one denoising step, from XLA's compiled program (nothing is run).

  .venv/bin/python bench/sampler_memory.py [--vocab=262144] [--dtype=bfloat16] [--semantics=hf] [--canvas=256]

A two-layer model of the `tiny` structure with the released vocabulary (so the [B, C, V] arrays dominate)
runs `denoise_canvas` for two steps at batch 1 against a 64-token cache; the program is compiled, not
run. Printed: XLA's scratch (`memory_analysis().temp_size_in_bytes`) in units of one fp32 [B, C, V]
array, and every [B, C, V] buffer of the optimized HLO outside fused computations (what the runtime
materialises), with the op that made it. On CPU, JAX's threefry uses rolled loops, whose u32 state
[B, C, V] arrays show up here; GPU lowerings unroll and fuse them, so the GPU figure needs a GPU run
(the same command there).
"""

import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags

from configs.models import tiny
from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.sampling import SamplerConfig, denoise_canvas
from dgemma.sampling.noise import as_noise

_VOCAB = flags.DEFINE_integer("vocab", 262_144, "Vocabulary size.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Parameter and compute dtype.")
_SEMANTICS = flags.DEFINE_enum("semantics", "hf", ["hf", "official"], "sample.semantics.")
_CANVAS = flags.DEFINE_integer("canvas", 256, "Canvas length.")

CONTEXT = 64


def compiled_step(vocab: int, dtype: str, semantics: str, canvas: int):
  cfg = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), vocab_size=vocab, num_layers=2,
                            layer_types=("sliding", "global"), dtype=dtype, param_dtype=dtype)
  model = Transformer(cfg)
  scfg = SamplerConfig(canvas_len=canvas, max_denoising_steps=2, confidence_threshold=0.0, early_exit=False,
                       end_ids=(), semantics=semantics)
  official = semantics == "official"

  def run(params, cache, key):
    positions = CONTEXT + jnp.broadcast_to(jnp.arange(canvas, dtype=jnp.int32), (1, canvas))
    ones = jnp.ones((1, canvas), jnp.int32)
    signal_fn = (lambda proc: model.apply({"params": params}, proc, method="self_conditioning_embedding")
                 .astype(jnp.bfloat16)) if official else None

    def decode_fn(canvas_BC, sc_BCX, sc_mask_B):
      signal = dict(sc_embeddings_BCD=sc_BCX) if official else dict(sc_logits_BCV=sc_BCX)
      return model.apply({"params": params}, canvas_BC, positions, ones, cache, sc_mask_B=sc_mask_B,
                         per_query_window=official, method="decode", **signal)

    noise = as_noise(key, 1)
    state = denoise_canvas(decode_fn, scfg, noise, noise.init_canvas(0, canvas, vocab), vocab,
                           sc_dtype=jnp.dtype(dtype), sc_signal_fn=signal_fn)
    return state.argmax_BC

  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_shapes(cfg))
  cache = jax.eval_shape(lambda: init_cache(cfg, 1, CONTEXT, jnp.dtype(dtype), sliding_ring=True))
  return jax.jit(run).lower(params, cache, jax.random.key(0)).compile()


def vocab_buffers(hlo_text: str, canvas: int, vocab: int) -> list[tuple[str, str, str]]:
  """(dtype, instruction, op name) of every [1, canvas, vocab] value outside fused computations."""
  out = []
  for block in re.split(r"\n(?=\S)", hlo_text):
    head = block.split("\n", 1)[0]
    if "fused" in head or "wrapped" in head:
      continue
    for line in block.split("\n"):
      m = re.search(r"%(\S+) = (\w+)\[1," + str(canvas) + "," + str(vocab) + r"\]", line)
      if m:
        op = re.search(r'op_name="([^"]*)"', line)
        out.append((m.group(2), m.group(1), op.group(1).split("/")[-1] if op else ""))
  return out


def main(argv):
  del argv
  comp = compiled_step(_VOCAB.value, _DTYPE.value, _SEMANTICS.value, _CANVAS.value)
  unit = _CANVAS.value * _VOCAB.value * 4
  temp = comp.memory_analysis().temp_size_in_bytes
  print(f"command: {' '.join(sys.argv)}")
  print(f"jax {jax.__version__} {jax.default_backend()}; vocab {_VOCAB.value}, {_DTYPE.value}, semantics "
        f"{_SEMANTICS.value}, canvas {_CANVAS.value}, batch 1")
  print(f"XLA scratch: {temp / 2**20:.0f} MiB = {temp / unit:.2f} x one fp32 [B, C, V] ({unit / 2**20:.0f} MiB)")
  for dtype, name, op in vocab_buffers(comp.as_text(), _CANVAS.value, _VOCAB.value):
    print(f"  {dtype:>5} {name:<40} {op}")


if __name__ == "__main__":
  app.run(main)
