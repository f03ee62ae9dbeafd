"""dgemma.tools.memory: the jaxpr working-set walk on programs with known answers, and the inference
and training estimates of the tiny preset against direct byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from dgemma import quant
from dgemma.model import ModelConfig, init_cache, param_shapes
from dgemma.tools import memory

TINY = ModelConfig.from_config_dict(tiny.get_config())


def test_activation_peak_known_programs():
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)  # 4000 bytes

  def chain(x):
    y = x * 2.0          # x dies here: live x + y = 8000
    z = y + 1.0          # live y + z
    return jnp.sum(y * z)  # y and z live while y * z is made: 12000

  assert memory.activation_peak(jax.make_jaxpr(chain)(x)) == 12000

  def keep_input(x):
    y = x * 2.0
    return x + y         # x, y and the output: 12000

  assert memory.activation_peak(jax.make_jaxpr(keep_input)(x)) == 12000

  def scanned(x):
    def body(c, _):
      t = jnp.outer(c, c)  # a 1000 x 1000 fp32 temporary inside the loop body (4e6 bytes)
      return c + t[0], None
    return jax.lax.scan(body, x, None, length=3)[0]

  peak = memory.activation_peak(jax.make_jaxpr(scanned)(x))
  assert 4_000_000 <= peak <= 4_000_000 + 5 * 4000, peak  # the body's temporary counted once, not 3x
  # int4 counts half a byte
  assert memory._aval_bytes(jax.ShapeDtypeStruct((10, 3), jnp.int4)) == 15


def test_inference_estimate_tiny():
  qcfg = quant.QuantConfig("int8")
  est = memory.inference_estimate(TINY, qcfg, context=48, canvas=16, batch=2)
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_shapes(TINY))
  q = jax.eval_shape(lambda p: quant.quantize_params(p, qcfg), shapes)
  assert est["weights"] == quant.tree_bytes(q)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert est["kv_cache"] == nbytes(init_cache(TINY, 2, 48, sliding_ring=True))  # what the samplers allocate
  # = the full cache less the (48 - W) slots the sliding layers drop, plus the ring's positions / segment ids
  K, H = TINY.num_kv_heads, TINY.head_dim
  sliding = sum(t == "sliding" for t in TINY.layer_types)
  dropped = sliding * 2 * 2 * (48 - TINY.sliding_window) * K * H * 4  # layers x (k, v) x batch x slots x K x H x fp32
  assert est["kv_cache"] == nbytes(init_cache(TINY, 2, 48)) - dropped + 2 * 2 * TINY.sliding_window * 4
  # at least the fp32 logits, the self-conditioning logits and the sampler's log-probs [2, 16, V]
  assert est["canvas_step"] > 3 * 2 * 16 * TINY.vocab_size * 4
  text = memory.report(_experiment(), quantize="int4", group_size=16, context=48, canvas=16, batch=1,
                       mesh_shape={"data": -1}, devices=2, budget_gib=1.0, training=False)
  assert "fits in 1 GiB" in text and "KV cache" in text


def _experiment():
  config = memory._experiment_config(tiny.get_config())
  config.data.batch_size, config.data.seq_len = 4, 64
  config.diffusion.canvas_len = 16
  return config


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_training_estimate_tiny():
  one = memory.training_estimate(_experiment(), dict(data=1, fsdp=1, expert=1, tensor=1))
  full_bytes = quant.tree_bytes(param_shapes(TINY))
  assert one["params"] == one["grads"] == full_bytes
  assert abs(one["opt_state"] - 2 * full_bytes) <= 64  # Adam mu and nu (fp32) + step counters
  assert one["batch_per_device"] == 4
  fsdp = memory.training_estimate(_experiment(), dict(data=1, fsdp=2, expert=1, tensor=1))
  # 'embed' -> fsdp: every matrix is split in two, the norm vectors are not
  norms = sum(int(np.prod(s.shape)) * 4 for p, s in jax.tree_util.tree_leaves_with_path(param_shapes(TINY))
              if "scale" in jax.tree_util.keystr(p) or "scalar" in jax.tree_util.keystr(p))
  assert fsdp["params"] == (full_bytes - norms) // 2 + norms, (fsdp["params"], full_bytes, norms)
  assert fsdp["batch_per_device"] == 2 and fsdp["activations"] < one["activations"]


QLORA_TINY = ("--config.finetune.mode=head_only", "--config.finetune.base_quant=int4_experts",
              "--config.finetune.base_quant_group_size=16", "--config.model.num_layers=2",
              "--config.model.layer_types=('global','global')")  # one scanned block: half the compile


def _qlora_tiny():
  """tiny_test with two global layers, a QLoRA of its head on an int4_experts base, and int4_experts sampling."""
  from configs import tiny_test
  from dgemma import settings as settings_lib
  config = tiny_test.get_config()
  config.finetune.mode, config.finetune.base_quant, config.finetune.base_quant_group_size = "head_only", "int4_experts", 16
  config.sample.quantize, config.sample.quant_group_size = "int4_experts", 16
  config.model.num_layers, config.model.layer_types = 2, ("global", "global")
  return settings_lib.from_config(config)


@pytest.mark.slow  # compiles a train step (about 8 s on 2 cores)
def test_compiled_train_memory_counts_the_quantized_state_it_is_given():
  """The compiled plan's arguments are exactly the train state (its int4 experts at half a byte), the batch and
  the step's key; the state's parts are split as the report prints them; the donated state is aliased whole; the
  report ends with `peak X GiB`."""
  settings = _qlora_tiny()
  plan = memory.compiled_train_memory(settings)
  state = memory.loop.run_programs(settings, memory.one_device_mesh()).abstract_state
  rows = settings.data.batch_size * settings.data.seq_len * 4  # tokens, segment_ids, positions: int32
  assert plan["batch"] == 3 * rows
  assert plan["arguments"] == quant.tree_bytes(state) + 3 * rows + 8  # + the uint32[2] key
  parts = plan["base_quantized"] + plan["frozen_float"] + plan["trainable"]
  assert parts == quant.tree_bytes(state.params) and plan["opt_state"] == quant.tree_bytes(state.opt_state)
  experts = [x for path, x in jax.tree_util.tree_leaves_with_path(state.params)
             if "experts" in jax.tree_util.keystr(path) and x.dtype == jnp.uint8]  # int4, two to a byte
  assert experts and plan["base_quantized"] > 0
  assert plan["aliased"] == quant.tree_bytes(state)  # the donated state is written in place, all of it
  assert plan["temporaries"] > 0
  last = memory.train_report(settings).splitlines()[-1]  # the same program compiled again: the same plan
  assert last == f"peak {plan['peak'] / 2**30:.2f} GiB"


@pytest.mark.slow  # three compiles of a tiny generate program on this host
def test_the_longest_prompt_is_the_last_one_whose_compiled_plan_fits():
  """longest_prompt bisects prompt_candidates over compiled plans: with a budget between the plans of a 4,096- and
  an 8,192-token prompt (the plan grows with the prompt), the answer is 4,096; a budget below the shortest
  candidate's plan gives 0; the --fits table prints it."""
  settings = _qlora_tiny()
  device = memory.one_device_mesh().devices.flat[0]
  plans = {n: memory.compiled_sample_memory(settings, n, device) for n in (4096, 8192)}
  assert plans[4096]["peak"] < plans[8192]["peak"]
  budget = (plans[4096]["peak"] + plans[8192]["peak"]) // 2
  assert memory.prompt_candidates(settings)[:4] == (1024, 2048, 4096, 8192)
  assert memory.longest_prompt(settings, device, budget, known=dict(plans)) == 4096
  smallest = memory.compiled_sample_memory(settings, 1024, device)
  assert memory.longest_prompt(settings, device, smallest["peak"] - 1, known={1024: smallest, **plans}) == 0
  table = {"host": dict(device="cpu", memory=budget, train=plans[4096], sample=plans[4096], train_fits=True,
                        sample_fits=True, longest_prompt=4096)}
  last = memory.fits_report(settings, 4096, table).splitlines()
  assert last[-2].endswith("longest prompt") and last[-1].split(" fits")[-1].strip() == "4,096 tokens"


def test_a_refused_layout_choice_is_the_sample_plan(monkeypatch):
  """With sample.weight_layouts='auto', the layouts come from a one-row program; where the compiler refuses even that
  one (a model too big for the chip), the plan is refused with its figure (a lower bound of the longer prompt's),
  not an error. Any other compile error is raised."""
  import jax
  from dgemma import api
  settings = _qlora_tiny().replace(**{"sample.weight_layouts": "auto"})
  refusal = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (16.32G) "
             "exceeds available HBM (15.75G).")

  def refuse(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(refusal)
  monkeypatch.setattr(api, "compiled_weight_formats", refuse)
  plan = memory.compiled_sample_memory(settings, 64)
  gib = 2**30
  assert plan["refused"] == 1 and plan["arguments"] == plan["weights"] > 0
  assert abs(plan["peak"] - 16.32 * gib) < 1 and abs(plan["available"] - 15.75 * gib) < 1
  monkeypatch.setattr(api, "compiled_weight_formats", lambda *a, **k: (_ for _ in ()).throw(
      jax.errors.JaxRuntimeError("INTERNAL: something else")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
    memory.compiled_sample_memory(settings, 64)


_ON_TARGETS = """
import json, sys
from dgemma.tools import targets
targets.use_plugins()  # before jax starts its backends
from dgemma import quant
from dgemma.tools import memory
sys.path.insert(0, sys.argv[1])
from tests.tools.test_memory import _qlora_tiny
settings = _qlora_tiny()
table = memory.fits(settings, 32, ("h100", "v5e"))
print(memory.fits_report(settings, 32, table))
import jax, jax.numpy as jnp
v5e = targets.device("v5e")
mesh = memory.one_device_mesh(v5e)
rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
x = jax.ShapeDtypeStruct((5632 * 512, 1024), jnp.bfloat16, sharding=rep)  # 5.5 GiB
refused = memory.compiled_memory(jax.jit(lambda x: (x * 2, x * 3)).lower(x), arguments=x.size * 2)
laid = settings.replace(**{"sample.weight_layouts": "auto"})
auto = memory.compiled_sample_memory(laid, 32, v5e)
# the layouts libtpu picks for the weights (dgemma.load with sample.weight_layouts='auto') against its default ones
from dgemma import api
from dgemma.sampling import generation
from dgemma.model import Transformer
shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), jax.eval_shape(
    lambda p: quant.quantize_params(p, laid.sample.quant), memory.param_shapes(laid.model)))
picked = jax.tree.leaves(api.compiled_weight_formats(shapes, laid, mesh))
default = jax.tree.leaves(generation.lower(Transformer(laid.model), shapes, laid.canvas_sampler, batch=1, prompt_len=32,
                                           max_new_tokens=16).compile().input_formats[0][0])
moved = [str(s.shape) for s, a, b in zip(jax.tree.leaves(shapes), picked, default) if a.layout != b.layout]
print(json.dumps(dict(table=table, refused=refused, auto=auto, moved=moved)))
"""


@pytest.mark.slow  # a subprocess that compiles a train step and generate for a GPU and for a TPU
def test_the_train_step_and_generate_compile_for_a_gpu_and_a_tpu_without_them():
  """The same tiny QLoRA step and int4_experts generate program (a 32-token prompt) compiled for an H100 (jax's CUDA
  plugin) and a TPU v5e (libtpu), neither present, as `--fits` tabulates them; the plugins are found beside the
  environment (`make venv` installs them in .venv/cuda-plugin and .venv/tpu-plugin). The GPU plans' arguments are
  exactly the state (its int4 experts packed at half a byte), the batch and the step's key, and the quantized weights
  and the request; the TPU's are at least that (its layouts pad small arrays to whole tiles). With
  sample.weight_layouts='auto' libtpu picks other layouts than its default ones for some weights (what dgemma.load
  then holds them in), and the program on them is planned."""
  import json
  import subprocess
  import sys
  from pathlib import Path
  repo = Path(__file__).resolve().parents[2]
  for kind, folder in (("gpu", "cuda-plugin"), ("tpu", "tpu-plugin")):
    assert (Path(sys.prefix) / folder).is_dir(), f"{sys.prefix}/{folder}: the {kind} plugin is missing (make venv)"
  out = subprocess.run([sys.executable, "-c", _ON_TARGETS, str(repo)], cwd=repo, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  table, refused, auto, moved = json.loads(lines[-1]).values()
  plans = {name: dict(t["train"], device=t["device"], sample=t["sample"]) for name, t in table.items()}
  # the --fits table: both plans fit both cards (a tiny model), one line per target
  assert all(t["train_fits"] and t["sample_fits"] for t in table.values())
  rows = [line for line in lines[:-1] if line.startswith(("h100 ", "v5e "))]
  assert len(rows) == 2 and all(row.count(" fits") == 2 for row in rows), lines
  exact = plans["h100"]["base_quantized"] + plans["h100"]["frozen_float"] + plans["h100"]["trainable"] + \
      plans["h100"]["opt_state"] + plans["h100"]["batch"] + 4 + 8  # + the step counter and the uint32[2] key
  assert plans["h100"]["device"] == "NVIDIA H100 80GB HBM3" and plans["v5e"]["device"] == "TPU v5 lite"
  assert plans["h100"]["arguments"] == exact and plans["v5e"]["arguments"] >= exact
  assert plans["h100"]["base_quantized"] == plans["v5e"]["base_quantized"] > 0
  for plan in plans.values():
    assert plan["refused"] == 0 and plan["temporaries"] > 0 and plan["peak"] >= plan["arguments"]
  # generate: the weights as sample.quantize quantizes them (the packed experts' bytes) and the request
  gpu, tpu = plans["h100"]["sample"], plans["v5e"]["sample"]
  assert gpu["weights"] == tpu["weights"] < plans["h100"]["base_quantized"] + plans["h100"]["frozen_float"] + \
      plans["h100"]["trainable"]  # the QLoRA state also holds the trained self-conditioning module's float copy
  # + the request as generate takes it: the prompt and its length, the key (uint32[2]), the infill tokens and mask of
  # the 16-token response and the row's active flag
  request = 32 * 4 + 4 + 8 + 16 * 4 + 16 + 1
  assert gpu["arguments"] == gpu["weights"] + request and tpu["arguments"] >= gpu["arguments"]
  for plan in (gpu, tpu, auto):
    assert plan["refused"] == 0 and plan["outputs"] > 0 and plan["peak"] >= plan["arguments"] + plan["temporaries"]
  assert auto["weights"] == tpu["weights"] and auto["arguments"] >= gpu["arguments"]  # the weights laid out by libtpu
  assert moved, "libtpu kept every weight in its default layout"  # it picks others for some: what 'auto' is for
  # A program the TPU compiler refuses: a 5.5 GiB argument and two 5.5 GiB outputs on a 16 GB v5e. The message's
  # figure is all it needs (16.50G, arguments and outputs included), so it is the plan's peak, not the temporaries
  # to add to the arguments (to the message's two decimals: 0.005 GiB)
  gib = 2**30
  assert refused["refused"] == 1 and refused["arguments"] == 5.5 * gib and refused["available"] < 16 * gib
  assert abs(refused["peak"] - 3 * 5.5 * gib) <= 0.005 * gib, refused
  assert abs(refused["temporaries"] - 2 * 5.5 * gib) <= 0.005 * gib, refused


@pytest.mark.slow  # a subprocess that compiles a train step for a GPU
def test_train_plan_for_a_gpu_without_one():
  """`python -m dgemma.tools.memory --train --target=h100` compiles for an H100 without one (jax's CUDA plugin,
  which `make venv` installs in .venv/cuda-plugin) and ends with `peak X GiB`."""
  import os
  import subprocess
  import sys
  from pathlib import Path
  repo = Path(__file__).resolve().parents[2]
  plugin = Path(sys.prefix) / "cuda-plugin"
  assert (plugin / "jax_plugins").is_dir(), f"{plugin}: jax's CUDA plugin is missing (make venv installs it)"
  env = dict(os.environ, PYTHONPATH=str(repo))  # the command finds the plugin beside the environment itself
  out = subprocess.run([sys.executable, "-m", "dgemma.tools.memory", "--config=configs/tiny_test.py", "--train",
                        "--target=h100", *QLORA_TINY], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert "NVIDIA H100" in lines[1] and "(gpu;" in lines[1], out.stdout
  assert lines[-1].startswith("peak ") and lines[-1].endswith(" GiB") and float(lines[-1].split()[1]) > 0
