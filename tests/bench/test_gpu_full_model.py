"""bench/gpu_full_model.py: the full config is the released 26B-A4B preset, the script imports only what
the GPU image has, and its tiny CPU mode runs the same code path end to end."""

import dataclasses

import pytest

from configs.models import diffusiongemma_26b_a4b
from dgemma.model import ModelConfig
from dgemma.tools import model_size
from tests.bench.gpu_image import ROOT, import_on_gpu_image, load_script

SCRIPT = ROOT / "bench" / "gpu_full_model.py"


def _load():
  return load_script(SCRIPT)


def test_full_config_is_the_released_preset():
  bench = _load()
  preset = ModelConfig.from_config_dict(diffusiongemma_26b_a4b.get_config())
  assert bench.model_config("full") == preset
  assert bench.model_config("full", "dense") == dataclasses.replace(preset, moe_impl="dense")
  assert bench.model_config("full", "capacity", 2.0) == dataclasses.replace(preset, moe_impl="capacity",
                                                                            moe_capacity_factor=2.0)


@pytest.mark.slow  # a subprocess
def test_imports_only_what_the_gpu_image_has():
  """Imports the script (and with it dgemma.model, dgemma.sampling, dgemma.tools.model_size) and builds the
  full config with the packages the GPU image lacks made unimportable."""
  out = import_on_gpu_image(SCRIPT, "g.model_config('full').d_model")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "2816"


def test_variants_are_the_issues_four_and_pairs_parse():
  bench = _load()
  assert bench.VARIANTS == {"dense_bf16": ("dense", "none"), "fast_bf16": ("tokamax", "none"),
                            "fast_int8": ("tokamax", "int8"), "fast_int4_experts": ("tokamax", "int4_experts")}
  assert bench.variant_spec("capacity:int8") == ("capacity", "int8")
  for bad in ("fast", "dense:int3", "magic:none", "dense"):
    with pytest.raises(ValueError, match="--variants"):
      bench.variant_spec(bad)


@pytest.mark.parametrize("scheme", ["none", "int8", "int4_experts"])
def test_random_weights_have_the_layout_quantize_params_gives(scheme):
  """The bench's random quantized weights (made directly as int values and scales, no bf16 copy) have exactly the
  tree, shapes and dtypes that dgemma.quant.quantize_params makes of real weights, so the programs it times are
  the ones a quantized checkpoint runs. Shapes only (jax.eval_shape): nothing is compiled."""
  import jax
  from dgemma import quant
  from dgemma.model import param_shapes
  bench = _load()
  cfg = bench.model_config("tiny")
  made = jax.eval_shape(lambda k: bench._random_tree(bench.quantized_shapes(cfg, scheme, 16), k), jax.random.key(0))
  want = param_shapes(cfg) if scheme == "none" else jax.eval_shape(
      lambda p: quant.quantize_params(p, quant.QuantConfig(scheme=scheme, group_size=16)), param_shapes(cfg))
  assert jax.tree.structure(made) == jax.tree.structure(want)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(made)] == [(x.shape, x.dtype) for x in jax.tree.leaves(want)]
  if scheme == "int4_experts":
    q = made["blocks"]["layer_0"]["moe"]["experts"]["gate_proj"]
    assert isinstance(q, quant.PackedInt4) and q.packed.dtype == jax.numpy.uint8  # int4, two to a byte
    assert quant.tree_bytes(made) < quant.tree_bytes(param_shapes(cfg)) / 2


@pytest.mark.slow  # 19 s on 2 cores: compiles the sampler for two variants and two prompt lengths
def test_tiny_variants_write_the_issues_json(tmp_path):
  """The CPU smoke run of the GPU script: every figure follows from the timings it reports, the JSON on disk is the
  result returned, and the int4_experts variant reads fewer weight bytes than bf16."""
  import json
  import jax
  from dgemma import quant
  bench = _load()
  out = tmp_path / "gpu" / "full_model.json"
  r = bench.run_variants(("dense_bf16", "fast_int4_experts"), "tiny", prompt_len=16, memory_prompt_len=48, canvas=16,
                         steps=(2, 4), reps=1, matmul_n=128, copy_gib=1 / 64, group_size=16, out=str(out),
                         profile_top=5)
  assert json.loads(out.read_text()) == json.loads(json.dumps(r))
  assert r["device"].startswith("cpu") and r["jax"] == jax.__version__
  assert set(r["variants"]) == {"dense_bf16", "fast_int4_experts"}
  for name, v in r["variants"].items():
    assert set(v) >= {"ms_per_step", "tokens_per_s_2", "tokens_per_s_4", "peak_gib_4k", "bandwidth_fraction"}, name
    call = {int(k): s for k, s in v["call_s"].items()}
    assert v["ms_per_step"] == pytest.approx((call[4] - call[2]) / 2 * 1e3, rel=1e-12)
    assert v["tokens_per_s_2"] == pytest.approx(16 / call[2], rel=1e-12)
    assert v["bandwidth_fraction"] == pytest.approx(
        v["weight_gib"] * 2**30 / (v["ms_per_step"] / 1e3) / (r["copy_gb_per_s"] * 1e9), rel=1e-9)
    shapes = bench.quantized_shapes(bench.model_config("tiny"), v["scheme"], 16)
    assert v["weight_gib"] * 2**30 == quant.tree_bytes(shapes)
    assert v["peak_gib_4k"] >= v["weight_gib"]  # the 4k program's arguments hold the weights
  assert r["variants"]["fast_int4_experts"]["weight_gib"] < r["variants"]["dense_bf16"]["weight_gib"]
  encode = r["prompt_encode"]  # issue #17 item 4: the 48-token prompt encode with each attention_impl
  assert encode["prompt_len"] == 48 and set(encode) == {"prompt_len", "xla", "tokamax"}
  for impl in ("xla", "tokamax"):
    assert encode[impl]["ms"] > 0 and encode[impl]["peak_gib"] * 2**30 >= quant.tree_bytes(
        bench.quantized_shapes(bench.model_config("tiny"), "none", 16)), impl  # its arguments hold the weights
  prof = r["profile"]
  assert prof["variant"] == "fast_int4_experts" and 0 < len(prof["per_step_ms"]) <= 5
  assert all(ms > 0 and n >= 1 for _, ms, n, _ in prof["per_step_ms"])
  text = bench.report(r)
  assert "fast_int4_experts" in text and "ms/step" in text and "attention_impl=tokamax" in text
