"""Sampling from a training run: load its checkpoint and config, encode a prompt, generate, decode.

`sample_from_workdir` is what `sample.py` calls. The model, data and diffusion settings come from the
run's own `config.json` (the checkpoint must be read with the architecture it was trained with); the
`sample` and `mesh` groups come from the config given on the command line, when one is given: the
params are restored sharded over that mesh and the sampler runs inside it (`trainer.mesh_context`:
rows over the batch axes, experts over 'expert' with model.moe_impl='expert_parallel').

Every request is checked before the checkpoint is read or anything is compiled (the sampler
settings, num_samples, max_new_tokens, infill, and the prompt against sample.max_context), with an
error naming the key. `sample.show='live'` redraws the canvases in the terminal at every step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import jax
import ml_collections
import numpy as np

from configs import base
from dgemma import checkpointing, quant, report, trainer
from dgemma import config as config_lib
from dgemma.data import pipeline as data_pipeline
from dgemma.data import sft
from dgemma.model import ModelConfig, Transformer
from dgemma.model.config import ConfigError
from dgemma.sampling import (GenerateOutput, LivePrinter, SamplerConfig, check_request, generate, infill_arrays,
                             trajectory_steps)


def run_config(workdir: str | Path, override: Optional[ml_collections.ConfigDict] = None) -> ml_collections.ConfigDict:
  """The run's saved config, with `sample` and `mesh` taken from `override` (mesh: the default
  cpu_host preset when there is no override)."""
  saved_path = Path(workdir) / "config.json"
  if not saved_path.exists():
    raise FileNotFoundError(f"--workdir: {saved_path} not found: is {workdir} a dgemma training workdir?")
  config = config_lib.from_json(saved_path.read_text())
  # The training mesh may need devices this host lacks: sample on the given (or default) mesh.
  config.mesh = (override if override is not None else base.get_config()).mesh
  if override is not None:
    config.sample = override.sample
  return config


@dataclasses.dataclass
class Samples:
  texts: list[str]
  output: GenerateOutput
  step: int


def sample_from_workdir(workdir: str, config: Optional[ml_collections.ConfigDict] = None, *,
                        steps: Optional[int] = None, seed: Optional[int] = None,
                        temperature: Optional[float] = None, print_fn=print) -> Samples:
  config = run_config(workdir, config)
  if steps is not None:
    config.sample.max_denoising_steps = steps
  if seed is not None:
    config.sample.seed = seed
  if temperature is not None:
    config.sample.t_max = config.sample.t_min = temperature
  config_lib.validate(config)
  # bad sampler settings, counts and infill positions fail before any loading or compiling
  sampler_cfg = SamplerConfig.from_config(config)
  n, max_new = int(config.sample.num_samples), int(config.sample.max_new_tokens)
  if n <= 0:
    raise ConfigError(f"sample.num_samples must be positive, got {n}")
  if max_new <= 0:
    raise ConfigError(f"sample.max_new_tokens must be positive, got {max_new}")
  infill = infill_arrays(config.sample.get("infill", ()), n, max_new, int(config.model.vocab_size))
  tokenizer = data_pipeline.prepare(config).tokenizer
  if config.data.get("format", "text") == "sft":  # the prompt as a user turn, rendered as in training
    prompt_ids = sft.prompt_ids(tokenizer, config.sample.prompt)
  else:
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(config.sample.prompt)
  check_request(sampler_cfg, batch=n, prompt_len=len(prompt_ids), max_new_tokens=max_new)
  qcfg = quant.QuantConfig.from_config(config)
  quant.check(ModelConfig.from_config_dict(config.model), qcfg)
  mesh = trainer.make_mesh(config.mesh)
  model_cfg, params, step = trainer.load_params(workdir, config, config.sample.checkpoint_step, mesh=mesh)
  params = quant.quantize_params(params, qcfg)  # sample.quantize: int8 / int4 weights ('none': unchanged)

  prompts_BP = np.tile(np.asarray(prompt_ids, np.int32)[None], (n, 1))
  lengths_B = np.full((n,), len(prompt_ids), np.int32)
  want_traj = bool(config.sample.trajectory_html)
  printer = None
  if sampler_cfg.show == "live":
    printer = LivePrinter(tokenizer.decode, [config.sample.prompt], total_steps=sampler_cfg.max_denoising_steps,
                          end_ids=sampler_cfg.end_ids)
  with trainer.mesh_context(mesh, config):
    out = generate(Transformer(model_cfg), params, prompts_BP, lengths_B, sampler_cfg,
                   jax.random.key(config.sample.seed), max_new, return_trajectory=want_traj,
                   infill_tokens_BN=infill[0], infill_mask_BN=infill[1], step_callback=printer)
    out = jax.device_get(out)
  texts = [tokenizer.decode(out.tokens_BN[b, :out.lengths_B[b]].tolist()) for b in range(n)]
  lines = []
  for b, text in enumerate(texts):
    lines.append(f"--- sample {b} (step {step}, {int(out.num_forwards_B[b])} decoder passes, "
                 f"{float(out.tokens_per_forward_B[b]):.2f} tokens/pass) ---")
    lines.append(config.sample.prompt + text)
  print_fn("\n".join(lines))
  checkpointing.write_text_atomic(Path(workdir) / "samples.txt", "\n".join(lines) + "\n")
  if want_traj:
    write_trajectory_html(out, tokenizer, config.sample.trajectory_html, prompt=config.sample.prompt)
    print_fn(f"trajectory written to {config.sample.trajectory_html}")
  return Samples(texts=texts, output=out, step=step)


def write_trajectory_html(out: GenerateOutput, tokenizer, path: str, prompt: str = "", row: int = 0) -> None:
  """Renders the first canvas of `row`: per step, the tokens it produced (accepted ones highlighted)."""
  tokens_SC, accepted_SC, entropy_SC = trajectory_steps(out.trajectory, row=row)
  pieces = [[tokenizer.decode([int(t)]) or "\u00b7" for t in step] for step in tokens_SC]
  html = report.trajectory_html(pieces, accepted_SC, entropy_SC, title="dgemma: one canvas being denoised",
                                prompt=prompt)
  checkpointing.write_text_atomic(path, html)
