"""One loader for every evaluation entry point: `--checkpoint` is a training workdir or a params checkpoint.

  ckpt = load_checkpoint("workdirs/demo")                          # config.json + Orbax run checkpoints
  ckpt = load_checkpoint("/ckpts/dgemma", config=demo_config)      # params/ + model_config.json
  ckpt.model, ckpt.params, ckpt.config, ckpt.tokenizer, ckpt.objective

A training workdir carries its whole config (config.json); the architecture, data/tokenizer and diffusion
settings come from it, and the `sample`, `eval` and `seed` settings from `config` when one is given (like
sample.py). A params checkpoint carries only the architecture (model_config.json): the tokenizer and the
diffusion settings must come from `config` (an error says so), and its `model` group is replaced by the
checkpoint's. Every problem is reported naming the path or field before params are read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Optional

import ml_collections

from dgemma import checkpoint_io, checkpointing, sample_lib, trainer
from dgemma import config as config_lib
from dgemma.data import pipeline as data_pipeline
from dgemma.model import ModelConfig, Transformer
from dgemma.model.config import ConfigError

# Groups a caller's config may change on top of a training workdir's saved config (evaluation only).
EVAL_GROUPS = ("sample", "eval", "seed")


@dataclasses.dataclass
class Checkpoint:
  """Loaded params and the config they are evaluated with.

  path: what --checkpoint named; kind: 'workdir' | 'params'; step: training step (None for params).
  """

  path: str
  kind: str
  config: ml_collections.ConfigDict
  model_cfg: ModelConfig
  params: Any
  step: Optional[int]

  @property
  def model(self) -> Transformer:
    return Transformer(self.model_cfg)

  @property
  def objective(self) -> str:
    return str(self.config.diffusion.objective)

  @functools.cached_property
  def tokenizer(self):
    return data_pipeline.prepare(self.config).tokenizer


def checkpoint_kind(path: str | Path) -> str:
  """'workdir' (config.json + checkpoints/) or 'params' (model_config.json + params/); raises otherwise."""
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"--checkpoint: {path} does not exist")
  if (p / "config.json").is_file() and checkpointing.checkpoint_dir(p).is_dir():
    return "workdir"
  if (p / checkpoint_io.MODEL_CONFIG).is_file():
    return "params"
  raise FileNotFoundError(
      f"--checkpoint: {path} is neither a training workdir (config.json + checkpoints/, from train.py) "
      f"nor a params checkpoint ({checkpoint_io.MODEL_CONFIG} + params/, from python -m dgemma.convert)")


def resolve_config(path: str | Path, config: Optional[ml_collections.ConfigDict] = None) -> ml_collections.ConfigDict:
  """The config a checkpoint is evaluated with (no params read); validated."""
  kind = checkpoint_kind(path)
  if kind == "workdir":
    run = sample_lib.run_config(path)
    if config is not None:
      for group in EVAL_GROUPS:
        with run.ignore_type():
          run[group] = config[group]
  else:
    if config is None:
      raise ConfigError(f"--checkpoint: {path} is a params checkpoint, which holds no tokenizer or diffusion "
                        "settings: pass --config=configs/<the run's config>.py as well")
    run = ml_collections.ConfigDict(config.to_dict())
    saved = json.loads((Path(path) / checkpoint_io.MODEL_CONFIG).read_text())
    model = ModelConfig.from_config_dict(saved).to_dict()
    for key, value in model.items():
      if key in run.model:
        with run.model.ignore_type():
          run.model[key] = value
  config_lib.validate(run)
  return run


def load_checkpoint(path: str | Path, config: Optional[ml_collections.ConfigDict] = None, *,
                    step: int = -1) -> Checkpoint:
  """Loads params (latest step of a workdir when step < 0) and resolves the config (see the module doc)."""
  run = resolve_config(path, config)
  kind = checkpoint_kind(path)
  if kind == "workdir":
    model_cfg, params, got_step = trainer.load_params(str(path), run, step)
    return Checkpoint(str(path), kind, run, model_cfg, params, got_step)
  params, _ = checkpoint_io.load_params(path)
  model_cfg = config_lib.validate(run)
  return Checkpoint(str(path), kind, run, model_cfg, params, None)


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted-key overrides ({'sample.max_denoising_steps': 8}); unknown keys raise
  naming the key."""
  out = ml_collections.ConfigDict(config.to_dict())
  for dotted, value in overrides.items():
    *parents, leaf = dotted.split(".")
    node = out
    for name in parents:
      if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
        raise ConfigError(f"{dotted}: no config group {name!r} (configs/base.py)")
      node = node[name]
    if leaf not in node:
      raise ConfigError(f"{dotted}: not a config key (configs/base.py)")
    with node.ignore_type():
      node[leaf] = tuple(value) if isinstance(value, list) else value
  return out


def cli_config(config: Optional[ml_collections.ConfigDict], checkpoint: str,
               eval_flags: dict[str, Any]) -> Optional[ml_collections.ConfigDict]:
  """The config an eval CLI runs with: --config (or, when any `eval.*` flag is given, the checkpoint's run
  config) with those flags (absl FlagHolders by eval key) written into `eval`; None = the run's own."""
  if config is None and any(f.value is not None for f in eval_flags.values()):
    config = resolve_config(checkpoint)
  if config is not None:
    config = ml_collections.ConfigDict(config.to_dict())
    for name, flag in eval_flags.items():
      if flag.value is not None:
        config.eval[name] = flag.value
  return config
