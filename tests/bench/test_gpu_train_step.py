"""bench/gpu_train_step.py: its medium model is configs/models/medium.py, the script imports only what the GPU
image has, and its tiny CPU mode runs the library's train step end to end with figures that follow from its
timings (issue #17 item 8)."""

import dataclasses
import json
import math

import pytest

from configs.models import medium
from dgemma.diffusion.config import DiffusionSettings
from dgemma.model import ModelConfig, count_params
from dgemma.tools import model_size
from tests.bench.gpu_image import ROOT, import_on_gpu_image, load_script

SCRIPT = ROOT / "bench" / "gpu_train_step.py"


def _load():
  return load_script(SCRIPT)


def test_medium_is_the_preset_and_one_to_two_billion_parameters():
  bench = _load()
  preset = ModelConfig.from_config_dict(medium.get_config())
  for impl in ("tokamax", "dense"):
    assert bench.model_config("medium", impl) == dataclasses.replace(preset, moe_impl=impl)
  counts = count_params(preset)
  assert 1e9 <= counts["total"] <= 2e9, counts  # the 1-2B preset
  assert preset.param_dtype == "float32" and preset.dtype == "bfloat16"  # fp32 weights, bf16 compute


@pytest.mark.slow  # a subprocess
def test_imports_only_what_the_gpu_image_has():
  out = import_on_gpu_image(SCRIPT, "g.model_config('medium', 'dense').d_model")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "1536"


@pytest.mark.slow  # compiles the train step twice (the one-layer tiny preset: about half the tiny preset's compile)
def test_tiny_run_trains_and_its_figures_follow_from_the_timings(tmp_path):
  bench = _load()
  out = tmp_path / "gpu" / "train_step.json"
  r = bench.run(("tokamax", "dense"), "tiny1", rows=2, seq_len=32, canvas=8, reps=2, matmul_n=128, out=str(out),
                progress=False)
  assert json.loads(out.read_text()) == json.loads(json.dumps(r))
  assert r["device"].startswith("cpu") and set(r["paths"]) == {"tokamax", "dense"}
  flops = model_size.train_step_flops(bench.model_config("tiny1", "dense"), DiffusionSettings(canvas_len=8), 2, 32)
  for impl, v in r["paths"].items():
    sec = v["ms_per_step"] / 1e3
    assert v["tokens_per_s"] == pytest.approx(2 * 32 / sec, rel=1e-12), impl
    assert v["model_tflop_per_s"] == pytest.approx(flops / sec / 1e12, rel=1e-12), impl
    assert v["mfu"] == pytest.approx(v["model_tflop_per_s"] / r["matmul_tflop_per_s"], rel=1e-12), impl
    # first step, warm-up, 2 timed; random tokens over a 512-token vocabulary: the loss starts near
    # ln 512 per term (two cross-entropies, canvas and encoder next-token) and stays finite
    assert len(v["losses"]) == 4 and all(math.isfinite(x) for x in v["losses"]), v["losses"]
    assert 2 * math.log(512) * 0.8 < v["losses"][0] < 2 * math.log(512) * 1.2, v["losses"]
    assert v["compiles"] == 1, impl  # the initial state has the step outputs' jit key: no second compile
