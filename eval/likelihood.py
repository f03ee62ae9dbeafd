"""Likelihood of text under a checkpoint: the block-autoregressive NELBO bound (diffusion) or the exact NLL (AR).

  python -m eval.likelihood --checkpoint=workdirs/demo --data=validation --max_tokens=2048
  python -m eval.likelihood --checkpoint=workdirs/demo --data=my_text.txt --num_t_samples=16 --out=ll.json
  python -m eval.likelihood --checkpoint=/ckpts/dgemma --data=my_text.txt      # any checkpoint kind
  python -m eval.likelihood --checkpoint=workdirs/demo --reference=workdirs/demo_ar --data=validation

Reports nats/token, bits per UTF-8 byte of the original text and the perplexity bound, each with a standard
error; the estimator is dgemma/diffusion/likelihood.py (its docstring has the mathematics), the same one
`dgemma.load(...).score(texts)` calls. Settings: `eval.*` in configs/base.py (flags of the same name override
them): eval.data is a .txt / .jsonl file (data.txt_mode, data.jsonl_field, data.encoding_errors) or a split of
the run's dataset; eval.max_documents / eval.max_tokens cut it. With eval.reference (--reference), a second
checkpoint (e.g. the AR baseline, same tokenizer and canvas length) is scored on the same canvases and the output
adds its figures and the paired comparison: ratio_to_reference and excess_nats_per_token, with standard errors
from the per-canvas pairs. The printed summary leaves out the per-canvas lists; eval.out has them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import ml_collections

import dgemma
from dgemma import data as data_lib
from dgemma import checkpoints, files
from dgemma.diffusion import likelihood
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
  settings = cli_flags.checked_settings(checkpoint, config)
  texts = eval_texts(settings)
  if settings.eval.reference:
    checkpoints.header(settings.eval.reference, REFERENCE_FIELD)  # a bad path fails before any weight is read
  model = dgemma.load(checkpoint, step=step, config=config, field=checkpoints.CHECKPOINT_FLAG)
  out = model.score(texts)
  if settings.eval.reference:
    out.update(compare(out, dgemma.load(settings.eval.reference, field=REFERENCE_FIELD), texts,
                       max_tokens=model.settings.eval.max_tokens))
  print_fn(json.dumps({k: v for k, v in out.items() if k not in PER_CANVAS}, indent=2))
  if out.get("measure") == "nelbo_bound" and out["nats_per_token"] > out["uniform_nats_per_token"]:
    print_fn(loose_bound_note(out))
  if model.settings.eval.out:
    files.write_text_atomic(model.settings.eval.out, json.dumps(out, indent=2) + "\n")
  return out


PER_CANVAS = ("canvas_nats", "canvas_tokens")


def loose_bound_note(out: dict) -> str:
  """What a bound above the uniform baseline means (docs/model.md, section 6)."""
  return (f"note: the bound, {out['nats_per_token']:.3f} nats/token, is above the uniform baseline log V = "
          f"{out['uniform_nats_per_token']:.3f} (a model that knows nothing). It is an upper bound, tight only when the "
          f"network's x_theta is close to the true leave-one-out distribution; a model trained with a posterior "
          f"objective ({out['objective']}) briefly or on little data can be far from it. Compare checkpoints with "
          "the same objective, or train with a loo_* objective for a tight bound (docs/model.md, section 6)")
REFERENCE_FIELD = "eval.reference (--reference)"


def compare(out: dict, reference: dgemma.Model, texts: list[str], *, max_tokens: int) -> dict:
  """The reference scored on the same canvases (the same cut and context length), and the paired comparison."""
  ref = reference.score(texts, context_len=out["context_len"], max_tokens=max_tokens)
  if ref["canvas_tokens"] != out["canvas_tokens"]:
    raise ConfigError(f"eval.reference: {reference.path} cuts the texts into other canvases ({ref['canvases']} "
                      f"canvases of {ref['canvas_len']} tokens, {ref['tokens']} tokens, against {out['canvases']} of "
                      f"{out['canvas_len']}, {out['tokens']}); it needs the same tokenizer and diffusion.canvas_len")
  summary = {k: ref[k] for k in ("checkpoint", "step", "objective", "measure", "nats_per_token", "nats_per_token_se",
                                 "bits_per_byte")}
  return {"reference": summary,
          **likelihood.paired_ratio(out["canvas_nats"], ref["canvas_nats"], out["canvas_tokens"])}


def main(argv):
  cli_flags.run_eval(argv, run)


if __name__ == "__main__":
  cli_flags.define("data", "num_t_samples", "max_tokens", "max_documents", "context_len", "reference", "out")
  cli_flags.main(main, "eval.likelihood")
