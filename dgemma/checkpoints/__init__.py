"""Every checkpoint format in one package (docs/checkpoints.md), and one reader that tells them apart.

  kind(path)   'workdir'  a training run (config.json + checkpoints/<step>/; workdir.py)
               'params'   a params checkpoint (model_config.json + params/, from dgemma.tools.convert or
                          merge_lora; params.py)
               'adapter'  the trained leaves of a LoRA / head-only run (adapter_config.json; adapter.py)
               'hf'       a Hugging Face DiffusionGemma or Gemma 4 text directory (config.json + safetensors;
                          hf.py reads it directly, streaming and casting tensor by tensor)
  header(path, field, step) -> Checkpoint   what it holds, without its weights (reader.py)
  identity(source) -> str                    a fingerprint of its tensor files (an adapter records its base's)
  load(source, ...) -> Checkpoint            the params only (never a run's optimizer state), placed, checked finite
  load_as(source, model, ...) -> Checkpoint  the params laid out as another architecture's tree (reader.py)
  Checkpoint, Placement (checkpoint.py)      the record every reader fills; where params go
  layout.relayout(tree, saved, new)          a tree between the stacked and the unrolled layer layout (layout.py)
Quantizing while reading is a per-tensor transform passed in (`quantizer`, a `dgemma.quant.Quantizer`).
"""

from dgemma.checkpoints import adapter, hf, layout, params, workdir
from dgemma.checkpoints.checkpoint import CHECKPOINT_FLAG, Checkpoint, Placement
from dgemma.checkpoints.reader import (KINDS, adapter_transfer, at_step, check_loadable_as, header, identity, kind, load,
                                      load_as, merge_adapters)

__all__ = ["KINDS", "CHECKPOINT_FLAG", "Checkpoint", "Placement", "kind", "header", "identity", "at_step", "load", "load_as",
           "adapter_transfer", "check_loadable_as", "merge_adapters", "adapter", "hf", "layout", "params", "workdir"]
