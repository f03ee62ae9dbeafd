"""The cross-kind reader: which kind a path holds, its header, and its params as stored or as another model's tree.

  kind(path)                           'workdir' | 'params' | 'adapter' | 'hf' (the kinds' own modules read them)
  header(path, field, step)            everything but the weights (each JSON file read once)
  identity(source)                     a fingerprint of its tensor files (what an adapter records of its base)
  load(source, step=, placement=, dtype=, quantizer=)     the params as the checkpoint holds them, placed
  load_as(source, model, placement=, quantizer=, leaves=) the params as `model`'s tree: the other layer layout,
                                       adapters kept or folded in, other leaves supplied, the frozen base quantized
`source` is a header (what a caller that checked it already holds: nothing is read twice) or a path.
`quantizer` (a `dgemma.quant.Quantizer`) is applied to each tensor as it is read from a params checkpoint or an HF
directory, so their float tree never exists; a run's own quantized base is restored as stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import flax
import jax
import numpy as np

from dgemma import quant
from dgemma.checkpoints import adapter, hf, layout, params, workdir
from dgemma.checkpoints.checkpoint import Checkpoint, Placement, check_finite, place, put, with_dtype
from dgemma.errors import CheckpointError, ConfigError
from dgemma.model import ModelConfig
from dgemma.model import lora as lora_lib
from dgemma.model.lora import LoraConfig

KINDS = ("workdir", "params", "adapter", "hf")
Source = Union[Checkpoint, str, os.PathLike]
# leaves(keys the model wants that the checkpoint lacks) -> {key path: array} completing or replacing its leaves
Leaves = Callable[[list], dict]


def kind(path: str | os.PathLike, field: str = "path") -> str:
  """Which format `path` holds (module docstring); raises FileNotFoundError naming `field` and what was
  looked for."""
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"{field}: {path} does not exist")
  if workdir.is_workdir(p):
    return "workdir"
  if adapter.is_adapter_dir(p):
    return "adapter"
  if params.is_params_dir(p):
    return "params"
  if hf.is_hf_dir(p):
    return "hf"
  raise FileNotFoundError(
      f"{field}: {path} is none of: a training workdir (config.json + checkpoints/, from train.py), a params "
      f"checkpoint ({params.MODEL_CONFIG} + params/, from python -m dgemma.tools.convert), an adapter "
      f"({adapter.ADAPTER_CONFIG}), or a Hugging Face directory (config.json + {hf.SINGLE_FILE} or {hf.INDEX_FILE})")


def header(path: str | os.PathLike, field: str = "path", step: Optional[int] = None, *,
           base: Optional[str] = None, any_base: bool = False) -> Checkpoint:
  """What a checkpoint holds, without reading its weights (params None): the architecture (with a run's LoRA
  layout), the tokenizer file, the settings of the run the weights come from, an HF config, and for a run the step
  to read (`step`, None or -1 = the latest). An adapter's base is the one it records, or `base`; either must hold the
  weights the adapter was trained on (`identity`) unless `any_base`. Errors name `field`."""
  k = kind(path, field)
  if (base is not None or any_base) and k != "adapter":
    raise CheckpointError(f"{'base' if base is not None else 'any_base'}: {path} is a {k} checkpoint; only an "
                          "adapter is loaded on a base")
  if k == "workdir":
    described = workdir.describe(path, field)
  elif k == "params":
    described = params.describe(path, field)
  elif k == "adapter":
    described = adapter.describe(path, field, header, identity, base=base, any_base=any_base)
  else:
    described = hf.describe(path, field)
  return at_step(described, step)


_SAMPLE_BYTES = 1 << 16


def identity(source: Source) -> str:
  """A fingerprint of the tensors a checkpoint holds (a run: the step it reads), cheap to take: each tensor file
  (Orbax's data files under `d/`, an HF directory's .safetensors) by its path within the checkpoint, its size and
  its first and last 64 KiB. A copy of the checkpoint has the same fingerprint; another run, step or training of
  the same architecture does not (its tensors' bytes differ). What an adapter records of its base."""
  described = _described(source)
  root = Path(described.path)
  if described.kind == "workdir":
    root = workdir.step_dir(described.path, described.step if described.step is not None else described.steps[-1])
  files = sorted(p for p in root.rglob("*") if p.is_file() and (p.parent.name == "d" or p.suffix == ".safetensors"))
  digest = hashlib.sha256()
  for path in files:
    size = path.stat().st_size
    digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
    with open(path, "rb") as f:
      digest.update(f.read(_SAMPLE_BYTES))
      if size > _SAMPLE_BYTES:
        f.seek(max(size - _SAMPLE_BYTES, _SAMPLE_BYTES))
        digest.update(f.read())
  return digest.hexdigest()[:32]


def at_step(described: Checkpoint, step: Optional[int]) -> Checkpoint:
  """`described` set to read a run's `step` (None or -1: the latest it has); a step the run lacks, or one asked of a
  kind without training steps, is an error naming it."""
  if step is None or step < 0:
    return described
  if described.kind != "workdir":
    raise CheckpointError(f"step: {described.path} is a {described.kind} checkpoint, which has no training steps")
  if step not in described.steps:
    raise CheckpointError(f"sample.checkpoint_step: step {step} not in {workdir.checkpoint_dir(described.path)} "
                          f"(have {list(described.steps)})")
  return dataclasses.replace(described, step=step)


def _described(source: Source, step: Optional[int] = None) -> Checkpoint:
  return at_step(source, step) if isinstance(source, Checkpoint) else header(source, step=step)


def load(source: Source, *, step: Optional[int] = None, placement: Optional[Placement] = None,
         dtype: Optional[str] = None, quantizer: Optional[quant.Quantizer] = None) -> Checkpoint:
  """The params of any checkpoint kind as it holds them (its own model, in `dtype` when given), placed (default
  `Placement.of()`), checked finite; `step` is for runs only. `quantizer`: applied to each tensor of a params
  checkpoint or HF directory as it is read, an adapter's base included (module docstring)."""
  described = _described(source, step)
  placement = placement or Placement.of()
  model = with_dtype(described.model, dtype)
  if described.kind == "workdir":
    tree = workdir.read(described, placement, dtype)
  elif described.kind == "adapter":
    tree = adapter.read(described, placement, dtype, load_as, quantizer)
  else:
    read = params.read if described.kind == "params" else hf.read
    tree = place(read(described, dtype, quantizer), model, placement)
    check_finite(tree, str(described.path))
  return dataclasses.replace(described, model=model, params=tree)


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  """A nested params dict as {(key, ...): leaf} (flax.traverse_util)."""
  return flax.traverse_util.flatten_dict(tree)


def _name(key: tuple[str, ...]) -> str:
  return "/".join(key)


def adapter_transfer(source: Optional[LoraConfig], target: Optional[LoraConfig], path, field: str) -> str:
  """How the LoRA adapters of a checkpoint (its layout `source`) become those of a model laid out as `target`:
  'none' (the checkpoint has none), 'keep' (the same layout: they go on training), 'merge' (mode-'lora'
  adapters folded into their weights, W + (alpha / rank) A B, so the new model starts at the checkpoint's).
  Decoder-only adapters (finetune.mode='head_only') act in decoder mode only while the encoder shares the
  weights, so folding them in would change the encoder: refused, naming `field`."""
  if source is None:
    return "none"
  if source == target:
    return "keep"
  if source.decoder_only:
    raise ConfigError(
        f"{field}: {path} was fine-tuned head_only (rank {source.rank}, targets {','.join(source.targets)}): its "
        "decoder-only adapters cannot be folded into the weights the encoder shares. Continue it with the same "
        "finetune.mode / lora_rank / lora_alpha / lora_targets / freeze_router, or start from its base checkpoint")
  return "merge"


def check_loadable_as(described: Checkpoint, model: ModelConfig) -> str:
  """Whether the checkpoint `described` (its header is enough) can be read as `model`'s tree (`load_as`): its
  architecture equals `model`'s up to the layer layout, and its adapters can be kept or folded in. Returns
  `adapter_transfer`'s answer; errors name described.field."""
  diffs = layout.differences_but_layout(described.model, model)
  if diffs:
    raise ConfigError(f"{described.field}: the architecture differs from the checkpoint {described.path} "
                      f"(checkpoint -> this run): {'; '.join(diffs)}")
  return adapter_transfer(described.model.lora, model.lora, described.path, described.field)


def merge_adapters(flat: dict, scale: float) -> dict:
  """A flat params dict with its LoRA factors folded into their weights (lora.merge, on the host) and dropped."""
  host = {k: np.asarray(v) for k, v in flat.items()}
  base = {k: v for k, v in host.items() if not lora_lib.is_adapter(k[-1])}
  factors = {k: v for k, v in host.items() if lora_lib.is_adapter(k[-1])}
  unflatten = flax.traverse_util.unflatten_dict
  return _flat(lora_lib.merge(unflatten(base), unflatten(factors), scale))


def load_as(source: Source, model: ModelConfig, *, placement: Optional[Placement] = None,
            quantizer: Optional[quant.Quantizer] = None, leaves: Optional[Leaves] = None) -> Checkpoint:
  """The params of any checkpoint kind (a run's header.step) as the parameter tree of `model`, on `placement` in
  model.param_dtype: what `train.init_from`, an adapter's base and dgemma.load read with.

  The checkpoint's architecture must equal `model`'s up to the layer layout (model.scan_layers: relaid,
  layout.py) and the LoRA layout: its adapters are kept or folded in (`adapter_transfer`). `leaves(missing)`: called
  with the keys `model` has and the checkpoint lacks, returns {key: array} completing (a fine-tuning run's new
  adapters, B = 0) or replacing (an adapter's trained leaves) the checkpoint's; a tensor still missing is an error
  naming it. `quantizer`: the weights it picks are held quantized (a QLoRA run's frozen base): a params checkpoint or
  HF directory is quantized as it is read, a float run or a merged / relaid tree one weight at a time here (a run's
  float tree itself is restored whole first)."""
  described = _described(source)
  placement = placement or Placement.of()
  transfer = check_loadable_as(described, model)
  # A QLoRA run's quantized base (finetune.base_quant) is kept as stored where it is read into the same layout and
  # quantization; otherwise it is read as the float model the run trained against (its dequantized weights):
  # merged into, relaid and re-quantized like any float checkpoint. `quantizer` is applied while reading only then
  # (a weight to merge into or relay is read in float and quantized once, below).
  keep_quantized = transfer != "merge" and described.model.block_period == model.block_period
  wanted = _flat(placement.abstract(model, quantizer))
  # A reader quantizes on the default device; where the placement shards a weight (fsdp, tensor, expert axes) that
  # would gather the whole quantized model on one device, so each weight is then quantized on its shards below.
  replicated = all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(wanted))
  loaded = load(described, placement=placement, dtype=model.param_dtype,
                quantizer=quantizer if keep_quantized and replicated else None)
  flat = {k: v if keep_quantized else quant.dequantize(v) for k, v in _flat(loaded.params).items()}
  loaded = dataclasses.replace(loaded, params=None)  # each read weight is let go once placed (below)
  if transfer == "merge":
    flat = merge_adapters(flat, described.model.lora.scale)
  if described.model.block_period != model.block_period:
    flat = _flat(layout.relayout(flax.traverse_util.unflatten_dict(flat), described.model, model))
  if leaves is not None:
    flat.update(leaves([key for key in wanted if key not in flat]))
  missing = [key for key in wanted if key not in flat]
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise CheckpointError(f"{described.field}: {described.path} has no tensor {', '.join(map(_name, missing[:3]))}"
                          f"{more}")
  for key, target in wanted.items():
    if tuple(flat[key].shape) != tuple(target.shape):
      raise CheckpointError(f"{described.field}: {described.path}'s {_name(key)} has shape {tuple(flat[key].shape)}, "
                            f"expected {tuple(target.shape)}")
  placed = {}
  for key, target in wanted.items():
    value = flat.pop(key)  # one weight at a time: a float weight quantized here is placed before the next
    if not quant.is_quantized(target):
      placed[key] = put(quant.dequantize(value), target)
      continue
    if not (quant.is_quantized(value) and quant.same_layout(value, target)):
      dense = put(quant.dequantize(value), jax.ShapeDtypeStruct(target.shape, target.dtype,
                                                                sharding=jax.tree.leaves(target)[0].sharding))
      value = quantizer(key, dense)
      del dense
    placed[key] = jax.tree.map(put, value, target)
  return dataclasses.replace(loaded, model=model, params=flax.traverse_util.unflatten_dict(placed))
