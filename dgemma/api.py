"""The front door: load any checkpoint, then generate, chat or score.

  model = dgemma.load("workdirs/demo")          # a run, a params checkpoint, an adapter or an HF directory
  out = model.generate(["ROMEO:", "To be"], max_new_tokens=64, steps=32, seed=0)
  out[0].text, out[0].token_ids, out[0].num_forwards, out[0].tokens_per_forward
  model.chat([{"role": "user", "content": "Hi"}])          # or a list of conversations
  model.score(["Some text."])["bits_per_byte"]            # the numbers eval.likelihood reports

`load` reads params only (never a run's optimizer state), finds the tokenizer that belongs to the weights
(a run's WORKDIR/tokenizer.model or its byte tokenizer; tokenizer.model, else tokenizer.json, beside
converted or Hugging Face weights), and checks every setting before reading a weight. The settings of a
run, and of anything made from one (its adapter, a conversion or export), are the run's; for other checkpoints
`config` (or every default, with the canvas length and generation_config.json of an HF directory). The Model
holds typed Settings (`model.settings`). A model trained with diffusion.objective='ar' (or a Gemma 4 AR
directory) generates with the AR decoder behind the same call.

Sampler settings per call: `steps` (sample.max_denoising_steps), `temperature` (sample.t_max = t_min) and
any key of the `sample` group as a keyword (`t_max=0.6`, `sampler='ancestral'`, ...), checked like a config
(`Settings.replace`). Prompts of new lengths and batch sizes reuse compiled programs (`generate_ids` pads them to
a few shapes, dgemma/sampling/generation.py `bucketed_shape`).
Streaming: `on_step(view)` gets a `dgemma.sampling.StepView` after every denoising step and
`on_canvas(view)` a `CanvasView` per finished canvas, so a notebook can show the text as it forms.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import jax
import ml_collections
import numpy as np
from absl import logging

from dgemma import checkpoints, files, jax_cache, quant, run_report, settings_fields, tokenizers
from dgemma import finetune as finetune_lib
from dgemma import data as data_lib
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.checkpoints import convert as convert_lib
from dgemma.data import jsonl, sft
from dgemma.diffusion import likelihood, objectives
from dgemma.errors import ConfigError, DataError
from dgemma.model import Transformer
from dgemma.sampling import LivePrinter, StepView, ar_generate, check_request, generate, trajectory_steps
from dgemma.sampling import generation
from dgemma.sampling.generation import bucketed_shape

# Groups a caller's config may set on top of a training run's saved config (evaluation only).
EVAL_GROUPS = ("sample", "eval", "seed", "mesh")
Conversation = Sequence[Mapping[str, str]]


@dataclasses.dataclass
class Generation:
  """One prompt's result. token_ids: the generated ids up to and including the end token (when one was
  generated); text: their decoding without the end token; num_forwards: decoder passes (AR: one per
  token); tokens_per_forward: len(token_ids) / num_forwards; trajectory: the first canvas step by step
  ({'tokens', 'accepted', 'entropy'}: [steps, canvas_len]) when asked for."""
  prompt: str
  text: str
  token_ids: list[int]
  num_forwards: int
  tokens_per_forward: float
  ended: bool
  trajectory: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class CanvasView:
  """A finished canvas, on the host: its index and, per row, the tokens it committed (cut after the end
  token; empty for rows that had already ended) and their text."""
  canvas_idx: int
  token_ids: list[list[int]]
  texts: list[str]


class _Streamer:
  """The step callback of one generate call: forwards steps to on_step (the first `rows` rows: the rest are
  padding, `bucketed_shape`; with `.texts`, each row's canvas result decoded) and turns them into per-canvas
  views for on_canvas (a canvas is done when the next one starts, and at the end)."""

  def __init__(self, decode, end_ids, on_step, on_canvas, rows: int):
    self._decode, self._end_ids, self._rows = decode, tuple(end_ids), rows
    self._on_step, self._on_canvas = on_step, on_canvas
    self._canvas, self._result_BC, self._ran_B = -1, None, None

  def __call__(self, view: StepView) -> None:
    n = self._rows
    view = dataclasses.replace(view, tokens_BC=view.tokens_BC[:n], accepted_BC=view.accepted_BC[:n],
                               result_BC=view.result_BC[:n], active_B=view.active_B[:n])
    if view.canvas_idx != self._canvas:
      self.flush()
      self._canvas, self._ran_B = view.canvas_idx, np.zeros(view.active_B.shape, bool)
    self._ran_B = self._ran_B | view.active_B
    self._result_BC = view.result_BC
    if self._on_step is not None:
      self._on_step(dataclasses.replace(view, texts=tuple(self._decode([int(t) for t in row])
                                                          for row in view.result_BC)))

  def flush(self) -> None:
    if self._result_BC is None or self._on_canvas is None:
      self._result_BC = None
      return
    rows = []
    for b, ran in enumerate(self._ran_B):
      ids = [int(t) for t in self._result_BC[b]] if ran else []
      ends = [i for i, t in enumerate(ids) if t in self._end_ids]
      rows.append(ids[:ends[0] + 1] if ends else ids)
    self._on_canvas(CanvasView(self._canvas, rows, [self._decode(r) for r in rows]))
    self._result_BC = None


def _copy(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(config.to_dict())


_set = settings_lib.set_key


def run_config(header: checkpoints.Checkpoint, config: Optional[ml_collections.ConfigDict] = None
               ) -> ml_collections.ConfigDict:
  """The raw config a checkpoint is used with (nothing is read but its metadata): what a command line or an
  evaluation tool assembles before `run_settings` checks it.

  A run, and a checkpoint that carries a run's settings (its adapter, a conversion or HF export of it): the
  run's config, with `sample`, `eval`, `seed` and `mesh` taken from `config` when given. Any other kind:
  `config` (default: every default) with the checkpoint's architecture (its compute choices, COMPUTE_MODEL_FIELDS
  such as model.moe_impl, `config`'s), the tokenizer file found beside the
  weights, and (without `config`) the HF config's canvas length and generation_config.json's sampler settings;
  a Gemma 4 AR directory is an 'ar' model."""
  if header.config_json is not None:
    run = settings_lib.from_json(header.config_json, source=f"{header.path} (its run's config)")
    source = config if config is not None else settings_lib.default_config()
    for group in EVAL_GROUPS if config is not None else ("mesh",):
      with run.ignore_type():
        run[group] = _copy(source[group]) if isinstance(source[group], ml_collections.ConfigDict) else source[group]
    return run
  run = _copy(config) if config is not None else settings_lib.default_config()
  model = header.model.to_dict()
  if config is not None:  # how the forward pass is computed (moe_impl, ...) is the caller's to choose
    model.update({name: config.model[name] for name in settings_lib.COMPUTE_MODEL_FIELDS if name in config.model})
  run.model = ml_collections.ConfigDict(model)
  if header.tokenizer_file is not None:
    run.data.tokenizer.kind, run.data.tokenizer.path = "file", str(header.tokenizer_file)
  elif config is None:
    raise ConfigError(f"{header.path} holds no tokenizer (tokenizer.model or tokenizer.json): pass a config "
                      "whose data.tokenizer names one (dgemma.load(..., config=), or on a command line "
                      "--config=configs/<the run's config>.py)")
  hf_config = header.hf_config or {}
  if config is None:
    canvas = int(hf_config.get("canvas_length", run.diffusion.canvas_len))
    run.diffusion.canvas_len = canvas
    run.data.seq_len = 2 * canvas  # scoring's default context: one canvas of text before each canvas
    if hf_config and hf_config.get("model_type") != checkpoints.hf.DIFFUSION:
      run.diffusion.objective = "ar"  # a Gemma 4 AR checkpoint: its diffusion head was never trained
    generation = Path(header.path) / checkpoints.hf.GENERATION_CONFIG
    if header.kind == "hf" and generation.is_file():
      for name, value in convert_lib.sample_settings_from_generation_config(files.read_json(generation)).items():
        _set(run, f"sample.{name}", value)
  return run


def run_settings(header: checkpoints.Checkpoint, config: Optional[ml_collections.ConfigDict] = None, *,
                 quantize: Optional[str] = None, dtype: Optional[str] = None,
                 mesh: Optional[Mapping] = None) -> settings_lib.Settings:
  """The checked Settings a checkpoint is used with (`run_config`, with load's quantize / dtype / mesh sizes)."""
  run = run_config(header, config)
  if quantize is not None:
    _set(run, "sample.quantize", quantize)
  if dtype is not None:
    _set(run, "model.dtype", dtype)
    _set(run, "model.param_dtype", dtype)
  for axis, size in (mesh or {}).items():
    _set(run, f"mesh.shape.{axis}", int(size))
  return settings_lib.from_config(run)


def load(path: str, *, step: Optional[int] = None, quantize: Optional[str] = None, mesh=None,
         dtype: Optional[str] = None, config: Optional[ml_collections.ConfigDict] = None,
         settings: Optional[settings_lib.Settings] = None, field: str = "path", base: Optional[str] = None,
         any_base: bool = False) -> "Model":
  """Loads the params of any checkpoint kind (module docstring).

  step: a run's training step (default: sample.checkpoint_step, -1 = the latest).
  quantize: 'int8' | 'int4' | 'int4_experts' weight-only quantization at load (sample.quantize).
  mesh: a jax Mesh, or {axis: size} over (data, fsdp, expert, tensor) (default: config.mesh, data-parallel
    over this host's devices). dtype: 'float32' | 'bfloat16' parameters and compute.
  config: a raw config to use (module docstring); settings: checked Settings to use instead (`run_settings`).
  field: how errors name `path` (a command line passes its flag, checkpoints.CHECKPOINT_FLAG).
  base: an adapter's base other than the one it records; any_base: load an adapter on a base whose weights are not
    the ones it was trained on (refused otherwise, naming both: checkpoints.identity).
  """
  jax_cache.enable()
  header = checkpoints.header(path, field, base=base, any_base=any_base)
  if settings is None:  # every check before a weight is read
    settings = run_settings(header, config, quantize=quantize, dtype=dtype,
                            mesh=mesh if isinstance(mesh, Mapping) else None)
  return load_with(header, settings, step=step, mesh=mesh if isinstance(mesh, jax.sharding.Mesh) else None)


def load_with(header: checkpoints.Checkpoint, settings: settings_lib.Settings, *, step: Optional[int] = None,
              mesh=None, tokenizer: Optional[tokenizers.Tokenizer] = None) -> "Model":
  """The weights `header` describes, with `settings` (and the `tokenizer` already built for them, if any): what
  `load` does once the settings are checked, for callers that hold them (sample.py's request). Nothing the header
  holds is read again."""
  jax_mesh = mesh if mesh is not None else mesh_lib.make_mesh(settings.mesh.axis_sizes)
  source = checkpoints.at_step(header, settings.sample.checkpoint_step if step is None else step)
  # laid out as the settings' model (its dtypes and compute choices: a run's, also for the weights of a run kept
  # elsewhere, its adapter, conversion or export), so they generate as the run does; a QLoRA run (and its adapter)
  # on the quantized base it trained against (finetune.base_quant), the other weights quantized as sample.quantize
  # says while they are read (an HF directory or params checkpoint: one tensor at a time, so the float model never
  # exists on the device; docs/finetuning.md)
  placement = checkpoints.Placement(jax_mesh, settings.mesh.axis_rules)
  quantizer = quant.chain(finetune_lib.base_quantizer(settings.finetune), quant.Quantizer(settings.sample.quant))
  ckpt = checkpoints.load_as(source, settings.model, placement=placement, quantizer=quantizer)
  if settings.sample.weight_layouts == "auto" and not settings.objective.autoregressive:
    # moved, one weight at a time, into the layouts the generate program picks (`compiled_weight_formats`); every
    # later program reads them as they are. `leaves` holds the only references: each is let go as it moves.
    formats = jax.tree.leaves(compiled_weight_formats(ckpt.params, settings, jax_mesh))
    leaves, treedef = jax.tree.flatten(ckpt.params)
    ckpt = dataclasses.replace(ckpt, params=None)
    generation.lay_out(leaves, formats)
    ckpt = dataclasses.replace(ckpt, params=jax.tree.unflatten(treedef, leaves))
  return Model(ckpt, settings, jax_mesh, tokenizer=tokenizer)


def compiled_weight_formats(params, settings: settings_lib.Settings, mesh):
  """The memory layouts the generate program picks for `params` (arrays or placed jax.ShapeDtypeStructs), compiled
  for a one-row request of the settings' max_new_tokens in the smallest prompt bucket
  (`generation.compiled_weight_formats`): where dgemma.load puts the weights with sample.weight_layouts='auto'."""
  _, prompt_len = bucketed_shape(batch=1, prompt_len=1, max_new_tokens=settings.sample.max_new_tokens,
                                 canvas_len=settings.diffusion.canvas_len, max_context=settings.sample.max_context)
  with mesh_lib.mesh_context(mesh, settings.mesh.axis_rules):
    return generation.compiled_weight_formats(Transformer(settings.model), params, settings.canvas_sampler,
                                              max_new_tokens=settings.sample.max_new_tokens, prompt_len=prompt_len)


class Model:
  """A loaded checkpoint with its settings, tokenizer and (possibly quantized) params."""

  def __init__(self, checkpoint: checkpoints.Checkpoint, settings: settings_lib.Settings, mesh,
               tokenizer: Optional[tokenizers.Tokenizer] = None):
    self._warned_no_turns = False
    self.checkpoint = checkpoint
    self.settings = settings
    self.mesh = mesh
    self.tokenizer = tokenizer if tokenizer is not None else tokenizer_for(settings, checkpoint)
    if self.tokenizer.vocab_size > settings.model.vocab_size:
      raise ConfigError(f"model.vocab_size: {settings.model.vocab_size} is smaller than the tokenizer's "
                        f"vocabulary ({self.tokenizer.vocab_size}, {self.tokenizer!r})")
    self.params = quant.quantize_params(checkpoint.params, settings.sample.quant)  # already, when read by load_with

  def with_settings(self, settings: settings_lib.Settings) -> "Model":
    """The same weights with other settings (e.g. an ablation's sample / eval overrides); the architecture,
    tokenizer and quantization must stay those the weights were loaded with."""
    diffs = settings_lib.model_differences(self.settings.model, settings.model)
    if diffs or settings.sample.quant != self.settings.sample.quant:
      raise ConfigError(f"with_settings: the architecture or sample.quantize differs from the loaded weights "
                        f"({'; '.join(diffs) or 'quantization'}); load the checkpoint again")
    other = object.__new__(Model)
    other.__dict__.update(self.__dict__)
    other.settings = settings
    return other

  def with_config(self, config: ml_collections.ConfigDict) -> "Model":
    """`with_settings` of a raw config (checked)."""
    return self.with_settings(settings_lib.from_config(config))

  def with_overrides(self, **dotted) -> "Model":
    """`with_settings` of these settings with single keys replaced: model.with_overrides(**{"eval.seed": 3})."""
    return self.with_settings(self.settings.replace(**dotted))

  @property
  def model_cfg(self):
    return self.checkpoint.model

  @property
  def step(self) -> Optional[int]:
    return self.checkpoint.step

  @property
  def path(self) -> str:
    return self.checkpoint.path

  @property
  def objective(self):
    return self.settings.objective

  def __repr__(self) -> str:
    return (f"dgemma.Model({self.path!r}, kind={self.checkpoint.kind!r}, step={self.step}, "
            f"objective={self.objective.name!r}, tokenizer={self.tokenizer!r})")

  # ---- settings of one call, prompts ----

  def call_settings(self, **kwargs) -> settings_lib.Settings:
    """These settings with this call's sample.* overrides (`call_settings` below)."""
    return call_settings(self.settings, **kwargs)

  def prompt_ids(self, prompt: str) -> list[int]:
    return encode_prompt(self.tokenizer, prompt)

  def chat_ids(self, conversation: Conversation) -> list[int]:
    return encode_chat(self.tokenizer, conversation)

  def generate(self, prompts: Union[str, Sequence[str]], *, max_new_tokens: int = 256, steps: Optional[int] = None,
               seed: int = 0, return_trajectory: bool = False, on_step: Optional[Callable] = None,
               on_canvas: Optional[Callable] = None, **sampler_overrides) -> Union[Generation, list[Generation]]:
    """Generates from one prompt (-> a Generation) or a list of prompts of any lengths (-> a list).
    Row b draws its randomness from fold_in(key(seed), b), as `dgemma.sampling.generate` does."""
    single = isinstance(prompts, str)
    texts = [prompts] if single else _texts("prompts", prompts)
    out = self.generate_ids([self.prompt_ids(t) for t in texts], texts, max_new_tokens=max_new_tokens, steps=steps,
                         seed=seed, return_trajectory=return_trajectory, on_step=on_step, on_canvas=on_canvas,
                         **sampler_overrides)
    return out[0] if single else out

  def chat(self, conversations: Union[Conversation, Sequence[Conversation]], *, max_new_tokens: int = 256,
           steps: Optional[int] = None, seed: int = 0, **kwargs) -> Union[Generation, list[Generation]]:
    """The model's next turn for one conversation ([{role, content}, ...], roles 'user' / 'model' or
    'assistant') or a list of them; generation stops at end-of-turn (sample.end_ids)."""
    single = bool(conversations) and isinstance(conversations[0], Mapping)
    convs = [conversations] if single else list(conversations)
    if not tokenizers.chat_turn_ids(self.tokenizer) and not self._warned_no_turns:
      self._warned_no_turns = True
      logging.warning("chat: %r has no Gemma 4 turn markers (<|turn>, <turn|>), so turns are rendered as plain "
                      "text; a model not trained on that format may not answer as in a chat", self.tokenizer)
    out = self.generate_ids([self.chat_ids(c) for c in convs], [c[-1]["content"] if c else "" for c in convs],
                            max_new_tokens=max_new_tokens, steps=steps, seed=seed, **kwargs)
    return out[0] if single else out

  def generate_ids(self, ids: list[list[int]], prompts: list[str], *, max_new_tokens: Optional[int] = None,
                   steps: Optional[int] = None, seed: Optional[int] = None, return_trajectory: bool = False,
                   on_step=None, on_canvas=None, checked: bool = False, **overrides) -> list[Generation]:
    """Generation from token ids (the shared body of generate, chat, sample.py and eval/): `ids` one list per
    row, `prompts` the text reported with each row; None = the setting. The batch and the prompt length are
    padded to a few sizes (`dgemma.sampling.generation.bucketed_shape`), so prompts of new lengths reuse
    compiled programs; the tokens are those of the unpadded request. The request (positions, free memory) is
    checked once, here, unless the caller did (`checked`: sample.py checks it before reading a weight)."""
    if not ids:
      raise ValueError("prompts: need at least one prompt")
    streaming = on_step is not None or on_canvas is not None
    st = self.call_settings(max_new_tokens=max_new_tokens, steps=steps, seed=seed,
                            live=streaming and not self.objective.autoregressive, **overrides)
    rows, pad = len(ids), self.tokenizer.pad_id
    prompt_len = max(len(x) for x in ids)
    if not self.objective.autoregressive and not checked:
      check_request(st.canvas_sampler, batch=rows, prompt_len=prompt_len, max_new_tokens=st.sample.max_new_tokens,
                    model_cfg=self.model_cfg)
    batch, length = bucketed_shape(batch=rows, prompt_len=prompt_len, max_new_tokens=st.sample.max_new_tokens,
                                   canvas_len=1 if self.objective.autoregressive else st.diffusion.canvas_len,
                                   max_context=st.sample.max_context)
    lengths_B = np.ones((batch,), np.int32)  # padding rows: one token, and they start ended
    prompts_BP = np.full((batch, length), pad, np.int32)
    for b, x in enumerate(ids):
      prompts_BP[b, :len(x)], lengths_B[b] = x, len(x)
    prompts_BP[rows:, 0] = self.tokenizer.bos_id
    rng = jax.random.key(st.sample.seed)
    model = Transformer(self.model_cfg)
    traj = None
    with mesh_lib.mesh_context(self.mesh, st.mesh.axis_rules):
      if self.objective.autoregressive:
        tokens_BN, lengths_out_B = jax.device_get(ar_generate(
            model, self.params, prompts_BP, lengths_B, rng, st.sample.max_new_tokens, st.eval.ar_temperature,
            st.end_ids, pad_id=pad))
        passes_B = np.maximum(lengths_out_B, 1)
        end_ids = st.end_ids
      else:
        sampler = st.canvas_sampler
        streamer = _Streamer(self.tokenizer.decode, sampler.end_ids, on_step, on_canvas, rows) if streaming else None
        out = jax.device_get(generate(model, self.params, prompts_BP, lengths_B, sampler, rng,
                                      st.sample.max_new_tokens, return_trajectory=return_trajectory,
                                      step_callback=streamer, row_active_B=np.arange(batch) < rows, check=False))
        if streamer is not None:
          streamer.flush()
        tokens_BN, lengths_out_B, passes_B = out.tokens_BN, out.lengths_B, out.num_forwards_B
        traj, end_ids = out.trajectory, sampler.end_ids
    results = []
    for b in range(rows):
      token_ids = [int(t) for t in tokens_BN[b, :lengths_out_B[b]]]
      ended = bool(token_ids) and token_ids[-1] in end_ids
      body = token_ids[:-1] if ended else token_ids
      record = None
      if traj is not None:
        tokens_SC, accepted_SC, entropy_SC = trajectory_steps(traj, row=b)
        record = {"tokens": tokens_SC, "accepted": accepted_SC, "entropy": entropy_SC}
      results.append(Generation(prompt=prompts[b], text=self.tokenizer.decode(body), token_ids=token_ids,
                                num_forwards=int(passes_B[b]),
                                tokens_per_forward=len(token_ids) / max(int(passes_B[b]), 1), ended=ended,
                                trajectory=record))
    return results

  # ---- likelihood ----

  def score(self, texts: Union[str, Sequence[str]], **eval_overrides) -> dict:
    """The likelihood of `texts` (each a document): the NELBO bound (diffusion) or the exact NLL (AR), in
    nats/token, bits per UTF-8 byte and perplexity, with standard errors: the numbers eval.likelihood
    reports. eval.* keys as keywords (num_t_samples=16, context_len=..., seed=...)."""
    st = self.settings.replace(**{f"eval.{name}": value for name, value in eval_overrides.items()}) \
        if eval_overrides else self.settings
    texts = [texts] if isinstance(texts, str) else _texts("texts", texts)
    for i, text in enumerate(texts):
      if not text.strip():
        raise ValueError(f"texts[{i}]: an empty document has no tokens to score")
    docs = [likelihood.cut_document(t, self.tokenizer, st.eval.max_tokens) for t in texts]
    with mesh_lib.mesh_context(self.mesh, st.mesh.axis_rules):
      out = likelihood.score_documents(self.params, self.model_cfg, st.diffusion, st.eval, docs,
                                       seq_len=st.data.seq_len, pad_id=self.tokenizer.pad_id,
                                       max_positions=st.sample.max_context)
    return {"checkpoint": self.path, "step": self.step, **out}


def call_settings(settings: settings_lib.Settings, *, max_new_tokens: Optional[int] = None,
                  steps: Optional[int] = None, seed: Optional[int] = None, temperature: Optional[float] = None,
                  live: bool = False, **sample_overrides) -> settings_lib.Settings:
  """`settings` with one call's sample.* overrides, checked as a config would be (`Settings.replace`): `steps`
  (sample.max_denoising_steps), `temperature` (sample.t_max = t_min; an AR model's eval.ar_temperature),
  `live` (sample.show='live'), and any key of the sample group. Overrides that change nothing: `settings`
  themselves, not checked again."""
  dotted = call_overrides(settings.objective.autoregressive, max_new_tokens=max_new_tokens, steps=steps, seed=seed,
                          temperature=temperature, live=live, **sample_overrides)
  current = settings_fields.flat(settings)
  dotted = {key: value for key, value in dotted.items() if key not in current or current[key] != value}
  return settings.replace(**dotted) if dotted else settings


def call_overrides(autoregressive: bool, *, max_new_tokens: Optional[int] = None, steps: Optional[int] = None,
                   seed: Optional[int] = None, temperature: Optional[float] = None, live: bool = False,
                   **sample_overrides) -> dict:
  """{dotted key: value} of one call's overrides (`call_settings`), their shorthands checked."""
  if steps is not None and not (isinstance(steps, int) and steps >= 1):
    raise ConfigError(f"steps (sample.max_denoising_steps; sample.py --steps): must be an integer >= 1, got {steps!r}")
  if temperature is not None and not (temperature > 0 or (temperature == 0 and autoregressive)):
    raise ConfigError(f"temperature (sample.t_max and t_min; sample.py --temperature): must be > 0 (0 = greedy for "
                      f"an AR model), got {temperature}")
  dotted = {f"sample.{name}": value for name, value in (("max_new_tokens", max_new_tokens),
                                                        ("max_denoising_steps", steps), ("seed", seed))
            if value is not None}
  if temperature is not None:
    if autoregressive:
      dotted["eval.ar_temperature"] = temperature
    else:
      dotted["sample.t_max"] = dotted["sample.t_min"] = temperature
  dotted.update({f"sample.{name}": value for name, value in sample_overrides.items()})
  if live:
    dotted["sample.show"] = "live"
  return dotted


def _texts(field: str, values) -> list[str]:
  """`values` as a list of strings; anything else is an error naming the item (`field[i]`)."""
  if isinstance(values, (bytes, bytearray)) or not isinstance(values, Sequence):
    raise ValueError(f"{field}: expected a string or a list of strings, got {type(values).__name__}")
  for i, value in enumerate(values):
    if not isinstance(value, str):
      hint = " (decode bytes first: b.decode('utf-8'))" if isinstance(value, (bytes, bytearray)) else ""
      raise ValueError(f"{field}[{i}]: expected a string, got {type(value).__name__}{hint}")
  return list(values)


def encode_prompt(tokenizer: tokenizers.Tokenizer, prompt: str) -> list[int]:
  """[BOS] + the prompt's ids."""
  return [tokenizer.bos_id] + tokenizer.encode(prompt)


def encode_chat(tokenizer: tokenizers.Tokenizer, conversation: Conversation) -> list[int]:
  """A conversation rendered in the Gemma 4 turn format (`<|turn>role\ncontent<turn|>\n` per turn, then the
  model's turn opened) when the tokenizer has the turn markers, the same structure as plain text otherwise."""
  turns = []
  for i, message in enumerate(conversation):
    if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)):
      raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {message!r}")
    turns.append([sft.canonical_role(message["role"], f"messages[{i}]"), message["content"]])
  if not turns:
    raise ValueError("messages: a conversation needs at least one turn")
  return sft.render_turns(tokenizer, turns)


def tokenizer_for(settings, ckpt: checkpoints.Checkpoint) -> tokenizers.Tokenizer:
  """The tokenizer that belongs to a checkpoint (a `checkpoints.header` is enough; module docstring)."""
  if ckpt.tokenizer_file is not None:
    return tokenizers.load_tokenizer_file(ckpt.tokenizer_file)
  if settings.data.tokenizer.kind in ("byte", "file"):
    return tokenizers.build_tokenizer(settings.data)
  return data_lib.prepare(settings).tokenizer  # a run saved before WORKDIR/tokenizer.model existed


# ---- sample.py ----------------------------------------------------------------------------------------

def read_prompts(path: str, field: str = "--prompts") -> list[Union[str, list]]:
  """Prompts of a file: .txt one per line; .jsonl one object per line with 'prompt' (a string) or
  'messages' (a conversation). Errors name `field`, the file and the line."""
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"{field}: {path} does not exist")
  items: list = []
  if p.suffix not in (".txt", ".jsonl"):
    raise ValueError(f"{field}: {path} must be a .txt or .jsonl file")
  try:
    text = jsonl.decode(p.read_bytes(), path, hint="save the prompts as UTF-8")
  except DataError as e:
    raise DataError(f"{field}: {e}") from None
  if p.suffix == ".txt":
    items = [line for line in text.splitlines() if line.strip()]
  else:
    for n, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{field}: {path} line {n}: not valid JSON ({e})") from e
      if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        items.append(record["prompt"])
      elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        items.append(record["messages"])
      else:
        raise ValueError(f"{field}: {path} line {n}: needs a string 'prompt' or a list 'messages'")
  if not items:
    raise ValueError(f"{field}: {path} holds no prompts")
  return items


def sample_command(checkpoint: str, config: Optional[ml_collections.ConfigDict] = None, *,
                   prompts_file: Optional[str] = None, out: Optional[str] = None, text_out: Optional[str] = None,
                   chat: bool = False, steps: Optional[int] = None, seed: Optional[int] = None,
                   temperature: Optional[float] = None, step: Optional[int] = None,
                   print_fn=print) -> list[Generation]:
  """What sample.py runs: prompts (the file's, else sample.prompt x sample.num_samples) through `load` and
  generate / chat; prints each result, writes `out` (JSONL: prompt, text, decoder passes, tokens per pass, the
  call's seconds per prompt) and `text_out` (what was printed); sample.trajectory_html gets the first row's
  first canvas. `step`: a run's checkpoint step (sample.checkpoint_step). Prompts are chat turns with --chat, for
  .jsonl 'messages', and for runs trained on SFT rows; a chat reply is printed on its own line."""
  # Everything that can be wrong with the request fails here, before a weight is read.
  for flag, path in (("--out", out), ("--text_out", text_out)):
    if path:
      files.check_writable(path, flag)
  items = read_prompts(prompts_file) if prompts_file else None
  header = checkpoints.header(checkpoint, checkpoints.CHECKPOINT_FLAG)
  run = run_config(header, config)
  autoregressive = objectives.get(run.diffusion.objective).autoregressive
  st = settings_lib.from_config(settings_lib.with_overrides(run, call_overrides(
      autoregressive, steps=steps, seed=seed, temperature=temperature)))  # the request's one check
  if st.sample.trajectory_html:
    files.check_writable(st.sample.trajectory_html, "sample.trajectory_html")
  tokenizer = tokenizer_for(st, header)
  as_chat = chat or st.data.format == "sft"
  if items is None:
    items = [st.sample.prompt] * st.sample.num_samples
  ids = [encode_chat(tokenizer, x if isinstance(x, list) else [{"role": "user", "content": x}])
         if as_chat or isinstance(x, list) else encode_prompt(tokenizer, x) for x in items]
  texts = [x if isinstance(x, str) else x[-1]["content"] for x in items]
  if st.sample.infill:
    raise ConfigError("sample.infill: sample.py does not infill; use dgemma.sampling.generate(..., infill_tokens_BN, "
                      "infill_mask_BN) (a study's eval infills its own way)")
  if not st.objective.autoregressive:  # the prompts against sample.max_context and the free memory, once
    check_request(st.canvas_sampler, batch=len(ids), prompt_len=max(len(x) for x in ids),
                  max_new_tokens=st.sample.max_new_tokens, model_cfg=st.model)
  model = load_with(header, st, step=step, tokenizer=tokenizer)
  live = st.sample.show == "live" and not model.objective.autoregressive
  printer = LivePrinter(model.tokenizer.decode, texts, total_steps=st.sample.max_denoising_steps,
                        end_ids=st.end_ids) if live else None
  start = time.perf_counter()
  results = model.generate_ids(ids, texts, return_trajectory=bool(st.sample.trajectory_html), on_step=printer,
                               checked=True)
  seconds = time.perf_counter() - start
  lines = []
  for b, r in enumerate(results):
    where = f"step {model.step}, " if model.step is not None else ""
    lines.append(f"--- sample {b} ({where}{r.num_forwards} decoder passes, {r.tokens_per_forward:.2f} tokens/pass) ---")
    lines.extend([r.prompt, r.text] if as_chat or isinstance(items[b], list) else [r.prompt + r.text])
  print_fn("\n".join(lines))
  if text_out:
    files.write_text_atomic(text_out, "\n".join(lines) + "\n")
  if out:  # the rows run together: each record gets the call's time divided by its rows
    files.write_text_atomic(out, "".join(json.dumps({
        "prompt": r.prompt, "text": r.text, "decoder_passes": r.num_forwards, "tokens_per_pass": r.tokens_per_forward,
        "seconds_per_prompt": seconds / len(results)}, ensure_ascii=False) + "\n" for r in results))
  if st.sample.trajectory_html and results[0].trajectory is not None:
    write_trajectory_html(results[0].trajectory, model.tokenizer, st.sample.trajectory_html, prompt=results[0].prompt)
    print_fn(f"trajectory written to {st.sample.trajectory_html}")
  return results


def write_trajectory_html(trajectory: dict, tokenizer, path: str, prompt: str = "") -> None:
  """Renders one canvas step by step (a Generation.trajectory): the tokens each step produced, accepted
  ones highlighted."""
  pieces = [[tokenizer.decode([int(t)]) or "\u00b7" for t in step] for step in trajectory["tokens"]]
  html = run_report.trajectory_html(pieces, trajectory["accepted"], trajectory["entropy"],
                                title="dgemma: one canvas being denoised", prompt=prompt)
  files.write_text_atomic(path, html)
