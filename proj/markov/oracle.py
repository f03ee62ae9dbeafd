"""The time-grid samplers driven by the exact denoiser of a Markov source: the sampler's own error, apart
from any model's.

A model's samples scored under the source (eval.samples --truth) mix two errors: the model's (its
posteriors are not the source's) and the sampler's (a reverse step that moves every position at once from
per-position posteriors is exact only as the steps get small). Here the decoder is replaced by the source's
exact per-position posterior p(x_i | z_t) (forward-backward, proj/markov/data.py `canvas_posteriors`) at
the noise level of each pass, handed to the project's sampler (dgemma.sampling.sampler.denoise_canvas) as a
posterior-output model's logits. So what remains is the sampler's error alone: with the source's posteriors
an ancestral sampler at temperature 1 draws the source's own documents as the steps go to zero, and its
score under the truth falls to `truth_expected_bits` (the source's documents of that length).

Each sample is one canvas at a document's start (no prompt); samplers 'ancestral' and 'pc' (the ones with
a time grid: the released sampler's canvas has no noise level, so no exact denoiser is defined for it).

  python -m proj.markov.oracle --truth=data_cache/markov1/truth.json --samplers=ancestral,pc \
      --steps=4,8,16,32,64 --num_samples=256 --out=markov_oracle/oracle.json
  # the released sampler's temperature schedule instead of 1: --t_max=0.8 --t_min=0.4

Prints one JSON line per (sampler, steps) as it is measured and writes them all to --out.
"""

from __future__ import annotations

import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental import io_callback

from dgemma import files, tokenizers
from proj.markov import data as markov
from dgemma.errors import ConfigError
from dgemma.sampling import noise as noise_lib
from dgemma.sampling import rules, sampler
from dgemma.sampling.config import SamplerConfig
from dgemma.tools import cli

TIME_GRID_SAMPLERS = ("ancestral", "pc")

_FLAGS: dict = {}


def define_flags() -> None:
  """The command line's flags (defined only when run as a program)."""
  _FLAGS["truth"] = flags.DEFINE_string("truth", None, "truth.json of proj.markov.make_text.", required=True)
  _FLAGS["out"] = flags.DEFINE_string("out", None, "JSON file for the rows.", required=True)
  _FLAGS["samplers"] = flags.DEFINE_list("samplers", ["ancestral", "pc"], f"Of {TIME_GRID_SAMPLERS}.")
  _FLAGS["steps"] = flags.DEFINE_list("steps", ["4", "8", "16", "32", "64"], "Decoder passes per canvas.")
  _FLAGS["num_samples"] = flags.DEFINE_integer("num_samples", 256, "Canvases per row.")
  _FLAGS["canvas_len"] = flags.DEFINE_integer("canvas_len", 32, "Symbols per canvas (one canvas per sample).")
  _FLAGS["t_max"] = flags.DEFINE_float("t_max", 1.0, "sample.t_max (1 with t_min 1: untempered).")
  _FLAGS["t_min"] = flags.DEFINE_float("t_min", 1.0, "sample.t_min.")
  _FLAGS["greedy_last_step"] = flags.DEFINE_boolean("greedy_last_step", True, "sample.greedy_last_step.")
  _FLAGS["pc_corrector_steps"] = flags.DEFINE_integer("pc_corrector_steps", 1, "sample.pc_corrector_steps.")
  _FLAGS["pc_corrector_fraction"] = flags.DEFINE_float("pc_corrector_fraction", 1.0, "sample.pc_corrector_fraction.")
  _FLAGS["seed"] = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def byte_ids(chain: markov.MarkovChain) -> list[int]:
  """The byte tokenizer's id of each symbol of the chain's alphabet (the runs trained here read bytes)."""
  return [tokenizers.ByteTokenizer().encode(c)[0] for c in chain.alphabet]


def exact_decode_fn(chain: markov.MarkovChain, cfg: SamplerConfig, ids_S: Sequence[int], vocab_size: int):
  """A `denoise_canvas` decode_fn whose logits are the chain's exact posteriors log p(x_i | z_t) over a
  vocabulary of `vocab_size` ids, symbol j being id ids_S[j], at pass s's input noise level
  (`rules.input_alpha`), for canvases at a document's start. The decoder has no time input, so the pass
  index is counted on the host: the callback is ordered and every pass of a canvas depends on the one
  before, so call k is pass k. Returns (decode_fn, passes): passes() is the number of calls so far (a run
  of S steps must make exactly S)."""
  if cfg.sampler not in TIME_GRID_SAMPLERS:
    raise ConfigError(f"sample.sampler: {cfg.sampler!r} has no noise level per pass; the exact denoiser "
                      f"serves {TIME_GRID_SAMPLERS}")
  ids_S = np.asarray(ids_S)
  if len(ids_S) != chain.num_symbols or len(set(ids_S.tolist())) != len(ids_S) or ids_S.max() >= vocab_size:
    raise ConfigError(f"exact denoiser: ids {ids_S.tolist()} must be {chain.num_symbols} distinct ids below "
                      f"the vocabulary size {vocab_size}")
  symbol_of_id_V = np.full(vocab_size, -1)
  symbol_of_id_V[ids_S] = np.arange(len(ids_S))
  calls = [0]

  def host(canvas_BC):
    alpha = float(rules.input_alpha(cfg, calls[0]))
    calls[0] += 1
    full_BCS, _ = markov.canvas_posteriors(chain, "", symbol_of_id_V[np.asarray(canvas_BC)], alpha, vocab_size)
    return markov.vocab_logits(full_BCS, ids_S, vocab_size)

  def decode_fn(canvas_BC, sc_BCX, sc_mask_B):
    del sc_BCX, sc_mask_B  # the exact posterior needs no self-conditioning signal
    shape = jax.ShapeDtypeStruct(canvas_BC.shape + (vocab_size,), jnp.float32)
    return io_callback(host, shape, canvas_BC, ordered=True)

  return decode_fn, lambda: calls[0]


def sample_texts(chain: markov.MarkovChain, cfg: SamplerConfig, num_samples: int, seed: int, *,
                 ids_S: Sequence[int] | None = None, vocab_size: int | None = None) -> list[str]:
  """`num_samples` canvases of cfg.canvas_len tokens drawn by cfg's sampler from the exact denoiser, as text
  (an id outside the alphabet reads as NUL, which no scoring accepts). Default vocabulary: the byte
  tokenizer's (`byte_ids`); a vocabulary of only the alphabet (ids_S = range(S), vocab_size = S) makes
  every noise token a symbol."""
  if ids_S is None:
    ids_S, vocab_size = byte_ids(chain), tokenizers.ByteTokenizer().vocab_size
  decode_fn, passes = exact_decode_fn(chain, cfg, ids_S, vocab_size)
  noise = noise_lib.JaxNoise(noise_lib.row_keys(jax.random.key(seed), num_samples))
  init_BC = sampler.initial_canvas(cfg, noise, 0, cfg.canvas_len, vocab_size)
  state = jax.jit(lambda z: sampler.denoise_canvas(decode_fn, cfg, noise, z, vocab_size))(init_BC)
  out_BC = np.asarray(sampler.canvas_result(state, cfg))
  if passes() != cfg.max_denoising_steps:
    raise RuntimeError(f"the exact denoiser was called {passes()} times for {cfg.max_denoising_steps} steps")
  char_of_id = {int(i): c for i, c in zip(ids_S, chain.alphabet)}
  return ["".join(char_of_id.get(int(i), "\0") for i in row) for row in out_BC]


def sampler_config(name: str, steps: int, *, canvas_len: int, t_max: float, t_min: float,
                   greedy_last_step: bool = True, pc_corrector_steps: int = 1, pc_corrector_fraction: float = 1.0,
                   loo_logits: bool = False) -> SamplerConfig:
  """The SamplerConfig of one row: every pass taken (no early exit), no self-conditioning signal."""
  return SamplerConfig(canvas_len=canvas_len, max_denoising_steps=steps, sampler=name, t_max=t_max, t_min=t_min,
                       greedy_last_step=greedy_last_step, pc_corrector_steps=pc_corrector_steps,
                       pc_corrector_fraction=pc_corrector_fraction,
                       loo_logits=loo_logits, self_conditioning=False, early_exit=False)


def main(argv):
  cli.no_extra_args(argv)
  chain = markov.read_chain(_FLAGS["truth"].value)
  bad = [s for s in _FLAGS["samplers"].value if s not in TIME_GRID_SAMPLERS]
  if bad:
    raise ConfigError(f"--samplers: {bad} not in {TIME_GRID_SAMPLERS}")
  try:
    steps = [int(s) for s in _FLAGS["steps"].value]
  except ValueError as e:
    raise ConfigError(f"--steps: {_FLAGS['steps'].value} must be integers") from e
  for name in ("num_samples", "canvas_len"):
    if _FLAGS[name].value < 1:
      raise ConfigError(f"--{name}: must be >= 1, got {_FLAGS[name].value}")
  rows = []
  for name in _FLAGS["samplers"].value:
    for n in steps:
      cfg = sampler_config(name, n, canvas_len=_FLAGS["canvas_len"].value, t_max=_FLAGS["t_max"].value,
                           t_min=_FLAGS["t_min"].value, greedy_last_step=_FLAGS["greedy_last_step"].value,
                           pc_corrector_steps=_FLAGS["pc_corrector_steps"].value,
                           pc_corrector_fraction=_FLAGS["pc_corrector_fraction"].value)
      texts = sample_texts(chain, cfg, _FLAGS["num_samples"].value, _FLAGS["seed"].value)
      row = {"sampler": name, "steps": n, "t_max": cfg.t_max, "t_min": cfg.t_min,
             "greedy_last_step": cfg.greedy_last_step, "pc_corrector_steps": cfg.pc_corrector_steps,
             "pc_corrector_fraction": cfg.pc_corrector_fraction, "num_samples": len(texts),
             **markov.sample_scores(chain, texts)}
      print(json.dumps(row), flush=True)
      rows.append(row)
  files.write_json_atomic(_FLAGS["out"].value, {"truth": _FLAGS["truth"].value, "rows": rows})
  print(f"wrote {_FLAGS['out'].value}")


if __name__ == "__main__":
  define_flags()
  cli.run(main, "proj.markov.oracle")
