"""Convert between Hugging Face checkpoints and dgemma params checkpoints.

  python -m dgemma.tools.convert --from_hf HF_DIR --to CKPT_DIR [--dtype bfloat16]
  python -m dgemma.tools.convert --from_ckpt CKPT_DIR --to_hf HF_DIR [--hf_base HF_DIR] [--max_shard_size 5GB]

Import reads DiffusionGemmaForBlockDiffusion or Gemma 4 text checkpoints (dgemma/checkpoints/hf.py), keeps
the source config.json as `hf_config.json` and copies the tokenizer (tokenizer.model, else tokenizer.json)
into CKPT_DIR, so the checkpoint is complete on its own (`dgemma.load(CKPT_DIR)`, `sample.py --checkpoint`).
The export restores token ids, the vision config and canvas length; `--hf_base` names an HF checkpoint whose
vision tensors (and config) it copies, giving a complete multimodal DiffusionGemma checkpoint.
"""

from __future__ import annotations

import re

from absl import app, flags, logging

from dgemma.checkpoints import hf
from dgemma.tools import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("from_hf", None, "HF checkpoint directory to import.")
flags.DEFINE_string("to", None, "dgemma params checkpoint directory to write (with --from_hf).")
flags.DEFINE_string("from_ckpt", None, "dgemma params checkpoint directory to export.")
flags.DEFINE_string("to_hf", None, "HF checkpoint directory to write (with --from_ckpt).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                  "Parameter dtype of the imported checkpoint.")
flags.DEFINE_string("model_type", None, "Override config.json's model_type on import.")
flags.DEFINE_string("hf_base", None, "Export: HF checkpoint to copy vision tensors and config from.")
flags.DEFINE_string("max_shard_size", "5GB", "Export: largest safetensors shard (e.g. 500MB, 5GB).")
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
  if FLAGS.from_hf and FLAGS.to and not (FLAGS.from_ckpt or FLAGS.to_hf):
    cfg = hf.import_hf(FLAGS.from_hf, FLAGS.to, dtype=FLAGS.dtype, model_type=FLAGS.model_type,
                       overwrite=FLAGS.overwrite)
    logging.info("wrote %s (%d layers, d_model %d)", FLAGS.to, cfg.num_layers, cfg.d_model)
  elif FLAGS.from_ckpt and FLAGS.to_hf and not (FLAGS.from_hf or FLAGS.to):
    hf.export_hf(FLAGS.from_ckpt, FLAGS.to_hf, hf_base=FLAGS.hf_base, max_shard_bytes=parse_size(FLAGS.max_shard_size),
                 overwrite=FLAGS.overwrite)
    logging.info("wrote %s", FLAGS.to_hf)
  else:
    raise app.UsageError("use either --from_hf DIR --to CKPT_DIR or --from_ckpt CKPT_DIR --to_hf DIR")


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.convert", user_errors=(ValueError,))
