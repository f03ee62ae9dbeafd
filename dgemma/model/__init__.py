"""DiffusionGemma model: config, the Flax trunk, its KV cache and parameter accounting."""

from dgemma.model.config import ModelConfig
from dgemma.model.transformer import (KVCache, Transformer, abstract_params, count_params, init_cache,
                                      param_shapes)

__all__ = ["ModelConfig", "Transformer", "KVCache", "abstract_params", "init_cache", "count_params",
           "param_shapes"]
