"""Every checkpoint format in one package (docs/checkpoints.md), and one loader that tells them apart.

  kind(path)   'workdir'  a training run (config.json + checkpoints/<step>/, dgemma/checkpoints/workdir.py)
               'params'   a params checkpoint (model_config.json + params/, from dgemma.tools.convert or
                          merge_lora; params.py)
               'adapter'  the trained leaves of a LoRA / head-only run (adapter_config.json; adapter.py)
               'hf'       a Hugging Face DiffusionGemma or Gemma 4 text directory (config.json + safetensors;
                          hf.py reads it directly, streaming and casting tensor by tensor)
  load(path, step=, mesh=, axis_rules=, dtype=) -> Checkpoint   the params only (never a run's optimizer
                          state), placed on `mesh`, checked finite, with the tokenizer file that belongs
                          to them and, for a run (or a run's adapter), its config.json
  load_as(path, model, ...) -> Checkpoint   the params of any kind laid out as the tree of another
                          architecture's run: the other layer layout, the checkpoint's LoRA adapters kept or
                          folded into their weights, the run's new adapters made fresh (`train.init_from`)
  layout.relayout(tree, saved, new)   a params (or optimizer state) tree between the stacked
                          (model.scan_layers) and the unrolled layer layout (layout.py)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dgemma import finetune as finetune_lib, mesh as mesh_lib, quant
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter, hf, layout, params, workdir
from dgemma.errors import CheckpointError, ConfigError
from dgemma.model import ModelConfig, abstract_params
from dgemma.model import lora as lora_lib
from dgemma.model.lora import LoraConfig

KINDS = ("workdir", "params", "adapter", "hf")
# How the command lines (sample.py, eval.*) name a checkpoint path in their errors; Python callers see `path`.
CHECKPOINT_FLAG = "--checkpoint"


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


@dataclasses.dataclass
class Checkpoint:
  """What a checkpoint holds, loaded.

  path / kind: what was loaded; model: the architecture (with a run's LoRA layout); params: on the mesh
  (or host numpy when no placement was asked for); step: a run's training step (None otherwise);
  config_json: a run's config.json (None otherwise); tokenizer_file: the SentencePiece / tokenizers file that
  belongs to the weights (None: a run's byte tokenizer, or none found); hf_config: an HF directory's config.json
  (or the one a converted checkpoint kept).
  """
  path: str
  kind: str
  model: ModelConfig
  params: Any
  step: Optional[int] = None
  config_json: Optional[str] = None
  tokenizer_file: Optional[Path] = None
  hf_config: Optional[dict] = None


@jax.jit
def _finite_leaves(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True, tree)


def header(path: str | os.PathLike, field: str = "path") -> Checkpoint:
  """What a checkpoint holds, without reading its weights (params=None): the architecture (with a run's LoRA
  layout), the tokenizer file, a run's config.json (and latest step), an HF config. Errors name `field`."""
  k = kind(path, field)
  if k == "workdir":
    config_json = workdir.read_config_json(path)
    available = workdir.steps(path)
    tok = Path(path) / workdir.TOKENIZER_FILE
    return Checkpoint(str(path), k, _run_model(config_json, Path(path) / workdir.CONFIG_FILE), None,
                      step=available[-1] if available else None, config_json=config_json,
                      tokenizer_file=tok if tok.is_file() else None)
  if k == "params":
    _, cfg_dict = params.read_header(path)
    return Checkpoint(str(path), k, ModelConfig.from_config_dict(cfg_dict), None,
                      config_json=adapter.read_run_config(path), tokenizer_file=params.tokenizer_file(path),
                      hf_config=params.read_extra_json(path, hf.HF_CONFIG))
  if k == "adapter":
    meta = params.read_extra_json(path, adapter.ADAPTER_CONFIG)
    if not meta.get("base"):
      raise CheckpointError(f"{path}/{adapter.ADAPTER_CONFIG}: names no base checkpoint ('base'), so the adapter "
                            "cannot be loaded on its own")
    base = header(adapter.base_path(path, meta), f"{path}/{adapter.ADAPTER_CONFIG} 'base'")
    lora = LoraConfig(**{k_: tuple(v) if isinstance(v, list) else v for k_, v in meta["lora"].items()})
    step, run_json = meta.get("step"), adapter.read_run_config(path)
    # The run's own model settings (dtypes, compute choices) when the adapter kept its config, else the base's.
    model = _run_model(run_json, Path(path) / adapter.RUN_CONFIG) if run_json is not None else base.model
    return Checkpoint(str(path), k, dataclasses.replace(model, lora=lora), None,
                      step=int(step) if step is not None else None, config_json=run_json,
                      tokenizer_file=base.tokenizer_file, hf_config=base.hf_config)
  config_json = hf.read_config(path)
  run = config_json.get(hf.RUN_CONFIG_KEY)  # the settings of the run an export came from
  return Checkpoint(str(path), k, hf.model_config_from_hf(config_json), None,
                    config_json=json.dumps(run) if isinstance(run, dict) else None,
                    tokenizer_file=params.tokenizer_file(path), hf_config=config_json)


def _run_model(config_json: str, source: Path) -> ModelConfig:
  """The architecture of a run's config.json text, with its LoRA layout (config.finetune)."""
  return settings_lib.load_json(config_json, source=source).model


def _check_finite(tree: Any, where: str) -> None:
  """Raises naming the leaves that hold a NaN or inf (host numpy arrays are checked on the host)."""
  finite = (jax.tree.map(lambda x: bool(np.all(np.isfinite(x))) if np.issubdtype(x.dtype, np.inexact) else True, tree)
            if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree)) else jax.device_get(_finite_leaves(tree)))
  bad = [jax.tree_util.keystr(path) for path, ok in jax.tree_util.tree_leaves_with_path(finite) if not bool(ok)]
  if bad:
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise CheckpointError(f"{where}: parameters {', '.join(bad[:3])}{more} are not finite (NaN or inf): the run "
                          "diverged before it was saved; pick an earlier step")


def _with_dtype(model: ModelConfig, dtype: Optional[str]) -> ModelConfig:
  return model if dtype is None else dataclasses.replace(model, dtype=dtype, param_dtype=dtype)


def _put(x: Any, target: jax.ShapeDtypeStruct) -> jax.Array:
  """One leaf (host or device array) in `target`'s dtype on its sharding."""
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  return jax.device_put(x.astype(target.dtype), target.sharding)


def _place(tree: Any, model: ModelConfig, mesh, axis_rules) -> Any:
  """Host (or device) arrays -> device arrays in model.param_dtype on `mesh` (by logical axis names); `QArray`s
  (quantized as they were read) stay where they are, on the default device: `load_as` places them on the run's
  quantized layout."""
  abstract = abstract_params(model, mesh, axis_rules)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_quantized)}
  put = lambda v, s: v if quant.is_quantized(v) else _put(v, s)
  return jax.tree_util.tree_map_with_path(lambda p, s: put(flat[jax.tree_util.keystr(p)], s), abstract)


def _default_mesh(mesh, axis_rules):
  if mesh is None:
    mesh = mesh_lib.make_mesh()
  return mesh, mesh_lib.AXIS_RULES if axis_rules is None else axis_rules


def load_workdir(path: str | os.PathLike, *, step: Optional[int] = None, mesh=None, axis_rules=None,
                 config_json: Optional[str] = None, dtype: Optional[str] = None) -> Checkpoint:
  """A run's params at `step` (None = the latest), restored onto `mesh` without its optimizer state.

  config_json: the run config to read the architecture from (default: the workdir's config.json)."""
  config_json = config_json if config_json is not None else workdir.read_config_json(path)
  run = settings_lib.load_json(config_json, source=Path(path) / workdir.CONFIG_FILE)
  mesh, axis_rules = _default_mesh(mesh, axis_rules if axis_rules is not None else run.mesh.axis_rules)
  available = workdir.steps(path)
  if not available:
    raise CheckpointError(f"--checkpoint: {workdir.checkpoint_dir(path)} holds no finished checkpoint "
                          f"(train first: python train.py --workdir={path})")
  if step is not None and step >= 0 and step not in available:
    raise CheckpointError(f"sample.checkpoint_step: step {step} not in {workdir.checkpoint_dir(path)} "
                          f"(have {available})")
  step = available[-1] if step is None or step < 0 else step
  model = _with_dtype(run.model, dtype)
  try:
    # a QLoRA run's checkpoint holds its frozen base quantized (finetune.base_quant): restored as it is
    quantize = finetune_lib.base_quantizer(run.base_quant, run.finetune)
    restored = workdir.restore_params(path, step, abstract_params(model, mesh, axis_rules, quantize))
  except Exception as e:  # pylint: disable=broad-except  (Orbax / tensorstore / JSON errors of a damaged step)
    earlier = [s for s in available if s < step]
    hint = (f"sample the previous step with sample.checkpoint_step={earlier[-1]}" if earlier else
            "no earlier step is left to sample")
    raise workdir.restore_error(path, step, e, hint) from e
  _check_finite(restored, f"{path} step {step}")
  tok = Path(path) / workdir.TOKENIZER_FILE
  return Checkpoint(str(path), "workdir", model, restored, step=step, config_json=config_json,
                    tokenizer_file=tok if tok.is_file() else None)


def load_params_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None,
                    place: bool = True, base_quant=None, quantize_only=None) -> Checkpoint:
  """A params checkpoint (or a merged one); place=False keeps the host numpy arrays. With `base_quant` the
  weights it quantizes (of those `quantize_only` picks) are quantized leaf by leaf as they are read, in `dtype`."""
  if base_quant is not None and base_quant.scheme != "none":
    def quantize(key, a):  # the weights base_quant picks go to the device quantized; the rest stay on the host
      if quant.leaf_plan(key, a.shape, base_quant, quantize_only) is None:
        return a
      return quant.quantize_leaf(key, jnp.asarray(a.astype(np.dtype(dtype)) if dtype else a), base_quant,
                                 quantize_only)
    tree, cfg_dict = params.load_params_each(path, quantize)
  else:
    tree, cfg_dict = params.load_params(path)
  model = _with_dtype(ModelConfig.from_config_dict(cfg_dict), dtype)
  if place:
    mesh, axis_rules = _default_mesh(mesh, axis_rules)
    tree = _place(tree, model, mesh, axis_rules)
  _check_finite(tree, str(path))
  return Checkpoint(str(path), "params", model, tree, tokenizer_file=params.tokenizer_file(path),
                    hf_config=params.read_extra_json(path, hf.HF_CONFIG))


def load_hf_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None,
                place: bool = True, base_quant=None, quantize_only=None) -> Checkpoint:
  """A Hugging Face directory, read directly (tensor by tensor, cast to `dtype`, default float32); with
  `base_quant` the weights it quantizes (of those `quantize_only` picks) are quantized as they are read."""
  model, tree = hf.load_hf_checkpoint(path, dtype=dtype or "float32", base_quant=base_quant,
                                      quantize_only=quantize_only)
  model = _with_dtype(model, dtype)
  if place:
    mesh, axis_rules = _default_mesh(mesh, axis_rules)
    tree = _place(tree, model, mesh, axis_rules)
  return Checkpoint(str(path), "hf", model, tree, tokenizer_file=params.tokenizer_file(path),
                    hf_config=hf.read_config(path))


def load_adapter_dir(path: str | os.PathLike, *, mesh=None, axis_rules=None, dtype: Optional[str] = None) -> Checkpoint:
  """An adapter on top of its base (adapter_config.json's `base`: any checkpoint kind, laid out as the adapter's
  model, `load_as`)."""
  described = header(path)
  leaves, _, meta = adapter.load_adapter(path)
  model = _with_dtype(described.model, dtype)
  mesh, axis_rules = _default_mesh(mesh, axis_rules)
  # a QLoRA adapter (finetune.base_quant) sits on its base quantized as the run held it
  run_json = adapter.read_run_config(path)
  run = settings_lib.load_json(run_json, source=Path(path) / adapter.RUN_CONFIG) if run_json is not None else None
  qlora = run is not None and run.finetune.base_quant != "none"
  base = load_as(adapter.base_path(path, meta), model, mesh=mesh, axis_rules=axis_rules,
                 field=f"{path}/{adapter.ADAPTER_CONFIG} 'base'", override=leaves,
                 base_quant=run.base_quant if qlora else None,
                 quantize_only=finetune_lib.frozen_base(run.finetune) if qlora else None)
  return dataclasses.replace(described, model=model, params=base.params)


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


def check_loadable_as(described: Checkpoint, model: ModelConfig, field: str) -> str:
  """Whether the checkpoint `described` (its header is enough) can be read as `model`'s tree (`load_as`): its
  architecture equals `model`'s up to the layer layout, and its adapters can be kept or folded in. Returns
  `adapter_transfer`'s answer; errors name `field`."""
  diffs = layout.differences_but_layout(described.model, model)
  if diffs:
    raise ConfigError(f"{field}: the architecture differs from the checkpoint {described.path} (checkpoint -> "
                      f"this run): {'; '.join(diffs)}")
  return adapter_transfer(described.model.lora, model.lora, described.path, field)


def _merge_adapters(flat: dict, scale: float) -> dict:
  """A flat params dict with its LoRA factors folded into their weights (lora.merge, on the host) and dropped."""
  host = {k: np.asarray(v) for k, v in flat.items()}
  base = {k: v for k, v in host.items() if not lora_lib.is_adapter(k[-1])}
  factors = {k: v for k, v in host.items() if lora_lib.is_adapter(k[-1])}
  unflatten = flax.traverse_util.unflatten_dict
  return _flat(lora_lib.merge(unflatten(base), unflatten(factors), scale))


def load_as(path: str | os.PathLike, model: ModelConfig, *, step: Optional[int] = None, mesh=None,
            axis_rules=None, field: str = "path", override: Any = None, fresh=None, base_quant=None,
            quantize_only=None) -> Checkpoint:
  """The params of any checkpoint kind (a run's `step`, default the latest) as the parameter tree of `model`, on
  `mesh` in model.param_dtype: what `train.init_from`, an adapter's base and dgemma.load read with.

  The checkpoint's architecture must equal `model`'s up to the layer layout (model.scan_layers: relaid,
  layout.py) and the LoRA layout: its adapters are kept or folded in (`adapter_transfer`). `override`: a nested
  dict of leaves that replace or complete the checkpoint's (an adapter's trained leaves). `fresh(keys)`: values
  for the adapters `model` has and the checkpoint lacks ({key tuple: array}; a fine-tuning run's new adapters,
  B = 0); without it a missing tensor is an error naming it. `base_quant` (a `quant.QuantConfig`): the weights
  `quantize_only(key path)` picks are held quantized (a QLoRA run's frozen base): an HF directory or a params
  checkpoint is quantized as it is read (`load`), a float run or a merged / relaid tree one weight at a time here
  (a run's float tree itself is restored whole first)."""
  mesh, axis_rules = _default_mesh(mesh, axis_rules)
  source = load(path, step=step, mesh=mesh, axis_rules=axis_rules, dtype=model.param_dtype, field=field,
                base_quant=base_quant, quantize_only=quantize_only)
  transfer = check_loadable_as(source, model, field)
  # A QLoRA run's quantized base (finetune.base_quant) is kept as stored where it is read into the same layout and
  # quantization; otherwise it is read as the float model the run trained against (its dequantized weights):
  # merged into, relaid and re-quantized like any float checkpoint.
  keep_quantized = transfer != "merge" and source.model.block_period == model.block_period
  flat = {k: v if keep_quantized else quant.dequantize(v) for k, v in _flat(source.params).items()}
  if transfer == "merge":
    flat = _merge_adapters(flat, source.model.lora.scale)
  if source.model.block_period != model.block_period:
    flat = _flat(layout.relayout(flax.traverse_util.unflatten_dict(flat), source.model, model))
  if override is not None:
    flat.update(_flat(override))
  quantizing = base_quant is not None and base_quant.scheme != "none"
  quantize = (lambda boxed: quant.quantize_boxed(boxed, base_quant, quantize_only)) if quantizing else None
  wanted = _flat(abstract_params(model, mesh, axis_rules, quantize))
  missing = [n for n in wanted if n not in flat]
  new_adapters = [k for k in missing if lora_lib.is_adapter(k[-1])]
  if fresh is not None and new_adapters:
    flat.update(fresh(new_adapters))
    missing = [n for n in missing if n not in new_adapters]
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise CheckpointError(f"{field}: {path} has no tensor {', '.join(map(_name, missing[:3]))}{more}")
  for key, target in wanted.items():
    if tuple(flat[key].shape) != tuple(target.shape):
      raise CheckpointError(f"{field}: {path}'s {_name(key)} has shape {tuple(flat[key].shape)}, expected "
                            f"{tuple(target.shape)}")
  placed = {}
  for key, target in wanted.items():
    value = flat.pop(key)  # one weight at a time: a float weight quantized here is placed before the next
    if not quant.is_quantized(target):
      placed[key] = _put(quant.dequantize(value), target)
      continue
    if not (quant.is_quantized(value) and quant.same_layout(value, target)):
      dense = _put(quant.dequantize(value), jax.ShapeDtypeStruct(target.shape, target.dtype,
                                                                  sharding=target.qvalue.sharding))
      value = quant.quantize_leaf(key, dense, base_quant, quantize_only)
    placed[key] = jax.tree.map(_put, value, target)
  return dataclasses.replace(source, model=model, params=flax.traverse_util.unflatten_dict(placed))


def load(path: str | os.PathLike, *, step: Optional[int] = None, mesh=None, axis_rules=None,
         dtype: Optional[str] = None, field: str = "path", base_quant=None, quantize_only=None) -> Checkpoint:
  """Loads the params of any checkpoint kind (module docstring); `step` is for runs only. Errors name `field`.
  `base_quant`: a params checkpoint or HF directory quantizes the weights it picks (of those `quantize_only`
  picks) as they are read, never holding the float tree (a QLoRA run's base)."""
  k = kind(path, field)
  if step is not None and step >= 0 and k != "workdir":
    raise CheckpointError(f"step: {path} is a {k} checkpoint, which has no training steps")
  if k == "workdir":
    return load_workdir(path, step=step, mesh=mesh, axis_rules=axis_rules, dtype=dtype)
  if k == "params":
    return load_params_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype, base_quant=base_quant,
                           quantize_only=quantize_only)
  if k == "adapter":
    return load_adapter_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype)
  return load_hf_dir(path, mesh=mesh, axis_rules=axis_rules, dtype=dtype, base_quant=base_quant,
                     quantize_only=quantize_only)


__all__ = ["KINDS", "Checkpoint", "kind", "header", "load", "load_as", "adapter_transfer", "check_loadable_as",
           "load_workdir",
           "load_params_dir", "load_hf_dir", "load_adapter_dir",
           "adapter", "hf", "params", "workdir"]
