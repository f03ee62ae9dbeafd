"""The model of an existing checkpoint as a config's starting point (fine-tuning and adaptation configs).

  config = from_checkpoint.apply(base.get_config(), "/ckpts/dgemma")   # any kind dgemma.load takes
  python -m dgemma.tools.model_size --config=configs/models/from_checkpoint.py:/ckpts/dgemma   # its model group

`apply` reads only the checkpoint's metadata (dgemma.checkpoints.header): a training run, a params checkpoint,
an adapter or a Hugging Face directory. It sets the architecture keys of the `model` group (compute choices such
as dtype, remat and moe_impl stay the config's), the tokenizer that belongs to the weights (the file beside them,
else the run's own tokenizer settings), `train.init_from`, and, when the checkpoint carries a run's settings, the
run's canvas length and sequence length, so the head is fine-tuned on the canvases it was trained and is sampled
with.
"""

import ml_collections

from dgemma import checkpoints
from dgemma import settings as settings_lib

FIELD = "the config argument (a checkpoint)"


def get_config(checkpoint: str = "") -> ml_collections.ConfigDict:
  """The model group of `checkpoint` (a preset read from it); without one, the declared defaults."""
  if not checkpoint:
    return settings_lib.default_config().model
  model = ml_collections.ConfigDict(checkpoints.header(checkpoint, FIELD).model.to_dict())
  model.preset = "imported"
  return model


def apply(config: ml_collections.ConfigDict, checkpoint: str) -> ml_collections.ConfigDict:
  described = checkpoints.header(checkpoint, FIELD)
  for key, value in described.model.to_dict().items():
    if key not in settings_lib.RUNTIME_MODEL_FIELDS:
      with config.model.ignore_type():
        config.model[key] = tuple(value) if isinstance(value, list) else value
  config.model.preset = "imported"
  run = settings_lib.from_json(described.config_json) if described.config_json is not None else None
  if described.tokenizer_file is not None:
    config.data.tokenizer.kind, config.data.tokenizer.path = "file", str(described.tokenizer_file)
  elif run is not None:
    config.data.tokenizer = run.data.tokenizer
  if run is not None:
    config.diffusion.canvas_len, config.data.seq_len = run.diffusion.canvas_len, run.data.seq_len
  config.train.init_from = str(checkpoint)
  return config
