"""Parameter count of a model config: total, active per token, per component, and weight bytes.

  python -m dgemma.tools.params --config=configs/models/diffusiongemma_26b_a4b.py
  python -m dgemma.tools.params --config=configs/demo.py --config.model.d_model=256

`--config` is either a model preset (configs/models/*.py: get_config() is the model group) or an
experiment config (configs/*.py with a `.model` group); overrides then go to `--config.<field>` or
`--config.model.<field>` respectively. Shapes come from `jax.eval_shape` (nothing is allocated).

Active per token: routed expert weights count top_k / num_experts; everything else counts fully
(the tied embedding table is used once as the output projection, so it is all active).

Weight bytes (weights only, no activations / KV cache / optimizer state):
  bf16: 2 bytes per parameter.
  int8 / int4: every matrix (embedding, attention, MLP, expert, self-conditioning kernels) at 1 or
    0.5 byte per weight plus one bf16 scale per output channel (symmetric per-channel quantization;
    the embedding gets one scale per vocabulary row); router kernels, norm scales, router scales and
    layer scalars stay bf16. The scales are included in the figure (they are < 0.1% at int8).
"""

from __future__ import annotations

import math
from typing import Any

import flax
import ml_collections
from absl import app
from ml_collections import config_flags

from dgemma.model import ConfigError, ModelConfig, count_params, param_shapes

COMPONENTS = ("embedding", "attention", "dense_mlp", "experts", "router", "norms", "self_conditioning")

_CONFIG = None  # the --config flag, defined only when run as a program (the module stays importable)


def model_group(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The model group of an experiment config, or the config itself if it is a model preset."""
  if "model" in config and isinstance(config.model, (ml_collections.ConfigDict, dict)):
    return config.model
  return config


def component(path: tuple[str, ...]) -> str:
  """The component a parameter belongs to (one of COMPONENTS), from its tree path."""
  name = "/".join(path)
  if path[0] == "embedder":
    return "embedding"
  if path[0] == "self_conditioning":
    return "self_conditioning"
  if "/experts/" in name:
    return "experts"
  if "/router/" in name:
    return "router"
  if "norm" in name or path[-1] == "layer_scalar":
    return "norms"
  if "/attn/" in name:
    return "attention"
  if "/mlp/" in name:
    return "dense_mlp"
  raise ValueError(f"unclassified parameter {name}")


def _input_size(path: tuple[str, ...], shape: tuple[int, ...], layered: bool) -> int | None:
  """Contracted (input) size of a quantizable matrix, or None if the leaf stays bf16."""
  s = shape[1:] if layered else shape  # drop the stacked 'layers' axis
  leaf = path[-2] if path[-1] == "kernel" else path[-1]
  if path[0] == "embedder":
    return s[1]  # one scale per vocabulary row
  if "router" in path or len(s) < 2:
    return None
  if "experts" in path:
    return s[1]  # [E, D, F] / [E, F, D]: the middle axis is contracted
  if leaf == "o_proj":
    return s[0] * s[1]  # [N, H, D]
  return s[0]  # [D, ...] / [F, D]


def summarize(cfg: ModelConfig) -> dict[str, Any]:
  """{'total', 'active', 'components': {name: (total, active)}, 'bytes': {'bf16', 'int8', 'int4'}}."""
  counts = count_params(cfg)
  flat = flax.traverse_util.flatten_dict(param_shapes(cfg))
  frac = cfg.experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
  comps = {c: [0, 0] for c in COMPONENTS}
  quant_weights = quant_scales = kept = 0
  for path, leaf in flat.items():
    n = math.prod(leaf.shape)
    c = component(path)
    comps[c][0] += n
    comps[c][1] += n * frac if c == "experts" else n
    fan_in = _input_size(path, tuple(leaf.shape), path[0] == "blocks")
    if fan_in is None:
      kept += n
    else:
      quant_weights += n
      quant_scales += n // fan_in
  comps = {c: (t, round(a)) for c, (t, a) in comps.items()}
  total = sum(t for t, _ in comps.values())
  active = sum(a for _, a in comps.values())
  assert total == counts["total"] and active == counts["active"], (counts, total, active)
  nbytes = {"bf16": 2 * total,
            "int8": quant_weights + 2 * (quant_scales + kept),
            "int4": quant_weights // 2 + 2 * (quant_scales + kept)}
  return {"total": total, "active": active, "components": comps, "bytes": nbytes,
          "quantized_params": quant_weights, "scales": quant_scales}


def _fmt(n: float) -> str:
  for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= div:
      return f"{n / div:.2f}{unit}"
  return str(int(n))


def report(cfg: ModelConfig, name: str = "") -> str:
  """The printed table."""
  s = summarize(cfg)
  lines = [f"model: {name or '?'}  (d={cfg.d_model}, layers={cfg.num_layers}, vocab={cfg.vocab_size}, "
           f"experts={cfg.num_experts} top-{cfg.experts_per_token})",
           f"total parameters:  {s['total']:>16,d}  ({_fmt(s['total'])})",
           f"active per token:  {s['active']:>16,d}  ({_fmt(s['active'])})",
           "",
           f"{'component':<18} {'total':>16} {'active':>16} {'% total':>8}"]
  for c, (t, a) in s["components"].items():
    lines.append(f"{c:<18} {t:>16,d} {a:>16,d} {100 * t / s['total']:>7.2f}%")
  lines += ["", "weight bytes (weights only):"]
  for k, v in s["bytes"].items():
    human = f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.2f} MiB"
    lines.append(f"  {k:<5} {v:>16,d}  ({human})")
  lines.append(f"  int8/int4: {_fmt(s['quantized_params'])} matrix weights quantized with one bf16 scale per "
               f"output channel ({_fmt(s['scales'])} scales, included); router, norms and scalars kept bf16")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required")
  group = model_group(_CONFIG.value)
  try:
    cfg = ModelConfig.from_config_dict(group)
  except ConfigError as e:
    raise app.UsageError(str(e)) from None
  print(report(cfg, group.get("preset", "")))


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "A model preset (configs/models/*.py) or an experiment config (with a .model group).")
  app.run(main)
