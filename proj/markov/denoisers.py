"""What the exact denoiser of a Markov source needs to be exact: its likelihood bound when it is not told the
noise level, and when it sees only the canvas tokens near the position it scores.

The uniform-state NELBO of a canvas, with the chain's exact leave-one-out posterior p(x_i | z_-i, t) as x_theta,
integrates to the source's own entropy (docs/experiments/likelihood_small.md, point 1).
A network is not that denoiser; two ways it can fall short are measured here with the exact one, no model:
  blind     the denoiser is not told t (DiffusionGemma's decoder has no time input): p(x_i | z_-i) mixes the
            exact posteriors over a grid of --blind_grid noise levels, weighted by how likely each makes the
            canvas's other tokens (proj/markov/data.py `blind_loo_posteriors`);
  window_w  the denoiser reads only the w canvas tokens on each side of i (and the clean text before the
            canvas): the tokens further away are replaced by ids outside the alphabet, which say nothing.
Each column is the NELBO integrand per token (nats) at each t of --grid, averaged over the canvases of the first
--max_documents documents (cut as eval.likelihood cuts them: canvas_len tokens after the clean text before
them; a document's first canvas and a last partial one are skipped) and one noise draw per (canvas, t), the
draws shared by every column. With the default midpoint grid, a column's mean over t is its bound (nats per
token; the t = 0 reconstruction term is zero for the linear schedule), and `exact` lands on the source's
entropy rate up to the draws' and the grid's error.

  python -m proj.markov.denoisers --truth=data_cache/markov/truth.json --data=data_cache/markov/valid.txt \\
      --out=ll_denoisers/denoisers.json

Prints one JSON line per t as it is measured, then each column's bound and its ratio to `exact`'s.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from absl import flags

from dgemma import files
from dgemma.data import builder as builder_lib
from proj.markov import data as markov
from dgemma.diffusion import objectives
from dgemma.errors import ConfigError
from dgemma.tools import cli

MIDPOINTS_20 = tuple(float(t) for t in (np.arange(20) + 0.5) / 20)

_FLAGS: dict = {}


def define_flags() -> None:
  """The command line's flags (defined only when run as a program)."""
  _FLAGS["truth"] = flags.DEFINE_string("truth", None, "truth.json of proj.markov.make_text.", required=True)
  _FLAGS["data"] = flags.DEFINE_string("data", None, "The chain's text, one document per line.", required=True)
  _FLAGS["out"] = flags.DEFINE_string("out", None, "Where the JSON record goes.", required=True)
  _FLAGS["max_documents"] = flags.DEFINE_integer("max_documents", 4, "Documents whose canvases are used.")
  _FLAGS["canvas_len"] = flags.DEFINE_integer("canvas_len", 32, "Tokens per canvas.")
  _FLAGS["vocab_size"] = flags.DEFINE_integer("vocab_size", 260, "Ids the forward process draws from (bytes: 260).")
  _FLAGS["grid"] = flags.DEFINE_list("grid", [str(t) for t in MIDPOINTS_20], "Noise levels t in (0, 1).")
  _FLAGS["blind_grid"] = flags.DEFINE_integer("blind_grid", 40, "Noise levels the blind denoiser mixes (midpoints).")
  _FLAGS["windows"] = flags.DEFINE_list("windows", ["1", "2", "3", "4", "6", "8"], "Neighbours w read on each side.")
  _FLAGS["seed"] = flags.DEFINE_integer("seed", 0, "Noise seed.")


def document_canvases(chain: markov.MarkovChain, texts: list[str], canvas_len: int) -> tuple[list[str], np.ndarray]:
  """(the clean text before each canvas, the canvases' symbols [N, C]): every whole canvas of each document but
  its first (which has no clean text before it)."""
  index = {c: i for i, c in enumerate(chain.alphabet)}
  prefixes, canvases = [], []
  for doc_number, text in enumerate(texts):
    bad = sorted(set(text) - set(index))
    if bad:
      raise ConfigError(f"--data: document {doc_number} holds {bad!r}, outside the chain's alphabet")
    for j in range(1, len(text) // canvas_len):
      prefixes.append(text[:j * canvas_len])
      canvases.append([index[c] for c in text[j * canvas_len:(j + 1) * canvas_len]])
  if not canvases:
    raise ConfigError(f"--data: no document holds two canvases of {canvas_len} symbols")
  return prefixes, np.asarray(canvases, np.int64)


def window_loo_posteriors(chain: markov.MarkovChain, prefix: str, noisy_symbols_C: np.ndarray, alpha: float,
                          vocab_size: int, w: int) -> np.ndarray:
  """[C, S]: position i's exact leave-one-out posterior given only the noisy tokens within w of it (the others
  replaced by an id outside the alphabet, whose emission is the same for every symbol) and the clean prefix."""
  C = len(noisy_symbols_C)
  i_C = np.arange(C)
  far_CC = np.abs(i_C[None, :] - i_C[:, None]) > w  # row i: the canvas as position i's window sees it
  rows_CC = np.where(far_CC, -1, np.asarray(noisy_symbols_C)[None, :])
  _, loo_CCS = markov.canvas_posteriors(chain, prefix, rows_CC, alpha, vocab_size)
  return loo_CCS[i_C, i_C]


def integrands(chain: markov.MarkovChain, prefixes: list[str], x_NC: np.ndarray, *, grid, vocab_size: int,
               blind_grid: int, windows, seed: int) -> list[dict]:
  """[{t, exact, blind, window_<w>...}]: each denoiser's mean NELBO integrand per token at t (nats)."""
  S = chain.num_symbols
  N, C = x_NC.shape
  t_blind = (np.arange(blind_grid) + 0.5) / blind_grid
  rng = np.random.default_rng(seed)

  def nelbo(loo_NCS, z_NC, alpha):  # symbols are ids 0..S-1; drawn ids outside the alphabet are S..V-1
    logits_NCV = markov.vocab_logits(loo_NCS, np.arange(S), vocab_size)
    return float(np.mean(objectives.uniform_nelbo_per_token(
        jnp.asarray(logits_NCV), jnp.asarray(x_NC), jnp.asarray(z_NC), jnp.full((N, C), alpha, jnp.float32),
        -jnp.ones((N, C)))))

  rows = []
  for t in grid:
    alpha = 1.0 - t
    drawn_NC = rng.random(x_NC.shape) < t
    z_NC = np.where(drawn_NC, rng.integers(0, vocab_size, x_NC.shape), x_NC)
    z_sym_NC = np.where(z_NC < S, z_NC, -1)
    exact = np.stack([markov.canvas_posteriors(chain, p, z, alpha, vocab_size)[1] for p, z in zip(prefixes, z_sym_NC)])
    blind = np.stack([markov.blind_loo_posteriors(chain, p, z, vocab_size, t_blind) for p, z in zip(prefixes, z_sym_NC)])
    row = {"t": float(t), "exact": nelbo(exact, z_NC, alpha), "blind": nelbo(blind, z_NC, alpha)}
    for w in windows:
      near = np.stack([window_loo_posteriors(chain, p, z, alpha, vocab_size, w) for p, z in zip(prefixes, z_sym_NC)])
      row[f"window_{w}"] = nelbo(near, z_NC, alpha)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv):
  cli.no_extra_args(argv)
  builder_lib.check_files([_FLAGS["data"].value])
  chain = markov.read_chain(_FLAGS["truth"].value)
  try:
    grid = tuple(float(t) for t in _FLAGS["grid"].value)
    windows = tuple(int(w) for w in _FLAGS["windows"].value)
  except ValueError as e:
    raise ConfigError(f"--grid / --windows: {e}") from e
  if not grid or not all(0.0 < t < 1.0 for t in grid):
    raise ConfigError(f"--grid: every noise level must lie in (0, 1), got {grid}")
  if any(w < 0 for w in windows):
    raise ConfigError(f"--windows: every window must be >= 0, got {windows}")
  for name in ("max_documents", "canvas_len", "blind_grid", "vocab_size"):
    if _FLAGS[name].value < 1:
      raise ConfigError(f"--{name}: must be >= 1, got {_FLAGS[name].value}")
  if _FLAGS["vocab_size"].value < chain.num_symbols:
    raise ConfigError(f"--vocab_size: {_FLAGS['vocab_size'].value} is smaller than the chain's alphabet")
  texts = list(builder_lib.iter_file_documents(_FLAGS["data"].value, "line", "text", "strict"))
  prefixes, x_NC = document_canvases(chain, texts[:_FLAGS["max_documents"].value], _FLAGS["canvas_len"].value)
  rows = integrands(chain, prefixes, x_NC, grid=grid, vocab_size=_FLAGS["vocab_size"].value,
                    blind_grid=_FLAGS["blind_grid"].value, windows=windows, seed=_FLAGS["seed"].value)
  columns = [k for k in rows[0] if k != "t"]
  bounds = {k: float(np.mean([r[k] for r in rows])) for k in columns}
  summary = {k: {"mean_over_grid": v, "ratio_to_exact": v / bounds["exact"]} for k, v in bounds.items()}
  print(json.dumps({"entropy_rate_nats": chain.entropy_rate(), **summary}))
  files.write_json_atomic(_FLAGS["out"].value, {
      "truth": _FLAGS["truth"].value, "data": _FLAGS["data"].value, "max_documents": _FLAGS["max_documents"].value,
      "canvases": int(x_NC.shape[0]), "canvas_len": _FLAGS["canvas_len"].value, "vocab_size": _FLAGS["vocab_size"].value,
      "blind_grid": _FLAGS["blind_grid"].value, "seed": _FLAGS["seed"].value,
      "entropy_rate_nats": chain.entropy_rate(), "rows": rows, "summary": summary})
  print(f"wrote {_FLAGS['out'].value}")


if __name__ == "__main__":
  define_flags()
  cli.run(main, "proj.markov.denoisers")
