"""Static architecture description of a Gemma 4 / DiffusionGemma text trunk.

`ModelConfig` is a frozen dataclass built from the `model` group of a config file
(`ModelConfig.from_config_dict(config.model)`); every module reads its hyper-parameters from it.
Field names follow the DiffusionGemma reference doc (../shared/reference/diffusiongemma.md); the
Hugging Face names are given where they differ so the checkpoint converter can map them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dgemma.errors import ConfigError

SLIDING = "sliding"
GLOBAL = "global"
LAYER_KINDS = (SLIDING, GLOBAL)
MOE_IMPLS = ("ragged", "dense", "capacity", "expert_parallel", "tokamax", "auto")
ATTENTION_IMPLS = ("xla", "tokamax", "auto")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of the shared encoder/decoder trunk.

  Attributes mirror HF `DiffusionGemmaTextConfig`:
    vocab_size: tokens in the (tied) embedding table.
    d_model: residual width (HF `hidden_size`).
    num_layers: transformer layers (HF `num_hidden_layers`).
    layer_types: one of 'sliding'/'global' per layer; empty -> 5 sliding then 1 global, repeated,
      with the last layer forced global (HF default).
    num_heads: query heads, shared by both layer kinds.
    num_kv_heads / head_dim / sliding_window / rope_base: sliding layers.
    global_num_kv_heads / global_head_dim / global_rope_base / global_rope_fraction: global layers;
      `global_k_eq_v` reuses the key projection as values (no v_proj on global layers).
    mlp_hidden: hidden width of the shared dense GeGLU branch (HF `intermediate_size`).
    num_experts / experts_per_token / expert_hidden: MoE branch (HF `num_experts`, `top_k_experts`,
      `moe_intermediate_size`); num_experts == 0 disables the branch.
    final_logit_softcap: logits = c * tanh(logits / c); 0 disables.
    rms_eps: RMSNorm epsilon.
    self_conditioning: whether the decoder has the self-conditioning module.
    decoder_shift: not in the released model (False keeps HF parity): canvas position p is scored by the
      decoder's output at p - 1, and a canvas's first position by the encoder's causal logits at the clean
      token before it, so each position is predicted where the token to its left sits, as the encoder's
      next-token head predicts (Dream and DiffuLLaMA shift the same way). Callers of `Transformer.decode` pass
      those encoder logits (`prev_logits_BKV`). Same parameters; a research option (docs/model.md).
    decoder_right_readout: R >= 0, not in the released model (0 = off): canvas position p's logits also get,
      for r = 1..R, a readout of the decoder's output at p + r, each through its own [D, D] projection
      (`right_readout[r - 1]`, zero at init, so training starts from the one-sided model) before the tied,
      softcapped vocabulary matmul; a term is dropped where p + r is past the canvas's end, padding or another
      document. The logits are then a product of experts, left readout x right readouts: for a Markov source
      the exact posterior of x_p factors this way (p(x_p | left) p(right | x_p) up to a constant). A research
      option (docs/model.md).
    decoder_head_layers: N >= 0, not in the released model (0 = off): N more layers of the sliding kind, with
      their own weights (`decoder_head_{i}`), after the shared stack in decoder mode only. They attend
      bidirectionally inside the canvas (same canvas, same document, not padding) and read no context cache;
      the encoder never runs them. Canvas-only depth whose attention is not shared with the causal encoder.
      A research option (docs/model.md).
    decoder_two_stream: not in the released model (False = off; needs decoder_shift, and no right readout,
      decoder-only layers or self-conditioning): the decoder makes two passes over the canvas with the shared
      weights, a forward stream (canvas attention to positions <= its own) and a backward stream (>= its own),
      both reading the whole clean context. Position p's logits come from the forward stream at p - 1 (the
      encoder's logits at the clean token before the canvas for p = 0, as decoder_shift) plus a position-wise
      MLP of width 4 D over [forward at p - 1, backward at p + 1] (`two_stream_in` / `two_stream_out`, the
      output zero at init), so they never read the noisy token at p: the output is a leave-one-out
      distribution p(x_p | z without p) by construction, and `diffusion.objective=blind_ce` trains it with a
      plain cross-entropy at every canvas position (docs/model.md). A research option.
    moe_impl: 'auto' (the default: per platform at trace time from measured figures,
      dgemma.model.moe.resolve_impl), 'ragged' (sorted tokens + jax.lax.ragged_dot), 'dense' (all experts,
      test reference), 'capacity' (per-expert slabs + batched matmuls, the slab size picked per call from
      a ladder so none overflows; the fast one on CPU, docs/benchmarks.md), 'expert_parallel' (experts
      sharded over the mesh axis 'expert', all-to-all token exchange) or 'tokamax' (the ragged path on tokamax.ragged_dot: Pallas
      kernels on GPU / TPU, quantized experts fed to its quantized kernels; XLA on CPU).
    attention_impl: the encoder's (causal) attention, i.e. the prompt encode, commits and training's context
      pass: 'xla' (dgemma.model.attention.attend: the scores materialised), 'tokamax'
      (`tokamax.dot_product_attention`: flash-attention kernels on GPU / TPU, its XLA implementation on CPU)
      or 'auto' (per platform, dgemma.model.attention.resolve_impl). The decoder's canvas pass always uses
      'xla' (256 queries).
    moe_capacity_factor: moe_impl='capacity': the smallest slab has this x the mean load T*k/E rows per
      expert; the larger ones double it up to T (dgemma.model.moe.capacity_rungs).
    scan_layers: apply repeated layer-pattern blocks with `nn.scan` over stacked weights (smaller programs,
      faster compiles); False makes the whole stack one unrolled block. On CPU a scan over several blocks
      costs per-iteration weight slices and activation write-backs: 0.72x the Sudoku step unrolled
      (docs/benchmarks.md, "Training"). The parameter tree differs: dgemma/checkpoints/layout.py converts
      (train.init_from does it; python -m dgemma.tools.relayout copies a workdir into the other layout).
    remat: rematerialisation policy name for each block ('none', 'full', 'dots').
    dtype / param_dtype: compute and storage dtypes ('float32', 'bfloat16'; 'float64' for numerical
      tests under `jax.enable_x64(True)`).
    router_aux_loss_weight / router_z_loss_weight: optional MoE losses (0 = off, as released).
    lora: LoRA adapters (a dgemma.model.lora.LoraConfig) or None. Not a key of the `model` group and
      not in `to_dict()` (model_config.json describes the base weights): `dgemma.settings.from_config` sets
      it from `config.finetune`.
  """

  vocab_size: int = 262_144
  d_model: int = 2816
  num_layers: int = 30
  layer_types: tuple[str, ...] = ()
  num_heads: int = 16
  num_kv_heads: int = 8
  head_dim: int = 256
  sliding_window: int = 1024
  rope_base: float = 10_000.0
  global_num_kv_heads: int = 2
  global_head_dim: int = 512
  global_rope_base: float = 1_000_000.0
  global_rope_fraction: float = 0.25
  global_k_eq_v: bool = True
  mlp_hidden: int = 2112
  num_experts: int = 128
  experts_per_token: int = 8
  expert_hidden: int = 704
  final_logit_softcap: float = 30.0
  rms_eps: float = 1e-6
  self_conditioning: bool = True
  decoder_shift: bool = False
  decoder_right_readout: int = 0
  decoder_two_stream: bool = False
  decoder_head_layers: int = 0
  moe_impl: str = "auto"
  moe_capacity_factor: float = 1.5
  attention_impl: str = "auto"
  scan_layers: bool = True
  remat: str = "none"
  dtype: str = "float32"
  param_dtype: str = "float32"
  router_aux_loss_weight: float = 0.0
  router_z_loss_weight: float = 0.0
  lora: Any = None

  def __post_init__(self):
    if not self.layer_types:
      kinds = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)]
      if kinds:
        kinds[-1] = GLOBAL
      object.__setattr__(self, "layer_types", tuple(kinds))
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    self.validate()

  def validate(self) -> None:
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ConfigError(f"model.{field}: {msg}")

    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "global_num_kv_heads", "global_head_dim", "mlp_hidden", "sliding_window"):
      need(int(getattr(self, name)) > 0, name, f"must be a positive integer, got {getattr(self, name)!r}")
    need(len(self.layer_types) == self.num_layers, "layer_types",
         f"has {len(self.layer_types)} entries but num_layers={self.num_layers}")
    for i, kind in enumerate(self.layer_types):
      need(kind in LAYER_KINDS, "layer_types", f"entry {i} is {kind!r}; expected one of {LAYER_KINDS}")
    need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
         f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    need(self.num_heads % self.global_num_kv_heads == 0, "global_num_kv_heads",
         f"num_heads={self.num_heads} is not a multiple of global_num_kv_heads={self.global_num_kv_heads}")
    need(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
    need(0.0 < self.global_rope_fraction <= 1.0, "global_rope_fraction", "must be in (0, 1]")
    need(self.num_experts >= 0, "num_experts", "must be >= 0")
    if self.num_experts:
      need(0 < self.experts_per_token <= self.num_experts, "experts_per_token",
           f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      need(self.expert_hidden > 0, "expert_hidden", "must be positive")
    need(isinstance(self.decoder_right_readout, int) and self.decoder_right_readout >= 0, "decoder_right_readout",
         f"must be an integer >= 0 (right neighbours read), got {self.decoder_right_readout!r}")
    need(isinstance(self.decoder_head_layers, int) and self.decoder_head_layers >= 0, "decoder_head_layers",
         f"must be an integer >= 0 (decoder-only layers), got {self.decoder_head_layers!r}")
    if self.decoder_two_stream:
      for name, ok in (("decoder_shift", self.decoder_shift), ("decoder_right_readout", not self.decoder_right_readout),
                       ("decoder_head_layers", not self.decoder_head_layers),
                       ("self_conditioning", not self.self_conditioning)):
        need(ok, name, f"{getattr(self, name)!r} does not fit decoder_two_stream=True (it needs decoder_shift=True, "
                       "decoder_right_readout=0, decoder_head_layers=0 and self_conditioning=False: every other "
                       "path to position p's logits would read the token at p)")
    need(self.moe_impl in MOE_IMPLS, "moe_impl", f"{self.moe_impl!r} not in {MOE_IMPLS}")
    need(self.attention_impl in ATTENTION_IMPLS, "attention_impl",
         f"{self.attention_impl!r} not in {ATTENTION_IMPLS}")
    need(self.moe_capacity_factor > 0, "moe_capacity_factor", f"must be > 0, got {self.moe_capacity_factor}")
    need(self.remat in ("none", "full", "dots"), "remat", f"{self.remat!r} not in ('none', 'full', 'dots')")
    for name in ("dtype", "param_dtype"):
      need(getattr(self, name) in ("float32", "bfloat16", "float16", "float64"), name,
           f"{getattr(self, name)!r} not in ('float32', 'bfloat16', 'float16', 'float64')")

  # ---- layer pattern -------------------------------------------------------------------------
  @property
  def block_period(self) -> int:
    """Length of the repeating layer pattern that `nn.scan` stacks (num_layers if not periodic)."""
    if not self.scan_layers:
      return self.num_layers
    n = self.num_layers
    for p in range(1, n + 1):
      if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
        return p
    return n

  @property
  def num_blocks(self) -> int:
    return self.num_layers // self.block_period

  @classmethod
  def from_config_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
    """Builds from an ml_collections ConfigDict (or dict); unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(cls)} - {"lora"}
    values = dict(cfg.items()) if hasattr(cfg, "items") else dict(cfg)
    values.pop("preset", None)  # informational: which preset the values came from
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"model: unknown key(s) {unknown}; known keys are {sorted(known)}")
    if "layer_types" in values and values["layer_types"] is not None:
      values["layer_types"] = tuple(values["layer_types"])
    return cls(**values)

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.pop("lora")
    out["layer_types"] = list(self.layer_types)
    return out
