"""DiffusionGemma model: config, the Flax trunk, its KV cache and parameter accounting."""

from dgemma.model.config import ConfigError, ModelConfig
from dgemma.model.transformer import KVCache, Transformer, count_params, init_cache, param_shapes

__all__ = ["ModelConfig", "ConfigError", "Transformer", "KVCache", "init_cache", "count_params",
           "param_shapes"]
