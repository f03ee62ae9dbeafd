"""Fold a LoRA adapter checkpoint into its base weights: a full params checkpoint with W + (alpha/r) A B.

  python -m dgemma.tools.merge_lora --adapter=workdirs/lora/adapter --out=/ckpts/merged
  python -m dgemma.tools.merge_lora --base=/ckpts/base --adapter=workdirs/lora/adapter --out=/ckpts/merged

`--base` defaults to the checkpoint the adapter was trained from (adapter_config.json 'base', i.e. the
run's train.init_from). The result is a plain dgemma params checkpoint (no adapters; the base's
model_config.json and extra JSON files such as hf_config.json are kept): train from it
(train.init_from), export it (python -m dgemma.tools.convert --from_ckpt), or compare it with the unmerged run.

A QLoRA adapter (finetune.base_quant) is folded into its base as the run saw it, quantized and dequantized
(`as_trained_base`): the merged float checkpoint computes what the run trained.
Only finetune.mode='lora' adapters can be merged. A head_only adapter acts only in decoder mode, while
the encoder shares the same weights: folding it in would change the encoder (and its KV cache), so the
tool refuses; sample from the training workdir instead (python sample.py --workdir=...).
"""

from __future__ import annotations

from pathlib import Path

import flax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from dgemma import quant
from dgemma import settings as settings_lib
from dgemma.checkpoints import adapter as adapter_ckpt
from dgemma.checkpoints import params as params_ckpt
from dgemma.model import ModelConfig, lora
from dgemma.tools import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("base", None, "Base dgemma params checkpoint (default: the adapter's recorded base).")
flags.DEFINE_string("adapter", None, "Adapter checkpoint written by training (WORKDIR/adapter).")
flags.DEFINE_string("out", None, "Merged params checkpoint directory to write.")
# dgemma.tools.convert defines the same flag (same meaning): both allow the other's definition.
flags.DEFINE_bool("overwrite", False, "Replace an existing output directory.", allow_override=True)


def as_trained_base(base: dict, run_config_json: str | None) -> dict:
  """The base weights as the adapter's run saw them: a QLoRA run (finetune.base_quant) trained against its base
  quantized in model.param_dtype, so those weights are quantized the same way and dequantized (float, the run's
  param dtype) before the adapter is folded in; the merged checkpoint then computes what the run trained, in
  float. Any other run: `base` unchanged."""
  if run_config_json is None:
    return base
  model, quantizer = settings_lib.run_model(run_config_json)
  if quantizer is None:
    return base
  dtype = jnp.dtype(model.param_dtype)

  def as_trained(names, w):  # one weight at a time, back in its stored dtype; the others as they are
    if quantizer.plan(names, np.shape(w)) is None:
      return w
    return np.asarray(quant.dequantize(quantizer(names, jnp.asarray(w, dtype)))).astype(np.asarray(w).dtype)

  flat = flax.traverse_util.flatten_dict(base)
  return flax.traverse_util.unflatten_dict({k: as_trained(k, w) for k, w in flat.items()})


def merge_checkpoints(adapter_dir: str, out_dir: str, base_dir: str | None = None, *, overwrite: bool = False) -> dict:
  """Writes the merged checkpoint; returns the adapter_config. Errors name the flag at fault."""
  adapter, adapter_model, meta = adapter_ckpt.load_adapter(adapter_dir)
  if meta["mode"] != "lora":
    raise ValueError(f"--adapter: {adapter_dir} is a {meta['mode']!r} adapter; only 'lora' adapters can be merged "
                     "(head_only adapters act only in decoder mode, and the encoder shares the weights: merging "
                     "would change the encoder and its KV cache). Sample from the training workdir instead.")
  base_dir = base_dir or meta.get("base")
  if not base_dir:
    raise ValueError(f"--base: {adapter_dir} records no base checkpoint (the run had no train.init_from); pass --base")
  if Path(out_dir).exists() and not overwrite:
    raise FileExistsError(f"--out: {out_dir} already exists (pass --overwrite to replace it)")
  base, base_model = params_ckpt.load_params(base_dir)
  diffs = settings_lib.model_differences(ModelConfig.from_config_dict(adapter_model),
                                         ModelConfig.from_config_dict(base_model))
  if diffs:
    raise ValueError(f"--base: {base_dir} is not the architecture the adapter was trained on (adapter -> base): "
                     f"{'; '.join(diffs)}")
  base = as_trained_base(base, params_ckpt.read_run_config(adapter_dir))
  scale = float(meta["lora"]["alpha"]) / int(meta["lora"]["rank"])
  merged = lora.merge(base, adapter, scale)
  extra = {p.name: params_ckpt.read_extra_json(base_dir, p.name) for p in Path(base_dir).glob("*.json")
           if p.name != params_ckpt.MODEL_CONFIG}
  tokenizer = params_ckpt.tokenizer_file(base_dir)
  params_ckpt.save_params(out_dir, merged, base_model, extra_json=extra, overwrite=overwrite,
                          extra_files={tokenizer.name: tokenizer} if tokenizer is not None else None)
  return meta


def main(argv):
  cli.no_extra_args(argv)
  if not FLAGS.adapter or not FLAGS.out:
    raise app.UsageError("--adapter and --out are required")
  meta = merge_checkpoints(FLAGS.adapter, FLAGS.out, FLAGS.base, overwrite=FLAGS.overwrite)
  logging.info("wrote %s (rank %d, alpha %g, targets %s)", FLAGS.out, meta["lora"]["rank"], meta["lora"]["alpha"],
               ",".join(meta["lora"]["targets"]))


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.merge_lora", user_errors=(ValueError,))
