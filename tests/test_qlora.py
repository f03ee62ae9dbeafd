"""QLoRA (finetune.base_quant): the frozen base held quantized in the train state, the adapters (and head_only's
self-conditioning module) trained in float32 against it.

Exactness is checked against the float model whose weights are the dequantized values: in float64 the two run the
same products (the quantized layers dequantize q * scale in the compute dtype, the reference holds that product as
its weight), so the adapters' gradients agree to float64 round-off (rtol 1e-9, the tolerance of tests/model_utils.py's
float64 references), while the gradients of the original float weights differ at the size of the quantization error
(int4 in groups of 16: about 1e-2 relative), which the same comparison must see."""

import copy
import functools
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_test
from dgemma import api, finetune, quant
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import params as params_ckpt
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.diffusion import diffusion_loss
from dgemma.errors import ConfigError, TrainingInterrupted
from dgemma.model import Transformer, init_cache, param_shapes
from dgemma.tools import merge_lora
from dgemma.train import loop
from dgemma.train import optimizer as optimizer_lib
from dgemma.train import state as state_lib
from tests.train_utils import sigterm_when_logged
from tests.model_utils import f64_config, float64, random_params, random_rows, to_f64

GROUP = 16  # divides the tiny preset's every contracted size (64, 32, 128 ...): int4 has several groups per row


def _config(mode="lora", base_quant="int4_experts", moe_impl="ragged", config=None):
  """tiny_test with two global layers (one scanned block: half the compile time) and a QLoRA fine-tune."""
  config = config if config is not None else tiny_test.get_config()
  config.model.num_layers, config.model.layer_types = 2, ("global", "global")
  config.model.moe_impl, config.model.remat = moe_impl, "none"
  config.finetune.mode, config.finetune.base_quant, config.finetune.lora_rank = mode, base_quant, 4
  config.finetune.base_quant_group_size = GROUP
  return config


def _trained_grads_fn(settings):
  """params -> the gradient of the diffusion loss w.r.t. the trainable leaves, as {key path: array} (float64 inside).
  One jitted function: params of the same tree (the dequantized and the float model's) share its compiled program."""
  cfg = f64_config(settings.model)

  @jax.jit
  def grads(p, batch):
    trainable, frozen = finetune.split(p, finetune.trainable_mask(p, settings.finetune))
    loss = lambda t: diffusion_loss(finetune.join(t, frozen), batch, jax.random.key(3), model_cfg=cfg,
                                    loss_cfg=settings.diffusion, step=jnp.zeros((), jnp.int32))[0]
    return jax.grad(loss)(trainable)

  return lambda params, batch: flax.traverse_util.flatten_dict(
      finetune.trained_leaves(jax.device_get(grads(params, batch)), settings.finetune))


# The MoE implementations read a quantized expert weight in one of three ways: 'ragged', 'capacity' and
# 'expert_parallel' dequantize it in `Experts` (one line, before the implementation is picked), 'dense' inside each
# of its products (qarray.frozen_product: its own VJP), 'tokamax' hands the QArray to its kernels (and its own VJP).
# One of each kind is checked, with an int4 base (every matrix int4 in groups) and an int4_experts one (the experts
# int4, every other matrix int8 per channel), in both modes.
@pytest.mark.slow  # 10-15 s each on 2 cores (three float64 gradient programs each): over the fast tier's budget
@pytest.mark.parametrize("scheme, mode, moe_impl", [
    ("int4", "head_only", "ragged"),
    ("int4_experts", "lora", "tokamax"),   # quantized experts into tokamax
    ("int4_experts", "head_only", "dense"),  # configs/finetune_head_qlora.py: frozen products, layers rematerialised
])
def test_adapter_gradients_equal_those_of_the_dequantized_float_model(scheme, mode, moe_impl):
  config = _config(mode, scheme, moe_impl)
  if moe_impl == "dense":
    config.model.remat = "full"
  settings = settings_lib.from_config(config)
  batch = random_rows(settings.model.vocab_size, 2, 24)
  with float64():
    params = jax.tree.map(jnp.asarray, to_f64(random_params(settings.model)))  # B != 0: A gets a gradient too
    qparams = finetune.base_quantizer(settings.finetune).params(params)
    quantized = [k for k, v in flax.traverse_util.flatten_dict(qparams).items() if quant.is_quantized(v)]
    dequantized = jax.tree.map(quant.dequantize, qparams, is_leaf=quant.is_quantized)
    trained_grads = _trained_grads_fn(settings)
    g_quant = trained_grads(qparams, batch)
    g_deq = trained_grads(dequantized, batch)
    g_float = trained_grads(params, batch)
  assert quantized and not any(lora_name in k[-1] for k in quantized for lora_name in ("lora_a", "lora_b"))
  # the stacked int4 weights are held packed two to a byte (qarray.PackedInt4), the path under test
  packed = {k for k, v in flax.traverse_util.flatten_dict(qparams).items() if isinstance(v, quant.PackedInt4)}
  assert packed and all("blocks" in k for k in packed)
  if mode == "head_only":  # the self-conditioning module trains in float32: never quantized
    assert not any(k[0] == "self_conditioning" for k in quantized)
    assert any(k[0] == "self_conditioning" for k in g_quant)
  assert set(g_quant) == set(g_deq) and any(k[-1].endswith("lora_a") for k in g_quant)
  scale = max(float(np.abs(g).max()) for g in g_deq.values())
  for k in g_quant:
    np.testing.assert_allclose(g_quant[k], g_deq[k], rtol=0, atol=1e-9 * scale, err_msg="/".join(k))
  # the comparison can see the base: the original float weights give other gradients
  assert max(float(np.abs(g_float[k] - g_deq[k]).max()) for k in g_deq) > 1e-5 * scale


def test_base_quant_needs_a_frozen_base_and_a_group_that_divides():
  with pytest.raises(ConfigError, match=r"^finetune\.base_quant: .*lora"):
    settings_lib.from_config(_config(mode="full"))
  config = _config()
  config.finetune.base_quant_group_size = 48  # does not divide the tiny model's d_model of 64
  with pytest.raises(ConfigError, match=r"^finetune\.base_quant_group_size: 48"):
    settings_lib.from_config(config)


def _abstract_state(settings):
  """The QLoRA train state's shapes on a one-device abstract mesh (nothing allocated)."""
  mesh = jax.sharding.AbstractMesh((1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
  optimizer = optimizer_lib.make_optimizer(settings.opt, 10, settings.finetune, settings.model)
  _, abstract, _ = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer,
                                                  finetune.base_quantizer(settings.finetune))
  return abstract


def test_the_state_holds_the_base_quantized_once_and_no_optimizer_state_for_it():
  """Shapes only: every frozen weight the preset quantizes is a QArray in the train state (no float copy), the
  optimizer has no state for it, and the trainable leaves are float32."""
  settings = settings_lib.from_config(_config(mode="head_only"))
  abstract = _abstract_state(settings)
  flat = flax.traverse_util.flatten_dict(abstract.params)
  quantized = jax.eval_shape(finetune.base_quantizer(settings.finetune).params, param_shapes(settings.model))
  expected_q = {k for k, v in flax.traverse_util.flatten_dict(quantized).items() if quant.is_quantized(v)}
  assert {k for k, v in flat.items() if quant.is_quantized(v)} == expected_q
  experts = [k for k in expected_q if "experts" in k]
  assert experts and all(jnp.dtype(flat[k].qtype) == jnp.int4 for k in experts)
  trainable = {k for k in flat if finetune.label(k, settings.finetune) == finetune.TRAINABLE}
  assert trainable and all(flat[k].dtype == jnp.float32 for k in trainable)
  moments = []
  jax.tree.map(lambda s: moments.append(s.mu) if hasattr(s, "mu") else None, abstract.opt_state,
               is_leaf=lambda s: hasattr(s, "mu"))
  assert {k for k, v in flax.traverse_util.flatten_dict(moments[0]).items() if hasattr(v, "shape")} == trainable


def test_the_base_scales_are_stored_in_base_quant_scale_dtype():
  """finetune.base_quant_scale_dtype='bfloat16': every quantized leaf of the frozen base has bf16 scales while the
  trained leaves stay float32 (model.param_dtype); '' keeps the scales in the parameter dtype. Changing it is a
  structural difference: a run cannot resume with the other (its stored base would be cast)."""
  def state(scale_dtype):
    config = _config(mode="head_only")
    config.finetune.base_quant_scale_dtype = scale_dtype
    settings = settings_lib.from_config(config)
    return settings, flax.traverse_util.flatten_dict(_abstract_state(settings).params)

  for scale_dtype, want in (("bfloat16", jnp.bfloat16), ("", jnp.float32)):
    settings, flat = state(scale_dtype)
    scales = {k: v.scale.dtype for k, v in flat.items() if quant.is_quantized(v)}
    assert scales and set(scales.values()) == {jnp.dtype(want)}, (scale_dtype, scales)
    trainable = [v for k, v in flat.items() if finetune.label(k, settings.finetune) == finetune.TRAINABLE]
    assert trainable and all(v.dtype == jnp.float32 for v in trainable)
  bf16, default = state("bfloat16")[0], state("")[0]
  assert any(d.startswith("finetune.base_quant_scale_dtype") for d in settings_lib.architecture_differences(
      default, bf16))


def _saved_params(step_dir) -> dict:
  """{key path: dtype name} of the params an Orbax train-state checkpoint holds (its metadata)."""
  from orbax import checkpoint as ocp
  tree = ocp.PyTreeCheckpointer().metadata(step_dir / workdir_ckpt.STATE).item_metadata
  return {k: str(v.dtype) for k, v in flax.traverse_util.flatten_dict(dict(tree["params"])).items() if v is not None}


@pytest.mark.slow  # three short runs of one compiled program, sampling and a merge: about 40 s on 2 cores
def test_qlora_run_resumes_exactly_keeps_its_base_and_loads_on_it(tiny_config, tmp_path, monkeypatch):
  """A 'lora' QLoRA run from a params checkpoint: the base's quantized leaves are bit-identical to the checkpoint's
  weights quantized, after training; a run stopped by SIGTERM and resumed gives the uninterrupted run's state
  bit for bit; the checkpoint holds the base only quantized; the adapter holds only adapters; dgemma.load of the
  run and of its adapter are the same model, on the quantized base; merge_lora folds the adapter into the base as
  the run saw it."""
  base_cfg = settings_lib.from_config(_config(mode="full", base_quant="none", config=copy.deepcopy(tiny_config))).model
  config = _config(config=tiny_config)
  model_cfg = settings_lib.from_config(config).model
  base = jax.device_get(random_params(base_cfg))
  params_ckpt.save_params(tmp_path / "base", base, base_cfg.to_dict())
  config.train.init_from = str(tmp_path / "base")
  config.train.update(num_steps=3, eval_every=3, ckpt_every=100, log_every=1, eval_batches=1, progress_bar=False,
                      async_checkpointing=False)
  config.opt.warmup_steps = 1
  straight = loop.train_and_evaluate(config, str(tmp_path / "straight"))
  # a real SIGTERM while step 1 is logged: the loop sees it after step 2, saves it and stops (TrainingInterrupted)
  with sigterm_when_logged(monkeypatch, 1), pytest.raises(TrainingInterrupted,
                                                           match="interrupted by SIGTERM after step 2 of 3"):
    loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert workdir_ckpt.steps(tmp_path / "wd") == [2]
  resumed = loop.train_and_evaluate(config, str(tmp_path / "wd"))
  for a, b in zip(jax.tree.leaves(jax.device_get((straight.params, straight.opt_state))),
                  jax.tree.leaves(jax.device_get((resumed.params, resumed.opt_state)))):
    np.testing.assert_array_equal(np.asarray(a, np.float32) if a.dtype == jnp.int4 else a,
                                  np.asarray(b, np.float32) if b.dtype == jnp.int4 else b)

  settings = settings_lib.from_config(config)
  # the step was compiled once for the three runs, with the frozen base laid out as its compiler picked
  # (state_lib.step_shardings), and the state put in those formats: the base's leaves are in them
  programs = loop.run_programs(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))
  assert programs.laid_out and len(programs.compiled) == 1
  (compiled_step, _), = programs.compiled.values()
  formats = compiled_step.input_formats[0][0]
  assert all(jax.tree.leaves(jax.tree.map(lambda x, f: x.format == f, resumed, formats)))
  want = finetune.base_quantizer(settings.finetune).params(jax.tree.map(jnp.asarray, base))
  want = {k: v for k, v in flax.traverse_util.flatten_dict(want).items() if quant.is_quantized(v)}
  got = flax.traverse_util.flatten_dict(jax.device_get(resumed.params))
  for k, w in want.items():
    assert quant.is_quantized(got[k]), "/".join(k)
    for field in ("qvalue", "scale"):
      np.testing.assert_array_equal(np.asarray(getattr(got[k], field), np.float32),
                                    np.asarray(getattr(w, field), np.float32), err_msg="/".join(k))

  saved = _saved_params(workdir_ckpt.step_dir(tmp_path / "wd", 3))
  for k in want:  # the base once, quantized: its values (int8, int4, or a layer's int4 two to a byte) and scale
    stored = saved.get(k + ("qvalue",)) or saved.get(k + ("packed",))
    assert stored in ("int4", "int8", "uint8") and k + ("scale",) in saved and k not in saved, "/".join(k)
  assert any(saved.get(k + ("packed",)) == "uint8" for k in want)  # the int4 experts, packed
  adapter_dir = tmp_path / "wd" / adapter_ckpt.ADAPTER_DIR
  leaves, _, meta = adapter_ckpt.load_adapter(adapter_dir)
  assert all(k[-1].endswith(("lora_a", "lora_b")) for k in flax.traverse_util.flatten_dict(leaves))
  assert json.loads((adapter_dir / adapter_ckpt.RUN_CONFIG).read_text())["finetune"]["base_quant"] == "int4_experts"

  run, adapter = api.load(str(tmp_path / "wd")), api.load(str(adapter_dir), quantize="int8")
  run_flat, adapter_flat = (flax.traverse_util.flatten_dict(jax.device_get(m.params)) for m in (run, adapter))
  for k, w in want.items():  # both on the quantized base the run trained (quantize='int8' does not touch it)
    assert jnp.dtype(run_flat[k].qtype) == jnp.dtype(adapter_flat[k].qtype) == jnp.dtype(w.qtype)
    np.testing.assert_array_equal(np.asarray(run_flat[k].scale), np.asarray(adapter_flat[k].scale))
  for k, v in run_flat.items():
    if k[-1].endswith(("lora_a", "lora_b")):
      np.testing.assert_array_equal(v, adapter_flat[k])
  assert run.generate("To be", max_new_tokens=8).text == api.load(str(adapter_dir)).generate(
      "To be", max_new_tokens=8).text

  # merge_lora: the base quantized and dequantized as the run held it, plus s A B: the float model computes the
  # QLoRA model's logits (fp32 round-off of the folded product; bound 1e-4 of the logits' scale)
  merge_lora.merge_checkpoints(str(adapter_dir), str(tmp_path / "merged"))
  merged, merged_cfg = params_ckpt.load_params(tmp_path / "merged")
  tokens = jnp.asarray(random_rows(model_cfg.vocab_size, 1, 12)["tokens"])
  pos = jnp.arange(12)[None]
  ones = jnp.ones_like(tokens)
  encode = functools.cache(lambda cfg: jax.jit(lambda p: Transformer(cfg).apply(
      {"params": p}, tokens, pos, ones, init_cache(cfg, 1, 16, jnp.float32), method="encode")[0]))
  logits = lambda cfg, p: np.asarray(encode(cfg)(p))  # one program per architecture (eager: ~2 s a call)
  ref = logits(model_cfg, run.params)
  out = logits(base_cfg, jax.tree.map(jnp.asarray, merged))
  np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
  plain = logits(base_cfg, jax.tree.map(jnp.asarray, base))  # and it is not the unquantized base's
  assert float(np.abs(plain - ref).max()) > 1e-3 * float(np.abs(ref).max())
  # dgemma.tools.convert of the run: a plain params checkpoint (finetune.base_quant 'none') of the same model
  from dgemma.checkpoints import convert
  convert.to_params(str(tmp_path / "wd"), str(tmp_path / "exported"))
  exported = api.load(str(tmp_path / "exported"))
  assert exported.settings.finetune.base_quant == "none"
  assert not any(quant.is_quantized(v) for v in jax.tree.leaves(exported.params, is_leaf=quant.is_quantized))
  np.testing.assert_allclose(logits(exported.settings.model, exported.params), ref, rtol=0,
                             atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.parametrize("kind", ["params", "hf"])
def test_a_base_read_for_qlora_is_quantized_as_it_streams_to_the_same_bits(kind, tmp_path):
  """train.init_from of a params checkpoint (leaf by leaf) or an HF directory (layer by layer) quantizes each
  weight as it is read: the same bits as quantizing the whole float tree after reading it."""
  from dgemma import checkpoints
  from tests.model_utils import save_random_hf
  settings = settings_lib.from_config(_config(mode="head_only"))
  base_cfg = settings_lib.from_config(_config(mode="full", base_quant="none")).model
  path = tmp_path / kind
  if kind == "params":
    params_ckpt.save_params(path, jax.device_get(random_params(base_cfg)), base_cfg.to_dict())
  else:
    save_random_hf(base_cfg, path)
  quantizer = finetune.base_quantizer(settings.finetune)
  streamed = checkpoints.load(path, dtype="float32", quantizer=quantizer)
  read = checkpoints.load(path, dtype="float32")
  after = quantizer.params(read.params)
  flat_s, flat_a = (flax.traverse_util.flatten_dict(t) for t in (streamed.params, after))
  assert flat_s.keys() == flat_a.keys() and any(quant.is_quantized(v) for v in flat_s.values())
  for k, v in flat_a.items():
    assert quant.is_quantized(flat_s[k]) == quant.is_quantized(v), "/".join(k)
    for a, b in zip(jax.tree.leaves(flat_s[k]), jax.tree.leaves(v)):
      assert a.dtype == b.dtype and a.shape == b.shape, "/".join(k)
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg="/".join(k))
  # and load_as (what train.init_from reads with) keeps the streamed QArrays on the run's quantized layout
  loaded = checkpoints.load_as(path, settings.model, quantizer=quantizer,
                               leaves=lambda missing: {k: np.zeros(s.shape, s.dtype) for k, s in
                                                       flax.traverse_util.flatten_dict(param_shapes(settings.model)).items()
                                                       if k in set(missing)})
  flat_l = flax.traverse_util.flatten_dict(loaded.params)
  for k, v in flat_s.items():
    if quant.is_quantized(v):
      np.testing.assert_array_equal(np.asarray(flat_l[k].qvalue, np.float32), np.asarray(v.qvalue, np.float32))


@pytest.mark.slow  # a two-step run (one compiled step): about 10 s on 2 cores
def test_an_all_int4_base_with_int4_weights_outside_the_stacked_layers_trains(tiny_config, tmp_path):
  """finetune.base_quant='int4' holds the weights outside the stacked layers (the embedding; decoder-head layers) as
  plain int4 arrays, not packed bytes. A train step compiled with laid-out arguments asks, on CPU, for int4 packed two
  to a byte, which no CPU array is, and refuses the first step ('compiled for input layouts that disagree'): on CPU
  such a base keeps the default layouts (state_lib.step_shardings), and the run trains."""
  config = _config(mode="head_only", base_quant="int4", config=tiny_config)
  config.model.decoder_head_layers = 1
  config.train.update(num_steps=2, eval_every=2, ckpt_every=100, log_every=1, eval_batches=1, progress_bar=False,
                      async_checkpointing=False)
  config.opt.warmup_steps = 1
  settings = settings_lib.from_config(config)
  assert not loop.run_programs(settings, mesh_lib.make_mesh(settings.mesh.axis_sizes)).laid_out
  state = loop.train_and_evaluate(config, str(tmp_path / "wd"))
  plain_int4 = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
                if leaf.dtype == jnp.int4]
  assert any("decoder_head_0" in k for k in plain_int4) and int(state.step) == 2
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.opt_state))
