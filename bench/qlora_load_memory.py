"""Host memory of reading a quantized model: a base for QLoRA (finetune.base_quant) and a model to sample
(`dgemma.load(path, quantize=...)`), quantized tensor by tensor as it streams, against reading the float tree first,
on a synthetic Hugging Face checkpoint of a preset.

  .venv/bin/python bench/qlora_load_memory.py [--config=configs/models/medium.py] [--scheme=int4_experts]

Writes a random checkpoint of the preset in bfloat16 (dgemma's HF exporter) to a temporary directory, then in a
fresh process for each way reads it as `train.init_from` does (`dgemma.checkpoints.load` with the run's quantizer, float32 parameters,
the head_only frozen base quantized): 'streamed' (the base quantized as each layer's tensor is read), 'load'
(`dgemma.load(path, quantize=SCHEME, dtype='float32')`, what sampling reads with: every weight sample.quantize
quantizes, the same way) and 'float first' (the float tree read whole, then quantized). Each process reports its resident-set high-water mark
(Linux VmHWM) less its resident set just before reading; on CPU the "device" is this host, so the figure is the
whole cost. Printed with the quantized tree's size, the float tree's, and the largest single float tensor.
"""

import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/models/medium.py", "Model preset.")
_SCHEME = flags.DEFINE_string("scheme", "int4_experts", "finetune.base_quant.")
_ROW = flags.DEFINE_string("row", "", "Internal: run one way ('streamed' | 'float_first') on --path.")
_PATH = flags.DEFINE_string("path", "", "Internal: the checkpoint directory.")
_GROUP = flags.DEFINE_integer("group_size", 64, "finetune.base_quant_group_size.")


def _status_kib(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


def _settings():
  from configs import base
  from dgemma import settings as settings_lib
  config = base.get_config()
  config.model = _CONFIG.value
  config.model.param_dtype = "float32"
  config.data.tokenizer.kind = "byte"
  config.finetune.mode, config.finetune.base_quant = "head_only", _SCHEME.value
  config.finetune.base_quant_group_size = _GROUP.value
  return settings_lib.from_config(config)


def _row(way: str, path: str) -> dict:
  import jax
  from dgemma import checkpoints, finetune, quant
  settings = _settings()
  quantizer = finetune.base_quantizer(settings.finetune)
  jax.devices()
  Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
  before, anon_before = _status_kib("VmRSS"), _status_kib("RssAnon")
  anon_peak, done = [anon_before], threading.Event()

  def poll():  # the anonymous resident set (no file pages) has no high-water mark: sample it
    while not done.is_set():
      anon_peak[0] = max(anon_peak[0], _status_kib("RssAnon"))
      time.sleep(0.005)

  poller = threading.Thread(target=poll, daemon=True)
  poller.start()
  if way == "streamed":
    loaded = checkpoints.load(path, dtype="float32", quantizer=quantizer)
  elif way == "load":  # the sampling front door: dgemma.load(hf_dir, quantize=...)
    import dgemma
    from configs import base
    config = base.get_config()
    config.data.tokenizer.kind = "byte"  # the checkpoint stores none
    config.sample.quant_group_size = _GROUP.value
    loaded = dgemma.load(path, quantize=_SCHEME.value, dtype="float32", config=config)
  else:
    loaded = checkpoints.load(path, dtype="float32")
    loaded = dataclasses.replace(loaded, params=quantizer.params(loaded.params))
  jax.block_until_ready(loaded.params)
  done.set()
  poller.join()
  return {"way": way, "peak_bytes": (_status_kib("VmHWM") - before) * 1024,
          "anon_peak_bytes": (anon_peak[0] - anon_before) * 1024, "tree_bytes": quant.tree_bytes(loaded.params)}


def main(argv):
  del argv
  if _ROW.value:
    print(json.dumps(_row(_ROW.value, _PATH.value)))
    return
  import jax
  import numpy as np
  from dgemma import quant
  from dgemma.checkpoints import hf
  from dgemma.model import param_shapes
  settings = _settings()
  base_cfg = dataclasses.replace(settings.model, lora=None)
  shapes = param_shapes(base_cfg)
  float_bytes = quant.tree_bytes(shapes)
  largest = max(quant.tree_bytes(s) for s in jax.tree.leaves(shapes))
  with tempfile.TemporaryDirectory() as tmp:
    rng = np.random.default_rng(0)
    fill = lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02).astype(np.float32)
    print(f"writing a random {base_cfg.preset} checkpoint ({float_bytes / 2**30:.2f} GiB of float32 parameters)",
          flush=True)
    hf.export_hf_checkpoint(base_cfg, jax.tree.map(fill, shapes), tmp, dtype="bfloat16",
                            base_config={"model_type": hf.DIFFUSION})
    rows = []
    for way in ("streamed", "load", "float_first"):
      out = subprocess.run([sys.executable, __file__, f"--row={way}", f"--path={tmp}",
                            f"--config={_config_arg()}", f"--scheme={_SCHEME.value}",
                            f"--group_size={_GROUP.value}"], capture_output=True, text=True, check=True)
      rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(rows[-1], flush=True)
  quantized = rows[0]["tree_bytes"]
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  print(f"preset {base_cfg.preset}, base_quant {_SCHEME.value}: float tree {gib(float_bytes)}, quantized tree "
        f"{gib(quantized)}, largest float tensor {gib(largest)}")
  for r in rows:
    print(f"  {r['way']:12s} peak anonymous memory {gib(r['anon_peak_bytes'])} = "
          f"{r['anon_peak_bytes'] / quantized:.2f} x the quantized tree, {r['anon_peak_bytes'] / float_bytes:.2f} x "
          f"the float tree; resident-set peak {gib(r['peak_bytes'])} (with the checkpoint's memory-mapped pages)")


def _config_arg() -> str:
  return next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), "configs/models/medium.py")


if __name__ == "__main__":
  app.run(main)
