"""Test helpers shared by the model-level test files."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dgemma import settings as settings_lib
from dgemma.checkpoints import workdir as workdir_ckpt
from dgemma.model import ModelConfig, param_shapes
from dgemma.train import optimizer as optimizer_lib, state as state_lib


@functools.cache
def random_params(cfg: ModelConfig, seed: int = 0):
  """Random params from `param_shapes` (no init compile): norm / router / layer scales != 1 and a
  spread router, so tests cannot pass by accident on identity scales."""
  g = np.random.default_rng(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      v = g.uniform(0.7, 1.3, s.shape)
    elif "router" in name:
      v = g.normal(0.0, 1.0, s.shape)
    else:
      v = g.normal(0.0, 0.15, s.shape)
    return jnp.asarray(v, s.dtype)

  return jax.tree_util.tree_map_with_path(fill, param_shapes(cfg))


def random_rows(vocab_size: int, batch: int, length: int, seed: int = 0) -> dict:
  """One unpadded packed batch {tokens, segment_ids, positions} of random ids (5 .. vocab_size - 1: no
  special token), a single document per row."""
  g = np.random.default_rng(seed)
  tokens = g.integers(5, vocab_size, (batch, length)).astype(np.int32)
  return {"tokens": tokens, "segment_ids": np.ones((batch, length), np.int32),
          "positions": np.tile(np.arange(length, dtype=np.int32), (batch, 1))}


def save_random_run(config, workdir):
  """A "trained" run without training: random params (no init program to compile) saved as step 1 of
  `workdir` beside the run's config.json. Returns (model_cfg, train state)."""
  settings = settings_lib.from_config(config)
  model_cfg = settings.model
  params = random_params(model_cfg)
  state = state_lib.TrainState(step=jnp.ones((), jnp.int32), params=params,
                               opt_state=optimizer_lib.make_optimizer(settings.opt, 1).init(params))
  workdir_ckpt.write_config_json(workdir, settings.config_json)
  workdir_ckpt.save_step(workdir, 1, state)
  return model_cfg, state


# ---- float64 references ---------------------------------------------------------------------------
# Two fp32 programs that differ only in reduction order (padding, batching, scan vs loop, MoE
# implementations, ...) agree only up to fp32 round-off amplified by the model, and that round-off
# depends on the CPU (XLA's blocking, vector width, FMA use). Tests of such equalities run the same
# function in float64 instead, where round-off is ~1e-16 relative and a tolerance of 1e-9 is robust on
# any machine yet ~1e6 times below the effect of a real bug (a masked key attended, a token routed
# to the wrong expert, ...).
EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7


@contextlib.contextmanager
def float64():
  """Scoped float64: `jax.enable_x64` is a thread-local config state and part of the jit cache key,
  so a jitted function called inside traces and compiles a separate float64 program, and on exit
  (even by an exception) the process is back in 32-bit mode. Turn results into numpy arrays inside
  the block: a float64 jax array used after it would be truncated to fp32."""
  with jax.enable_x64(True):
    yield


def f64_config(cfg: ModelConfig) -> ModelConfig:
  return dataclasses.replace(cfg, dtype="float64", param_dtype="float64")


def to_f64(tree):
  """Floating leaves as float64 numpy arrays (exact: every fp32 value is a float64 value); others as is."""
  return jax.tree.map(lambda a: np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def save_random_hf(cfg: ModelConfig, path, *, canvas_length: int = 8, seed: int = 0):
  """A tiny random Hugging Face DiffusionGemma directory (config.json + safetensors) written by dgemma's
  own exporter (tests/checkpoints/test_hf.py checks it against transformers): the front-door tests need the
  format, not torch. Returns the path."""
  from dgemma.checkpoints import hf
  hf.export_hf_checkpoint(cfg, jax.device_get(random_params(cfg, seed)), path,
                          base_config={"model_type": hf.DIFFUSION, "canvas_length": canvas_length})
  return path
