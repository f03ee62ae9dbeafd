"""The config boundary: an experiment config (an `ml_collections.ConfigDict` from `configs/*.py`) is checked
and turned into typed, frozen settings here, once, and the library below takes those.

  settings = dgemma.settings.from_config(config)   # every check; raises ConfigError naming the field
  settings.model       ModelConfig (dgemma.model), with the LoRA layout of `finetune`
  settings.data        DataSettings (+ .tokenizer, .sudoku)
  settings.diffusion   DiffusionSettings (dgemma.diffusion.config: what dgemma.diffusion.loss reads)
  settings.opt         OptimizerSettings        settings.train     TrainSettings
  settings.finetune    FinetuneSettings         settings.mesh      MeshSettings
  settings.sample      SampleSettings (.sampler: SamplerConfig, .quant: QuantConfig, the request)
  settings.eval        EvalSettings             settings.seed      int

Checks, all before anything is built, read or compiled: every key must be one `configs/base.py` defines;
each group's values (types, finite numbers, ranges, choices from the registries: objectives, schedules,
data sources, sampler rules); the relations between groups (the canvas fits the sequence, the tokenizer
fits the vocabulary, an mdlm mask id is not a real token, ...). The data source's own checks (its record
in `dgemma.data.sources`: files exist, Sudoku shapes) run where its data is first needed
(`dgemma.data.prepare`, still before anything is compiled), so sampling a run does not need its training
files. Lower layers never import this module: each takes the part it needs (duck-typed), so a part can be
built directly in a test.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Optional

import ml_collections

from configs import base
from dgemma import finetune as finetune_lib
from dgemma import files, quant, tokenizers
from dgemma.data import sources
from dgemma.diffusion import distill as distill_lib, objectives, schedules
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from dgemma.model.config import ModelConfig
from dgemma.model.sharding import MESH_AXES
from dgemma.sampling.config import (BEGIN_OF_TOOL_RESPONSE_ID, CONTEXT_LEN, END_OF_TURN_ID, EOS_ID, SEMANTICS,
                                    SamplerConfig)

# Groups whose keys are free-form (mesh axis names are checked by MeshSettings) or owned by a preset
# (the model group is checked against ModelConfig's fields).
_OPEN_GROUPS = ("mesh.shape", "model")


# ---- value checks --------------------------------------------------------------------------------

def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"{field}: {msg}")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _int(field: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
  """An integer in [lo, hi]; an integral float (1e3 from a flag) is accepted as its integer."""
  if isinstance(value, float) and math.isfinite(value) and value.is_integer():
    value = int(value)
  _need(_is_int(value), field, f"must be an integer, got {value!r}")
  _need(lo is None or value >= lo, field, f"must be >= {lo}, got {value}")
  _need(hi is None or value <= hi, field, f"must be <= {hi}, got {value}")
  return int(value)


def _float(field: str, value, lo: Optional[float] = None, hi: Optional[float] = None, *,
           lo_open: bool = False, hi_open: bool = False) -> float:
  """A finite number in the interval (lo/hi open or closed)."""
  _need(isinstance(value, (int, float)) and not isinstance(value, bool), field, f"must be a number, got {value!r}")
  value = float(value)
  _need(math.isfinite(value), field, f"must be finite, got {value}")
  if lo is not None:
    _need(value > lo if lo_open else value >= lo, field, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
  if hi is not None:
    _need(value < hi if hi_open else value <= hi, field, f"must be {'<' if hi_open else '<='} {hi}, got {value}")
  return value


def _bool(field: str, value) -> bool:
  _need(isinstance(value, bool), field, f"must be True or False, got {value!r}")
  return value


def _choice(field: str, value, options) -> str:
  options = tuple(options)
  _need(value in options, field, f"{value!r} not in {options}")
  return str(value)


def _str(field: str, value) -> str:
  _need(isinstance(value, str), field, f"must be a string, got {value!r}")
  return value


def _tuple(value) -> tuple:
  if isinstance(value, str):
    return (value,)
  return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def _numbers(field: str, value, what: str) -> tuple[float, ...]:
  """A config tuple of numbers (not bools) as floats; anything else names `field` and the expected `what`."""
  values = _tuple(value)
  _need(all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in values), field,
        f"need numbers {what}, got {values}")
  return tuple(float(a) for a in values)


def _check_keys(config: Any, reference: Any, prefix: str) -> None:
  if prefix in _OPEN_GROUPS:
    return
  if isinstance(reference, ml_collections.ConfigDict):
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
      raise ConfigError(f"{prefix or 'config'}: expected a group of settings, got {config!r}")
    unknown = sorted(set(config.keys()) - set(reference.keys()))
    if unknown:
      names = ", ".join(f"{prefix + '.' if prefix else ''}{k}" for k in unknown)
      raise ConfigError(f"unknown config key(s): {names} (see configs/base.py for the keys dgemma reads)")
    for key in config.keys():
      _check_keys(config[key], reference[key], f"{prefix}.{key}" if prefix else key)


# ---- the parts -----------------------------------------------------------------------------------

ENCODING_ERRORS = ("strict", "replace")
DATA_FORMATS = ("text", "sft")
SFT_OVERFLOW = ("truncate_left", "error")
TXT_MODES = ("line", "file")
NONFINITE = ("halt", "skip")
ON_CORRUPT = ("fallback", "error")
OPT_STATE_DTYPES = ("float32", "bfloat16")
QUANT_SCHEMES = quant.SCHEMES


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
  kind: str
  vocab_size: int
  path: str


@dataclasses.dataclass(frozen=True)
class SudokuSettings:
  train_csv: str
  validation_csv: str
  num_train: int
  num_validation: int
  min_blanks: int
  max_blanks: int
  augment: bool
  infill_givens: bool


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """`config.data` (configs/base.py documents every field)."""
  source: str
  files: tuple[str, ...]
  txt_mode: str
  jsonl_field: str
  tfds_name: str
  tfds_text_key: str
  cache_dir: str
  validation_fraction: float
  seq_len: int
  batch_size: int
  shuffle: bool
  num_epochs: int
  tokenizer: TokenizerSettings
  sudoku: SudokuSettings
  format: str
  prompt_field: str
  response_field: str
  messages_field: str
  sft_overflow: str
  encoding_errors: str


@dataclasses.dataclass(frozen=True)
class DistillSettings:
  """`config.distill`: consistency distillation into a few-step student (dgemma.diffusion.distill reads it)."""
  method: str = "none"
  teacher_steps: int = 64
  student_steps: int = 4
  round_steps: int = 100
  divergence: str = "kl_fwd"


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """`config.opt`: AdamW with warmup + cosine decay and global-norm clipping (dgemma.train.optimizer)."""
  lr: float = 3e-4
  end_lr_fraction: float = 0.1
  warmup_steps: int = 100
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  grad_accum_steps: int = 1
  state_dtype: str = "float32"
  optimizer: str = "adamw"
  muon_lr: float = 0.02
  muon_momentum: float = 0.95


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """`config.train`: the loop, checkpoints and what to do with a non-finite step (dgemma.train.loop)."""
  num_steps: int
  log_every: int
  eval_every: int
  eval_batches: int
  ckpt_every: int
  keep_checkpoints: int
  async_checkpointing: bool
  progress_bar: bool
  init_from: str
  nonfinite: str
  max_nonfinite_skips: int
  restore_step: int
  on_corrupt_checkpoint: str


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
  """`config.finetune` (dgemma.finetune reads it)."""
  mode: str = "full"
  lora_rank: int = 8
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("all",)
  freeze_router: bool = False
  save_adapter: bool = True


@dataclasses.dataclass(frozen=True)
class SampleSettings:
  """`config.sample`: the sampler's static settings (`sampler`, a SamplerConfig), weight quantization at
  load (`quant`), and one request (prompt, rows, length, seed, which checkpoint step, outputs)."""
  sampler: SamplerConfig
  quant: quant.QuantConfig
  prompt: str
  num_samples: int
  max_new_tokens: int
  seed: int
  checkpoint_step: int
  trajectory_html: str
  infill: tuple[tuple[int, int], ...]

  @property
  def end_ids(self) -> tuple[int, ...]:
    return self.sampler.end_ids


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """`config.eval` (eval/likelihood.py, eval/samples.py)."""
  split: str
  data: str
  max_documents: int
  max_tokens: int
  context_len: int
  num_t_samples: int
  self_conditioning: bool
  batch_size: int
  num_samples: int
  prompts: str
  reference: str
  ar_temperature: float
  real_words: str
  truth: str
  samples_out: str
  out: str
  seed: int


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """`config.mesh`: axis sizes of (data, fsdp, expert, tensor), -1 = the remaining devices, and the
  logical axis rules (dgemma.mesh)."""
  shape: tuple[tuple[str, int], ...]
  axis_rules: tuple

  def size(self, axis: str) -> int:
    return dict(self.shape).get(axis, 1)


@dataclasses.dataclass(frozen=True)
class Settings:
  seed: int
  model: ModelConfig
  data: DataSettings
  diffusion: DiffusionSettings
  opt: OptimizerSettings
  train: TrainSettings
  distill: DistillSettings
  finetune: FinetuneSettings
  sample: SampleSettings
  eval: EvalSettings
  mesh: MeshSettings
  config_json: str = dataclasses.field(repr=False, compare=False)

  @property
  def objective(self) -> objectives.Objective:
    return objectives.get(self.diffusion.objective)

  @property
  def canvas_sampler(self) -> SamplerConfig:
    """The canvas sampler, checked against the objective the model was trained with."""
    objective = self.objective
    if objective.autoregressive:
      raise ConfigError("diffusion.objective='ar' trains an autoregressive model: sample it with "
                        "dgemma.sampling.ar_generate (the API does so), not the canvas sampler")
    if self.sample.sampler.sampler not in objective.samplers:
      raise ConfigError(f"sample.sampler={self.sample.sampler.sampler!r} does not fit diffusion.objective="
                        f"{objective.name!r} (it takes {objective.samplers}): masked-diffusion (mdlm) models "
                        "need sample.sampler='masked', and only they")
    return self.sample.sampler

  def config(self) -> ml_collections.ConfigDict:
    """The raw config these settings came from (a fresh copy)."""
    return from_json(self.config_json)


# ---- building each part --------------------------------------------------------------------------

def _data(d) -> DataSettings:
  tok, sud = d.tokenizer, d.sudoku
  tokenizer = TokenizerSettings(kind=_choice("data.tokenizer.kind", tok.kind, tokenizers.TOKENIZER_KINDS),
                                vocab_size=_int("data.tokenizer.vocab_size", tok.vocab_size, 1),
                                path=_str("data.tokenizer.path", tok.path))
  if tokenizer.kind == "sentencepiece":
    tokenizers.check_sentencepiece_vocab_size(tokenizer.vocab_size)
  sudoku = SudokuSettings(
      train_csv=_str("data.sudoku.train_csv", sud.train_csv),
      validation_csv=_str("data.sudoku.validation_csv", sud.validation_csv),
      num_train=_int("data.sudoku.num_train", sud.num_train, 0),
      num_validation=_int("data.sudoku.num_validation", sud.num_validation, 0),
      min_blanks=_int("data.sudoku.min_blanks", sud.min_blanks, 0, 64),
      max_blanks=_int("data.sudoku.max_blanks", sud.max_blanks, 0, 64),
      augment=_bool("data.sudoku.augment", sud.augment),
      infill_givens=_bool("data.sudoku.infill_givens", sud.infill_givens))
  _need(sudoku.min_blanks <= sudoku.max_blanks, "data.sudoku.min_blanks",
        f"need min_blanks <= max_blanks, got {sudoku.min_blanks}..{sudoku.max_blanks}")
  out = DataSettings(
      source=_choice("data.source", d.source, sources.SOURCES),
      files=tuple(str(f) for f in _tuple(d.files)),
      txt_mode=_choice("data.txt_mode", d.txt_mode, TXT_MODES),
      jsonl_field=_str("data.jsonl_field", d.jsonl_field),
      tfds_name=_str("data.tfds_name", d.tfds_name), tfds_text_key=_str("data.tfds_text_key", d.tfds_text_key),
      cache_dir=_str("data.cache_dir", str(d.cache_dir)),
      validation_fraction=_float("data.validation_fraction", d.validation_fraction, 0.0, 1.0, hi_open=True),
      seq_len=_int("data.seq_len", d.seq_len, 1), batch_size=_int("data.batch_size", d.batch_size, 1),
      shuffle=_bool("data.shuffle", d.shuffle), num_epochs=_int("data.num_epochs", d.num_epochs, 0),
      tokenizer=tokenizer, sudoku=sudoku,
      format=_choice("data.format", d.format, DATA_FORMATS),
      prompt_field=_str("data.prompt_field", d.prompt_field),
      response_field=_str("data.response_field", d.response_field),
      messages_field=_str("data.messages_field", d.messages_field),
      sft_overflow=_choice("data.sft_overflow", d.sft_overflow, SFT_OVERFLOW),
      encoding_errors=_choice("data.encoding_errors", d.encoding_errors, ENCODING_ERRORS))
  _need(bool(out.cache_dir), "data.cache_dir", "must name a directory")
  _need(out.format != "sft" or out.source == "files", "data.format",
        f"'sft' reads .jsonl records from data.files; set data.source='files' (got {out.source!r})")
  return out


def _diffusion(d, seq_len: int) -> DiffusionSettings:
  mixture = _numbers("diffusion.t_mixture", d.t_mixture, "(weight, t_lo, t_hi)")
  window = _numbers("diffusion.curriculum_alpha_range", d.curriculum_alpha_range, "(alpha_lo, alpha_hi)")
  out = DiffusionSettings(
      canvas_len=_int("diffusion.canvas_len", d.canvas_len, 1),
      t_eps=_float("diffusion.t_eps", d.t_eps, 0.0, 1.0, lo_open=True, hi_open=True),
      encoder_loss_weight=_float("diffusion.encoder_loss_weight", d.encoder_loss_weight, 0.0),
      self_cond_prob=_float("diffusion.self_cond_prob", d.self_cond_prob, 0.0, 1.0),
      objective=objectives.get(d.objective).name,
      schedule=schedules.get(d.schedule, "diffusion.schedule").name,
      schedule_eps=_float("diffusion.schedule_eps", d.schedule_eps, 0.0, 1.0, lo_open=True, hi_open=True),
      reweight_cap=_float("diffusion.reweight_cap", d.reweight_cap, 1.0),
      mask_id=_int("diffusion.mask_id", d.mask_id, 0),
      antithetic_t=_bool("diffusion.antithetic_t", d.antithetic_t),
      t_power=_float("diffusion.t_power", d.t_power, 0.0, 10.0, lo_open=True),
      t_mixture=mixture,
      canvases_per_row=_int("diffusion.canvases_per_row", d.canvases_per_row, 1),
      short_canvas_len=_int("diffusion.short_canvas_len", d.short_canvas_len, 0),
      short_canvases_per_row=_int("diffusion.short_canvases_per_row", d.short_canvases_per_row, 0),
      short_canvas_weight=_float("diffusion.short_canvas_weight", d.short_canvas_weight, 0.0, 1.0),
      curriculum_steps=_int("diffusion.curriculum_steps", d.curriculum_steps, 0),
      curriculum_tau_start=_float("diffusion.curriculum_tau_start", d.curriculum_tau_start, 0.0, lo_open=True),
      curriculum_tau_end=_float("diffusion.curriculum_tau_end", d.curriculum_tau_end, 0.0, lo_open=True),
      curriculum_alpha_range=window)
  _need(out.canvas_len < seq_len, "diffusion.canvas_len",
        f"canvas of {out.canvas_len} tokens does not fit in data.seq_len={seq_len} "
        "(the sequence is context + canvas; the canvas must be shorter)")
  K = out.canvases_per_row
  _need(K * out.canvas_len <= seq_len, "diffusion.canvases_per_row",
        f"{K} canvases of diffusion.canvas_len={out.canvas_len} do not fit in data.seq_len={seq_len}")
  _need(K == 1 or not out.objective_record.autoregressive, "diffusion.canvases_per_row",
        f"objective 'ar' has no canvases; use 1, got {K}")
  if out.short_canvas_len:
    _need(not out.objective_record.autoregressive, "diffusion.short_canvas_len",
          f"objective 'ar' has no canvases; use 0, got {out.short_canvas_len}")
    A = out.num_short_canvases
    _need(A * out.short_canvas_len < seq_len, "diffusion.short_canvases_per_row",
          f"{A} short canvases of diffusion.short_canvas_len={out.short_canvas_len} leave no context in "
          f"data.seq_len={seq_len} (0 = as many as diffusion.canvases_per_row * canvas_len tokens cover)")
  mixture = out.t_mixture
  _need(not mixture or (len(mixture) == 3 and 0.0 < mixture[0] < 1.0 and out.t_eps <= mixture[1] < mixture[2] <= 1.0),
        "diffusion.t_mixture", f"need () or (weight, t_lo, t_hi) with 0 < weight < 1 and "
        f"diffusion.t_eps={out.t_eps} <= t_lo < t_hi <= 1, got {mixture}")
  window = out.curriculum_alpha_range
  _need(not window or (len(window) == 2 and 0.0 <= window[0] < window[1] < 1.0), "diffusion.curriculum_alpha_range",
        f"need () or (alpha_lo, alpha_hi) with 0 <= alpha_lo < alpha_hi < 1, got {window}")
  _need(out.curriculum_steps == 0 or out.objective_record.corruption == objectives.UNIFORM,
        "diffusion.curriculum_steps", f"the Gaussian-relaxation curriculum is for uniform-state objectives; "
        f"objective {out.objective!r} corrupts with {out.objective_record.corruption!r} (use 0)")
  return out


def _opt(o, batch_size: int) -> OptimizerSettings:
  out = OptimizerSettings(
      lr=_float("opt.lr", o.lr, 0.0, lo_open=True),
      end_lr_fraction=_float("opt.end_lr_fraction", o.end_lr_fraction, 0.0, 1.0),
      warmup_steps=_int("opt.warmup_steps", o.warmup_steps, 0),
      b1=_float("opt.b1", o.b1, 0.0, 1.0, hi_open=True),
      b2=_float("opt.b2", o.b2, 0.0, 1.0, hi_open=True),
      eps=_float("opt.eps", o.eps, 0.0, lo_open=True),
      weight_decay=_float("opt.weight_decay", o.weight_decay, 0.0),
      grad_clip=_float("opt.grad_clip", o.grad_clip, 0.0, lo_open=True),
      grad_accum_steps=_int("opt.grad_accum_steps", o.grad_accum_steps, 1),
      state_dtype=_choice("opt.state_dtype", o.state_dtype, OPT_STATE_DTYPES),
      optimizer=_str("opt.optimizer", o.optimizer),  # a name of dgemma.train.optimizer.OPTIMIZERS (checked there,
                                                     # by the loop before any work: that layer sits above this one)
      muon_lr=_float("opt.muon_lr", o.muon_lr, 0.0, lo_open=True),
      muon_momentum=_float("opt.muon_momentum", o.muon_momentum, 0.0, 1.0, hi_open=True))
  _need(batch_size % out.grad_accum_steps == 0, "opt.grad_accum_steps",
        f"{out.grad_accum_steps} does not divide data.batch_size={batch_size}")
  return out


def _train(t) -> TrainSettings:
  return TrainSettings(
      num_steps=_int("train.num_steps", t.num_steps, 1),
      log_every=_int("train.log_every", t.log_every, 1), eval_every=_int("train.eval_every", t.eval_every, 1),
      eval_batches=_int("train.eval_batches", t.eval_batches, 1),
      ckpt_every=_int("train.ckpt_every", t.ckpt_every, 1),
      keep_checkpoints=_int("train.keep_checkpoints", t.keep_checkpoints, 1),
      async_checkpointing=_bool("train.async_checkpointing", t.async_checkpointing),
      progress_bar=_bool("train.progress_bar", t.progress_bar),
      init_from=_str("train.init_from", t.init_from),
      nonfinite=_choice("train.nonfinite", t.nonfinite, NONFINITE),
      max_nonfinite_skips=_int("train.max_nonfinite_skips", t.max_nonfinite_skips, 1),
      restore_step=_int("train.restore_step", t.restore_step, -1),
      on_corrupt_checkpoint=_choice("train.on_corrupt_checkpoint", t.on_corrupt_checkpoint, ON_CORRUPT))


def _distill(d) -> DistillSettings:
  out = DistillSettings(
      method=_choice("distill.method", d.method, distill_lib.METHODS),
      teacher_steps=_int("distill.teacher_steps", d.teacher_steps, 1),
      student_steps=_int("distill.student_steps", d.student_steps, 1),
      round_steps=_int("distill.round_steps", d.round_steps, 1),
      divergence=_choice("distill.divergence", d.divergence, tuple(distill_lib.DIVERGENCES)))
  ratio = out.teacher_steps / out.student_steps
  _need(out.teacher_steps % out.student_steps == 0 and ratio >= 1 and math.log2(ratio).is_integer(),
        "distill.teacher_steps", f"teacher_steps / student_steps must be a power of 2 (dt doubles each round), got "
        f"{out.teacher_steps} / {out.student_steps}")
  return out


def _finetune(f) -> FinetuneSettings:
  out = FinetuneSettings(mode=f.mode, lora_rank=f.lora_rank, lora_alpha=f.lora_alpha,
                         lora_targets=_tuple(f.lora_targets), freeze_router=f.freeze_router,
                         save_adapter=_bool("finetune.save_adapter", f.save_adapter))
  finetune_lib.lora_config(out)  # mode, rank, alpha, targets, freeze_router
  return out


def tokenizer_end_ids(data: DataSettings, semantics: str = "hf") -> tuple[int, ...]:
  """The automatic end ids (`sample.end_ids = ()`): EOS (1) for the byte and trained SentencePiece
  tokenizers (with the byte tokenizer id 106 is the letter 'f'); for a tokenizer file, its EOS and, when
  it has Gemma's chat pieces, its `<turn|>` (the end SFT trains on; Gemma 4: (1, 106)). Read from the file:
  a foreign SentencePiece model may put EOS at 2 and an ordinary piece at 106. Without the file yet (a
  converted checkpoint before its tokenizer is in place), Gemma 4's (1, 106). With semantics='official',
  a Gemma 4 vocabulary (one with the turn pieces) also ends at `<begin_of_tool_response>` (50), as the
  official sampler does."""
  if data.tokenizer.kind != "file":
    return (EOS_ID,)
  ids = ((EOS_ID, END_OF_TURN_ID) if not os.path.isfile(data.tokenizer.path)
         else _file_end_ids(data.tokenizer.path, os.stat(data.tokenizer.path).st_mtime_ns))
  if semantics == "official" and len(ids) > 1:
    ids = ids + (BEGIN_OF_TOOL_RESPONSE_ID,)
  return ids


@functools.lru_cache(maxsize=8)
def _file_end_ids(path: str, mtime_ns: int) -> tuple[int, ...]:
  del mtime_ns  # part of the cache key: a rewritten file is read again
  try:
    tokenizer = tokenizers.load_tokenizer_file(path)
  except (ValueError, OSError) as e:
    raise ConfigError(f"data.tokenizer.path: {e}") from e
  return tokenizers.end_ids(tokenizer)


def _sampler(s, diffusion: DiffusionSettings, data: DataSettings, vocab_size: int) -> SamplerConfig:
  end_ids = (tuple(_int("sample.end_ids", i, 0) for i in _tuple(s.end_ids))
             or tokenizer_end_ids(data, _choice("sample.semantics", s.semantics, SEMANTICS)))
  kwargs = dict(
      max_denoising_steps=_int("sample.max_denoising_steps", s.max_denoising_steps, 1),
      entropy_bound=_float("sample.entropy_bound", s.entropy_bound, 0.0, lo_open=True),
      t_max=_float("sample.t_max", s.t_max, 0.0, lo_open=True), t_min=_float("sample.t_min", s.t_min, 0.0),
      stability_threshold=_int("sample.stability_threshold", s.stability_threshold, 0),
      confidence_threshold=_float("sample.confidence_threshold", s.confidence_threshold, 0.0),
      early_exit=_bool("sample.early_exit", s.early_exit),
      self_conditioning=_bool("sample.self_conditioning", s.self_conditioning),
      sampler=s.sampler, pc_corrector_steps=_int("sample.pc_corrector_steps", s.pc_corrector_steps, 1),
      pc_corrector_fraction=_float("sample.pc_corrector_fraction", s.pc_corrector_fraction, 0.0, 1.0, lo_open=True),
      acceptance=s.acceptance,
      accept_confidence=_float("sample.accept_confidence", s.accept_confidence, 0.0, 1.0),
      accept_k=_int("sample.accept_k", s.accept_k, 1), renoise=s.renoise,
      renoise_confidence=_float("sample.renoise_confidence", s.renoise_confidence, 0.0, 1.0),
      top_k=_int("sample.top_k", s.top_k, 0), top_p=_float("sample.top_p", s.top_p, 0.0, 1.0, lo_open=True),
      alpha_schedule=s.alpha_schedule,
      schedule_eps=_float("sample.schedule_eps", s.schedule_eps, 0.0, 1.0, lo_open=True, hi_open=True),
      greedy_last_step=_bool("sample.greedy_last_step", s.greedy_last_step),
      max_context=_int("sample.max_context", s.max_context, 0) or CONTEXT_LEN, show=s.show, semantics=s.semantics)
  return SamplerConfig(canvas_len=diffusion.canvas_len, end_ids=tuple(i for i in end_ids if i < vocab_size),
                       mask_id=diffusion.mask_id, loo_logits=objectives.get(diffusion.objective).leave_one_out,
                       **kwargs)


def _sample(s, diffusion: DiffusionSettings, data: DataSettings, vocab_size: int) -> SampleSettings:
  infill = []
  for pair in _tuple(s.infill):
    _need(isinstance(pair, (tuple, list)) and len(pair) == 2, "sample.infill",
          f"expected (position, token_id) pairs, got {pair!r}")
    infill.append((_int("sample.infill", pair[0], 0), _int("sample.infill", pair[1], 0, vocab_size - 1)))
  out = SampleSettings(
      sampler=_sampler(s, diffusion, data, vocab_size),
      quant=quant.QuantConfig(scheme=_choice("sample.quantize", s.quantize, QUANT_SCHEMES),
                              group_size=_int("sample.quant_group_size", s.quant_group_size, 0),
                              embedding=_bool("sample.quantize_embedding", s.quantize_embedding)),
      prompt=_str("sample.prompt", s.prompt),
      num_samples=_int("sample.num_samples", s.num_samples, 1),
      max_new_tokens=_int("sample.max_new_tokens", s.max_new_tokens, 1),
      seed=_int("sample.seed", s.seed), checkpoint_step=_int("sample.checkpoint_step", s.checkpoint_step, -1),
      trajectory_html=_str("sample.trajectory_html", s.trajectory_html), infill=tuple(infill))
  for pos, _ in out.infill:
    _need(pos < out.max_new_tokens, "sample.infill",
          f"position {pos} is outside the response [0, sample.max_new_tokens={out.max_new_tokens})")
  return out


def _eval(e) -> EvalSettings:
  return EvalSettings(
      split=_str("eval.split", e.split), data=_str("eval.data", e.data),
      max_documents=_int("eval.max_documents", e.max_documents, 0),
      max_tokens=_int("eval.max_tokens", e.max_tokens, 0),
      context_len=_int("eval.context_len", e.context_len, 0),
      num_t_samples=_int("eval.num_t_samples", e.num_t_samples, 1),
      self_conditioning=_bool("eval.self_conditioning", e.self_conditioning),
      batch_size=_int("eval.batch_size", e.batch_size, 1), num_samples=_int("eval.num_samples", e.num_samples, 1),
      prompts=_str("eval.prompts", e.prompts), reference=_str("eval.reference", e.reference),
      ar_temperature=_float("eval.ar_temperature", e.ar_temperature, 0.0),
      real_words=_str("eval.real_words", e.real_words), truth=_str("eval.truth", e.truth),
      samples_out=_str("eval.samples_out", e.samples_out), out=_str("eval.out", e.out),
      seed=_int("eval.seed", e.seed))


def _mesh(m) -> MeshSettings:
  shape = dict(m.shape)
  unknown = sorted(set(shape) - set(MESH_AXES))
  _need(not unknown, "mesh.shape", f"unknown mesh axes {unknown}; use {', '.join(MESH_AXES)}")
  sizes = tuple((axis, _int(f"mesh.shape.{axis}", shape.get(axis, 1), -1)) for axis in MESH_AXES)
  for axis, size in sizes:
    _need(size != 0, f"mesh.shape.{axis}", "must be positive or -1 (= the remaining devices)")
  _need(sum(1 for _, v in sizes if v == -1) <= 1, "mesh.shape", "at most one axis may be -1")
  rules = tuple((str(name), tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in m.axis_rules)
  _need(any(name == "batch" for name, _ in rules), "mesh.axis_rules", "no rule for the logical axis 'batch'")
  return MeshSettings(shape=sizes, axis_rules=rules)


def _cross_checks(st: Settings) -> None:
  model, data, diff = st.model, st.data, st.diffusion
  _need(diff.canvases_per_row == 1 or data.format != "sft", "diffusion.canvases_per_row",
        f"data.format='sft' rows hold one response canvas; use 1, got {diff.canvases_per_row}")
  if st.objective.masked:
    _need(diff.mask_id < model.vocab_size, "diffusion.mask_id",
          f"{diff.mask_id} is not an id of the model's vocabulary (model.vocab_size={model.vocab_size})")
    if data.tokenizer.kind in ("byte", "sentencepiece"):
      # Tokenizers built here use every id below their vocabulary size (4 specials, then pieces / bytes).
      tok_vocab = tokenizers.ByteTokenizer().vocab_size if data.tokenizer.kind == "byte" else data.tokenizer.vocab_size
      _need(diff.mask_id >= tok_vocab, "diffusion.mask_id",
            f"{diff.mask_id} is a real token of the {data.tokenizer.kind} tokenizer (ids < {tok_vocab}); for "
            f"objective='mdlm' use an added id, e.g. mask_id={tok_vocab} with model.vocab_size > {tok_vocab}")
  if st.objective.needs_two_stream:
    _need(model.decoder_two_stream, "diffusion.objective",
          f"{st.objective.name!r} is proper only for a decoder blind to each position's own token: set "
          "model.decoder_two_stream=True (with model.decoder_shift=True), or use loo_ce")
  if data.tokenizer.kind == "sentencepiece":
    _need(model.vocab_size >= data.tokenizer.vocab_size, "model.vocab_size",
          f"{model.vocab_size} is smaller than data.tokenizer.vocab_size={data.tokenizer.vocab_size}")
  if data.tokenizer.kind == "byte":
    _need(model.vocab_size >= tokenizers.ByteTokenizer().vocab_size, "model.vocab_size",
          f"{model.vocab_size} is too small for the byte tokenizer (256 bytes + 4 special tokens = 260)")
  _need(st.opt.warmup_steps <= st.train.num_steps, "opt.warmup_steps",
        f"{st.opt.warmup_steps} warmup steps exceed train.num_steps={st.train.num_steps}")
  _need(st.sample.sampler.max_context > diff.canvas_len, "sample.max_context",
        f"must exceed diffusion.canvas_len={diff.canvas_len}, got {st.sample.sampler.max_context}")
  if distill_lib.enabled(st.distill):
    _need(diff.short_canvas_len == 0, "diffusion.short_canvas_len",
          f"consistency distillation trains the configured canvases only; use 0, got {diff.short_canvas_len}")
    _need(bool(st.train.init_from), "train.init_from", "distill.method='dcd' distils a trained run: name it here "
          "(a training workdir or params checkpoint; configs/distill_dcd.py:TEACHER sets it)")
    _need(st.objective.corruption == objectives.UNIFORM and not st.objective.autoregressive, "distill.method",
          f"consistency distillation runs on the Gaussian relaxation of uniform-state diffusion; "
          f"diffusion.objective={st.objective.name!r} is not uniform-state")
  expert_axis = st.mesh.size("expert")
  if model.moe_impl == "expert_parallel" and model.num_experts and expert_axis > 0:
    _need(model.num_experts % expert_axis == 0, "model.num_experts",
          f"{model.num_experts} experts do not split over mesh.shape.expert={expert_axis} devices "
          "(moe_impl='expert_parallel' needs num_experts % expert == 0)")
  if st.sample.quant.scheme != "none":
    quant.check(model, st.sample.quant)  # sample.quant_group_size against this architecture (shapes only)


def from_config(config: ml_collections.ConfigDict) -> Settings:
  """Checks an experiment config and returns its Settings. Raises ConfigError naming the field (or, for a
  data file that does not exist, FileNotFoundError naming it)."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config: expected an ml_collections.ConfigDict from a configs/*.py get_config(), got "
                      f"{type(config).__name__}")
  _check_keys(config, base.get_config(), "")
  model = ModelConfig.from_config_dict(config.model)
  finetune = _finetune(config.finetune)
  model = dataclasses.replace(model, lora=finetune_lib.lora_config(finetune))  # adapters are params too
  data = _data(config.data)
  diffusion = _diffusion(config.diffusion, data.seq_len)
  settings = Settings(
      seed=_int("seed", config.seed), model=model, data=data, diffusion=diffusion,
      opt=_opt(config.opt, data.batch_size), train=_train(config.train), distill=_distill(config.distill),
      finetune=finetune,
      sample=_sample(config.sample, diffusion, data, model.vocab_size), eval=_eval(config.eval),
      mesh=_mesh(config.mesh), config_json=to_json(config))
  _cross_checks(settings)
  return settings


# ---- editing a raw config ----------------------------------------------------------------------------

def set_key(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  """config.<dotted> = value (lists become tuples); a key configs/base.py does not define raises naming it."""
  *parents, leaf = dotted.split(".")
  node = config
  for name in parents:
    if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
      raise ConfigError(f"{dotted}: no config group {name!r} (configs/base.py)")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"{dotted}: not a config key (configs/base.py)")
  with node.ignore_type():
    node[leaf] = tuple(value) if isinstance(value, list) else value


def with_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """A copy of `config` with {dotted key: value} overrides ({'sample.max_denoising_steps': 8})."""
  out = ml_collections.ConfigDict(config.to_dict())
  for dotted, value in dict(overrides).items():
    set_key(out, dotted, value)
  return out


# ---- config.json -----------------------------------------------------------------------------------

def to_json(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=2, sort_keys=True)


def from_json(text: str, source: str | os.PathLike = "config.json") -> ml_collections.ConfigDict:
  """Inverse of `to_json`, laid over today's defaults (configs/base.py), so a run saved before a key
  existed still loads, with that key at its default. Tuples come back as lists. A damaged text is an error
  naming `source` (the file it was read from)."""
  config = base.get_config()
  values = files.parse_json(text, source)
  if not isinstance(values, dict):
    raise ConfigError(f"{source}: holds {type(values).__name__}, not a config (a JSON object)")
  _merge(config, values, "")
  return config


def _merge(config: ml_collections.ConfigDict, values: dict, prefix: str) -> None:
  for key, value in values.items():
    if isinstance(value, dict) and isinstance(config.get(key), ml_collections.ConfigDict):
      _merge(config[key], value, f"{prefix}{key}.")
    else:
      with config.ignore_type():
        config[key] = value


# ModelConfig fields that may differ between a checkpoint and the run that reads it (compute choices, not
# the shapes of the parameters).
RUNTIME_MODEL_FIELDS = ("dtype", "param_dtype", "moe_impl", "moe_capacity_factor", "attention_impl", "remat",
                        "router_aux_loss_weight", "router_z_loss_weight")


def model_differences(saved: ModelConfig, new: ModelConfig) -> list[str]:
  """'model.key: saved -> new' for every architecture field (not a compute choice) that differs: weights
  saved with `saved` cannot be read as `new`."""
  a, b = saved.to_dict(), new.to_dict()
  return [f"model.{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a) if k not in RUNTIME_MODEL_FIELDS and a[k] != b[k]]


def architecture_differences(saved: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> list[str]:
  """The keys whose change makes `new` unable to resume a run saved with `saved`: the model architecture
  (not its compute choices), the fine-tuning layout (which parameters and optimizer states exist), the
  optimizer (its state's layout) and its state dtype, and the tokenizer. Each entry reads 'key: saved -> new'."""
  diffs = model_differences(ModelConfig.from_config_dict(saved.model), ModelConfig.from_config_dict(new.model))
  for dotted in ("distill.method", "finetune.mode", "finetune.lora_rank", "finetune.lora_targets", "finetune.freeze_router",
                 "opt.optimizer", "opt.state_dtype", "data.tokenizer.kind", "data.tokenizer.vocab_size", "data.tokenizer.path"):
    group, *rest = dotted.split(".")
    a, b = saved[group], new[group]
    for name in rest:
      a, b = a[name], b[name]
    a, b = (_tuple(x) if isinstance(x, (list, tuple)) else x for x in (a, b))
    if a != b:
      diffs.append(f"{dotted}: {a!r} -> {b!r}")
  return diffs


# The keys of a run's config that change what it trains. Changing one on resume is allowed (a researcher extends
# train.num_steps or lowers opt.lr), but it is listed; `training_differences` names them. Everything else is
# bookkeeping or inference (train.log_every, sample.*, eval.*, mesh.*: where the run writes, samples or lays out
# its arrays) and the architecture keys, which `architecture_differences` refuses outright.
TRAINING_GROUPS = ("seed", "data", "diffusion", "distill", "opt", "train", "finetune")
TRAINING_MODEL_FIELDS = ("dtype", "param_dtype", "router_aux_loss_weight", "router_z_loss_weight")
NON_TRAINING_KEYS = frozenset((
    "data.cache_dir", "finetune.save_adapter", "opt.grad_accum_steps",  # the same update (optimizer docstring)
    "train.log_every", "train.eval_every", "train.eval_batches", "train.ckpt_every", "train.keep_checkpoints",
    "train.async_checkpointing", "train.progress_bar", "train.init_from",  # read only by a fresh run
    "train.nonfinite", "train.max_nonfinite_skips", "train.restore_step", "train.on_corrupt_checkpoint"))


def _leaves(value, prefix: str) -> dict:
  if isinstance(value, (ml_collections.ConfigDict, dict)):
    out = {}
    for key in value.keys():
      out.update(_leaves(value[key], f"{prefix}.{key}" if prefix else key))
    return out
  return {prefix: _tuple(value) if isinstance(value, (list, tuple)) else value}


def training_differences(saved: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> list[str]:
  """'key: saved -> new' for every key that changes what a run trains (TRAINING_GROUPS, the model's
  TRAINING_MODEL_FIELDS), other than the architecture keys of `architecture_differences`."""
  structural = {d.split(":")[0] for d in architecture_differences(saved, new)}
  a, b = {}, {}
  for group in TRAINING_GROUPS:
    a.update(_leaves(saved[group], group))
    b.update(_leaves(new[group], group))
  for field in TRAINING_MODEL_FIELDS:
    a[f"model.{field}"], b[f"model.{field}"] = saved.model.get(field), new.model.get(field)
  return [f"{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(set(a) | set(b))
          if key not in NON_TRAINING_KEYS and key not in structural and a.get(key) != b.get(key)]
