"""Likelihood of text under a checkpoint: the block-autoregressive NELBO bound (diffusion) or the exact NLL (AR).

  python -m eval.likelihood --checkpoint=workdirs/demo --data=validation --max_tokens=2048
  python -m eval.likelihood --checkpoint=workdirs/demo --data=my_text.txt --num_t_samples=16 --out=ll.json
  python -m eval.likelihood --checkpoint=/ckpts/dgemma --data=my_text.txt      # any checkpoint kind

Reports nats/token, bits per UTF-8 byte of the original text and the perplexity bound, each with a standard
error; the estimator is dgemma/diffusion/likelihood.py (its docstring has the mathematics), the same one
`dgemma.load(...).score(texts)` calls. Settings: `eval.*` in configs/base.py (flags of the same name override
them): eval.data is a .txt / .jsonl file (data.txt_mode, data.jsonl_field, data.encoding_errors) or a split of
the run's dataset; eval.max_documents / eval.max_tokens cut it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import ml_collections

import dgemma
from dgemma import data as data_lib
from dgemma import files
from dgemma.data import builder as builder_lib
from dgemma.errors import ConfigError
from eval import cli_flags


def read_texts(settings, data: str) -> list[str]:
  """Documents of a .txt / .jsonl file or of a split of the run's dataset."""
  if not data:
    raise ConfigError("eval.data: empty (a .txt/.jsonl file or a split name such as 'validation')")
  if data.endswith((".txt", ".jsonl")) or Path(data).exists():
    builder_lib.check_files([data])
    return list(builder_lib.iter_file_documents(data, settings.data.txt_mode, settings.data.jsonl_field,
                                                settings.data.encoding_errors))
  prepared = data_lib.prepare(settings)
  if data not in prepared.splits:
    raise ConfigError(f"eval.data: {data!r} is neither a .txt/.jsonl file nor a split of {prepared.dataset_id} "
                      f"({prepared.splits})")
  return list(prepared.texts(data))


def eval_texts(settings) -> list[str]:
  """eval.data (or eval.split), cut to eval.max_documents."""
  texts = read_texts(settings, settings.eval.data or settings.eval.split)
  return texts[:settings.eval.max_documents] if settings.eval.max_documents > 0 else texts


def ablation_metrics(model: dgemma.Model) -> dict:
  """eval/ablate.py metric 'likelihood'."""
  out = model.score(eval_texts(model.settings))
  return {k: out[k] for k in ("nats_per_token", "nats_per_token_se", "bits_per_byte", "perplexity", "tokens",
                              "wall_s")}


def run(checkpoint: str, config: Optional[ml_collections.ConfigDict], *, step: int = -1, print_fn=print) -> dict:
  """The CLI: reads the texts first (bad data fails before any weight is read), then loads and scores."""
  texts = eval_texts(cli_flags.checked_settings(checkpoint, config))
  model = dgemma.load(checkpoint, step=step, config=config)
  out = model.score(texts)
  text = json.dumps(out, indent=2)
  print_fn(text)
  if model.settings.eval.out:
    files.write_text_atomic(model.settings.eval.out, text + "\n")
  return out


def main(argv):
  cli_flags.run_eval(argv, run)


if __name__ == "__main__":
  cli_flags.define(
      data=("string", "eval.data: a .txt/.jsonl file or a split name."),
      num_t_samples=("integer", "eval.num_t_samples."),
      max_tokens=("integer", "eval.max_tokens (per document)."),
      max_documents=("integer", "eval.max_documents."),
      context_len=("integer", "eval.context_len."),
      out=("string", "eval.out: write the summary JSON here."))
  cli_flags.main(main, "eval.likelihood")
