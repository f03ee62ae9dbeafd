"""The `tiny` fixture: a tiny random model with one generate run over three prompts (module scope)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dgemma.sampling import SamplerConfig, generate
from tests.sampling.helpers import C, S, N, PROMPTS, P, tiny_model, count_compiles


@pytest.fixture(scope="module")
def tiny():
  model, params = tiny_model()
  prompts = np.array([p + [0] * (P - len(p)) for p in PROMPTS])
  lengths = np.array([len(p) for p in PROMPTS])
  keys = jax.random.split(jax.random.key(7), len(PROMPTS))
  cfg = SamplerConfig(canvas_len=C, max_denoising_steps=S, end_ids=(1, 106), confidence_threshold=0.05)
  run = lambda cfg=cfg, rng=keys, **kw: generate(model, params, prompts, lengths, cfg, rng, N,
                                                return_trajectory="all", **kw)
  jax.clear_caches()  # whatever this worker ran before (the same program in another module): the first run compiles
  out, compiles = count_compiles(run)
  return dict(model=model, params=params, prompts=prompts, lengths=lengths, keys=keys, cfg=cfg, run=run,
              out=jax.tree.map(np.asarray, out), first_compiles=compiles)
