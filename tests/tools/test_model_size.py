"""dgemma.tools.model_size: the CLI on the 26B preset and an experiment config; exact counts on tiny."""

import math
import re
import subprocess
import sys
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import demo
from configs.models import tiny
from dgemma.model import ModelConfig, Transformer
from dgemma.tools import model_size

ROOT = Path(__file__).resolve().parents[2]


def _run_cli(config_path: str) -> str:
  out = subprocess.run([sys.executable, "-m", "dgemma.tools.model_size", f"--config={config_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout


def _count(text: str, label: str) -> int:
  return int(re.search(rf"^{label}:\s+([\d,]+)", text, re.M).group(1).replace(",", ""))


@pytest.mark.slow  # a subprocess
def test_cli_26b_preset():
  text = _run_cli("configs/models/diffusiongemma_26b_a4b.py")
  total, active = _count(text, "total parameters"), _count(text, "active per token")
  assert 25.0e9 < total < 25.5e9, total
  assert 3.7e9 < active < 3.95e9, active
  rows = {m[0]: (int(m[1].replace(",", "")), int(m[2].replace(",", "")))
          for m in re.findall(r"^(\w+)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+%$", text, re.M)}
  assert set(rows) == set(model_size.COMPONENTS), rows
  assert sum(t for t, _ in rows.values()) == total and sum(a for _, a in rows.values()) == active
  assert rows["experts"][1] * 16 == rows["experts"][0]  # top-8 of 128
  nbytes = {m[0]: int(m[1].replace(",", "")) for m in re.findall(r"^  (bf16|int8|int4)\s+([\d,]+)", text, re.M)}
  assert nbytes["bf16"] == 2 * total
  assert total < nbytes["int8"] < 1.01 * total   # 1 byte + per-channel scales + bf16 vectors
  # 0.5 byte + one bf16 scale per 64 inputs (2 / 64 = 0.031 byte) per quantized weight
  assert 0.53 * total < nbytes["int4"] < 0.535 * total


def test_experiment_config_detected():
  config = demo.get_config()
  assert model_size.model_group(config) is config.model
  preset = tiny.get_config()
  assert model_size.model_group(preset) is preset


def test_tiny_total_equals_init():
  cfg = ModelConfig.from_config_dict(tiny.get_config())
  tok = jnp.zeros((1, 1), jnp.int32)
  variables = jax.jit(lambda: Transformer(cfg).init(jax.random.key(0), tok, tok, tok, tok, tok, tok))()
  leaves = jax.tree.leaves(flax.linen.unbox(variables["params"]))
  s = model_size.summarize(cfg)
  assert s["total"] == sum(int(np.size(x)) for x in leaves)
  n_experts = sum(math.prod(v.shape) for k, v in flax.traverse_util.flatten_dict(
      flax.linen.unbox(variables["params"])).items() if "experts" in k)
  assert s["active"] == s["total"] - n_experts // 2  # top-2 of 4 experts
  assert "tiny" in model_size.report(cfg, "tiny")


def test_train_step_flops_counts_each_pass():
  """6 per active parameter per trained token (encoder: the row before its last canvas; decoder: K canvases of C),
  2 per active parameter per canvas token for the self-conditioning forward pass, one causal pass for AR."""
  from dgemma.diffusion.config import DiffusionSettings
  cfg = ModelConfig.from_config_dict(tiny.get_config())
  active = model_size.count_params(cfg)["active"]
  rows, seq_len, C = 3, 64, 8
  no_sc = model_size.train_step_flops(cfg, DiffusionSettings(canvas_len=C, self_cond_prob=0.0), rows, seq_len)
  assert no_sc == 6 * active * rows * seq_len  # one canvas: the encoder's 56 tokens and the decoder's 8
  two = model_size.train_step_flops(cfg, DiffusionSettings(canvas_len=C, self_cond_prob=0.0, canvases_per_row=2),
                                     rows, seq_len)
  assert two - no_sc == 6 * active * rows * C  # a second canvas is one more decoder pass over C tokens
  assert cfg.self_conditioning
  sc = model_size.train_step_flops(cfg, DiffusionSettings(canvas_len=C), rows, seq_len)
  assert sc - no_sc == 2 * active * rows * C
  ar = model_size.train_step_flops(cfg, DiffusionSettings(canvas_len=C, objective="ar"), rows, seq_len)
  assert ar == 6 * active * rows * seq_len
  # Short canvases: the encoder reads S - C more tokens (up to the last short canvas), one more decoder pass over
  # their A * S tokens, no self-conditioning pass for them.
  short = model_size.train_step_flops(cfg, DiffusionSettings(canvas_len=C, short_canvas_len=2), rows, seq_len)
  assert short - sc == 6 * active * rows * ((C - 2) + C)
