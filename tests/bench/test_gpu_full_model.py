"""bench/gpu_full_model.py: the full config is the released 26B-A4B preset, the script imports only what
the GPU image has, and its tiny CPU mode runs the same code path end to end."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from configs.models import diffusiongemma_26b_a4b
from dgemma.model import ModelConfig
from dgemma.tools import params as params_tool

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_full_model.py"


def _load():
  spec = importlib.util.spec_from_file_location("gpu_full_model", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_full_config_is_the_released_preset():
  bench = _load()
  preset = ModelConfig.from_config_dict(diffusiongemma_26b_a4b.get_config())
  assert bench.model_config("full") == preset
  assert bench.model_config("full", "dense") == dataclasses.replace(preset, moe_impl="dense")
  assert bench.model_config("full", "capacity", 2.0) == dataclasses.replace(preset, moe_impl="capacity",
                                                                            moe_capacity_factor=2.0)


_BLOCKED = ("ml_collections", "grain", "tensorflow_datasets", "tensorflow", "tensorboardX", "sentencepiece",
            "torch", "transformers")


@pytest.mark.slow  # a subprocess
def test_imports_only_what_the_gpu_image_has():
  """Imports the script (and with it dgemma.model, dgemma.sampling, dgemma.tools.params) and builds the
  full config with the packages the GPU image lacks made unimportable."""
  code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in {_BLOCKED!r}:
      raise ImportError('blocked on the GPU image: ' + name)
sys.meta_path.insert(0, Block())
import importlib.util
spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r})
g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
print(g.model_config('full').d_model)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "2816"


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_tiny_mode_runs_the_same_path():
  bench = _load()
  r = bench.run("tiny", prompt_len=16, canvas=16, steps=(2,), reps=1, matmul_n=128)
  assert r["steps"] == (2,) and r["canvas"] == 16 and r["prompt_len"] == 16
  assert r["decode_s"] > 0 and r["per_steps"][2]["total_s"] > 0
  p = r["per_steps"][2]
  assert p["total_s"] > 0 and r["encode_s"] > 0 and r["matmul_flops_per_s"] > 0
  # one step count: s/step = (call - encode) / steps, and the token rates follow from it
  assert abs(r["s_per_step"] - p["s_per_step"]) < 1e-12
  assert abs(r["denoise_tokens_per_s"][2] - 16 / (2 * r["s_per_step"])) < 1e-6
  assert abs(p["tokens_per_s"] - 16 / p["total_s"]) < 1e-9
  cfg = bench.model_config("tiny")
  assert r["decoder_flops"] == params_tool.forward_flops(cfg, 16, 32, decoder=True, sc_signal=True)
  assert r["mfu_decoder"] == r["decoder_flops"] / r["s_per_step"] / r["matmul_flops_per_s"]
  text = bench.report(r)
  assert "s/step" in text and "MFU" in text
