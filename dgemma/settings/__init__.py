"""The config boundary: an experiment config (an `ml_collections.ConfigDict` from `configs/*.py`) is checked and
turned into typed, frozen settings here, once; everything below takes the typed settings.

  settings = dgemma.settings.from_config(config)   # every check; raises ConfigError naming the field
  settings.model       ModelConfig (dgemma.model), with the LoRA layout of `finetune`
  settings.data        DataSettings (+ .tokenizer, and a study's group)   settings.diffusion  DiffusionSettings
  settings.opt         OptimizerSettings   settings.train  TrainSettings   settings.distill  DistillSettings
  settings.finetune    FinetuneSettings    settings.eval   EvalSettings    settings.mesh     MeshSettings
  settings.sample      SampleSettings (the request, the sampler's keys, .quant: QuantConfig)
  settings.rl          RLSettings (dgemma/rl: GRPO on the model's own samples)
  settings.seed        int;  settings.imports   the study modules the config names
  settings.replace(**{"sample.t_max": 0.6})   # typed overrides of single keys, checked as a config would be
Values derived from them are computed, never stored beside them: `settings.end_ids` (sample.end_ids, or the
tokenizer's), `settings.canvas_sampler` (the SamplerConfig a compiled sampler takes, checked against the training
objective), `dgemma.finetune.base_quantizer(settings.finetune)` (a QLoRA run's frozen base).

Each key is declared once, with its type, default, bounds and doc, in the dataclass of its group
(dgemma/settings_fields.py; `python -m dgemma.settings` lists them all); the field's name is the key. A study's
modules (its data source, rewards, settings group) are named by the config's `imports` and imported before the rest
of it is read. `default_config()` is the raw config of every default: configs/base.py is it. Checks, all before
anything is built, read or compiled: every key must be declared; each group checks its values and their relations
when built; `_cross_checks` the relations between groups (the canvas fits the sequence, the tokenizer fits the
vocabulary, an mdlm mask id is not a real token, ...). The data source's own checks (its record in
`dgemma.data.sources`: files exist, shapes fit) run where its data is first needed (`dgemma.data.prepare`), so
sampling a run does not need its training files. A run's config.json is `to_json(settings)`; `from_json` reads one
back over today's defaults (a key added since keeps its default).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from typing import ClassVar, Sequence

import ml_collections

from dgemma import files, finetune as finetune_lib, quant, registry, settings_fields, tokenizers
from dgemma.diffusion import distill as distill_lib, objectives
from dgemma.diffusion.config import DiffusionSettings
from dgemma.errors import ConfigError
from dgemma.model.config import ModelConfig
from dgemma.rl.config import RLSettings
from dgemma.sampling.config import (BEGIN_OF_TOOL_RESPONSE_ID, END_OF_TURN_ID, EOS_ID, SampleSettings, SamplerConfig,
                                    SamplerSettings)
from dgemma.settings.groups import (DataSettings, DistillSettings, EvalSettings, FinetuneSettings, MeshSettings,
                                    MeshShape, OptimizerSettings, TokenizerSettings, TrainSettings)
from dgemma.settings.resume import (COMPUTE_MODEL_FIELDS, RUNTIME_MODEL_FIELDS, architecture_differences,
                                    model_differences, training_differences)
from dgemma.settings_fields import group, setting

LIST_COMMAND = "python -m dgemma.settings lists every key with its default and doc"
IMPORTS_DOC = ("modules imported before the rest of the config is read: a study's data source, rewards, eval "
               "metrics and settings groups register themselves from its modules (proj/<study>/)")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every group of a config, typed and checked (module docstring)."""
  GROUP: ClassVar[str] = ""
  seed: int = setting(0, "the run's seed: initialisation, data order, training noise")
  imports: tuple = setting((), IMPORTS_DOC, items=str)
  model: ModelConfig = group(ModelConfig, "the architecture: a preset from configs/models/")
  data: DataSettings = group(DataSettings, "which text, how it is tokenized and packed")
  diffusion: DiffusionSettings = group(DiffusionSettings, "uniform-state corruption and the training objective")
  distill: DistillSettings = group(DistillSettings, "discrete consistency distillation")
  opt: OptimizerSettings = group(OptimizerSettings, "the optimizer")
  train: TrainSettings = group(TrainSettings, "the training loop")
  finetune: FinetuneSettings = group(FinetuneSettings, "fine-tuning: which parameters train")
  rl: RLSettings = group(RLSettings, "reinforcement learning on the model's own samples (GRPO)")
  sample: SampleSettings = group(SampleSettings, "sampling (sample.py and the API)")
  eval: EvalSettings = group(EvalSettings, "evaluation (eval/)")
  mesh: MeshSettings = group(MeshSettings, "the device mesh: a preset from configs/mesh/")

  def __post_init__(self):
    settings_fields.check(self)
    _cross_checks(self)

  @property
  def objective(self) -> objectives.Objective:
    return objectives.get(self.diffusion.objective)

  @functools.cached_property
  def end_ids(self) -> tuple[int, ...]:
    """The tokens that end a response: sample.end_ids, or () = the tokenizer's (`tokenizer_end_ids`); ids outside
    the model's vocabulary are dropped."""
    ids = self.sample.end_ids or tokenizer_end_ids(self.data, self.sample.semantics)
    return tuple(i for i in ids if i < self.model.vocab_size)

  @functools.cached_property
  def sampler_config(self) -> SamplerConfig:
    """The sampler's keys with the values the other groups give it (canvas, end ids, mask id, leave-one-out
    logits); `canvas_sampler` is the same, checked against the training objective."""
    return SamplerConfig(self.sample.sampler_settings, canvas_len=self.diffusion.canvas_len, end_ids=self.end_ids,
                         mask_id=self.diffusion.mask_id, loo_logits=self.objective.leave_one_out)

  @functools.cached_property
  def canvas_sampler(self) -> SamplerConfig:
    """The canvas sampler, checked against the objective the model was trained with."""
    objective = self.objective
    if objective.autoregressive:
      raise ConfigError("diffusion.objective='ar' trains an autoregressive model: sample it with "
                        "dgemma.sampling.ar_generate (the API does so), not the canvas sampler")
    if self.sample.sampler not in objective.samplers:
      raise ConfigError(f"sample.sampler={self.sample.sampler!r} does not fit diffusion.objective="
                        f"{objective.name!r} (it takes {objective.samplers}): masked-diffusion (mdlm) models "
                        "need sample.sampler='masked', and only they")
    return self.sampler_config

  @property
  def config_json(self) -> str:
    """The run's config.json: every key's value (`from_json` reads it back)."""
    return to_json(self)

  def replace(self, **dotted) -> "Settings":
    """These settings with single keys replaced, e.g. `settings.replace(**{"sample.t_max": 0.6})`: every group is
    built again from the raw values (its checks run), and so are the values derived from them; the cross checks
    run again."""
    raw = settings_fields.to_raw(self)
    for key, value in dotted.items():
      _set_raw(raw, key, value)
    return _build(raw, _imports(raw))


def _set_raw(raw: dict, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = raw
  for name in parents:
    if not isinstance(node.get(name), dict):
      raise ConfigError(f"{dotted}: no config group {name!r}{did_you_mean(dotted)} ({LIST_COMMAND})")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"{dotted}: not a config key{did_you_mean(dotted)} ({LIST_COMMAND})")
  node[leaf] = tuple(value) if isinstance(value, list) else value


# ---- the raw config ------------------------------------------------------------------------------------

def _config_dict(tree: dict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({k: _config_dict(v) if isinstance(v, dict) else v for k, v in tree.items()})


def _imports(raw) -> tuple[str, ...]:
  """The config's `imports`, checked and imported (each registers its study's records)."""
  value = raw["imports"] if "imports" in raw else ()
  modules = settings_fields.value("imports", value, settings_fields.keys(Settings)["imports"])
  registry.import_modules(modules, "imports")
  return modules


def default_config(imports: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The raw config of every default (configs/base.py); its model is the released 26B-A4B trunk. `imports`: study
  modules to import first (their groups join the config, `imports` names them)."""
  modules = _imports({"imports": tuple(imports)})
  config = settings_fields.defaults(Settings, modules)
  config["imports"] = modules
  return _config_dict(config)


def did_you_mean(key: str, imports: Sequence[str] = ()) -> str:
  """' (did you mean K?)' with K the declared key nearest to a mistyped dotted `key`, or '' when none is near."""
  keys = [row[0] for row in settings_fields.rows(Settings, imports=imports)]
  parent, _, leaf = key.rpartition(".")
  siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
  if parent and siblings:  # a group that exists: the nearest of its own keys (a shared prefix proves nothing)
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    return f" (did you mean {parent}.{near[0]}?)" if near else ""
  groups = {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1)}
  near = difflib.get_close_matches(key, keys + sorted(groups), n=1, cutoff=0.75)
  return f" (did you mean {near[0]}?)" if near else ""


def from_config(config: ml_collections.ConfigDict) -> Settings:
  """Checks an experiment config and returns its Settings. Raises ConfigError naming the field (or, for a
  data file that does not exist, FileNotFoundError naming it)."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config: expected an ml_collections.ConfigDict from a configs/*.py get_config(), got "
                      f"{type(config).__name__}")
  modules = _imports(config)
  unknown = settings_fields.unknown_keys(Settings, config, "", modules)
  if unknown:
    hint = (" (a study's group exists when the config's `imports` name the module that registers it)"
            if any(k.count(".") > 1 for k in unknown) else "")
    raise ConfigError(f"unknown config key(s): {', '.join(k + did_you_mean(k, modules) for k in unknown)} "
                      f"({LIST_COMMAND}){hint}")
  return _build(config, modules)


def _build(raw, modules: tuple[str, ...]) -> Settings:
  """Settings from a raw config whose keys are known and whose `imports` (`modules`) are imported."""
  finetune = settings_fields.from_raw(FinetuneSettings, raw["finetune"] if "finetune" in raw else {})
  groups = dict(finetune=finetune)
  for f, spec in settings_fields.declared(Settings):
    if spec.kind == "group" and f.name not in groups:
      groups[f.name] = settings_fields.from_raw(spec.group, raw[f.name] if f.name in raw else {}, modules)
  groups["model"] = dataclasses.replace(groups["model"], lora=finetune_lib.lora_config(finetune))  # adapters: params
  groups["diffusion"].check_row(groups["data"].seq_len)
  return Settings(seed=raw["seed"] if "seed" in raw else 0, imports=modules, **groups)


def _cross_checks(st: Settings) -> None:
  """Relations between groups (each group checked its own when built)."""
  need = settings_fields.need
  model, data, diff = st.model, st.data, st.diffusion
  need(diff.canvases_per_row == 1 or data.format != "sft", "diffusion.canvases_per_row",
       f"data.format='sft' rows hold one response canvas; use 1, got {diff.canvases_per_row}")
  if st.objective.masked:
    need(diff.mask_id < model.vocab_size, "diffusion.mask_id",
         f"{diff.mask_id} is not an id of the model's vocabulary (model.vocab_size={model.vocab_size})")
    if data.tokenizer.kind in ("byte", "sentencepiece"):
      # Tokenizers built here use every id below their vocabulary size (4 specials, then pieces / bytes).
      tok_vocab = tokenizers.ByteTokenizer().vocab_size if data.tokenizer.kind == "byte" else data.tokenizer.vocab_size
      need(diff.mask_id >= tok_vocab, "diffusion.mask_id",
           f"{diff.mask_id} is a real token of the {data.tokenizer.kind} tokenizer (ids < {tok_vocab}); for "
           f"objective='mdlm' use an added id, e.g. mask_id={tok_vocab} with model.vocab_size > {tok_vocab}")
  if st.objective.needs_two_stream:
    need(model.decoder_two_stream, "diffusion.objective",
         f"{st.objective.name!r} is proper only for a decoder blind to each position's own token: set "
         "model.decoder_two_stream=True (with model.decoder_shift=True), or use loo_ce")
  if data.tokenizer.kind == "sentencepiece":
    need(model.vocab_size >= data.tokenizer.vocab_size, "model.vocab_size",
         f"{model.vocab_size} is smaller than data.tokenizer.vocab_size={data.tokenizer.vocab_size}")
  if data.tokenizer.kind == "byte":
    need(model.vocab_size >= tokenizers.ByteTokenizer().vocab_size, "model.vocab_size",
         f"{model.vocab_size} is too small for the byte tokenizer (256 bytes + 4 special tokens = 260)")
  need(st.opt.warmup_steps <= st.train.num_steps, "opt.warmup_steps",
       f"{st.opt.warmup_steps} warmup steps exceed train.num_steps={st.train.num_steps}")
  need(data.batch_size % st.opt.grad_accum_steps == 0, "opt.grad_accum_steps",
       f"{st.opt.grad_accum_steps} does not divide data.batch_size={data.batch_size}")
  for pos, token in st.sample.infill:
    need(token < model.vocab_size, "sample.infill", f"token id {token} at position {pos} is outside the vocabulary "
         f"[0, model.vocab_size={model.vocab_size})")
  base = finetune_lib.base_quantizer(st.finetune)
  if base is not None:
    quant.check(model, base.config)  # finetune.base_quant_group_size divides every quantized axis
  if distill_lib.enabled(st.distill):
    need(diff.short_canvas_len == 0, "diffusion.short_canvas_len",
         f"consistency distillation trains the configured canvases only; use 0, got {diff.short_canvas_len}")
    need(bool(st.train.init_from), "train.init_from", "distill.method='dcd' distils a trained run: name it here "
         "(a training workdir or params checkpoint; configs/distill_dcd.py:TEACHER sets it)")
    need(st.objective.corruption == objectives.UNIFORM and not st.objective.autoregressive, "distill.method",
         f"consistency distillation runs on the Gaussian relaxation of uniform-state diffusion; "
         f"diffusion.objective={st.objective.name!r} is not uniform-state")
  if st.rl.enabled:
    _rl_checks(st)
  expert_axis = st.mesh.shape.expert
  if model.moe_impl == "expert_parallel" and model.num_experts and expert_axis > 0:
    need(model.num_experts % expert_axis == 0, "model.num_experts",
         f"{model.num_experts} experts do not split over mesh.shape.expert={expert_axis} devices "
         "(moe_impl='expert_parallel' needs num_experts % expert == 0)")
  if st.sample.quant.scheme != "none":
    quant.check(model, st.sample.quant)  # sample.quant_group_size against this architecture (shapes only)
  st.sampler_config  # pylint: disable=pointless-statement  (the sampler's derived values, checked when built)


def _rl_checks(st: Settings) -> None:
  """What reinforcement learning (rl.algorithm, dgemma/rl) needs from the other groups."""
  need = settings_fields.need
  rl, sampler = st.rl, st.sample
  need(not st.objective.autoregressive and not st.objective.masked, "rl.algorithm",
       f"GRPO samples with the uniform-state canvas sampler; diffusion.objective={st.objective.name!r} is not one")
  need(sampler.sampler == "released", "sample.sampler", f"rl samples with the released sampler, whose trajectory "
       f"log-probability is exact (dgemma/rl/policy.py); got {sampler.sampler!r}")
  need(sampler.semantics == "hf", "sample.semantics", f"rl replays the sampler's steps with semantics 'hf'; got "
       f"{sampler.semantics!r}")
  need(sampler.renoise in ("non_accepted", "none"), "sample.renoise", f"rl reads each step's accepted draws; "
       f"renoise {sampler.renoise!r} also holds earlier ones (use 'non_accepted' or 'none')")
  need(sampler.show != "live", "sample.show", "rl samples inside the training loop: use 'none'")
  need(not distill_lib.enabled(st.distill), "distill.method", "rl and consistency distillation are two runs")
  need(st.diffusion.canvases_per_row == 1, "diffusion.canvases_per_row", "rl samples one canvas per prompt; use 1")
  mu = rl.num_iterations
  need(st.train.num_steps % mu == 0, "train.num_steps", f"{st.train.num_steps} updates are not a whole number of "
       f"rollouts of rl.num_iterations={mu} updates each")
  need(st.train.ckpt_every % mu == 0, "train.ckpt_every", f"checkpoints fall between rollouts only: use a multiple "
       f"of rl.num_iterations={mu}, got {st.train.ckpt_every}")
  need(rl.steps_per_update <= sampler.max_denoising_steps, "rl.steps_per_update", f"{rl.steps_per_update} > "
       f"sample.max_denoising_steps={sampler.max_denoising_steps}")
  need(st.opt.grad_accum_steps == 1, "opt.grad_accum_steps", "rl takes one gradient per update; use 1")


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
  ids = (EOS_ID, END_OF_TURN_ID) if not os.path.isfile(data.tokenizer.path) else _file_end_ids(data.tokenizer.path)
  if semantics == "official" and len(ids) > 1:
    ids = ids + (BEGIN_OF_TOOL_RESPONSE_ID,)
  return ids


def _file_end_ids(path: str) -> tuple[int, ...]:
  try:
    tokenizer = tokenizers.load_tokenizer_file(path)
  except (ValueError, OSError) as e:
    raise ConfigError(f"data.tokenizer.path: {e}") from e
  return tokenizers.end_ids(tokenizer)


def run_model(config_json: str, source: str | os.PathLike = "config.json"
              ) -> tuple[ModelConfig, "quant.Quantizer | None"]:
  """What a checkpoint's reader needs of the config.json of the run its weights come from, without building the rest
  of the settings: the architecture with its LoRA layout, and how the run holds its frozen base (a QLoRA run's
  `finetune.base_quant`, `dgemma.finetune.base_quantizer`; None for float weights). Errors name `source`."""
  raw = from_json(config_json, source)
  finetune = settings_fields.from_raw(FinetuneSettings, raw.finetune)
  model = dataclasses.replace(settings_fields.from_raw(ModelConfig, raw.model), lora=finetune_lib.lora_config(finetune))
  return model, finetune_lib.base_quantizer(finetune)


# ---- editing a raw config (above the boundary: config files, command lines) ----------------------------

def set_key(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  """config.<dotted> = value (lists become tuples); a key no group declares raises naming it."""
  *parents, leaf = dotted.split(".")
  node = config
  for name in parents:
    if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
      raise ConfigError(f"{dotted}: no config group {name!r}{did_you_mean(dotted)} ({LIST_COMMAND})")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"{dotted}: not a config key{did_you_mean(dotted)} ({LIST_COMMAND})")
  with node.ignore_type():
    node[leaf] = tuple(value) if isinstance(value, list) else value


def with_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """A copy of `config` with {dotted key: value} overrides ({'sample.max_denoising_steps': 8})."""
  out = ml_collections.ConfigDict(config.to_dict())
  for dotted, value in dict(overrides).items():
    set_key(out, dotted, value)
  return out


# ---- config.json ---------------------------------------------------------------------------------------

def to_json(config) -> str:
  """A run's config.json text, from Settings (every key's value) or from a raw config."""
  if isinstance(config, Settings):
    return json.dumps(settings_fields.to_raw(config), indent=2, sort_keys=True)
  return config.to_json_best_effort(indent=2, sort_keys=True)


def from_json(text: str, source: str | os.PathLike = "config.json") -> ml_collections.ConfigDict:
  """The raw config of a config.json text, laid over today's defaults, so a run saved before a key existed still
  loads, with that key at its default. Tuples come back as lists. A damaged text is an error naming `source`
  (the file it was read from). The study modules it names (`imports`) are imported first, so their groups are
  there to lay values on."""
  values = files.parse_json(text, source)
  if not isinstance(values, dict):
    raise ConfigError(f"{source}: holds {type(values).__name__}, not a config (a JSON object)")
  config = default_config(values.get("imports", ()))
  _merge(config, values)
  return config


def load_json(text: str, source: str | os.PathLike = "config.json") -> Settings:
  """The Settings of a config.json text (`from_json`, then `from_config`)."""
  return from_config(from_json(text, source))


def _merge(config: ml_collections.ConfigDict, values: dict) -> None:
  for key, value in values.items():
    if isinstance(value, dict) and isinstance(config.get(key), ml_collections.ConfigDict):
      _merge(config[key], value)
    else:
      with config.ignore_type():
        config[key] = value


__all__ = ["Settings", "from_config", "default_config", "to_json", "from_json", "load_json", "set_key",
           "with_overrides", "tokenizer_end_ids", "run_model", "model_differences", "architecture_differences",
           "training_differences", "RUNTIME_MODEL_FIELDS", "COMPUTE_MODEL_FIELDS", "DataSettings", "TokenizerSettings",
           "OptimizerSettings", "TrainSettings", "DistillSettings", "FinetuneSettings", "SampleSettings",
           "SamplerSettings", "EvalSettings", "MeshSettings", "MeshShape", "RLSettings", "DiffusionSettings",
           "ModelConfig", "SamplerConfig"]
