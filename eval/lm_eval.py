"""EleutherAI's lm-evaluation-harness with dgemma models: the model class `dgemma` (needs the optional extra,
`pip install -e ".[lm_eval]"`).

  python -m eval.lm_eval --model dgemma --model_args checkpoint=workdirs/demo --tasks arc_challenge
  python -m eval.lm_eval --model dgemma --model_args checkpoint=/ckpts/dgemma,quantize=int4_experts,steps=48 \\
      --tasks gsm8k --apply_chat_template --batch_size 8
  python -m eval.lm_eval --model dgemma --model_args checkpoint=workdirs/demo --tasks my_task \\
      --include_path my_tasks/          # local YAML tasks (dataset_path: json, dataset_kwargs.data_files)

`python -m eval.lm_eval` is lm-eval's own command line (every flag of `lm-eval run`) with the class registered
first. From Python: `lm_eval.simple_evaluate(model=eval.lm_eval.dgemma_lm(checkpoint=...), tasks=[...])`, or
`dgemma_lm(model=dgemma.load(...))` for a model already loaded. docs/evaluation.md has the benchmark commands
and what the likelihood's noise does to accuracy.

Model arguments (`--model_args k=v,...`), each checked before a weight is read, a bad one one line naming it:
checkpoint (any path `dgemma.load` takes), step (a run's step; default sample.checkpoint_step), quantize, dtype;
batch_size (canvases per likelihood batch and prompts per generate call: eval.batch_size; lm-eval's --batch_size,
whose default is 1, when not given here), num_t_samples (eval.num_t_samples), context_len (eval.context_len),
seed (eval.seed and sample.seed), steps (sample.max_denoising_steps); and any setting as GROUP.KEY
(sample.t_max=0.3, eval.self_conditioning=false, ...).

The three request kinds:
- loglikelihood(context, continuation): log p(continuation | context). A diffusion model's is the negative of
  the block-autoregressive NELBO bound of dgemma/diffusion/likelihood.py (eval.likelihood's estimator): the
  continuation cut into canvases from its first token, each scored given the clean text before it (context and
  earlier canvases, at most context_len tokens) with num_t_samples antithetic times plus the reconstruction
  term. So it is a lower bound with Monte-Carlo noise. The noise of one question's choices is shared: every
  request with the same context draws the same times and the same noise (common random numbers, keyed by the
  context), so a ranking compares the choices on equal draws. `score_continuations` returns the estimate's
  standard error too. An AR-objective model's loglikelihood is exact (its causal NLL).
  is_greedy: exact for an AR model (every continuation token is the argmax of its prediction). For a diffusion
  model it is False: which continuation greedy decoding produces is a property of a whole sampler run (order
  of acceptance, re-noising), not of the bound, so tasks' `acc` from is_greedy (LAMBADA) do not apply to it.
- loglikelihood_rolling(text): log p(text) for perplexity tasks: the same bound over [BOS] + the text's tokens
  in canvases (no EOS: lm-eval's definition; eval.likelihood scores the EOS of a complete document too).
- generate_until(context, gen_kwargs): the model's configured sampler (the released one, or what sample.*
  says) with max_gen_toks new tokens, stopped at the end token and cut at the first of the `until` strings.
  Requests are batched by the generate program's padded prompt length (`bucketed_shape`), so the compiled
  programs are reused; the batch that starts at sorted request j samples with seed sample.seed + j. A
  diffusion sampler has no greedy mode: do_sample=False / temperature=0 run the configured sampler, and a
  temperature > 0 with do_sample sets sample.t_max = t_min; an AR model decodes greedily at temperature 0.
  With --apply_chat_template, prompts are Gemma 4 turns (`<|turn>user\\n...<turn|>\\n<|turn>model\\n`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import zlib
from typing import Any, Optional, Sequence

import numpy as np

try:
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError:  # the optional extra
  if __name__ == "__main__":
    sys.exit('eval.lm_eval: needs lm-evaluation-harness: pip install -e ".[lm_eval]"')
  raise

from tqdm.auto import tqdm

import dgemma
from dgemma import api, checkpoints, jax_cache
from dgemma import mesh as mesh_lib
from dgemma.data import sft
from dgemma.diffusion import likelihood
from dgemma.errors import ConfigError
from dgemma.sampling.generation import bucketed_shape

# model argument -> the settings it sets (None: an argument of the load itself)
MODEL_ARGS = {"checkpoint": None, "step": None, "quantize": None, "dtype": None,
              "batch_size": ("eval.batch_size",), "num_t_samples": ("eval.num_t_samples",),
              "context_len": ("eval.context_len",), "seed": ("eval.seed", "sample.seed"),
              "steps": ("sample.max_denoising_steps",)}
HARNESS_ARGS = ("max_batch_size", "device")  # what lm-eval passes every model; JAX picks its own devices


@dataclasses.dataclass(frozen=True)
class ContinuationScore:
  """One loglikelihood request: logprob (nats; a lower bound for a diffusion model), its Monte-Carlo standard
  error (0 when exact), is_greedy (module docstring) and the continuation's token count."""
  logprob: float
  stderr: float
  is_greedy: bool
  tokens: int


@dataclasses.dataclass(frozen=True)
class _Generation:
  """One generate_until request: its index, [BOS] + prompt ids, prompt text, until strings, and the generate program
  it needs (padded prompt length, new tokens, temperature)."""
  index: int
  ids: list
  context: str
  until: tuple
  program: tuple


def context_key(text: str) -> int:
  """The noise key of a request group: a stable hash of its context (the same in every process and run)."""
  return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


def _batch_size(value) -> Optional[int]:
  """lm-eval's --batch_size: an integer, or 'auto' / 'auto:N' (-> the settings' eval.batch_size)."""
  if value is None or (isinstance(value, str) and value.startswith("auto")):
    return None
  try:
    size = int(value)
  except (TypeError, ValueError):
    raise ConfigError(f"model_args batch_size: expected an integer or 'auto', got {value!r}") from None
  if size < 1:
    raise ConfigError(f"model_args batch_size: must be >= 1, got {size}")
  return size


def model_settings(args: dict) -> tuple[dict, dict]:
  """(load arguments, {dotted setting: value}) of the model arguments; an unknown one is a ConfigError naming it."""
  load, dotted = {}, {}
  for name, value in args.items():
    if name in HARNESS_ARGS:
      continue
    if name == "batch_size":
      value = _batch_size(value)
      if value is None:
        continue
    if name in MODEL_ARGS:
      if MODEL_ARGS[name] is None:
        load[name] = value
      else:
        dotted.update({key: value for key in MODEL_ARGS[name]})
    elif "." in name:
      dotted[name] = value
    else:
      near = difflib.get_close_matches(name, MODEL_ARGS, n=1)
      raise ConfigError(f"model_args {name}: not an argument of the dgemma model"
                        + (f" (did you mean {near[0]}?)" if near else "")
                        + f"; arguments: {', '.join(MODEL_ARGS)}, or any setting as group.key (sample.t_max=0.3)")
  return load, dotted


@register_model("dgemma")
class DgemmaLM(LM):
  """lm-eval's LM interface over a dgemma checkpoint (module docstring)."""

  def __init__(self, checkpoint: str = "", *, model: Optional[dgemma.Model] = None, **model_args: Any):
    super().__init__()
    load, dotted = model_settings(model_args)
    jax_cache.enable()
    if model is None:
      if not checkpoint:
        raise ConfigError("model_args checkpoint: required (a run, params checkpoint, adapter or HF directory)")
      header = checkpoints.header(str(checkpoint), "model_args checkpoint")
      settings = api.run_settings(header, quantize=load.get("quantize"), dtype=load.get("dtype"))
      settings = settings.replace(**dotted) if dotted else settings
      self._check(settings, header.model)  # before a weight is read
      model = api.load_with(header, settings, step=load.get("step"))
    else:
      if checkpoint or load:
        raise ConfigError(f"model_args: {', '.join(['checkpoint'] * bool(checkpoint) + list(load))} with a loaded "
                          "model: load it with those instead")
      model = model.with_overrides(**dotted) if dotted else model
      self._check(model.settings, model.model_cfg)
    self.model = model

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "DgemmaLM":
    from lm_eval.utils import simple_parse_args_string
    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "DgemmaLM":
    """lm-eval's flags (--batch_size: 1 unless given) under the model arguments: batch_size in --model_args wins."""
    harness = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
    return cls(**arg_dict, **harness)

  @staticmethod
  def _check(settings, model_cfg) -> None:
    if settings.objective.autoregressive:
      return
    likelihood.check_request(model_cfg, context_len=likelihood.context_length(
        settings.eval, seq_len=settings.data.seq_len, canvas_len=settings.diffusion.canvas_len),
        canvas_len=settings.diffusion.canvas_len, batch_size=settings.eval.batch_size,
        max_positions=settings.sample.max_context)

  # ---- what lm-eval asks of a model ----

  @property
  def tokenizer_name(self) -> str:
    return repr(self.model.tokenizer)

  def chat_template(self, chat_template=False) -> str:
    return "gemma4-turns"  # sft.render_text: fixed, not a template file

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
    turns = [[sft.canonical_role(m["role"], f"chat_history[{i}]"), m["content"]] for i, m in enumerate(chat_history)]
    return sft.render_text(turns, add_generation_prompt)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    scores = self.score_continuations([r.args for r in requests], progress=not disable_tqdm)
    return [(s.logprob, s.is_greedy) for s in scores]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    texts = [r.args[0] for r in requests]
    tok = self.model.tokenizer
    docs = [[tok.bos_id] + self.encode(t) for t in texts]
    scores = self.score_ids(docs, [1] * len(docs), [context_key(t) for t in texts], progress=not disable_tqdm)
    return [s.logprob for s in scores]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    settings = self.model.settings
    canvas_len = 1 if self.model.objective.autoregressive else settings.diffusion.canvas_len
    items = []
    for index, request in enumerate(requests):
      context, gen_kwargs = request.args
      kwargs = dict(gen_kwargs or {})
      until = kwargs.pop("until", None) or []
      ids = [self.model.tokenizer.bos_id] + self.encode(context)
      max_new = int(kwargs.pop("max_gen_toks", settings.sample.max_new_tokens))
      program = (bucketed_shape(batch=1, prompt_len=len(ids), max_new_tokens=max_new, canvas_len=canvas_len,
                                max_context=settings.sample.max_context)[1], max_new, self._temperature(kwargs))
      items.append(_Generation(index, ids, context, (until,) if isinstance(until, str) else tuple(until), program))
    # one compiled program per (padded prompt length, new tokens, temperature): sorted, then batched within one
    items.sort(key=lambda it: (it.program[:2], it.program[2] is None, it.program[2] or 0.0, len(it.ids), it.index))
    out: list[Optional[str]] = [None] * len(items)
    bar = tqdm(total=len(items), desc="generate_until", disable=disable_tqdm or None)
    start = 0
    while start < len(items):
      group = [it for it in items[start:start + settings.eval.batch_size] if it.program == items[start].program]
      _, max_new, temperature = group[0].program
      generations = self.model.generate_ids([it.ids for it in group], [it.context for it in group],
                                            max_new_tokens=max_new, seed=settings.sample.seed + start,
                                            temperature=temperature)
      for it, generation in zip(group, generations):
        out[it.index] = cut_at(generation.text, it.until)
      start += len(group)
      bar.update(len(group))
    bar.close()
    return out

  # ---- the likelihood, with its standard error ----

  def encode(self, text: str) -> list[int]:
    """The ids of `text` (turn markers of a chat template as their pieces)."""
    return sft.encode_turn_text(self.model.tokenizer, text)

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """([BOS] + context ids, continuation ids) as lm-eval's own models split them: the pair encoded as one text
    (so a word is tokenized as it is in running text), the continuation the ids past those of the context;
    spaces at the end of the context move to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = self.encode(context)
    whole = self.encode(context + continuation)
    return [self.model.tokenizer.bos_id] + context_ids, whole[len(context_ids):]

  def score_continuations(self, pairs: Sequence[tuple[str, str]], progress: bool = False) -> list[ContinuationScore]:
    """log p(continuation | context) of each (context, continuation) pair, with its standard error (module
    docstring); pairs with the same context share their noise."""
    return self.score_ids(*self.pair_ids(pairs), [context_key(context) for context, _ in pairs], progress=progress)

  def pair_ids(self, pairs: Sequence[tuple[str, str]]) -> tuple[list[list[int]], list[int]]:
    """(`score_ids`'s docs, starts) of (context, continuation) pairs: [BOS] + context + continuation ids, and
    where each continuation starts."""
    split = [self.encode_pair(context, continuation) for context, continuation in pairs]
    return [c + x for c, x in split], [len(c) for c, _ in split]

  def score_ids(self, docs: list[list[int]], starts: list[int], key_ids: list[int],
                progress: bool = False) -> list[ContinuationScore]:
    """`score_continuations` of token ids: docs[i] = [BOS] + context + continuation ids, the continuation from
    index starts[i], its noise keyed by key_ids[i]."""
    m, st = self.model, self.model.settings
    canvas_len = st.diffusion.canvas_len
    context_len = likelihood.context_length(st.eval, seq_len=st.data.seq_len, canvas_len=canvas_len)
    rows = likelihood.block_rows([np.asarray(d, np.int32) for d in docs], canvas_len, context_len,
                                 m.tokenizer.pad_id, starts=starts)
    bar = tqdm(total=len(rows), desc="loglikelihood canvases", disable=(not progress) or None)
    on_batch = lambda done, _: bar.update(done - bar.n)
    with mesh_lib.mesh_context(m.mesh, st.mesh.axis_rules):
      scores = likelihood.canvas_scores(m.params, m.model_cfg, st.diffusion, st.eval, rows, context_len=context_len,
                                        key_ids=np.asarray(key_ids, np.int32)[rows.doc_index], on_batch=on_batch)
    bar.close()
    per_doc = lambda values: np.bincount(rows.doc_index, weights=values, minlength=len(docs))  # sums over canvases
    nats, variance = per_doc(scores["nats"]), per_doc(np.square(scores["mc_se"]))
    not_greedy, tokens = per_doc(~scores["greedy"]), per_doc(scores["tokens"])
    return [ContinuationScore(logprob=-float(nats[d]), stderr=math.sqrt(float(variance[d])),
                              is_greedy=bool(not_greedy[d] == 0), tokens=int(tokens[d])) for d in range(len(docs))]

  def _temperature(self, gen_kwargs: dict) -> Optional[float]:
    """The temperature a request's gen_kwargs ask for (module docstring); None = the configured sampler's."""
    temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
    if self.model.objective.autoregressive:
      return temperature if gen_kwargs.get("do_sample", temperature > 0) else 0.0
    return temperature if gen_kwargs.get("do_sample") and temperature > 0 else None


def cut_at(text: str, until: Sequence[str]) -> str:
  """`text` up to the first occurrence of any of the `until` strings."""
  cut = min((text.find(s) for s in until if s and s in text), default=len(text))
  return text[:cut]


def dgemma_lm(checkpoint: str = "", *, model: Optional[dgemma.Model] = None, **model_args) -> DgemmaLM:
  """The model class for `lm_eval.simple_evaluate(model=...)`: a checkpoint with model arguments (module
  docstring), or a loaded `dgemma.Model` with setting overrides."""
  return DgemmaLM(checkpoint, model=model, **model_args)


def main(argv: Optional[list[str]] = None) -> None:
  """lm-eval's command line with `dgemma` registered; bad model arguments and checkpoints are one line."""
  from lm_eval.__main__ import cli_evaluate
  from dgemma.tools import cli
  if argv is not None:
    sys.argv = [sys.argv[0]] + list(argv)
  try:
    cli_evaluate()
  except cli.USER_ERRORS as e:
    sys.exit(f"eval.lm_eval: {e}")


if __name__ == "__main__":
  main()
