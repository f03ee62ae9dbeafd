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
  real_word_rate     with eval.real_words set: the share of the samples' words (lowercased letter runs, over
                     all samples) that occur in that corpus ('train': the run's training split; or a .txt
                     file); real_word_rate_heldout: the same count on the run's validation split, the
                     yardstick ('train' with a validation split only), and unigram_entropy_heldout: the
                     unigram entropy of consecutive held-out pieces as long as the samples' mean length
  truth_bits_per_byte  with eval.truth (a Markov source's truth.json): the samples' exact bits per byte under
                     the source, beside its entropy rate truth_entropy_rate_bits (proj.markov.data.sample_scores)
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
import re
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import ml_collections
import numpy as np

import dgemma
from dgemma import api, checkpoints, files
from dgemma.data import builder as data_builder
from proj.markov import data as markov
from dgemma.data import pipeline
from dgemma.diffusion.likelihood import causal_nll
from dgemma.errors import ConfigError
from dgemma.sampling import num_canvases
from eval import cli_flags


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


_WORD = re.compile(r"[a-z]+")


def words(text: str) -> list[str]:
  """The words of a text: its lowercased letter runs (a-z; "o'er" is 'o' and 'er')."""
  return _WORD.findall(text.lower())


def real_word_rate(texts: Sequence[str], vocabulary: frozenset[str]) -> float:
  """The share of the words of all `texts` that are in `vocabulary` (nan when the texts have no words)."""
  all_words = [w for t in texts for w in words(t)]
  return sum(w in vocabulary for w in all_words) / len(all_words) if all_words else float("nan")


def check_real_words(settings) -> None:
  """eval.real_words: '' | 'train' (a plain-text corpus built here) | an existing .txt file; checked before loading."""
  spec = settings.eval.real_words
  if spec == "train":
    try:
      local = data_builder.make_builder_config(settings.data)  # only local text sources have one
    except ConfigError as e:
      raise ConfigError(f"eval.real_words='train' needs a training corpus built here: {e}; pass a .txt file "
                        "instead") from e
    if local.format == "sft":
      raise ConfigError("eval.real_words='train' needs plain text, not data.format='sft' rows; pass a .txt file")
  elif spec and not Path(spec).is_file():
    raise ConfigError(f"eval.real_words: {spec!r} is neither 'train' nor an existing text file")


@functools.lru_cache(maxsize=4)
def _split_texts(data_settings, split: str) -> tuple[str, ...]:
  return tuple(pipeline.local_texts(data_settings, split))


@functools.lru_cache(maxsize=4)
def _split_vocabulary(data_settings, split: str) -> frozenset[str]:
  """The words of a split, derived once per process (a sweep scores many settings against one corpus)."""
  return frozenset(w for t in pipeline.local_texts(data_settings, split) for w in words(t))


def real_word_corpora(settings) -> tuple[frozenset[str], tuple[str, ...]]:
  """(the vocabulary of eval.real_words, held-out texts for the yardstick: the validation split's
  documents with 'train' and a validation split, else none)."""
  spec = settings.eval.real_words
  if spec == "train":
    heldout = _split_texts(settings.data, "validation") if settings.data.validation_fraction > 0 else ()
    return _split_vocabulary(settings.data, "train"), heldout
  return frozenset(words(Path(spec).read_text(encoding="utf-8", errors="replace"))), ()


def heldout_unigram_entropy(texts: Sequence[str], tokenizer, window: int, max_windows: int = 256) -> float:
  """The yardstick for `unigram_entropy`: its mean over consecutive `window`-token pieces of held-out text
  (the samples' length, since the entropy of a histogram grows with its length), the first `max_windows`
  pieces of the documents in order (nan when the texts are shorter than one window)."""
  values = []
  for text in texts:
    ids = tokenizer.encode(text)
    for start in range(0, len(ids) - window + 1, window):
      values.append(unigram_entropy(ids[start:start + window]))
      if len(values) == max_windows:
        return float(np.mean(values))
  return float(np.mean(values)) if values else float("nan")


def same_tokenizer(a, b) -> bool:
  """Same kind, size, special ids, and the same piece for every id."""
  if type(a) is not type(b) or a.vocab_size != b.vocab_size:
    return False
  if (a.bos_id, a.eos_id, a.pad_id) != (b.bos_id, b.eos_id, b.pad_id):
    return False
  return all(a.decode([i]) == b.decode([i]) for i in range(a.vocab_size))


# ---- generation ----------------------------------------------------------------------------------

def _timed(fn):
  """(result, seconds) of fn() with its outputs on the host."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


@functools.lru_cache(maxsize=4)
def _load_reference(path: str) -> dgemma.Model:
  return dgemma.load(path, field="eval.reference (--reference)")


def reference_nll(ref: dgemma.Model, prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]]) -> np.ndarray:
  """NLL (nats) of each row's generated tokens (end token included) under the AR reference model."""
  B = len(prompts)
  L = max(len(p) + len(g) for p, g in zip(prompts, generated))
  rows = {k: np.zeros((B, L), np.int32) for k in ("tokens", "segment_ids", "positions")}
  weights = np.zeros((B, L), bool)
  for b in range(B):
    seq = np.concatenate([np.asarray(prompts[b], np.int32), np.asarray(generated[b], np.int32)])
    rows["tokens"][b, :len(seq)] = seq
    rows["segment_ids"][b, :len(seq)] = 1
    rows["positions"][b, :len(seq)] = np.arange(len(seq))
    weights[b, len(prompts[b]):len(seq)] = True
  return np.asarray(causal_nll(ref.params, rows, weights, model_cfg=ref.model_cfg))


def check_reference(ref: dgemma.Model, model: dgemma.Model) -> None:
  if not ref.objective.autoregressive:
    raise ConfigError(f"eval.reference: {ref.path} was trained with diffusion.objective={ref.objective.name!r}; "
                      "generative perplexity needs an AR run (diffusion.objective='ar')")
  if not same_tokenizer(ref.tokenizer, model.tokenizer):
    raise ConfigError(f"eval.reference: {ref.path} uses another tokenizer ({ref.tokenizer!r} vs {model.tokenizer!r})")


def sample_metrics(model: dgemma.Model, reference: Optional[dgemma.Model] = None) -> tuple[dict, list[dict]]:
  """Generates eval.num_samples samples with model.settings' sample settings and scores them:
  (summary, records). reference: the AR model for generative perplexity (default: eval.reference loaded,
  if set)."""
  st = model.settings
  base_prompts = api.read_prompts(st.eval.prompts, "eval.prompts") if st.eval.prompts else [st.sample.prompt]
  items = [base_prompts[b % len(base_prompts)] for b in range(st.eval.num_samples)]
  ids = [model.chat_ids(x) if isinstance(x, list) else model.prompt_ids(x) for x in items]
  texts = [x if isinstance(x, str) else x[-1]["content"] for x in items]
  ref = reference
  if ref is None and st.eval.reference:
    ref = _load_reference(st.eval.reference)
  if ref is not None:
    check_reference(ref, model)
  call = lambda: model.generate_ids(ids, texts)
  (_, first_s), (results, wall_s) = _timed(call), _timed(call)
  ar = model.objective.autoregressive
  canvases = st.sample.max_new_tokens if ar else num_canvases(st.sample.max_new_tokens, st.diffusion.canvas_len)
  bodies = [r.token_ids[:-1] if r.ended else r.token_ids for r in results]  # without the end token
  passes_B = np.asarray([r.num_forwards for r in results])
  total_tokens = sum(len(r.token_ids) for r in results)
  summary = {"checkpoint": model.path, "step": model.step, "objective": model.objective.name,
             "num_samples": len(results), "max_new_tokens": st.sample.max_new_tokens,
             "mean_length": float(np.mean([len(x) for x in bodies])),
             "sampler": "autoregressive" if ar else st.sample.sampler,
             "steps": 1 if ar else st.sample.max_denoising_steps,
             "decoder_passes": float(passes_B.mean()),
             "passes_per_canvas": 1.0 if ar else float(passes_B.mean()) / max(canvases, 1),
             "tokens_per_forward": total_tokens / max(int(passes_B.sum()), 1),
             "wall_s": wall_s, "first_call_s": first_s, "tokens_per_s": total_tokens / max(wall_s, 1e-9),
             "unigram_entropy": float(np.mean([unigram_entropy(x) for x in bodies])),
             "distinct_1": distinct_n(bodies, 1), "distinct_2": distinct_n(bodies, 2),
             "distinct_3": distinct_n(bodies, 3), "rep_4": repetition_rate(bodies, 4)}
  if st.eval.real_words:
    vocabulary, heldout = real_word_corpora(st)
    summary["real_word_rate"] = real_word_rate([r.text for r in results], vocabulary)
    if heldout:
      summary["real_word_rate_heldout"] = real_word_rate(heldout, vocabulary)
      window = max(1, int(round(summary["mean_length"])))
      summary["unigram_entropy_heldout"] = heldout_unigram_entropy(heldout, model.tokenizer, window)
  if st.eval.truth:
    summary.update(markov.sample_scores(markov.read_chain(st.eval.truth, "eval.truth"), [r.text for r in results]))
  nll_B = None
  if ref is not None:
    nll_B = reference_nll(ref, ids, [r.token_ids for r in results])
    summary["gen_nll"] = float(nll_B.sum() / max(total_tokens, 1))
    summary["gen_ppl"] = math.exp(summary["gen_nll"])
  records = []
  for b, r in enumerate(results):
    rec = {"prompt": texts[b], "text": r.text, "tokens": r.token_ids, "decoder_passes": r.num_forwards}
    if nll_B is not None:
      rec["reference_nll"] = float(nll_B[b])
    records.append(rec)
  return summary, records


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  files.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def ablation_metrics(model: dgemma.Model) -> dict:
  """eval/ablate.py metric 'samples': the numeric summary."""
  summary, _ = sample_metrics(model)
  return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and k != "step"}


def run(checkpoint: str, config: Optional[ml_collections.ConfigDict], *, step: int = -1, print_fn=print) -> dict:
  settings = cli_flags.checked_settings(checkpoint, config)  # bad settings fail before loading
  if not settings.objective.autoregressive:
    settings.canvas_sampler  # pylint: disable=pointless-statement  (the sampler fits the model)
  if settings.eval.prompts:
    api.read_prompts(settings.eval.prompts, "eval.prompts")
  if settings.eval.reference:
    checkpoints.kind(settings.eval.reference, "eval.reference (--reference)")
  check_real_words(settings)
  if settings.eval.truth:
    markov.read_chain(settings.eval.truth, "eval.truth (--truth)")
  model = dgemma.load(checkpoint, step=step, config=config, field=checkpoints.CHECKPOINT_FLAG)
  summary, records = sample_metrics(model)
  text = json.dumps(summary, indent=2)
  print_fn(text)
  if model.settings.eval.samples_out:
    write_jsonl(model.settings.eval.samples_out, records)
  if model.settings.eval.out:
    files.write_text_atomic(model.settings.eval.out, text + "\n")
  return summary


def main(argv):
  cli_flags.run_eval(argv, run)


if __name__ == "__main__":
  cli_flags.define("num_samples", "prompts", "reference", "real_words", "truth", "samples_out", "out")
  cli_flags.main(main, "eval.samples")
