"""Hugging Face checkpoint import/export for the dgemma parameter tree: the tensors (config.json's mapping to
ModelConfig is dgemma/checkpoints/hf_config.py).

Reads `DiffusionGemmaForBlockDiffusion` checkpoints and Gemma 4 autoregressive text checkpoints
(`Gemma4ForCausalLM`, `Gemma4ForConditionalGeneration`; the self-conditioning module is then freshly
initialised), and writes `DiffusionGemmaForBlockDiffusion` checkpoints. Tensors are streamed one at a
time from safetensors into preallocated stacked numpy arrays, so a checkpoint is never held twice.
torch is not needed: safetensors is read with its numpy backend (bfloat16 via ml_dtypes).

dgemma tree (leading `num_blocks` axis on everything under `blocks/`; HF layer = b * period + i):
  embedder/embedding [V, D], final_norm/scale [D], self_conditioning/{pre_norm/scale, gate_proj,
  up_proj, down_proj}, blocks/layer_{i}/{pre_attn_norm, attn/{q,k,v,o}_proj, attn/{q,k}_norm,
  post_attn_norm, mlp_pre_norm, mlp/{gate,up,down}_proj, mlp_post_norm, moe_pre_norm, moe/router/...,
  moe/experts/..., moe_post_norm, ffw_post_norm, layer_scalar}. With num_experts == 0 (dense Gemma 4)
  the moe_* leaves are absent; HF dense layers have no post_feedforward_layernorm_1, so mlp_post_norm
  is set to ones (rms_norm(rms_norm(x)) equals rms_norm(x) up to the eps term, ~1e-6 relative).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dgemma import files, quant
from dgemma.checkpoints import params as params_ckpt
from dgemma.checkpoints.checkpoint import Checkpoint
from dgemma.checkpoints.hf_config import (ARCHITECTURES, CONFIG_FILE, DIFFUSION, GEMMA4, GEMMA4_TEXT,  # noqa: F401
                                          TEXT_ONLY_VISION, HFCheckpointError, detect, is_text_only,
                                          model_config_from_hf, model_config_to_hf)
from dgemma.model.config import GLOBAL, ModelConfig

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

_MULTIMODAL_PARTS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
_SC_SEED = 0

_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float16": np.dtype(np.float16)}


def _np_dtype(name: str) -> np.dtype:
  if name not in _DTYPES:
    raise HFCheckpointError(f"dtype {name!r} not in {sorted(_DTYPES)}")
  return _DTYPES[name]


# ---------------------------------------------------------------------------------------------
# Name mapping
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor (possibly stored under several tied names) and the dgemma leaves it fills."""
  names: tuple[str, ...]          # every HF name carrying this value; first is the canonical one
  export_names: tuple[str, ...]   # names written on export
  shape: tuple[int, ...]          # HF shape
  targets: tuple[str, ...]        # '/'-joined dgemma paths
  index: int | None               # block index on the leading axis; None for non-layer leaves
  to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  to_hf: Callable[..., np.ndarray]


def _same(x):
  return (x,)


def _ident(x):
  return x


def _linear(shape_ours: tuple[int, ...]):
  """HF nn.Linear [out, in] <-> ours [in, *out-or-split]."""
  def to_ours(w):
    return (np.reshape(w.T, shape_ours),)
  def to_hf(k):
    return np.ascontiguousarray(np.reshape(k, (shape_ours[0], -1)).T)
  return to_ours, to_hf


def _o_proj(n: int, h: int, d: int):
  def to_ours(w):  # [D, N*H] -> [N, H, D]
    return (np.reshape(w.T, (n, h, d)),)
  def to_hf(k):
    return np.ascontiguousarray(np.reshape(k, (n * h, d)).T)
  return to_ours, to_hf


def _gate_up(fe: int):
  def to_ours(w):  # [E, 2Fe, D] -> gate, up [E, D, Fe]
    return (np.swapaxes(w[:, :fe], 1, 2), np.swapaxes(w[:, fe:], 1, 2))
  def to_hf(g, u):
    return np.ascontiguousarray(np.concatenate([np.swapaxes(g, 1, 2), np.swapaxes(u, 1, 2)], 1))
  return to_ours, to_hf


def _swap12(x):
  return (np.swapaxes(x, 1, 2),)


def _swap12_hf(x):
  return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _prefixes(mt: str) -> list[str]:
  """Prefixes of the text stack's tensors; the first is canonical (DiffusionGemma: decoder)."""
  if mt == DIFFUSION:
    return ["model.decoder.", "model.encoder.language_model."]
  if mt == GEMMA4:
    return ["model.language_model."]
  return ["model."]


def _entries(cfg: ModelConfig, mt: str) -> list[_Entry]:
  """The full HF <-> dgemma mapping for `cfg` read as model_type `mt`."""
  d, v, f = cfg.d_model, cfg.vocab_size, cfg.mlp_hidden
  prefixes = _prefixes(mt)
  out: list[_Entry] = []

  def add(rel, shape, targets, index, conv=None, export_all=False, layer=True, names=None):
    if names is None:
      names = tuple(p + rel for p in prefixes) if layer else (rel,)
    to_ours, to_hf = conv or (_same, _ident)
    out.append(_Entry(tuple(names), tuple(names) if export_all else (names[0],), tuple(shape),
                      tuple(targets), index, to_ours, to_hf))

  add("embed_tokens.weight", (v, d), ["embedder/embedding"], None,
      names=tuple(p + "embed_tokens.weight" for p in prefixes) + ("lm_head.weight",))
  add("norm.weight", (d,), ["final_norm/scale"], None)
  period = cfg.block_period
  for layer in range(cfg.num_layers):
    b, i = divmod(layer, period)
    pre = f"layers.{layer}."
    base = f"blocks/layer_{i}/"
    glob = cfg.layer_types[layer] == GLOBAL
    h = cfg.global_head_dim if glob else cfg.head_dim
    k = cfg.global_num_kv_heads if glob else cfg.num_kv_heads
    n = cfg.num_heads
    add(pre + "input_layernorm.weight", (d,), [base + "pre_attn_norm/scale"], b)
    add(pre + "self_attn.q_proj.weight", (n * h, d), [base + "attn/q_proj/kernel"], b,
        _linear((d, n, h)))
    add(pre + "self_attn.k_proj.weight", (k * h, d), [base + "attn/k_proj/kernel"], b,
        _linear((d, k, h)))
    if not (glob and cfg.global_k_eq_v):
      add(pre + "self_attn.v_proj.weight", (k * h, d), [base + "attn/v_proj/kernel"], b,
          _linear((d, k, h)))
    add(pre + "self_attn.o_proj.weight", (d, n * h), [base + "attn/o_proj/kernel"], b,
        _o_proj(n, h, d))
    add(pre + "self_attn.q_norm.weight", (h,), [base + "attn/q_norm/scale"], b)
    add(pre + "self_attn.k_norm.weight", (h,), [base + "attn/k_norm/scale"], b)
    add(pre + "post_attention_layernorm.weight", (d,), [base + "post_attn_norm/scale"], b)
    add(pre + "pre_feedforward_layernorm.weight", (d,), [base + "mlp_pre_norm/scale"], b)
    add(pre + "mlp.gate_proj.weight", (f, d), [base + "mlp/gate_proj/kernel"], b, _linear((d, f)))
    add(pre + "mlp.up_proj.weight", (f, d), [base + "mlp/up_proj/kernel"], b, _linear((d, f)))
    add(pre + "mlp.down_proj.weight", (d, f), [base + "mlp/down_proj/kernel"], b, _linear((f, d)))
    add(pre + "post_feedforward_layernorm.weight", (d,), [base + "ffw_post_norm/scale"], b)
    add(pre + "layer_scalar", (1,), [base + "layer_scalar"], b, export_all=True)
    if cfg.num_experts:
      e, fe = cfg.num_experts, cfg.expert_hidden
      add(pre + "post_feedforward_layernorm_1.weight", (d,), [base + "mlp_post_norm/scale"], b)
      add(pre + "pre_feedforward_layernorm_2.weight", (d,), [base + "moe_pre_norm/scale"], b)
      add(pre + "post_feedforward_layernorm_2.weight", (d,), [base + "moe_post_norm/scale"], b)
      add(pre + "router.proj.weight", (e, d), [base + "moe/router/proj/kernel"], b, _linear((d, e)))
      add(pre + "router.scale", (d,), [base + "moe/router/scale"], b)
      add(pre + "router.per_expert_scale", (e,), [base + "moe/router/per_expert_scale"], b)
      add(pre + "experts.gate_up_proj", (e, 2 * fe, d),
          [base + "moe/experts/gate_proj", base + "moe/experts/up_proj"], b, _gate_up(fe))
      add(pre + "experts.down_proj", (e, d, fe), [base + "moe/experts/down_proj"], b,
          (_swap12, _swap12_hf))
  if mt == DIFFUSION:
    sc = "model.decoder.self_conditioning."
    add(sc + "pre_norm.weight", (d,), ["self_conditioning/pre_norm/scale"], None, layer=False)
    add(sc + "gate_proj.weight", (f, d), ["self_conditioning/gate_proj/kernel"], None,
        _linear((d, f)), layer=False)
    add(sc + "up_proj.weight", (f, d), ["self_conditioning/up_proj/kernel"], None,
        _linear((d, f)), layer=False)
    add(sc + "down_proj.weight", (d, f), ["self_conditioning/down_proj/kernel"], None,
        _linear((f, d)), layer=False)
  return out


def _synthetic(cfg: ModelConfig, mt: str, dtype: np.dtype) -> dict[str, np.ndarray]:
  """Leaves the HF checkpoint does not hold: Gemma 4's self-conditioning, dense mlp_post_norm."""
  out: dict[str, np.ndarray] = {}
  d, f = cfg.d_model, cfg.mlp_hidden
  if mt != DIFFUSION:
    rng = np.random.default_rng(_SC_SEED)
    out["self_conditioning/pre_norm/scale"] = np.ones((d,), dtype)
    for name, shape in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
      out[f"self_conditioning/{name}/kernel"] = rng.normal(0.0, 0.02, shape).astype(dtype)
  if not cfg.num_experts:
    for i in range(cfg.block_period):
      out[f"blocks/layer_{i}/mlp_post_norm/scale"] = np.ones((cfg.num_blocks, d), dtype)
  return out


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Flat '/'-path -> shape of the dgemma tree for `cfg` (stacked layer leaves included)."""
  shapes: dict[str, tuple[int, ...]] = {}
  for e in _entries(cfg, DIFFUSION):
    ours = e.to_ours(np.zeros(e.shape, np.int8))
    for path, arr in zip(e.targets, ours):
      shapes[path] = ((cfg.num_blocks,) if e.index is not None else ()) + tuple(arr.shape)
  for path, arr in _synthetic(cfg, DIFFUSION, np.dtype(np.int8)).items():
    shapes[path] = arr.shape
  return shapes


def _is_multimodal(name: str) -> bool:
  return any(part in _MULTIMODAL_PARTS for part in name.split("."))


# ---------------------------------------------------------------------------------------------
# Tree helpers
# ---------------------------------------------------------------------------------------------

def _unflatten(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for path, val in flat.items():
    node = tree
    parts = path.split("/")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = val
  return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat: dict[str, Any] = {}
  for key, val in tree.items():
    path = f"{prefix}{key}"
    if isinstance(val, Mapping):
      flat.update(_flatten(val, path + "/"))
    else:
      flat[path] = val
  return flat


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------

def _safe_open(path: Path):
  """safetensors' safe_open, with errors (a truncated or damaged file) that name the file."""
  try:
    return safe_open(str(path), framework="np")
  except Exception as e:  # SafetensorError names no path
    raise HFCheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or damaged") from e


class _Reader:
  """Lazily opened safetensors files of one checkpoint (single file or sharded with index)."""

  def __init__(self, ckpt_dir: Path):
    self.dir = ckpt_dir
    index, single = ckpt_dir / INDEX_FILE, ckpt_dir / SINGLE_FILE
    self.where: dict[str, str] = {}
    if index.exists():
      weight_map = files.read_json(index)["weight_map"]
      self.where = dict(weight_map)
    elif single.exists():
      with _safe_open(single) as f:
        self.where = {k: SINGLE_FILE for k in f.keys()}
    else:
      raise HFCheckpointError(f"{ckpt_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._open: dict[str, Any] = {}

  def _file(self, name: str):
    fname = self.where[name]
    if fname not in self._open:
      path = self.dir / fname
      if not path.exists():
        raise HFCheckpointError(f"{self.dir / INDEX_FILE}: shard {fname!r} (holding {name!r}) "
                                "does not exist")
      self._open[fname] = _safe_open(path)
    return self._open[fname]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._file(name).get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    try:
      return self._file(name).get_tensor(name)
    except Exception as e:  # safetensors' SafetensorError names neither the file nor the tensor
      raise HFCheckpointError(f"{self.dir / self.where[name]}: cannot read tensor {name!r} ({e}); the file may be "
                              "truncated or damaged") from e

  def close(self):
    for f in self._open.values():
      f.__exit__(None, None, None)
    self._open.clear()


def read_config(ckpt_dir: str | os.PathLike) -> dict:
  path = Path(ckpt_dir) / CONFIG_FILE
  if not path.exists():
    raise HFCheckpointError(f"{path}: not found")
  return files.read_json(path)


def load_hf_checkpoint(ckpt_dir: str | os.PathLike, *, dtype: str = "float32",
                       model_type: str | None = None,
                       config_overrides: Mapping[str, Any] | None = None,
                       quantizer: quant.Quantizer | None = None,
                       config_json: dict | None = None) -> tuple[ModelConfig, dict]:
  """Reads an HF checkpoint directory into (ModelConfig, params).

  `params` is a nested dict of numpy arrays in `dtype` (the model's param_dtype is set to it).
  Tensors stream one at a time into preallocated stacked arrays. Vision/audio tensors are skipped
  (one notice); Gemma 4 AR checkpoints get a freshly initialised self-conditioning module (notice).
  Tied copies (encoder/decoder layers, lm_head) must be equal when several are stored.

  `quantizer` (e.g. a QLoRA run's frozen base): each weight it quantizes is quantized one layer's tensor at a
  time as it is read, on the default device, and only its quantized layers are kept (stacked at the end into a
  `QArray`): host memory peaks near the quantized tree plus one tensor, never the float checkpoint. Each layer
  quantizes as its slice of the stacked weight would (`quant.quantize_params` of the float tree gives the same
  bits). `config_json`: the directory's config.json when the caller has read it already.
  """
  ckpt_dir = Path(ckpt_dir)
  config_json = read_config(ckpt_dir) if config_json is None else config_json
  mt, _ = detect(config_json, model_type)
  overrides = dict(param_dtype=dtype)
  overrides.update(config_overrides or {})
  cfg = model_config_from_hf(config_json, model_type=mt, **overrides)
  target = _np_dtype(dtype)
  entries = _entries(cfg, mt)

  flat: dict[str, Any] = {}
  layers_of: dict[str, list] = {}  # quantized weights: one QArray per stacked layer, or [the weight]
  stacked: set[str] = set()
  for e in entries:
    ours = e.to_ours(np.zeros(e.shape, np.int8))
    for path, arr in zip(e.targets, ours):
      if path in flat or path in layers_of:
        continue
      if quantizer is not None and quantizer.plan(tuple(path.split("/")), arr.shape) is not None:
        layers_of[path] = [None] * (cfg.num_blocks if e.index is not None else 1)
        if e.index is not None:
          stacked.add(path)
      else:
        lead = (cfg.num_blocks,) if e.index is not None else ()
        flat[path] = np.empty(lead + tuple(arr.shape), target)

  def put(path: str, index: int | None, val: np.ndarray) -> None:
    if path in layers_of:
      one = jnp.asarray(np.asarray(val, target))
      layers_of[path][0 if index is None else index] = quantizer(tuple(path.split("/")), one)
    elif index is None:
      flat[path][...] = val
    else:
      flat[path][index] = val

  reader = _Reader(ckpt_dir)
  try:
    known: set[str] = set()
    for e in entries:
      known.update(e.names)
      present = [n for n in e.names if n in reader.where]
      if not present:
        raise HFCheckpointError(f"{ckpt_dir}: missing tensor {e.names[0]!r} (expected shape "
                                f"{list(e.shape)})")
      first = None
      for name in present:
        found = reader.shape(name)
        if found != e.shape:
          raise HFCheckpointError(f"{ckpt_dir}: tensor {name!r} has shape {list(found)}, "
                                  f"expected {list(e.shape)}")
        raw = reader.get(name)
        if first is None:
          first = (name, raw)
          for path, val in zip(e.targets, e.to_ours(raw)):
            put(path, e.index, val)
        elif not np.array_equal(first[1], raw):
          what = "layer_scalar buffers" if name.endswith("layer_scalar") else "tied tensors"
          raise HFCheckpointError(
              f"{ckpt_dir}: {what} {first[0]!r} and {name!r} differ; dgemma shares one copy "
              "between encoder and decoder (and the lm_head with the embedding)")
        del raw
    skipped = [n for n in reader.where if n not in known and _is_multimodal(n)]
    extra = sorted(n for n in reader.where if n not in known and not _is_multimodal(n))
    if extra:
      more = f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""
      raise HFCheckpointError(f"{ckpt_dir}: unexpected tensor(s) {extra[:10]}{more} for "
                              f"model_type {mt!r}")
  finally:
    reader.close()
  if skipped and not is_text_only(config_json):
    log.warning("%s: skipped %d vision/audio tensor(s) (dgemma is text-only)", ckpt_dir,
                len(skipped))
  for path in list(layers_of):  # each weight's layers stacked, and its pieces let go before the next
    pieces = layers_of.pop(path)
    flat[path] = quant.stack(pieces) if path in stacked else pieces[0]
    del pieces
  flat.update(_synthetic(cfg, mt, target))
  if mt != DIFFUSION:
    log.warning("%s: Gemma 4 autoregressive checkpoint has no self-conditioning module; "
                "initialised it fresh (seed %d, normal std 0.02 kernels, unit pre_norm scale)",
                ckpt_dir, _SC_SEED)
  if not cfg.num_experts:
    log.warning("%s: dense Gemma 4 (no MoE): num_experts=0, mlp_post_norm scales set to ones",
                ckpt_dir)
  return cfg, _unflatten(flat)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def _check_tree(cfg: ModelConfig, flat: Mapping[str, Any]) -> None:
  want = param_shapes(cfg)
  missing = sorted(set(want) - set(flat))
  extra = sorted(set(flat) - set(want))
  if missing or extra:
    raise HFCheckpointError(f"params do not match the config: missing {missing[:10]}, "
                            f"unexpected {extra[:10]}")
  for path, shape in want.items():
    got = tuple(np.shape(flat[path]))
    if got != shape:
      raise HFCheckpointError(f"params: {path} has shape {list(got)}, expected {list(shape)}")


def _multimodal_sources(src_dir: Path) -> Iterator[tuple[str, str]]:
  """(source name, DiffusionGemma name) of the vision tensors in an HF checkpoint."""
  reader = _Reader(src_dir)
  try:
    names = list(reader.where)
  finally:
    reader.close()
  for name in names:
    m = re.match(r"^(?:model\.encoder\.|model\.)?(vision_tower\..*|embed_vision\..*)$", name)
    if m:
      yield name, "model.encoder." + m.group(1)


def _vision_stub(d_model: int) -> dict[str, np.ndarray]:
  """Zero weights of the `TEXT_ONLY_VISION` tower and its projection into the text model (transformers' names)."""
  h, inner = TEXT_ONLY_VISION["hidden_size"], TEXT_ONLY_VISION["intermediate_size"]
  head, patch = TEXT_ONLY_VISION["head_dim"], TEXT_ONLY_VISION["patch_size"]
  tower, layer = "model.encoder.vision_tower.", "model.encoder.vision_tower.encoder.layers.0."
  shapes = {tower + "patch_embedder.position_embedding_table": (2, TEXT_ONLY_VISION["position_embedding_size"], h),
            tower + "patch_embedder.input_proj.weight": (h, 3 * patch * patch),
            "model.encoder.embed_vision.embedding_projection.weight": (d_model, h)}
  for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    shapes[f"{layer}self_attn.{proj}.linear.weight"] = (h, h)
  shapes[f"{layer}self_attn.q_norm.weight"] = shapes[f"{layer}self_attn.k_norm.weight"] = (head,)
  for proj, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
    shapes[f"{layer}mlp.{proj}.linear.weight"] = shape
  for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
    shapes[f"{layer}{norm}.weight"] = (h,)
  return {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}


GENERATION_CONFIG = "generation_config.json"
RUN_CONFIG_KEY = "dgemma"  # config.json key of an export: the settings of the run it came from (dgemma.load reads it)


def export_hf_checkpoint(cfg: ModelConfig, params: Mapping[str, Any], out_dir: str | os.PathLike,
                         *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         base_config: Mapping[str, Any] | None = None,
                         multimodal_from: str | os.PathLike | None = None,
                         dtype: str | None = None, overwrite: bool = False,
                         extra_config: Mapping[str, Any] | None = None,
                         generation_config: Mapping[str, Any] | None = None,
                         extra_files: Mapping[str, str | os.PathLike] | None = None) -> None:
  """Writes `params` as a `DiffusionGemmaForBlockDiffusion` checkpoint (config.json + safetensors).

  Shards with an index when the tensors exceed `max_shard_bytes`. `base_config`: see
  `model_config_to_hf`. `multimodal_from`: an HF checkpoint dir whose vision tensors are copied
  (e.g. the one the params came from), so the export is a complete multimodal checkpoint; without it the
  export is text-only (`TEXT_ONLY_VISION`). `dtype` casts on the way out (default: keep each leaf's dtype).
  `extra_config`: keys added to config.json (canvas_length, a run's settings); `generation_config`: written as
  generation_config.json; `extra_files` {name: source}: copied in (the tokenizer). Every file gets the
  permissions of the umask.
  """
  out_dir = Path(out_dir)
  for option in ("decoder_shift", "decoder_right_readout", "decoder_head_layers", "decoder_two_stream"):
    if getattr(cfg, option):
      raise HFCheckpointError(f"{out_dir}: model.{option} is a dgemma research option that Hugging Face's "
                              "DiffusionGemma does not have; its export would decode differently")
  if out_dir.exists() and any(out_dir.iterdir()):
    if not overwrite:
      raise HFCheckpointError(f"{out_dir}: exists and is not empty (use --overwrite to replace it)")
    for p in out_dir.iterdir():
      if (p.name in (CONFIG_FILE, INDEX_FILE, GENERATION_CONFIG, *(extra_files or {}))
          or p.name.endswith(".safetensors")):
        p.unlink()
  flat = _flatten(params)
  _check_tree(cfg, flat)
  config_json = model_config_to_hf(cfg, base_config)
  config_json.update(extra_config or {})
  out_dtype = _np_dtype(dtype) if dtype else None

  def part(path: str, index: int | None) -> np.ndarray:
    # Slice before converting, so a jax leaf is never copied whole.
    x = flat[path] if index is None else flat[path][index]
    return np.asarray(x)

  # (name, nbytes, producer) for every tensor to write.
  items: list[tuple[str, int, Callable[[], np.ndarray]]] = []
  for e in _entries(cfg, DIFFUSION):
    def produce(e=e):
      arr = np.asarray(e.to_hf(*[part(p, e.index) for p in e.targets]))
      return arr.astype(out_dtype) if out_dtype is not None else arr
    itemsize = (out_dtype or np.dtype(flat[e.targets[0]].dtype)).itemsize
    for name in e.export_names:
      items.append((name, int(np.prod(e.shape)) * itemsize, produce))
  if multimodal_from is not None:
    src = _Reader(Path(multimodal_from))
    for src_name, name in _multimodal_sources(Path(multimodal_from)):
      nbytes = int(np.prod(src.shape(src_name))) * _safetensors_itemsize(src, src_name)
      items.append((name, nbytes, lambda s=src_name: src.get(s)))
  else:
    src = None
    config_json["vision_config"] = dict(TEXT_ONLY_VISION)
    stub = _vision_stub(cfg.d_model)
    items.extend((name, arr.nbytes, lambda a=arr: a.astype(out_dtype) if out_dtype is not None else a)
                 for name, arr in stub.items())

  shards: list[list[int]] = [[]]
  size = 0
  for i, (_, nbytes, _) in enumerate(items):
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(i)
    size += nbytes
  out_dir.mkdir(parents=True, exist_ok=True)
  weight_map: dict[str, str] = {}
  total = 0
  try:
    for s, idx in enumerate(shards):
      fname = SINGLE_FILE if len(shards) == 1 else f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
      tensors = {}
      for i in idx:
        name, nbytes, produce = items[i]
        tensors[name] = np.ascontiguousarray(produce())
        weight_map[name] = fname
        total += tensors[name].nbytes
      _save_atomic(tensors, out_dir / fname)
      del tensors
  finally:
    if src is not None:
      src.close()
  if len(shards) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / INDEX_FILE, index)
  dtypes = {str(np.dtype(x.dtype)) for x in flat.values()} if out_dtype is None else {str(out_dtype)}
  config_json["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
  for name, source in (extra_files or {}).items():
    files.copy_file_atomic(source, out_dir / name)
  if generation_config is not None:
    _write_json(out_dir / GENERATION_CONFIG, dict(generation_config))
  _write_json(out_dir / CONFIG_FILE, config_json)


def _safetensors_itemsize(reader: _Reader, name: str) -> int:
  return _ST_SIZES[reader._file(name).get_slice(name).get_dtype()]


_ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _save_atomic(tensors: Mapping[str, np.ndarray], path: Path) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
  os.chmod(tmp, files.umask_mode())  # safetensors creates its files 0600
  os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
  files.write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def is_hf_dir(path: str | os.PathLike) -> bool:
  p = Path(path)
  return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


def describe(path: str | os.PathLike, field: str = "path") -> Checkpoint:
  """The header of an HF directory: its config.json (and, for an export of a dgemma run, that run's settings)."""
  config_json = read_config(path)
  run = config_json.get(RUN_CONFIG_KEY)  # the settings of the run an export came from
  return Checkpoint(str(path), "hf", model_config_from_hf(config_json), field=field,
                    config_json=json.dumps(run) if isinstance(run, dict) else None,
                    tokenizer_file=params_ckpt.tokenizer_file(path), hf_config=config_json)


def read(header: Checkpoint, dtype: str | None = None, quantizer: quant.Quantizer | None = None) -> dict:
  """The params on the host, read tensor by tensor and cast to `dtype` (default float32); the weights `quantizer`
  quantizes as `QArray`s on the default device (`load_hf_checkpoint`)."""
  return load_hf_checkpoint(header.path, dtype=dtype or "float32", quantizer=quantizer, config_json=header.hf_config)[1]
