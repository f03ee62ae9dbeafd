"""Fold a LoRA adapter checkpoint into its base weights: a full params checkpoint with W + (alpha/r) A B.

  python -m dgemma.tools.merge_lora --adapter=workdirs/lora/adapter --out=/ckpts/merged
  python -m dgemma.tools.merge_lora --base=/ckpts/base --adapter=workdirs/lora/adapter --out=/ckpts/merged

`--base` defaults to the checkpoint the adapter was trained from (adapter_config.json 'base', i.e. the
run's train.init_from): any checkpoint kind (a params checkpoint, a training run, an HF directory, a QLoRA run).
It must hold the weights the adapter was trained on (the fingerprint the adapter recorded,
`dgemma.checkpoints.identity`): another run of the same architecture is refused unless `--any_base`. The result is
a plain dgemma params checkpoint (no adapters; a converted base's extra JSON files such as hf_config.json, or an HF
base's config, and its tokenizer are kept): train from it (train.init_from), export it (python -m
dgemma.tools.convert --from_ckpt), or compare it with the unmerged run.

A QLoRA adapter (finetune.base_quant) is folded into its base as the run saw it, quantized and dequantized: the
merged float checkpoint computes what the run trained.
Only finetune.mode='lora' adapters can be merged. A head_only adapter acts only in decoder mode, while
the encoder shares the same weights: folding it in would change the encoder (and its KV cache), so the
tool refuses; sample from the training workdir instead (python sample.py --workdir=...).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flax
import jax
import numpy as np
from absl import app, flags, logging

from dgemma import checkpoints, quant
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import params as params_ckpt
from dgemma.model.sharding import MESH_AXES
from dgemma.tools import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("base", None, "The base: any checkpoint kind (default: the adapter's recorded base).")
flags.DEFINE_bool("any_base", False, "Merge into a base whose weights are not the ones the adapter was trained on "
                  "(refused otherwise).")
flags.DEFINE_string("adapter", None, "Adapter checkpoint written by training (WORKDIR/adapter).")
flags.DEFINE_string("out", None, "Merged params checkpoint directory to write.")
# dgemma.tools.convert defines the same flag (same meaning): both allow the other's definition.
flags.DEFINE_bool("overwrite", False, "Replace an existing output directory.", allow_override=True)


def merge_checkpoints(adapter_dir: str, out_dir: str, base_dir: str | None = None, *, overwrite: bool = False,
                      any_base: bool = False) -> dict:
  """Writes the merged checkpoint; returns the adapter_config. The base is any checkpoint kind (a params checkpoint,
  a training run, an HF directory, a QLoRA run), read by the cross-kind reader as the adapter's run held it and laid
  out as its model (`checkpoints.load` of the adapter), then the adapters are folded in. A base whose weights are not
  the ones the adapter was trained on is refused (`checkpoints.identity`) unless `any_base`. Errors name the flag."""
  if not adapter_ckpt.is_adapter_dir(adapter_dir):
    raise FileNotFoundError(f"--adapter: {adapter_dir} has no {adapter_ckpt.ADAPTER_CONFIG} (not an adapter "
                            "checkpoint; training writes one to WORKDIR/adapter with finetune.mode='lora')")
  meta = params_ckpt.read_extra_json(adapter_dir, adapter_ckpt.ADAPTER_CONFIG)
  if meta["mode"] != "lora":
    raise ValueError(f"--adapter: {adapter_dir} is a {meta['mode']!r} adapter; only 'lora' adapters can be merged "
                     "(head_only adapters act only in decoder mode, and the encoder shares the weights: merging "
                     "would change the encoder and its KV cache). Sample from the training workdir instead.")
  if not base_dir and not meta.get("base"):
    raise ValueError(f"--base: {adapter_dir} records no base checkpoint (the run had no train.init_from); pass --base")
  if Path(out_dir).exists() and not overwrite:
    raise FileExistsError(f"--out: {out_dir} already exists (pass --overwrite to replace it)")
  header = checkpoints.header(adapter_dir, "--adapter", base=base_dir, any_base=any_base)
  # the base as the run held it (a QLoRA run's frozen base quantized, then dequantized here: the merged float
  # checkpoint computes what the run trained), the adapter's leaves on top, on the host
  host = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
  loaded = checkpoints.load(header, placement=checkpoints.Placement.of(host))  # on the host, not an accelerator
  flat = {k: np.asarray(quant.dequantize(v)) for k, v in flax.traverse_util.flatten_dict(loaded.params).items()}
  merged = flax.traverse_util.unflatten_dict(checkpoints.merge_adapters(flat, header.model.lora.scale))
  base = header.base
  extra = {}
  if base.kind == "params":  # what a converted checkpoint keeps beside its weights (hf_config.json, ...)
    extra = {p.name: params_ckpt.read_extra_json(base.path, p.name) for p in Path(base.path).glob("*.json")
             if p.name not in (params_ckpt.MODEL_CONFIG, adapter_ckpt.ADAPTER_CONFIG)}
  elif base.hf_config is not None:
    extra = {params_ckpt.HF_CONFIG: base.hf_config}
  tokenizer = header.tokenizer_file
  params_ckpt.save_params(out_dir, merged, dataclasses.replace(header.model, lora=None).to_dict(), extra_json=extra,
                          overwrite=overwrite, extra_files={tokenizer.name: tokenizer} if tokenizer is not None else None)
  return meta


def main(argv):
  cli.no_extra_args(argv)
  if not FLAGS.adapter or not FLAGS.out:
    raise app.UsageError("--adapter and --out are required")
  meta = merge_checkpoints(FLAGS.adapter, FLAGS.out, FLAGS.base, overwrite=FLAGS.overwrite, any_base=FLAGS.any_base)
  logging.info("wrote %s (rank %d, alpha %g, targets %s)", FLAGS.out, meta["lora"]["rank"], meta["lora"]["alpha"],
               ",".join(meta["lora"]["targets"]))


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.merge_lora", user_errors=(ValueError,))
