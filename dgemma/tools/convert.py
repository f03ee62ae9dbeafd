"""Convert any checkpoint to a dgemma params checkpoint or a Hugging Face DiffusionGemma directory.

  python -m dgemma.tools.convert --from_hf HF_DIR --to CKPT_DIR [--dtype bfloat16]
  python -m dgemma.tools.convert --from_ckpt workdirs/demo --to CKPT_DIR          # a run -> params
  python -m dgemma.tools.convert --from_ckpt workdirs/demo --to_hf HF_DIR [--hf_base HF_DIR] [--max_shard_size 5GB]

--from_ckpt takes every kind `dgemma.load` takes: a training run (its latest step), a params checkpoint, an
adapter (on its base) or an HF directory; --from_hf is the same flag for an HF directory. LoRA adapters are
folded into their weights; head_only adapters cannot be and are refused. The output keeps the tokenizer and the
run's settings (canvas length, sampler), so `dgemma.load(OUT)` samples as the run did; an HF export also writes
them where transformers reads them (config.json canvas_length, generation_config.json) and is text-only unless
--hf_base names an HF checkpoint whose vision tensors (and config) it copies (dgemma/checkpoints/convert.py).
"""

from __future__ import annotations

import re

from absl import app, flags, logging

from dgemma.checkpoints import convert
from dgemma.tools import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("from_hf", None, "HF checkpoint directory to convert (the same as --from_ckpt).")
flags.DEFINE_string("from_ckpt", None, "Checkpoint to convert: a training workdir, params checkpoint, adapter or "
                    "HF directory.")
flags.DEFINE_string("to", None, "dgemma params checkpoint directory to write.")
flags.DEFINE_string("to_hf", None, "HF DiffusionGemma checkpoint directory to write.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "Parameter dtype of the output (default: float32 from an HF directory, else the source's).")
flags.DEFINE_string("model_type", None, "Override an HF config.json's model_type when reading it.")
flags.DEFINE_string("hf_base", None, "HF export: an HF checkpoint to copy vision tensors and config from.")
flags.DEFINE_string("max_shard_size", "5GB", "HF export: largest safetensors shard (e.g. 500MB, 5GB).")
flags.DEFINE_bool("overwrite", False, "Replace an existing output directory.",
                  allow_override=True)  # dgemma.tools.merge_lora defines it too

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
  """'5GB' -> 5e9 bytes; also KB/MB, KiB/MiB/GiB and plain integers."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).upper() not in _UNITS:
    raise ValueError(f"--max_shard_size: cannot parse {text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv):
  cli.no_extra_args(argv)
  sources = [(f, v) for f, v in (("--from_hf", FLAGS.from_hf), ("--from_ckpt", FLAGS.from_ckpt)) if v]
  targets = [t for t in (FLAGS.to, FLAGS.to_hf) if t]
  if len(sources) != 1 or len(targets) != 1:
    raise app.UsageError("use one source (--from_ckpt CKPT or --from_hf HF_DIR) and one output (--to CKPT_DIR "
                         "or --to_hf HF_DIR)")
  (field, src), = sources
  max_shard_bytes = parse_size(FLAGS.max_shard_size)  # bad flags fail before any weight is read
  if FLAGS.to:
    cfg = convert.to_params(src, FLAGS.to, dtype=FLAGS.dtype, model_type=FLAGS.model_type, overwrite=FLAGS.overwrite,
                            field=field)
    logging.info("wrote %s (%d layers, d_model %d)", FLAGS.to, cfg.num_layers, cfg.d_model)
  else:
    convert.to_hf(src, FLAGS.to_hf, hf_base=FLAGS.hf_base, max_shard_bytes=max_shard_bytes, dtype=FLAGS.dtype,
                  overwrite=FLAGS.overwrite, field=field)
    logging.info("wrote %s", FLAGS.to_hf)


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.convert", user_errors=(ValueError,))
