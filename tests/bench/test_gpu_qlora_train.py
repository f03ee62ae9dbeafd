"""bench/gpu_qlora_train.py: its recipe is configs/finetune_head_qlora.py's, the script imports only what the GPU image
has, and its tiny CPU mode runs the library's QLoRA train step with figures that follow from its timings (issue #55
item 7)."""

import json
import math

import jax
import pytest

from configs import finetune_head_qlora
from dgemma import quant
from dgemma import settings as settings_lib
from tests.bench.gpu_image import ROOT, import_on_gpu_image, load_script

SCRIPT = ROOT / "bench" / "gpu_qlora_train.py"


def test_the_recipe_is_the_config():
  recipe = load_script(SCRIPT).RECIPE
  settings = settings_lib.from_config(finetune_head_qlora.get_config())
  ft, model = settings.finetune, settings.model
  assert (ft.mode, ft.freeze_router, ft.base_quant, ft.lora_rank, ft.lora_alpha, tuple(ft.lora_targets)) == (
      recipe["mode"], recipe["freeze_router"], recipe["base_quant"], recipe["lora_rank"], recipe["lora_alpha"],
      recipe["lora_targets"])
  assert (ft.base_quant_group_size, model.moe_impl, model.remat, settings.opt.lr) == (
      recipe["group_size"], recipe["moe_impl"], recipe["remat"], recipe["lr"])
  assert load_script(SCRIPT).qlora_model("full").lora == model.lora
  assert settings.data.batch_size // settings.opt.grad_accum_steps == 1  # one row per step, as the bench runs


@pytest.mark.slow  # a subprocess
def test_imports_only_what_the_gpu_image_has():
  out = import_on_gpu_image(SCRIPT, "g.qlora_model('full').d_model")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "2816"


@pytest.mark.slow  # compiles the QLoRA step of the one-layer tiny preset
def test_tiny_run_trains_on_a_quantized_base_and_its_figures_follow(tmp_path):
  bench = load_script(SCRIPT)
  out = tmp_path / "gpu" / "qlora_train.json"
  r = bench.run("tiny1", seq_len=32, canvas=8, steps=3, out=str(out))
  assert json.loads(out.read_text()) == json.loads(json.dumps(r))
  assert r["device"].startswith("cpu") and r["peak_gib"] is None  # CPU reports no device memory
  assert {"device", "peak_gib", "s_per_step", "tokens_per_s"} <= set(r)
  assert math.isclose(r["tokens_per_s"], 32 / r["s_per_step"])
  assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
  assert 0 < r["base_quantized_gib"] < r["state_gib"]
