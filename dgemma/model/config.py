"""Static architecture description of a Gemma 4 / DiffusionGemma text trunk.

`ModelConfig` is a frozen dataclass built from the `model` group of a config file
(`ModelConfig.from_config_dict(config.model)`); every module reads its hyper-parameters from it.
Field names follow the DiffusionGemma reference doc (../shared/reference/diffusiongemma.md); the
Hugging Face names are given where they differ so the checkpoint converter can map them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from dgemma import settings_fields
from dgemma.errors import ConfigError
from dgemma.settings_fields import setting

SLIDING = "sliding"
GLOBAL = "global"
LAYER_KINDS = (SLIDING, GLOBAL)
MOE_IMPLS = ("ragged", "dense", "capacity", "expert_parallel", "tokamax", "auto")
ATTENTION_IMPLS = ("xla", "tokamax", "auto")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of the shared encoder/decoder trunk, and its compute choices: the `model` group of a config.
  Field names follow the reference doc; the Hugging Face names are given where they differ (the converter maps
  them, dgemma/checkpoints/hf_config.py). Each field's doc is in its declaration (`python -m dgemma.settings`
  lists them); the research options (decoder_shift, decoder_right_readout, decoder_two_stream,
  decoder_head_layers) are described in dgemma/model/decoder_variants.py. `lora` is not a key: dgemma.settings sets it
  from config.finetune (model_config.json describes the base weights)."""
  GROUP: ClassVar[str] = "model"
  preset: str = setting("diffusiongemma_26b_a4b", "informational: the preset (configs/models/) the values came "
                        "from", compare=False)
  vocab_size: int = setting(262_144, "tokens in the (tied) embedding table", lo=1)
  d_model: int = setting(2816, "residual width (HF hidden_size)", lo=1)
  num_layers: int = setting(30, "transformer layers (HF num_hidden_layers)", lo=1)
  layer_types: tuple = setting((), "'sliding' / 'global' per layer; () = 5 sliding then 1 global, repeated, the "
                               "last layer global (HF default)", items=str, choices=LAYER_KINDS)
  num_heads: int = setting(16, "query heads, shared by both layer kinds", lo=1)
  num_kv_heads: int = setting(8, "key/value heads of the sliding layers", lo=1)
  head_dim: int = setting(256, "head width of the sliding layers (even: RoPE)", lo=1)
  sliding_window: int = setting(1024, "the sliding layers' window", lo=1)
  rope_base: float = setting(10_000.0, "RoPE base of the sliding layers", lo=0.0, lo_open=True)
  global_num_kv_heads: int = setting(2, "key/value heads of the global layers", lo=1)
  global_head_dim: int = setting(512, "head width of the global layers", lo=1)
  global_rope_base: float = setting(1_000_000.0, "RoPE base of the global layers", lo=0.0, lo_open=True)
  global_rope_fraction: float = setting(0.25, "share of a global head rotated by RoPE", lo=0.0, hi=1.0, lo_open=True)
  global_k_eq_v: bool = setting(True, "global layers reuse the key projection as values (no v_proj)")
  mlp_hidden: int = setting(2112, "hidden width of the shared dense GeGLU branch (HF intermediate_size)", lo=1)
  num_experts: int = setting(128, "experts of the MoE branch (0 = no MoE branch)", lo=0)
  experts_per_token: int = setting(8, "experts each token is routed to (HF top_k_experts)", lo=0)
  expert_hidden: int = setting(704, "hidden width of each expert (HF moe_intermediate_size)", lo=0)
  final_logit_softcap: float = setting(30.0, "logits = c * tanh(logits / c); 0 disables", lo=0.0)
  rms_eps: float = setting(1e-6, "RMSNorm epsilon", lo=0.0, lo_open=True)
  self_conditioning: bool = setting(True, "the decoder has the self-conditioning module")
  decoder_shift: bool = setting(False, "research option, not in the released model: position p is scored where "
                                "the token to its left sits (dgemma/model/decoder_variants.py)")
  decoder_right_readout: int = setting(0, "research option: R right-neighbour readouts per position (0 = off; "
                                       "dgemma/model/decoder_variants.py)", lo=0)
  decoder_two_stream: bool = setting(False, "research option: logits blind to their own token, from a forward and "
                                     "a backward stream (dgemma/model/decoder_variants.py)")
  decoder_head_layers: int = setting(0, "research option: N decoder-only layers after the shared stack (0 = off)",
                                     lo=0)
  moe_impl: str = setting("auto", "the experts' implementation: 'auto' (per platform), 'ragged', 'dense', "
                          "'capacity', 'expert_parallel' or 'tokamax' (dgemma/model/moe.py)", choices=MOE_IMPLS)
  moe_dense_block: int = setting(0, "moe_impl='dense': the experts this many at a time (a lax.scan over blocks: "
                                 "one block's activations and dequantized weights at once, not every expert's; must "
                                 "divide num_experts); 0 = all at once", lo=0)
  moe_capacity_factor: float = setting(1.5, "moe_impl='capacity': the smallest slab holds this x the mean load",
                                       lo=0.0, lo_open=True)
  attention_impl: str = setting("auto", "the encoder's attention: 'xla' (scores materialised), 'tokamax' (flash "
                                "kernels on GPU / TPU) or 'auto'", choices=ATTENTION_IMPLS)
  scan_layers: bool = setting(True, "nn.scan over stacked blocks of the layer pattern (False: one unrolled block; "
                              "another parameter tree, dgemma/checkpoints/layout.py)")
  remat: str = setting("none", "rematerialisation of each layer", choices=("none", "full", "dots"))
  dtype: str = setting("float32", "compute dtype", choices=DTYPES)
  param_dtype: str = setting("float32", "parameter storage dtype", choices=DTYPES)
  router_aux_loss_weight: float = setting(0.0, "MoE load-balancing loss weight (0 = off, as released)", lo=0.0)
  router_z_loss_weight: float = setting(0.0, "MoE router z-loss weight (0 = off, as released)", lo=0.0)
  lora: Any = None  # derived: dgemma.settings sets it from config.finetune

  def __post_init__(self):
    if not self.layer_types:
      kinds = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(int(self.num_layers))]
      if kinds:
        kinds[-1] = GLOBAL
      object.__setattr__(self, "layer_types", tuple(kinds))
    self.validate()

  def validate(self) -> None:
    settings_fields.check(self)
    need = lambda cond, field, msg: settings_fields.need(cond, f"model.{field}", msg)
    need(len(self.layer_types) == self.num_layers, "layer_types",
         f"has {len(self.layer_types)} entries but num_layers={self.num_layers}")
    need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
         f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    need(self.num_heads % self.global_num_kv_heads == 0, "global_num_kv_heads",
         f"num_heads={self.num_heads} is not a multiple of global_num_kv_heads={self.global_num_kv_heads}")
    need(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
    if self.num_experts:
      need(0 < self.experts_per_token <= self.num_experts, "experts_per_token",
           f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      need(self.num_experts % max(self.moe_dense_block, 1) == 0, "moe_dense_block",
           f"must divide num_experts={self.num_experts}, got {self.moe_dense_block}")
      need(self.expert_hidden > 0, "expert_hidden", "must be positive")
    if self.decoder_two_stream:
      for name, ok in (("decoder_shift", self.decoder_shift), ("decoder_right_readout", not self.decoder_right_readout),
                       ("decoder_head_layers", not self.decoder_head_layers),
                       ("self_conditioning", not self.self_conditioning)):
        need(ok, name, f"{getattr(self, name)!r} does not fit decoder_two_stream=True (it needs decoder_shift=True, "
                       "decoder_right_readout=0, decoder_head_layers=0 and self_conditioning=False: every other "
                       "path to position p's logits would read the token at p)")

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
    """Builds from an ml_collections ConfigDict (or dict, e.g. a model_config.json); unknown keys are an error."""
    unknown = settings_fields.unknown_keys(cls, cfg, "model")
    if unknown:
      raise ConfigError(f"unknown config key(s): {', '.join(unknown)} (python -m dgemma.settings lists every key)")
    return settings_fields.from_raw(cls, cfg)

  def to_dict(self) -> dict[str, Any]:
    """The architecture and compute settings (model_config.json: without `preset` and the LoRA layout)."""
    out = settings_fields.to_raw(self)
    out.pop("preset")
    return out
