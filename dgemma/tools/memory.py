"""Memory estimate of a config, per device, from shapes only (nothing is allocated or compiled).

  python -m dgemma.tools.memory --config=configs/models/diffusiongemma_26b_a4b.py --quantize=int4 --context=4096
  python -m dgemma.tools.memory --config=configs/demo.py --mesh=data=1,fsdp=2 --config.model.remat=full
  python -m dgemma.tools.memory --config=configs/models/diffusiongemma_26b_a4b.py --mesh=fsdp=8 --train_batch=8 \
      --seq_len=4096 --config.remat=full

The compiled train step instead of estimates (`--train`; docs/finetuning.md): the config's real step lowered from
abstract shapes and compiled for one device, XLA's buffer assignment printed, `peak X GiB` last:
  python -m dgemma.tools.memory --config=configs/finetune_head_qlora.py --train --target=h100
and of the generate program (`--sample`: a `--context`-token prompt and one canvas, `--quantize` weights):
  python -m dgemma.tools.memory --config=configs/models/diffusiongemma_26b_a4b.py --sample --quantize=int4_experts \
      --context=4096 --target=h100 [--prompt_chunk=1024] [--weight_layouts=auto]
and both for each card a researcher may have (`--fits`: a 24 GB, a 40 GB and an 80 GB GPU, TPU v5e-1 and v6e-1):
  python -m dgemma.tools.memory --config=configs/finetune_head_qlora.py --fits --quantize=int4_experts --context=4096

`--config` is a model preset (configs/models/*.py; the rest of the settings are configs/base.py's) or an
experiment config. Overrides go to `--config.<field>` / `--config.model.<field>` as in dgemma.tools.model_size.

Inference (one device; the sampler at `--batch` rows, `--canvas` = diffusion.canvas_len by default):
  weights      the `dgemma.quant.quantize_params` tree of the param_dtype weights (`--quantize`), or plain;
  KV cache     `init_cache` of `--context` slots as the samplers allocate it: global layers keep every
               slot, sliding layers a ring of min(W, context) (`dgemma.model.transformer.KVCache`);
  canvas step  the working set of one denoising step (decoder pass with self-conditioning + the sampler's
               [B, C, V] work) against that cache: the peak of `activation_peak` over its jaxpr, less
               the weights and cache it reads.
Training (per device of `--mesh`, default config.mesh.shape; a -1 axis takes what the others leave of
`--devices`): params, gradients and optimizer state sharded like the trainer shards them (logical axes
+ mesh.axis_rules, `dgemma.train.state.abstract_train_state` on an abstract mesh), and the working set of
value_and_grad(diffusion_loss) at the per-device batch (batch / (data x fsdp)) under model.remat, less
its parameter inputs and gradient outputs. Activations are not divided over tensor / expert axes.

`activation_peak` walks a jaxpr in program order, keeping every value until its last use and adding
the peak of nested programs (scan / while / cond / remat bodies). It is an estimate, not a bound: XLA
fuses elementwise chains (fewer buffers) but also keeps loop-carried copies and schedules differently
(more); on the small preset it came within -39% .. +4% of XLA's CPU buffer assignment
(`bench/memory_check.py`, docs/benchmarks.md "Memory").
"""

from __future__ import annotations

import functools
import math
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dgemma import api, finetune, quant
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.diffusion import diffusion_loss
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer, init_cache, param_shapes
from dgemma.model.sharding import MESH_AXES
from dgemma.sampling import SamplerConfig, as_noise, denoise_canvas, generation
from dgemma.sampling.config import WEIGHT_LAYOUTS
from dgemma.tools import model_size, targets
from dgemma.train import loop
from dgemma.train import optimizer as optimizer_lib
from dgemma.train import state as state_lib

_CONFIG = None  # flags, defined only when run as a program
_FLAGS = {}
GiB = 2**30


# ---- program working sets -------------------------------------------------------------------------

def _aval_bytes(aval) -> int:
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return math.prod(shape) * 8
  bits = 4 if jnp.dtype(dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8 * jnp.dtype(dtype).itemsize
  return math.prod(shape) * bits // 8


def _inner_jaxprs(eqn):
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, jax.extend.core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax.extend.core.Jaxpr):
        yield x


def activation_peak(jaxpr) -> int:
  """Peak bytes live at once when `jaxpr`'s equations run in order (inputs included): a value lives
  from the equation that makes it to its last use; a nested program adds its own peak less its inputs."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  Var = jax.extend.core.Var
  last = {}
  n = len(jaxpr.eqns)
  for i, e in enumerate(jaxpr.eqns):
    for v in e.invars:
      if isinstance(v, Var):
        last[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, Var):
      last[v] = n
  live = {v: _aval_bytes(v.aval) for v in list(jaxpr.invars) + list(jaxpr.constvars)}
  cur = sum(live.values())
  peak = cur
  for i, e in enumerate(jaxpr.eqns):
    inner = max((activation_peak(j) - sum(_aval_bytes(v.aval) for v in j.invars) for j in _inner_jaxprs(e)),
                default=0)
    out = sum(_aval_bytes(v.aval) for v in e.outvars)
    peak = max(peak, cur + max(inner, 0) + out)
    for v in e.outvars:
      live[v] = _aval_bytes(v.aval)
      cur += live[v]
    for v in [x for x in e.invars if isinstance(x, Var)] + list(e.outvars):
      if isinstance(v, Var) and last.get(v, -1) <= i and v in live:
        cur -= live.pop(v)
  return peak


# ---- inference ------------------------------------------------------------------------------------

def canvas_step_program(cfg: ModelConfig, qcfg: quant.QuantConfig, context: int, canvas: int, batch: int = 1):
  """(fn, abstract args) of one denoising step (decoder pass + sampler) against a `context`-slot cache;
  args = (weights, cache, key)."""
  weights = model_size.quantized_shapes(cfg, qcfg, cfg.param_dtype) if qcfg.scheme != "none" else param_shapes(cfg)
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, context, jnp.dtype(cfg.dtype), sliding_ring=True))
  model = Transformer(cfg)
  scfg = SamplerConfig(canvas_len=canvas, max_denoising_steps=1, confidence_threshold=0.0, early_exit=False,
                       end_ids=(), max_context=context + canvas + 1)

  def one_step(params, cache, key):
    positions = context + jnp.broadcast_to(jnp.arange(canvas, dtype=jnp.int32), (batch, canvas))
    ones = jnp.ones((batch, canvas), jnp.int32)

    def decode_fn(canvas_BC, sc_logits_BCV, sc_mask_B):
      prev = jnp.zeros((batch, 1, cfg.vocab_size), jnp.float32) if cfg.decoder_shift else None  # (shapes only)
      return model.apply({"params": params}, canvas_BC, positions, ones, cache, sc_logits_BCV=sc_logits_BCV,
                         sc_mask_B=sc_mask_B, prev_logits_BKV=prev, method="decode")

    noise = as_noise(key, batch)
    state = denoise_canvas(decode_fn, scfg, noise, noise.init_canvas(0, canvas, cfg.vocab_size), cfg.vocab_size,
                           sc_dtype=jnp.dtype(cfg.param_dtype))
    return state.argmax_BC

  return one_step, (weights, cache, jax.eval_shape(lambda: jax.random.key(0)))


def inference_estimate(cfg: ModelConfig, qcfg: quant.QuantConfig, context: int, canvas: int,
                       batch: int = 1) -> dict[str, int]:
  """{'weights', 'kv_cache', 'canvas_step'} bytes on one device (see the module docstring)."""
  fn, (weights, cache, key) = canvas_step_program(cfg, qcfg, context, canvas, batch)
  jaxpr = jax.make_jaxpr(fn)(weights, cache, key)
  w, c = quant.tree_bytes(weights), quant.tree_bytes(cache)
  return {"weights": w, "kv_cache": c, "canvas_step": activation_peak(jaxpr) - w - c}


# ---- training -------------------------------------------------------------------------------------

def _abstract_mesh(sizes: dict[str, int]):
  return jax.sharding.AbstractMesh(tuple(int(sizes[a]) for a in MESH_AXES), MESH_AXES)


def mesh_sizes(mesh_shape, devices: int) -> dict[str, int]:
  """Axis sizes with a -1 axis resolved against `devices`."""
  sizes = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
  known = math.prod(s for s in sizes.values() if s != -1)
  for a, s in sizes.items():
    if s == -1:
      if devices % known:
        raise ConfigError(f"mesh.shape: {dict(mesh_shape)} does not divide --devices={devices}")
      sizes[a] = devices // known
  return sizes


def train_grad_program(config, sizes: dict[str, int]):
  """(fn, abstract args, abstract sharded train state) of value_and_grad(diffusion_loss) at the
  per-device batch; args = (params, batch, rng)."""
  settings = settings_lib.from_config(config)
  mesh = _abstract_mesh(sizes)
  optimizer = optimizer_lib.make_optimizer(settings.opt, settings.train.num_steps, model_cfg=settings.model)
  _, abstract, _ = state_lib.abstract_train_state(settings.model, mesh, settings.mesh.axis_rules, optimizer)
  b = max(settings.data.batch_size // (sizes["data"] * sizes["fsdp"]), 1)
  L = settings.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, L), jnp.int32) for k in ("tokens", "segment_ids", "positions")}
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract.params)
  grad_fn = jax.value_and_grad(functools.partial(diffusion_loss, model_cfg=settings.model,
                                                 loss_cfg=settings.diffusion), has_aux=True)
  return grad_fn, (params, batch, jax.eval_shape(lambda: jax.random.PRNGKey(0))), abstract


def training_estimate(config, sizes: dict[str, int]) -> dict[str, int]:
  """{'params', 'grads', 'opt_state', 'activations', 'batch_per_device'} bytes per device."""
  fn, (params, batch, rng), abstract = train_grad_program(config, sizes)
  per_dev = lambda tree: sum(_aval_bytes(jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype))
                             for x in jax.tree.leaves(tree))
  jaxpr = jax.make_jaxpr(fn)(params, batch, rng)
  full = quant.tree_bytes(params)
  working = activation_peak(jaxpr) - 2 * full - quant.tree_bytes(batch)  # less params in and grads out
  return {"params": per_dev(abstract.params), "grads": per_dev(abstract.params),
          "opt_state": per_dev(abstract.opt_state), "activations": max(working, 0),
          "batch_per_device": batch["tokens"].shape[0]}


# ---- the compiled train step ----------------------------------------------------------------------

def one_device_mesh(device=None) -> jax.sharding.Mesh:
  """The mesh of one `device` (default: this host's first) a plan compiles on: every axis of size 1."""
  device = device if device is not None else jax.devices()[0]
  return jax.sharding.Mesh(np.array([device]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def compiled_train_memory(settings, device=None) -> dict[str, int]:
  """XLA's buffer assignment for the run's real train step (`dgemma.train.loop.run_programs`: the state, the
  batch of data.batch_size x data.seq_len rows in micro-batches of opt.grad_accum_steps, the optimizer, the
  frozen and quantized leaves) on one `device` (default: this host's first; `targets.device`), lowered from
  abstract shapes and compiled: nothing is allocated. Bytes: 'arguments' (of which 'base_quantized',
  'frozen_float', 'trainable', 'opt_state', 'batch'), 'outputs', 'aliased' (outputs written into the donated
  state), 'temporaries', 'peak' (arguments + outputs - aliased + temporaries, or XLA's own peak when it reports a
  larger one)."""
  mesh = one_device_mesh(device)
  programs = loop.run_programs(settings, mesh)
  state = programs.abstract_state
  batch = loop.batch_specs(settings, mesh)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  parts = {"base_quantized": 0, "frozen_float": 0, "trainable": 0}
  for key, leaf in flax.traverse_util.flatten_dict(state.params).items():
    kind = ("trainable" if finetune.label(key, settings.finetune) == finetune.TRAINABLE else
            "base_quantized" if quant.is_quantized(leaf) else "frozen_float")
    parts[kind] += quant.tree_bytes(leaf)
  out = dict(parts, opt_state=quant.tree_bytes(state.opt_state), batch=quant.tree_bytes(batch))
  with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
    lowered = programs.train_step.lower(state, batch, rng)
  out.update(compiled_memory(lowered, arguments=quant.tree_bytes((state, batch, rng))))
  return out


def compiled_memory(lowered, arguments: int) -> dict[str, int]:
  """XLA's buffer assignment of a lowered program, compiled: 'arguments', 'outputs', 'aliased', 'temporaries' and
  'peak' (arguments + outputs - aliased + temporaries, or XLA's own peak when it reports a larger one). A program
  the compiler refuses for want of memory (a TPU's does: "the total memory required for HLO temporaries (16.37G)
  exceeds available HBM (15.75G)") is a plan too. The message's figure is everything the program needs at its peak,
  its arguments and outputs included (a program of a 5.5 GiB argument and two 5.5 GiB outputs is refused with
  16.50G: tests/tools/test_memory.py), so it is the plan's 'peak'; with 'available' from the message, `arguments`
  (the caller's count of the argument bytes), 'temporaries' the rest (outputs included: the split is not known),
  'refused' 1."""
  try:
    stats = lowered.compile().memory_analysis()
  except jax.errors.JaxRuntimeError as e:
    return refused_plan(e, arguments)
  out = dict(arguments=int(stats.argument_size_in_bytes), outputs=int(stats.output_size_in_bytes),
             aliased=int(stats.alias_size_in_bytes), temporaries=int(stats.temp_size_in_bytes), refused=0)
  summed = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  out["peak"] = max(summed, int(getattr(stats, "peak_memory_in_bytes", 0) or 0))
  return out


def refused_plan(error: Exception, arguments: int) -> dict[str, int]:
  """The plan of a program the compiler refused for want of memory (`compiled_memory`), from its message; any other
  error is raised again."""
  found = REFUSED.search(str(error))
  if found is None:
    raise error
  required, available = (int(float(x) * GiB) for x in found.groups())
  return dict(arguments=arguments, outputs=0, aliased=0, temporaries=max(required - arguments, 0),
              available=available, peak=required, refused=1)


def compiled_sample_memory(settings, prompt_len: int, device=None) -> dict[str, int]:
  """XLA's buffer assignment for the real generate program (`dgemma.sampling.generation.lower`: the prompt encode of
  `prompt_len` tokens and one canvas of the config's sampler, batch 1, `sample.max_context` = prompt + canvas) on the
  weights as sample.quantize quantizes them, on one `device` (`compiled_train_memory`), compiled from abstract
  shapes. Bytes as `compiled_memory`, with 'weights' (the quantized tree). The weights in the memory layouts
  sample.weight_layouts says, as dgemma.load holds them: 'default', or 'auto' (those the program compiled for a
  one-row request in the smallest prompt bucket picks, `dgemma.api.compiled_weight_formats`; where the compiler
  refuses that program, its figure is the plan's, refused: a lower bound of this one's)."""
  mesh = one_device_mesh(device)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  cfg, qcfg, canvas = settings.model, settings.sample.quant, settings.diffusion.canvas_len
  shapes = param_shapes(cfg)
  if qcfg.scheme != "none":
    shapes = jax.eval_shape(functools.partial(quant.quantize_params, qcfg=qcfg), shapes)
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes)
  settings = settings.replace(**{"sample.max_new_tokens": canvas, "sample.max_context": prompt_len + canvas})
  weights = quant.tree_bytes(shapes)
  formats = None
  if settings.sample.weight_layouts == "auto":
    try:
      formats = api.compiled_weight_formats(shapes, settings, mesh)
    except jax.errors.JaxRuntimeError as e:  # the one-row program that picks them does not fit: nor does this one
      return dict(refused_plan(e, weights), weights=weights)
  with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
    lowered = generation.lower(Transformer(cfg), shapes, settings.canvas_sampler, batch=1, prompt_len=prompt_len,
                               max_new_tokens=canvas, weight_formats=formats)
  arguments = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(lowered.in_avals))
  return dict(compiled_memory(lowered, arguments=arguments), weights=weights)


def sample_report(settings, prompt_len: int, target: str = "host") -> str:
  """The compiled generate program's memory plan (`compiled_sample_memory` on `targets.device(target)`), its last
  line `peak X GiB`."""
  device = targets.device(target)
  m = compiled_sample_memory(settings, prompt_len, device)
  cfg, qcfg = settings.model, settings.sample.quant
  fmt = lambda x: f"{x / GiB:8.3f} GiB"
  return "\n".join([
      f"model: {cfg.preset} (d={cfg.d_model}, layers={cfg.num_layers}, vocab={cfg.vocab_size}); param_dtype "
      f"{cfg.param_dtype}, compute {cfg.dtype}, moe_impl {cfg.moe_impl}",
      f"generate compiled for one {device.device_kind} ({device.platform}; XLA's buffer assignment, nothing "
      f"allocated): sample.quantize {qcfg.scheme}"
      + (f" (int4 groups of {qcfg.group_size})" if qcfg.scheme in ("int4", "int4_experts") else "")
      + f", a {prompt_len}-token prompt"
      + (f" encoded {settings.sample.prompt_chunk} tokens at a time" if settings.sample.prompt_chunk else "")
      + f" and one {settings.diffusion.canvas_len}-token canvas, batch 1"
      + ("; the weights in the layouts the program picks (sample.weight_layouts='auto')"
         if settings.sample.weight_layouts == "auto" else ""),
      f"  arguments        {fmt(m['arguments'])}   (the weights: {m['weights'] / GiB:.3f} GiB)",
      f"  outputs          {fmt(m['outputs'])}",
      f"  temporaries      {fmt(m['temporaries'])}   (KV cache, activations, the sampler's work)",
      *([f"  refused by the compiler: the program needs {m['peak'] / GiB:.2f} GiB in all, over the "
         f"{m['available'] / GiB:.2f} GiB it allows (temporaries: the rest beyond the arguments, outputs included)"]
        if m["refused"] else []),
      f"peak {m['peak'] / GiB:.2f} GiB"])


# The cards `--fits` plans for: a 24 GB GPU (sm_89), a 40 GB and an 80 GB one, Colab's two one-chip TPUs
FITS_TARGETS = ("rtx4090", "a100_40gb", "h100", "v5e", "v6e")


def fits(settings, prompt_len: int, names: tuple[str, ...] = FITS_TARGETS, *,
         longest: bool = False) -> dict[str, dict]:
  """For each target in `names`: the config's train step (`compiled_train_memory`) and its generate program at a
  `prompt_len`-token prompt (`compiled_sample_memory`), each compiled for that target, and whether each fits: not
  refused and its peak within the target's memory (`targets.Target.memory`). With `longest`, also the longest
  prompt whose generate program fits (`longest_prompt`: 'longest_prompt', 0 when none does)."""
  out = {}
  for name in names:
    device, memory = targets.device(name), targets.get(name).memory
    plans = dict(train=compiled_train_memory(settings, device), sample=compiled_sample_memory(settings, prompt_len,
                                                                                             device))
    out[name] = dict(device=device.device_kind, memory=memory, **plans,
                     **{f"{k}_fits": _fits(p, memory) for k, p in plans.items()})
    if longest:
      out[name]["longest_prompt"] = longest_prompt(settings, device, memory, known={prompt_len: plans["sample"]})
  return out


def _fits(plan: dict, memory: int) -> bool:
  return not plan["refused"] and plan["peak"] <= memory


def prompt_candidates(settings) -> tuple[int, ...]:
  """The prompt lengths `longest_prompt` tries: 1,024 doubled while a prompt and one canvas fit the model's
  positions (sample.max_context), then the longest that does."""
  most = settings.sampler_config.max_context - settings.diffusion.canvas_len
  lengths = [n for n in (1024 * 2**k for k in range(20)) if n <= most]
  return tuple(lengths + ([most] if most not in lengths and most > 0 else []))


def longest_prompt(settings, device, memory: int, known: dict | None = None) -> int:
  """The longest of `prompt_candidates` whose generate program (`compiled_sample_memory`, batch 1) fits `memory`
  bytes on `device`, 0 when none does: a bisection over the compiled plans (a longer prompt never needs less: the
  KV cache and the prompt encode grow with it), `known` plans ({prompt length: plan}) reused."""
  known = dict(known or {})
  plan = lambda n: known[n] if n in known else known.setdefault(n, compiled_sample_memory(settings, n, device))
  candidates = prompt_candidates(settings)
  lo, hi = 0, len(candidates)  # candidates[:lo] fit, candidates[hi:] do not
  while lo < hi:
    mid = (lo + hi) // 2
    if _fits(plan(candidates[mid]), memory):
      lo = mid + 1
    else:
      hi = mid
  return candidates[lo - 1] if lo else 0


def fits_report(settings, prompt_len: int, table: dict[str, dict]) -> str:
  """A `fits` table as a researcher reads it first: per target, the train step's and the generate program's peak
  and whether each fits."""
  cfg, ft, qcfg = settings.model, settings.finetune, settings.sample.quant
  cell = lambda t, k: (f"{t[k]['peak'] / GiB:6.2f} GiB " + ("fits" if t[f"{k}_fits"] else
                       "refused" if t[k]["refused"] else "too big")).ljust(22)
  lines = [f"model: {cfg.preset} (layers={cfg.num_layers}, d={cfg.d_model}); plans compiled for each target, "
           "nothing allocated",
           f"train: finetune.mode {ft.mode}, base_quant {ft.base_quant}, {settings.data.seq_len}-token rows, "
           f"{settings.data.batch_size // settings.opt.grad_accum_steps} per micro-batch; sample: sample.quantize "
           f"{qcfg.scheme}, a {prompt_len}-token prompt"
           + (f" encoded {settings.sample.prompt_chunk} tokens at a time" if settings.sample.prompt_chunk else "")
           + f" and one {settings.diffusion.canvas_len}-token canvas"
           + (f"; moe_impl {cfg.moe_impl}" + (f", the experts {cfg.moe_dense_block} at a time" if cfg.moe_dense_block
                                                else ""))
           + ("; the weights in the layouts the program picks" if settings.sample.weight_layouts == "auto" else ""),
           f"{'target':40s}{'memory':>10s}   {'train step':22s}{'sample':22s}"
           + ("longest prompt" if any("longest_prompt" in t for t in table.values()) else "")]
  for name, t in table.items():
    longest = f"{t['longest_prompt']:,} tokens" if t.get("longest_prompt") else ("none fits" if "longest_prompt" in t
                                                                                 else "")
    lines.append(f"{name + ' (' + t['device'] + ')':40.40s}{t['memory'] / GiB:7.2f} GiB   {cell(t, 'train')}"
                 f"{cell(t, 'sample')}{longest}".rstrip())
  return "\n".join(lines)


# XLA's TPU compiler refusing a program that does not fit (its byte counts are GiB, printed 'G')
REFUSED = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def train_report(settings, target: str = "host") -> str:
  """The compiled train step's memory plan (`compiled_train_memory` on `targets.device(target)`), its last line
  `peak X GiB`."""
  device = targets.device(target)
  m = compiled_train_memory(settings, device)
  cfg, ft = settings.model, settings.finetune
  fmt = lambda x: f"{x / GiB:8.3f} GiB"
  micro = settings.data.batch_size // settings.opt.grad_accum_steps
  return "\n".join([
      f"model: {cfg.preset} (d={cfg.d_model}, layers={cfg.num_layers}, vocab={cfg.vocab_size}); param_dtype "
      f"{cfg.param_dtype}, compute {cfg.dtype}, remat {cfg.remat}, moe_impl {cfg.moe_impl}",
      f"train step compiled for one {device.device_kind} ({device.platform}; XLA's buffer assignment, nothing "
      f"allocated): "
      f"finetune.mode {ft.mode}, base_quant {ft.base_quant}, batch {settings.data.batch_size} x "
      f"{settings.data.seq_len} in micro-batches of {micro} row(s)",
      f"  arguments        {fmt(m['arguments'])}",
      f"    frozen base, quantized   {fmt(m['base_quantized'])}",
      f"    frozen base, float       {fmt(m['frozen_float'])}   (norms, router, scalars and what base_quant keeps)",
      f"    trained leaves           {fmt(m['trainable'])}",
      f"    optimizer state          {fmt(m['opt_state'])}",
      f"    batch                    {fmt(m['batch'])}",
      f"  outputs          {fmt(m['outputs'])}   (of which {m['aliased'] / GiB:.3f} GiB written into the donated state)",
      f"  temporaries      {fmt(m['temporaries'])}",
      *([f"  refused by the compiler: the program needs {m['peak'] / GiB:.2f} GiB in all, over the "
         f"{m['available'] / GiB:.2f} GiB it allows (temporaries: the rest beyond the arguments as counted here, "
         "outputs included)"] if m["refused"] else []),
      f"peak {m['peak'] / GiB:.2f} GiB"])


# ---- CLI ------------------------------------------------------------------------------------------

def _experiment_config(config):
  """An experiment config: `config` itself, or configs/base.py with `config` as its model group."""
  if "model" in config:
    return config
  full = settings_lib.default_config()
  full.model = config
  full.data.tokenizer.kind = "file"  # a preset names no tokenizer; the vocabulary is the model's
  return full


def report(config, *, quantize: str, group_size: int, context: int, canvas: int, batch: int, mesh_shape,
           devices: int, budget_gib: float, training: bool = True) -> str:
  cfg = ModelConfig.from_config_dict(config.model)
  qcfg = quant.QuantConfig(quantize, group_size)
  inf = inference_estimate(cfg, qcfg, context, canvas, batch)
  total = sum(inf.values())
  name = config.model.get("preset", "?")
  fmt = lambda x: f"{x / GiB:8.3f} GiB"
  lines = [f"model: {name} (d={cfg.d_model}, layers={cfg.num_layers}, vocab={cfg.vocab_size}); param_dtype "
           f"{cfg.param_dtype}, compute {cfg.dtype}",
           f"inference, one device: weights {quantize}" + (f" (int4 groups of {group_size})" if quantize == "int4" else "")
           + f", KV cache {context} slots, batch {batch}, canvas {canvas}",
           f"  weights          {fmt(inf['weights'])}",
           f"  KV cache         {fmt(inf['kv_cache'])}",
           f"  canvas step      {fmt(inf['canvas_step'])}   (one denoising step's working set)",
           f"  total            {fmt(total)}   -> by this estimate {'fits' if total <= budget_gib * GiB else 'does NOT fit'} in "
           f"{budget_gib:g} GiB ({budget_gib * GiB / 1e9:.1f} GB)"]
  if training:
    sizes = mesh_sizes(mesh_shape, devices)
    tr = training_estimate(config, sizes)
    t_total = tr["params"] + tr["grads"] + tr["opt_state"] + tr["activations"]
    lines += [f"training, per device of mesh {sizes} (batch {config.data.batch_size} x {config.data.seq_len}: "
              f"{tr['batch_per_device']} rows per device; remat={cfg.remat}, opt.state_dtype={config.opt.state_dtype})",
              f"  params           {fmt(tr['params'])}",
              f"  gradients        {fmt(tr['grads'])}",
              f"  optimizer state  {fmt(tr['opt_state'])}",
              f"  activations      {fmt(tr['activations'])}   (working set of value_and_grad at the per-device batch)",
              f"  total            {fmt(t_total)}"]
  return "\n".join(lines)


def main(argv):
  cli.no_extra_args(argv)
  config = _experiment_config(cli.config(_CONFIG))
  mesh_shape = dict(config.mesh.shape)
  for item in _FLAGS["mesh"].value:
    axis, _, size = item.partition("=")
    mesh_shape[axis] = int(size)
  if _FLAGS["train_batch"].value:
    config.data.batch_size = _FLAGS["train_batch"].value
  if _FLAGS["seq_len"].value:
    config.data.seq_len = _FLAGS["seq_len"].value
  if _FLAGS["train"].value or _FLAGS["sample"].value or _FLAGS["fits"].value:
    target = "" if _FLAGS["fits"].value else _FLAGS["target"].value
    targets.use_plugins(target)  # before jax's backends start (the settings' checks start them); "": both plugins
    if target != "host":  # a program for a device this machine lacks cannot be loaded from JAX's persistent cache
      jax.config.update("jax_enable_compilation_cache", False)
    if _FLAGS["sample"].value or _FLAGS["fits"].value:
      config.sample.quantize = _FLAGS["quantize"].value
      config.sample.quant_group_size = _FLAGS["group_size"].value
      if _FLAGS["prompt_chunk"].value >= 0:
        config.sample.prompt_chunk = _FLAGS["prompt_chunk"].value
      if _FLAGS["weight_layouts"].value is not None:
        config.sample.weight_layouts = _FLAGS["weight_layouts"].value
    if _FLAGS["fits"].value:
      settings = settings_lib.from_config(config)
      print(fits_report(settings, _FLAGS["context"].value,
                        fits(settings, _FLAGS["context"].value, longest=_FLAGS["longest_prompt"].value)))
    elif _FLAGS["sample"].value:
      print(sample_report(settings_lib.from_config(config), _FLAGS["context"].value, target))
    else:
      print(train_report(settings_lib.from_config(config), target))
    return
  canvas = _FLAGS["canvas"].value or int(config.diffusion.canvas_len)
  print(report(config, quantize=_FLAGS["quantize"].value, group_size=_FLAGS["group_size"].value,
               context=_FLAGS["context"].value, canvas=canvas, batch=_FLAGS["batch"].value, mesh_shape=mesh_shape,
               devices=_FLAGS["devices"].value, budget_gib=_FLAGS["budget_gib"].value,
               training=_FLAGS["training"].value))


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags
  from dgemma.tools import cli  # defined with the flags, as in dgemma.tools.model_size
  _CONFIG = config_flags.DEFINE_config_file("config", None, "A model preset or an experiment config.")
  flags.mark_flags_as_required(["config"])
  _FLAGS.update(
      quantize=flags.DEFINE_enum("quantize", "none", list(quant.SCHEMES), "Inference weights."),
      group_size=flags.DEFINE_integer("group_size", quant.QuantConfig.group_size, "int4 group size."),
      context=flags.DEFINE_integer("context", 4096, "KV cache slots (prompt + committed canvases)."),
      canvas=flags.DEFINE_integer("canvas", 0, "Canvas tokens (0 = diffusion.canvas_len)."),
      batch=flags.DEFINE_integer("batch", 1, "Sampler rows."),
      mesh=flags.DEFINE_list("mesh", [], "Mesh axis sizes overriding config.mesh.shape, e.g. data=1,fsdp=8."),
      devices=flags.DEFINE_integer("devices", 1, "Devices a -1 mesh axis is resolved against."),
      budget_gib=flags.DEFINE_float("budget_gib", 18e9 / 2**30, "Inference memory budget (default 18 GB)."),
      training=flags.DEFINE_bool("training", True, "Also estimate training memory."),
      train_batch=flags.DEFINE_integer("train_batch", 0, "Training global batch (0 = data.batch_size)."),
      seq_len=flags.DEFINE_integer("seq_len", 0, "Training row length (0 = data.seq_len)."),
      train=flags.DEFINE_bool("train", False, "Compile the config's real train step (abstract shapes, nothing "
                              "allocated) and print XLA's memory plan for it instead of the estimates."),
      sample=flags.DEFINE_bool("sample", False, "Compile the real generate program (a --context-token prompt "
                               "and one canvas, batch 1, --quantize weights) and print XLA's memory plan for it."),
      fits=flags.DEFINE_bool("fits", False, "For each card of FITS_TARGETS (a 24 GB, a 40 GB and an 80 GB GPU, TPU "
                             "v5e-1, v6e-1): the config's train step and its generate program (--quantize, --context) "
                             "compiled for it, and whether each fits."),
      longest_prompt=flags.DEFINE_bool("longest_prompt", False, "With --fits: also the longest prompt (1,024 "
                                       "doubled, up to the model's positions) whose generate program fits each card, "
                                       "by bisection over compiled plans (a few more compiles per card)."),
      prompt_chunk=flags.DEFINE_integer("prompt_chunk", -1, "--sample / --fits: sample.prompt_chunk, the prompt "
                                        "encoded this many tokens at a time (0 = at once; -1 = the config's)"),
      weight_layouts=flags.DEFINE_enum("weight_layouts", None, list(WEIGHT_LAYOUTS), "--sample / --fits: "
                                       "sample.weight_layouts, the weights in their default memory layouts or "
                                       "'auto', those the generate program picks (unset = the config's)."),
      target=flags.DEFINE_enum("target", "host", list(targets.TARGETS), "--train / --sample compile for: 'host' ("
                               "this machine's device) or an accelerator without one (dgemma/tools/targets.py; the "
                               "plugins make venv installs beside the environment)."),
  )
  cli.run(main, "dgemma.tools.memory")
