"""The config groups declared here, each key once (dgemma/settings_fields.py): data, opt, train, distill, finetune,
eval and mesh. The groups of a lower package are declared beside the code that owns them: model (ModelConfig,
dgemma/model/config.py), diffusion (DiffusionSettings, dgemma/diffusion/config.py), sample (SampleSettings,
dgemma/sampling/config.py) and rl (RLSettings, dgemma/rl/config.py). Each group checks its own keys and their
relations when built; relations between groups are dgemma.settings' cross checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from dgemma import finetune as finetune_lib, mesh as mesh_lib, quant, settings_fields, tokenizers
from dgemma.data import sources
from dgemma.diffusion import distill as distill_lib
from dgemma.model.sharding import MESH_AXES
from dgemma.settings_fields import group, setting


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
  GROUP: ClassVar[str] = "data.tokenizer"
  kind: str = setting("sentencepiece", "'sentencepiece' (trained here on the data) | 'byte' | 'file'",
                      choices=tokenizers.TOKENIZER_KINDS)
  vocab_size: int = setting(8192, "pieces of a SentencePiece tokenizer trained here", lo=1)
  path: str = setting("", "a SentencePiece .model or tokenizer.json file when kind == 'file'")

  def __post_init__(self):
    settings_fields.check(self)
    if self.kind == "sentencepiece":
      tokenizers.check_sentencepiece_vocab_size(self.vocab_size)


@dataclasses.dataclass(frozen=True)
class DataSettings(settings_fields.Extensible):
  """`config.data`: which text, how it is tokenized and packed (dgemma.data). A study's data source may add a group
  of its own here (`settings_fields.register_group`: a study's `data.<name>` keys)."""
  GROUP: ClassVar[str] = "data"
  source: str = setting("shakespeare", "a record of dgemma.data.sources: 'shakespeare' (bundled) | 'files' | "
                        "'tfds' | a study's (registered by a module of `imports`)", choices=sources.names)
  files: tuple = setting((), ".txt / .jsonl paths when source == 'files'", items=str)
  txt_mode: str = setting("line", ".txt files: 'line' (one document per line) | 'file'", choices=("line", "file"))
  jsonl_field: str = setting("text", ".jsonl: the field that holds the document")
  tfds_name: str = setting("", "TFDS catalog name when source == 'tfds' (needs internet), e.g. 'lm1b'")
  tfds_text_key: str = setting("text", "the TFDS feature that holds the text")
  cache_dir: str = setting("data_cache", "built datasets, downloads, trained tokenizers")
  validation_fraction: float = setting(0.05, "documents held out (deterministic by document hash)", lo=0.0, hi=1.0,
                                       hi_open=True)
  seq_len: int = setting(512, "packed sequence length = context + canvas", lo=1)
  batch_size: int = setting(8, "global batch", lo=1)
  shuffle: bool = setting(True, "shuffle the training documents (reshuffled each epoch)")
  num_epochs: int = setting(0, "passes over the training split (0 = repeat forever)", lo=0)
  encoding_errors: str = setting("strict", "invalid UTF-8 in data files: 'strict' (an error naming the file and "
                                 "line) | 'replace' (U+FFFD for each bad byte)", choices=("strict", "replace"))
  tokenizer: TokenizerSettings = group(TokenizerSettings, "the tokenizer (dgemma/tokenizers.py)")
  format: str = setting("text", "'text' (packed documents) | 'sft' (.jsonl prompt/response or chat records, "
                        "dgemma/data/sft.py)", choices=("text", "sft"))
  prompt_field: str = setting("prompt", "format='sft': the .jsonl field of the prompt ...")
  response_field: str = setting("response", "... and of the response")
  messages_field: str = setting("messages", "... or a chat: [{role, content}, ...], the last turn the response")
  restart_if_changed: bool = setting(False, "resuming a run whose data changed since its checkpoint (its files, or "
                                     "how they are read: data.shuffle, seed): False refuses in one line naming the "
                                     "change; True resumes the model and optimizer and reads the data from its "
                                     "beginning")
  sft_overflow: str = setting("truncate_left", "prompt + earlier canvases > seq_len - canvas_len: drop the oldest "
                              "context tokens ('truncate_left') or raise ('error')",
                              choices=("truncate_left", "error"))

  def __post_init__(self):
    settings_fields.check(self)
    settings_fields.need(bool(self.cache_dir), "data.cache_dir", "must name a directory")
    settings_fields.need(self.format != "sft" or self.source == "files", "data.format",
                f"'sft' reads .jsonl records from data.files; set data.source='files' (got {self.source!r})")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """`config.opt`: global-norm clipping, then AdamW or Muon (dgemma/train/optimizer.py OPTIMIZERS); linear warmup
  then cosine decay of every learning rate."""
  GROUP: ClassVar[str] = "opt"
  lr: float = setting(3e-4, "peak learning rate", lo=0.0, lo_open=True)
  end_lr_fraction: float = setting(0.1, "the cosine decay ends at lr * this", lo=0.0, hi=1.0)
  warmup_steps: int = setting(100, "linear warmup steps (<= train.num_steps)", lo=0)
  b1: float = setting(0.9, "Adam beta1", lo=0.0, hi=1.0, hi_open=True)
  b2: float = setting(0.95, "Adam beta2", lo=0.0, hi=1.0, hi_open=True)
  eps: float = setting(1e-8, "Adam epsilon", lo=0.0, lo_open=True)
  weight_decay: float = setting(0.01, "decoupled weight decay", lo=0.0)
  grad_clip: float = setting(1.0, "global gradient-norm clip", lo=0.0, lo_open=True)
  grad_accum_steps: int = setting(1, "micro-batches per step (scan; the same update as the whole batch)", lo=1)
  state_dtype: str = setting("float32", "Adam mu / nu storage", choices=("float32", "bfloat16"))
  optimizer: str = setting("adamw", "'adamw' | 'muon' (hidden matrices: orthogonalised momentum at muon_lr; the "
                           "rest: Nesterov AdamW at lr, no weight decay; full training only); checked against "
                           "dgemma.train.optimizer.OPTIMIZERS by the loop")
  muon_lr: float = setting(0.02, "'muon': the matrices' peak learning rate (opt.lr: the other parameters')",
                           lo=0.0, lo_open=True)
  muon_momentum: float = setting(0.95, "'muon': the matrices' (Nesterov) momentum", lo=0.0, hi=1.0, hi_open=True)

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """`config.train`: the loop, checkpoints and what to do with a non-finite step (dgemma.train.loop)."""
  GROUP: ClassVar[str] = "train"
  num_steps: int = setting(1000, "optimizer steps of the run", lo=1)
  # what the run reports
  log_every: int = setting(10, "steps per train metrics row", lo=1)
  eval_every: int = setting(200, "steps per validation pass", lo=1)
  eval_batches: int = setting(4, "batches per validation pass", lo=1)
  # checkpoints
  ckpt_every: int = setting(200, "steps per checkpoint", lo=1)
  keep_checkpoints: int = setting(3, "checkpoints kept (the oldest rotated away)", lo=1)
  async_checkpointing: bool = setting(True, "write checkpoints while training goes on")
  progress_bar: bool = setting(True, "a tqdm progress bar, where stderr is a terminal or a notebook (not in a log "
                                     "file or a pipe: the log lines only)")
  init_from: str = setting("", "a checkpoint of any kind (a run's latest step, params, adapter, HF directory) to "
                           "start from; params only")
  nonfinite: str = setting("halt", "a non-finite loss, gradient norm or state: 'halt' (error naming the step; "
                           "nothing non-finite is saved) | 'skip' (drop that update and count it)",
                           choices=("halt", "skip"))
  max_nonfinite_skips: int = setting(10, "nonfinite='skip': halt after this many in a row", lo=1)
  restore_step: int = setting(-1, "resume from this step of the workdir (-1 = the latest)", lo=-1)
  on_corrupt_checkpoint: str = setting("fallback", "a checkpoint that cannot be read on resume: 'fallback' (move it "
                                       "to WORKDIR/corrupt/, restore the previous step) | 'error'",
                                       choices=("fallback", "error"))

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class DistillSettings:
  """`config.distill`: Duo's discrete consistency distillation into a few-step student (dgemma/diffusion/distill.py;
  configs/distill_dcd.py): rounds of round_steps steps, each from a frozen copy of the student as teacher."""
  GROUP: ClassVar[str] = "distill"
  method: str = setting("none", "'none' | 'dcd'", choices=distill_lib.METHODS)
  teacher_steps: int = setting(64, "round 0's dt = 1 / teacher_steps", lo=1)
  student_steps: int = setting(4, "the last rounds' dt = 1 / student_steps (teacher_steps / student_steps a power "
                               "of 2)", lo=1)
  round_steps: int = setting(100, "training steps per round (the teacher is refreshed at each start)", lo=1)
  divergence: str = setting("kl_fwd", "'kl_fwd' KL(teacher || student) | 'kl_bwd' KL(student || teacher)",
                            choices=lambda: tuple(distill_lib.DIVERGENCES))

  def __post_init__(self):
    settings_fields.check(self)
    ratio = self.teacher_steps / self.student_steps
    settings_fields.need(self.teacher_steps % self.student_steps == 0 and ratio >= 1 and math.log2(ratio).is_integer(),
                "distill.teacher_steps", f"teacher_steps / student_steps must be a power of 2 (dt doubles each "
                f"round), got {self.teacher_steps} / {self.student_steps}")


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
  """`config.finetune` (dgemma/finetune.py, dgemma/model/lora.py): which parameters train, LoRA adapters."""
  GROUP: ClassVar[str] = "finetune"
  mode: str = setting("full", "'full' (every parameter) | 'lora' (only LoRA adapters, B = 0 at the start) | "
                      "'head_only' (self-conditioning in full plus decoder-only adapters)",
                      choices=finetune_lib.MODES)
  lora_rank: int = setting(8, "r of every adapter (lora / head_only)", lo=1)
  lora_alpha: float = setting(16.0, "adapter scale = lora_alpha / lora_rank", lo=0.0, lo_open=True)
  lora_targets: tuple = setting(("all",), "adapted module kinds: 'all' or a subset of "
                                "attn, mlp, experts, router, self_conditioning", items=str)
  freeze_router: bool = setting(False, "router weights stay fixed (full: frozen; lora / head_only: no router "
                                "adapters)")
  save_adapter: bool = setting(True, "lora / head_only: also write WORKDIR/adapter/ at the end of training")
  base_quant: str = setting("none", "the frozen base held quantized in the train state (QLoRA): a sample.quantize "
                            "preset ('int8', 'int4', 'int4_experts', the embedding included); lora / head_only only",
                            choices=quant.SCHEMES)
  base_quant_group_size: int = setting(64, "base_quant's int4 group along the contracted axis (0 = per output "
                                       "channel); must divide it", lo=0)
  base_quant_scale_dtype: str = setting("", "base_quant's scales: '' = the parameter dtype (model.param_dtype) | "
                                        "'bfloat16' (half the scales' bytes, and no converted copy of them in a "
                                        "bf16 step, while the trained leaves stay in model.param_dtype)",
                                        choices=("", "bfloat16", "float32"))

  def __post_init__(self):
    settings_fields.check(self)
    finetune_lib.lora_config(self)  # the targets, and what is left to train
    settings_fields.need(self.base_quant == "none" or self.mode != "full", "finetune.base_quant",
                f"{self.base_quant!r} needs a frozen base: finetune.mode 'lora' or 'head_only' (full trains every "
                "weight, which cannot be held quantized)")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """`config.eval` (eval/likelihood.py, eval/samples.py; flags of the same name override)."""
  GROUP: ClassVar[str] = "eval"
  split: str = setting("validation", "the split training's validation pass and eval tools read")
  data: str = setting("", "likelihood: a .txt/.jsonl file or a split name of the run's dataset ('' = eval.split)")
  max_documents: int = setting(0, "likelihood: the first this many documents (0 = all)", lo=0)
  max_tokens: int = setting(0, "likelihood: at most this many tokens of each document, cut at whitespace (0 = "
                            "whole documents)", lo=0)
  context_len: int = setting(0, "likelihood: clean tokens each canvas conditions on (0 = data.seq_len - canvas_len)",
                             lo=0)
  num_t_samples: int = setting(8, "likelihood: antithetic Monte-Carlo t samples per canvas", lo=1)
  self_conditioning: bool = setting(True, "likelihood: x_theta from the two-pass self-conditioned decoder")
  batch_size: int = setting(32, "likelihood: canvases per forward pass", lo=1)
  num_samples: int = setting(16, "samples: how many samples (rows of one generate call)", lo=1)
  prompts: str = setting("", "samples: a prompts file (.txt lines / .jsonl 'prompt'), used cyclically")
  reference: str = setting("", "samples: an AR checkpoint for generative perplexity; likelihood: any checkpoint "
                           "scored on the same canvases for a paired ratio")
  ar_temperature: float = setting(1.0, "samples from an AR checkpoint: 0 = greedy", lo=0.0)
  real_words: str = setting("", "samples: real_word_rate against the words of 'train' or of a .txt file")
  truth: str = setting("", "samples: a Markov source's truth.json: the samples' exact bits per byte")
  samples_out: str = setting("", "samples: write every sample as JSONL here")
  out: str = setting("", "likelihood / samples: write the summary JSON here")
  seed: int = setting(0, "noise for the likelihood's t and z_t draws, and for training's validation pass")

  def __post_init__(self):
    settings_fields.check(self)


@dataclasses.dataclass(frozen=True)
class MeshShape:
  GROUP: ClassVar[str] = "mesh.shape"
  data: int = setting(-1, "data-parallel devices (-1 = the remaining devices)", lo=-1)
  fsdp: int = setting(1, "devices the parameters are sharded over", lo=-1)
  expert: int = setting(1, "devices the experts are split over (moe_impl='expert_parallel')", lo=-1)
  tensor: int = setting(1, "tensor-parallel devices", lo=-1)

  def __post_init__(self):
    settings_fields.check(self)
    for axis in MESH_AXES:
      settings_fields.need(getattr(self, axis) != 0, f"mesh.shape.{axis}",
                           "must be positive or -1 (= the remaining devices)")
    settings_fields.need(sum(1 for axis in MESH_AXES if getattr(self, axis) == -1) <= 1, "mesh.shape",
                "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """`config.mesh`: axis sizes of (data, fsdp, expert, tensor) and the logical axis rules (dgemma/mesh.py);
  presets in configs/mesh/."""
  GROUP: ClassVar[str] = "mesh"
  preset: str = setting("cpu_host", "informational: the preset (configs/mesh/) the values came from",
                        compare=False)
  shape: MeshShape = group(MeshShape, "axis sizes")
  axis_rules: tuple = setting(mesh_lib.AXIS_RULES, "logical axis -> mesh axes, for parameters and activations",
                              items="rule")

  def __post_init__(self):
    settings_fields.check(self)
    settings_fields.need(any(name == "batch" for name, _ in self.axis_rules), "mesh.axis_rules",
                "no rule for the logical axis 'batch'")

  @property
  def axis_sizes(self) -> tuple[tuple[str, int], ...]:
    """((axis, size), ...) over (data, fsdp, expert, tensor), as dgemma.mesh.make_mesh takes it."""
    return tuple((axis, getattr(self.shape, axis)) for axis in MESH_AXES)
