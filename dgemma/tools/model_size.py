"""Parameter count of a model config: total, active per token, per component, and weight bytes.

  python -m dgemma.tools.model_size --config=configs/models/diffusiongemma_26b_a4b.py
  python -m dgemma.tools.model_size --config=configs/demo.py --config.model.d_model=256

`--config` is either a model preset (configs/models/*.py: get_config() is the model group) or an
experiment config (configs/*.py with a `.model` group); overrides then go to `--config.<field>` or
`--config.model.<field>` respectively. Shapes come from `jax.eval_shape` (nothing is allocated).

Active per token: routed expert weights count top_k / num_experts; everything else counts fully
(the tied embedding table is used once as the output projection, so it is all active).

Weight bytes (weights only, no activations / KV cache / optimizer state; `python -m dgemma.tools.memory`
adds those):
  bf16: 2 bytes per parameter.
  int8 / int4: the trees `dgemma.quant.quantize_params` makes from the bf16 weights (shapes only):
    every matrix (embedding, attention, MLP, expert, self-conditioning kernels) at 1 or 0.5 byte per
    weight plus bf16 scales (int8: one per output channel, the embedding one per vocabulary row; int4:
    one per group of `group_size` inputs); router kernels, norm scales, router scales and layer scalars
    stay bf16. The scales are included in the figure.

Also here: `forward_flops`, the useful matmul FLOPs of one encoder / decoder pass (the benchmarks' MFU).
This module imports neither ml_collections nor absl at import time (bench/gpu_full_model.py uses it
on a machine that may lack them).
"""

from __future__ import annotations

import math
from typing import Any

import flax
import jax

from dgemma import quant
from dgemma.model import ModelConfig, count_params, layers, param_shapes
from dgemma.model.config import SLIDING

COMPONENTS = ("embedding", "attention", "dense_mlp", "experts", "router", "norms", "self_conditioning",
              "right_readout", "decoder_head", "two_stream")

_CONFIG = None  # the --config flag, defined only when run as a program (the module stays importable)


def model_group(config):
  """The model group of an experiment config (an ml_collections.ConfigDict), or the config itself if
  it is a model preset."""
  import ml_collections
  if "model" in config and isinstance(config.model, (ml_collections.ConfigDict, dict)):
    return config.model
  return config


def _is_norm(path: tuple[str, ...]) -> bool:
  """A norm scale or layer scalar: a per-channel multiply, not a matmul weight."""
  return "norm" in "/".join(path) or path[-1] == "layer_scalar"


def component(path: tuple[str, ...]) -> str:
  """The component a parameter belongs to (one of COMPONENTS), from its tree path."""
  name = "/".join(path)
  if path[0] == "embedder":
    return "embedding"
  if path[0] in ("self_conditioning", "right_readout"):
    return path[0]
  if path[0].startswith("decoder_head_"):  # ModelConfig.decoder_head_layers: decoder-only layers, all kinds
    return "decoder_head"
  if path[0].startswith("two_stream_"):  # ModelConfig.decoder_two_stream: the combining MLP
    return "two_stream"
  if "/experts/" in name:
    return "experts"
  if "/router/" in name:
    return "router"
  if _is_norm(path):
    return "norms"
  if "/attn/" in name:
    return "attention"
  if "/mlp/" in name:
    return "dense_mlp"
  raise ValueError(f"unclassified parameter {name}")


def quantized_shapes(cfg: ModelConfig, qcfg: "quant.QuantConfig", dtype: str = "bfloat16") -> Any:
  """The tree `quant.quantize_params` makes from `dtype` weights of this architecture (shapes only)."""
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, layers.dtype_of(dtype)), param_shapes(cfg))
  return jax.eval_shape(lambda p: quant.quantize_params(p, qcfg), shapes)


def summarize(cfg: ModelConfig, group_size: int = quant.QuantConfig.group_size) -> dict[str, Any]:
  """{'total', 'active', 'components': {name: (total, active)}, 'bytes': {'bf16', 'int8', 'int4'},
  'quantized_params', 'int4_scales', 'group_size'} (int4 with groups of `group_size`; see the module docstring)."""
  comps = components(cfg)
  total = sum(t for t, _ in comps.values())
  active = sum(a for _, a in comps.values())
  nbytes = {"bf16": 2 * total}
  for scheme in ("int8", "int4"):
    qtree = quantized_shapes(cfg, quant.QuantConfig(scheme, group_size))
    nbytes[scheme] = quant.tree_bytes(qtree)
  qleaves = [x for x in jax.tree.leaves(qtree, is_leaf=quant.is_quantized) if quant.is_quantized(x)]
  return {"total": total, "active": active, "components": comps, "bytes": nbytes,
          "quantized_params": sum(math.prod(x.shape) for x in qleaves),
          "int4_scales": sum(math.prod(x.scale.shape) for x in qleaves), "group_size": group_size}


def components(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """{component: (total, active)} parameter counts (COMPONENTS; shapes only)."""
  counts = count_params(cfg)
  flat = flax.traverse_util.flatten_dict(param_shapes(cfg))
  frac = cfg.experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
  comps = {c: [0, 0] for c in COMPONENTS}
  for path, leaf in flat.items():
    n = math.prod(leaf.shape)
    c = component(path)
    comps[c][0] += n
    routed = c == "experts" or (c == "decoder_head" and "experts" in path)
    comps[c][1] += n * frac if routed else n
  comps = {c: (t, round(a)) for c, (t, a) in comps.items()}
  total = sum(t for t, _ in comps.values())
  active = sum(a for _, a in comps.values())
  assert total == counts["total"] and active == counts["active"], (counts, total, active)
  return comps


def trunk_active(comps: dict[str, tuple[int, int]]) -> int:
  """Active parameters of the repeating stack's matmuls (attention, dense MLP, experts, router) in `components`
  output: what one more pass of the stack over a token costs, 2 FLOPs per parameter forward."""
  return sum(comps[c][1] for c in ("attention", "dense_mlp", "experts", "router"))


def forward_flops(cfg: ModelConfig, tokens: int, keys: int, decoder: bool, sc_signal: bool) -> float:
  """Useful matmul FLOPs of one pass over `tokens` queries attending `keys` keys: active experts only,
  attention over every key (the masks are dense), and in the decoder the output logits, the
  self-conditioning MLP and, with a signal, the soft embedding softmax(sc) @ table (an encode is
  counted without its logits, as the sampler runs it)."""
  comps = components(cfg)
  trunk = trunk_active(comps)
  per_token = 2 * trunk
  if decoder:
    per_token += 2 * cfg.vocab_size * cfg.d_model  # output logits
  if decoder and cfg.decoder_right_readout:  # its R [D, D] projections and R more vocabulary readouts
    per_token += 2 * comps["right_readout"][1] + 2 * cfg.decoder_right_readout * cfg.vocab_size * cfg.d_model
  head_attn = 0
  if decoder and cfg.decoder_head_layers:  # decoder-only layers: their weights, attention over the canvas only
    per_token += 2 * decoder_head_matmul_params(cfg)
    _, H = layers.attn_dims(cfg, SLIDING)
    head_attn = cfg.decoder_head_layers * 4 * cfg.num_heads * H * tokens
  if decoder and cfg.self_conditioning:
    per_token += 2 * comps["self_conditioning"][1]
    if sc_signal:
      per_token += 2 * cfg.vocab_size * cfg.d_model
  attn = 0
  for kind in cfg.layer_types:
    _, H = layers.attn_dims(cfg, kind)
    attn += 4 * cfg.num_heads * H * keys  # q.k and p.v per query
  if decoder and cfg.decoder_two_stream:  # a second pass through the stack (the backward stream) and the MLP
    per_token += 2 * trunk + 2 * comps["two_stream"][1]
    attn *= 2
  return tokens * (per_token + attn + head_attn)


def decoder_head_matmul_params(cfg: ModelConfig) -> int:
  """Active weights of `cfg.decoder_head_layers`' matmuls (attention, dense MLP, router, active experts; not
  their norms and scalars)."""
  frac = cfg.experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
  total = 0.0
  for path, leaf in flax.traverse_util.flatten_dict(param_shapes(cfg)).items():
    if component(path) == "decoder_head" and not _is_norm(path):
      total += math.prod(leaf.shape) * (frac if "experts" in path else 1.0)
  return round(total)


def train_step_flops(cfg: ModelConfig, diffusion, rows: int, seq_len: int) -> float:
  """Model FLOPs of one training step on `rows` packed rows of `seq_len` tokens under `diffusion`
  (dgemma.diffusion.config.DiffusionSettings): forward + backward = 6 per active parameter per token, over the
  encoder's tokens (`diffusion.encoder_len`: the row up to its last canvas, of the shortest kind trained) and the
  decoder's (K canvases of C, and the short canvases' pass when trained), plus a forward only (2 per active
  parameter) over the canvases for the self-conditioning first pass when it runs; an AR objective is one causal
  pass over the whole row. Attention's score FLOPs are not counted (the training-throughput convention of
  bench/train_throughput.py)."""
  active = count_params(cfg)["active"]
  if diffusion.objective_record.autoregressive:
    return 6 * active * rows * seq_len
  canvas_tokens = diffusion.canvases_per_row * diffusion.canvas_len
  short_tokens = diffusion.num_short_canvases * diffusion.short_canvas_len  # one more decoder pass, no sc
  encoder_tokens = diffusion.encoder_len(seq_len)
  sc = 2 if (cfg.self_conditioning and diffusion.self_cond_prob > 0) else 0
  flops = 6 * active * (encoder_tokens + canvas_tokens + short_tokens) + sc * active * canvas_tokens
  R = cfg.decoder_right_readout
  if R:  # decoder only: its R [D, D] projections are not in the encoder's count, and each decoder pass pays R
    # more vocabulary readouts (the tied table is in `active` once)
    flops += R * cfg.vocab_size * cfg.d_model * (6 * (canvas_tokens + short_tokens) + sc * canvas_tokens)
    flops -= 6 * R * cfg.d_model ** 2 * encoder_tokens
  if cfg.decoder_head_layers:  # decoder-only layers: in `active`, but the encoder never runs them
    flops -= 6 * components(cfg)["decoder_head"][1] * encoder_tokens
  if cfg.decoder_two_stream:  # the backward stream: the stack once more over the canvases; the MLP decoder only
    comps = components(cfg)
    flops += 6 * trunk_active(comps) * (canvas_tokens + short_tokens) - 6 * comps["two_stream"][1] * encoder_tokens
  return rows * flops


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
  lines.append(f"  int8/int4: {_fmt(s['quantized_params'])} matrix weights quantized (dgemma.quant); bf16 scales "
               f"included: int8 one per output channel, int4 one per {s['group_size']} inputs "
               f"({_fmt(s['int4_scales'])}); router, norms and scalars kept bf16")
  return "\n".join(lines)


def main(argv):
  cli.no_extra_args(argv)  # `cli` and `_CONFIG` are defined when run as a program (below)
  group = model_group(cli.config(_CONFIG))
  print(report(ModelConfig.from_config_dict(group), group.get("preset", "")))


if __name__ == "__main__":
  # absl and ml_collections only for the program (module docstring)
  from absl import flags
  from ml_collections import config_flags
  from dgemma.tools import cli
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "A model preset (configs/models/*.py) or an experiment config (with a .model group).")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "dgemma.tools.model_size")
