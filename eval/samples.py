"""Sample quality: generate N samples and score them.

  python -m eval.samples --checkpoint=workdirs/demo --reference=workdirs/demo_ar --num_samples=16 \
      --samples_out=samples.jsonl
  python -m eval.samples --checkpoint=workdirs/demo --config=configs/demo.py --config.sample.max_denoising_steps=8 \
      --config.eval.prompts=prompts.txt --config.sample.sampler=ancestral

Settings: `sample.*` (the sampler, prompt, max_new_tokens, seed) and `eval.*` (num_samples, prompts,
reference, samples_out, out) in configs/base.py; flags of the same name override eval.*. Reports:

  gen_ppl            generative perplexity exp(mean NLL of the generated tokens) under `eval.reference`, an AR
                     checkpoint of this codebase (diffusion.objective='ar') with the same tokenizer, each
                     token conditioned on BOS + prompt + the tokens generated before it (end token included)
  unigram_entropy    mean over samples of the entropy (nats) of the sample's token histogram (low = repetitive)
  distinct_1/2/3     distinct n-grams / all n-grams over all samples (token ids)
  rep_4              mean over samples of the fraction of 4-grams that repeat an earlier 4-gram of the sample
  decoder_passes     mean forward passes per sample (AR: one per token); passes_per_canvas; tokens_per_forward
  wall_s, tokens_per_s  one generate call, compiled beforehand (compile + first call: first_call_s)

The metrics count generated tokens up to and excluding the end token. Samples are written as JSONL
(prompt, text, token ids, passes, the reference NLL) to eval.samples_out.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import ml_collections
import numpy as np

from dgemma import checkpointing
from dgemma.model.config import ConfigError
from dgemma.sampling import SamplerConfig, ar_generate, check_request, generate, num_canvases
from eval import checkpoints
from eval.likelihood import causal_nll


# ---- text statistics (token ids) -----------------------------------------------------------------

def unigram_entropy(tokens: Sequence[int]) -> float:
  """Entropy (nats) of the token histogram of one sample (0 for an empty one)."""
  if not len(tokens):
    return 0.0
  counts = np.asarray(list(collections.Counter(int(t) for t in tokens).values()), np.float64)
  p = counts / counts.sum()
  return float(-np.sum(p * np.log(p)))


def _ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
  return [tuple(int(t) for t in tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(samples: Sequence[Sequence[int]], n: int) -> float:
  """Distinct n-grams / all n-grams over every sample (nan when there are none)."""
  grams = [g for s in samples for g in _ngrams(s, n)]
  return len(set(grams)) / len(grams) if grams else float("nan")


def repetition_rate(samples: Sequence[Sequence[int]], n: int = 4) -> float:
  """Mean over samples (with >= n tokens) of the fraction of n-grams already seen earlier in the sample."""
  rates = []
  for s in samples:
    grams = _ngrams(s, n)
    if grams:
      rates.append(1.0 - len(set(grams)) / len(grams))
  return float(np.mean(rates)) if rates else float("nan")


def same_tokenizer(a, b) -> bool:
  """Same kind, size, special ids, and the same piece for every id."""
  if type(a) is not type(b) or a.vocab_size != b.vocab_size:
    return False
  if (a.bos_id, a.eos_id, a.pad_id) != (b.bos_id, b.eos_id, b.pad_id):
    return False
  return all(a.decode([i]) == b.decode([i]) for i in range(a.vocab_size))


# ---- generation ----------------------------------------------------------------------------------

def read_prompts(path: str) -> list[str]:
  """Prompts of a .txt file (one per non-empty line) or .jsonl file (field 'prompt')."""
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"eval.prompts: {path} does not exist")
  if p.suffix == ".txt":
    prompts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
  elif p.suffix == ".jsonl":
    prompts = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
      if line.strip():
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
          raise ValueError(f"eval.prompts: {path} line {n} has no string field 'prompt'")
        prompts.append(record["prompt"])
  else:
    raise ValueError(f"eval.prompts: {path} must be a .txt or .jsonl file")
  if not prompts:
    raise ValueError(f"eval.prompts: {path} holds no prompts")
  return prompts


def _prompt_batch(prompts: Sequence[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
  ids = [[tokenizer.bos_id] + tokenizer.encode(p) for p in prompts]
  lengths = np.asarray([len(x) for x in ids], np.int32)
  batch = np.full((len(ids), int(lengths.max())), tokenizer.pad_id, np.int32)
  for b, x in enumerate(ids):
    batch[b, :len(x)] = x
  return batch, lengths


def _timed(fn):
  """(result, seconds) of fn() with its outputs on the host."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


@functools.lru_cache(maxsize=4)
def _load_reference(path: str):
  return checkpoints.load_checkpoint(path)


def reference_nll(ref: checkpoints.Checkpoint, prompts_BP: np.ndarray, lengths_B: np.ndarray,
                  tokens_BN: np.ndarray, gen_lengths_B: np.ndarray) -> np.ndarray:
  """NLL (nats) of each row's generated tokens (end token included) under the AR reference model."""
  B = len(lengths_B)
  L = int(lengths_B.max() + tokens_BN.shape[1])
  rows = {k: np.zeros((B, L), np.int32) for k in ("tokens", "segment_ids", "positions")}
  weights = np.zeros((B, L), bool)
  for b in range(B):
    seq = np.concatenate([prompts_BP[b, :lengths_B[b]], tokens_BN[b, :gen_lengths_B[b]]])
    rows["tokens"][b, :len(seq)] = seq
    rows["segment_ids"][b, :len(seq)] = 1
    rows["positions"][b, :len(seq)] = np.arange(len(seq))
    weights[b, lengths_B[b]:len(seq)] = True
  return np.asarray(causal_nll(ref.params, rows, weights, model_cfg=ref.model_cfg))


def sample_metrics(ckpt: checkpoints.Checkpoint, config: ml_collections.ConfigDict,
                   reference: Optional[checkpoints.Checkpoint] = None) -> tuple[dict, list[dict]]:
  """Generates eval.num_samples samples with config.sample settings and scores them: (summary, records).
  reference: the AR model for generative perplexity (default: eval.reference loaded, if set)."""
  ev, tokenizer = config.eval, ckpt.tokenizer
  n = int(ev.num_samples)
  if n <= 0:
    raise ConfigError(f"eval.num_samples: must be positive, got {n}")
  max_new = int(config.sample.max_new_tokens)
  if max_new <= 0:
    raise ConfigError(f"sample.max_new_tokens must be positive, got {max_new}")
  base_prompts = read_prompts(ev.prompts) if ev.prompts else [str(config.sample.prompt)]
  prompts = [base_prompts[b % len(base_prompts)] for b in range(n)]
  prompts_BP, lengths_B = _prompt_batch(prompts, tokenizer)
  ref = reference
  if ref is None and ev.reference:
    ref = _load_reference(str(ev.reference))
  if ref is not None:
    if ref.objective != "ar":
      raise ConfigError(f"eval.reference: {ref.path} was trained with diffusion.objective={ref.objective!r}; "
                        "generative perplexity needs an AR run (diffusion.objective='ar')")
    if not same_tokenizer(ref.tokenizer, tokenizer):
      raise ConfigError(f"eval.reference: {ref.path} uses another tokenizer ({ref.tokenizer!r} vs {tokenizer!r})")
  rng = jax.random.key(int(config.sample.seed))
  if ckpt.objective == "ar":
    sampler_cfg = SamplerConfig.from_config(config)
    end_ids = sampler_cfg.end_ids
    temperature = float(ev.ar_temperature)
    if temperature < 0:
      raise ConfigError(f"eval.ar_temperature: must be >= 0, got {temperature}")
    call = lambda: ar_generate(ckpt.model, ckpt.params, prompts_BP, lengths_B, rng, max_new, temperature, end_ids,
                               pad_id=tokenizer.pad_id)
    (_, first_s), ((tokens_BN, gen_len_B), wall_s) = _timed(call), _timed(call)
    passes_B = np.asarray(gen_len_B)  # one forward per generated token
    canvases = max_new
  else:
    sampler_cfg = SamplerConfig.from_config(config)
    check_request(sampler_cfg, batch=n, prompt_len=prompts_BP.shape[1], max_new_tokens=max_new)
    call = lambda: generate(ckpt.model, ckpt.params, prompts_BP, lengths_B, sampler_cfg, rng, max_new)
    (_, first_s), (out, wall_s) = _timed(call), _timed(call)
    tokens_BN, gen_len_B, passes_B = out.tokens_BN, out.lengths_B, out.num_forwards_B
    end_ids = sampler_cfg.end_ids
    canvases = num_canvases(max_new, sampler_cfg.canvas_len)
  tokens_BN, gen_len_B, passes_B = np.asarray(tokens_BN), np.asarray(gen_len_B), np.asarray(passes_B)
  bodies = []  # generated ids without the end token
  for b in range(n):
    ids = tokens_BN[b, :gen_len_B[b]].tolist()
    bodies.append(ids[:-1] if ids and ids[-1] in end_ids else ids)
  total_tokens = int(gen_len_B.sum())
  summary = {"checkpoint": ckpt.path, "step": ckpt.step, "objective": ckpt.objective, "num_samples": n,
             "max_new_tokens": max_new, "mean_length": float(np.mean([len(x) for x in bodies])),
             "steps": int(config.sample.max_denoising_steps) if ckpt.objective != "ar" else 1,
             "decoder_passes": float(passes_B.mean()), "passes_per_canvas": float(passes_B.mean()) / max(canvases, 1)
             if ckpt.objective != "ar" else 1.0,
             "tokens_per_forward": total_tokens / max(int(passes_B.sum()), 1),
             "wall_s": wall_s, "first_call_s": first_s, "tokens_per_s": total_tokens / max(wall_s, 1e-9),
             "unigram_entropy": float(np.mean([unigram_entropy(x) for x in bodies])),
             "distinct_1": distinct_n(bodies, 1), "distinct_2": distinct_n(bodies, 2),
             "distinct_3": distinct_n(bodies, 3), "rep_4": repetition_rate(bodies, 4)}
  nll_B = None
  if ref is not None:
    nll_B = reference_nll(ref, prompts_BP, lengths_B, tokens_BN, gen_len_B)
    summary["gen_nll"] = float(nll_B.sum() / max(total_tokens, 1))
    summary["gen_ppl"] = math.exp(summary["gen_nll"])
  records = []
  for b in range(n):
    rec = {"prompt": prompts[b], "text": tokenizer.decode(bodies[b]), "tokens": tokens_BN[b, :gen_len_B[b]].tolist(),
           "decoder_passes": int(passes_B[b])}
    if nll_B is not None:
      rec["reference_nll"] = float(nll_B[b])
    records.append(rec)
  return summary, records


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  checkpointing.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def ablation_metrics(ckpt: checkpoints.Checkpoint, config: ml_collections.ConfigDict) -> dict:
  """eval/ablate.py metric 'samples': the numeric summary."""
  summary, _ = sample_metrics(ckpt, config)
  return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and k != "step"}


def run(checkpoint: str, config: Optional[ml_collections.ConfigDict], *, step: int = -1, print_fn=print) -> dict:
  run_config = checkpoints.resolve_config(checkpoint, config)  # bad settings fail before loading
  SamplerConfig.from_config(run_config)
  if run_config.eval.prompts:
    read_prompts(run_config.eval.prompts)
  ckpt = checkpoints.load_checkpoint(checkpoint, config, step=step)
  summary, records = sample_metrics(ckpt, ckpt.config)
  text = json.dumps(summary, indent=2)
  print_fn(text)
  if ckpt.config.eval.samples_out:
    write_jsonl(ckpt.config.eval.samples_out, records)
  if ckpt.config.eval.out:
    checkpointing.write_text_atomic(ckpt.config.eval.out, text + "\n")
  return summary


def main(argv):
  from absl import app
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    run(_CHECKPOINT.value, checkpoints.cli_config(_CONFIG.value, _CHECKPOINT.value, _FLAGS), step=_STEP.value)
  except (ConfigError, FileNotFoundError) as e:
    sys.exit(f"eval.samples: {e}")


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Config whose `sample` / `eval` settings to use "
                                            "(optional for a workdir).")
  _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Training workdir or params checkpoint.", required=True)
  _STEP = flags.DEFINE_integer("step", -1, "Training step of a workdir (-1 = latest).")
  _FLAGS = {
      "num_samples": flags.DEFINE_integer("num_samples", None, "eval.num_samples."),
      "prompts": flags.DEFINE_string("prompts", None, "eval.prompts: a .txt/.jsonl prompts file."),
      "reference": flags.DEFINE_string("reference", None, "eval.reference: AR checkpoint for generative perplexity."),
      "samples_out": flags.DEFINE_string("samples_out", None, "eval.samples_out: JSONL of the samples."),
      "out": flags.DEFINE_string("out", None, "eval.out: write the summary JSON here."),
  }
  app.run(main)
