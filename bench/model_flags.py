"""The flags the model benchmarks share: the preset (or experiment config) and the shapes of one denoising step."""

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", "configs/models/small.py", "Model preset (or experiment config).")
CONTEXT = flags.DEFINE_integer("context", 256, "Encoded context tokens in the KV cache.", lower_bound=1)
CANVAS = flags.DEFINE_integer("canvas", 256, "Canvas tokens.", lower_bound=1)
