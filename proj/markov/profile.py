"""Where a diffusion model's likelihood bound is lost: the NELBO integrand against the noise level t, for a
checkpoint and for the exact denoiser of the Markov source it was trained on, on the same canvases and noise.

  python -m proj.markov.profile --checkpoint=workdirs/ll_small --data=data_cache/markov/valid.txt \\
      --truth=data_cache/markov/truth.json --out_dir=ll_profile

The bound is (1 - t_eps) times the integral over t of this integrand (per token) plus a small reconstruction
term (dgemma/diffusion/likelihood.py); the exact denoiser (the chain's leave-one-out posterior by
forward-backward, proj/markov/data.py `canvas_posteriors`) integrates to the source's entropy, so the gap
between the two curves at each t is where the model loses bits. Canvases are the document canvases of
eval.likelihood that hold only alphabet symbols (the first and last of a document are skipped), each
conditioned on its training-length context; each (canvas, t) gets --draws noise draws shared by both.
Each row also splits both integrands between kept positions (z_i = x_i, no draw) and drawn ones (the forward
process drew a uniform token there), and gives the mean KL(exact || model) of the two leave-one-out
distributions p(x_i | z_-i) at each kind of position: the distribution the NELBO reads, so a KL far from 0
says the model has not learned it there (docs/experiments/likelihood_small.md); and
how much each denoiser's prediction at a drawn position uses the canvas to its right.
Writes out_dir/profile.json and out_dir/integrand_vs_t.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import dgemma
from dgemma import checkpoints, files, run_report
from dgemma.data import builder as builder_lib
from proj.markov import data as markov
from dgemma.diffusion import likelihood, objectives
from dgemma.diffusion.corruption import split_context_canvas
from dgemma.errors import ConfigError
from dgemma.model import Transformer, init_cache
from dgemma.tools import cli

GRID = (0.003, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97)
RIGHT_PROBES = slice(2, None, 3)  # canvas positions whose use of the right side is measured (one decode each)

_FLAGS: dict = {}


def define_flags() -> None:
  """The command line's flags (defined only when run as a program, so importing this module for its
  functions leaves absl's global flags alone)."""
  _FLAGS["checkpoint"] = flags.DEFINE_string("checkpoint", None,
                                             "A diffusion run trained on the chain's text.", required=True)
  _FLAGS["data"] = flags.DEFINE_string("data", None,
                                       "The chain's validation .txt (one document per line).", required=True)
  _FLAGS["truth"] = flags.DEFINE_string("truth", None, "truth.json of proj.markov.make_text.", required=True)
  _FLAGS["out_dir"] = flags.DEFINE_string("out_dir", None, "Where profile.json and the plot go.", required=True)
  _FLAGS["max_documents"] = flags.DEFINE_integer("max_documents", 4, "Documents whose canvases are used.")
  _FLAGS["draws"] = flags.DEFINE_integer("draws", 2, "Noise draws per canvas and t.")
  _FLAGS["seed"] = flags.DEFINE_integer("seed", 0, "Noise seed.")
  _FLAGS["step"] = flags.DEFINE_integer("step", -1, "The run's checkpoint step (-1: the latest).")
  _FLAGS["grid"] = flags.DEFINE_list("grid", [str(t) for t in GRID], "Noise levels t in (0, 1).")




def profile(model: dgemma.Model, chain: markov.MarkovChain, texts: list[str], *, grid=GRID, draws: int = 2,
            seed: int = 0) -> list[dict]:
  """[{t, model, exact, ...}]: the mean NELBO integrand per token at each t, of the model and of the exact denoiser;
  `model_kept` / `model_drawn` and `exact_kept` / `exact_drawn` are the same means over kept and drawn positions,
  `kl_kept` / `kl_drawn` the mean KL(exact || model) of the leave-one-out distributions there (nats), and
  `drawn_fraction` the share of drawn positions. `right_kl_model` / `right_kl_exact`: how much each denoiser's
  leave-one-out prediction at a drawn position uses the canvas to its right, the mean KL(intact || every later
  canvas token replaced by a non-alphabet id, i.e. known noise), over drawn positions among every third one
  (`RIGHT_PROBES`)."""
  st = model.settings
  if st.diffusion.objective_record.autoregressive or st.diffusion.objective_record.masked:
    raise ConfigError(f"--checkpoint: objective {st.diffusion.objective!r} is not a uniform-state diffusion run")
  if st.diffusion.schedule != "linear":
    raise ConfigError(f"diffusion.schedule: {st.diffusion.schedule!r}; this profile assumes the linear schedule")
  C = st.diffusion.canvas_len
  context_len = st.eval.context_len or st.data.seq_len - C
  tok = model.tokenizer
  symbol_of_id = {tok.encode(c)[0]: i for i, c in enumerate(chain.alphabet)}
  docs = [likelihood.cut_document(t, tok, 0) for t in texts]
  rows = likelihood.block_rows([d.tokens for d in docs], C, context_len, tok.pad_id)
  keep = [r for r in range(len(rows))  # (a document's first canvas has no clean prefix to start from)
          if rows.canvas_index[r] > 0 and all(int(i) in symbol_of_id for i in rows.tokens[r, context_len:])]
  if not keep:
    raise ConfigError("--data: no canvas holds only the chain's alphabet (is this the chain's text?)")
  batch = {"tokens": rows.tokens[keep], "segment_ids": rows.segment_ids[keep], "positions": rows.positions[keep]}
  prefixes = [texts[rows.doc_index[r]][:rows.canvas_index[r] * C] for r in keep]
  model_cfg, V = model.model_cfg, model.model_cfg.vocab_size
  record = st.diffusion.objective_record
  transformer = Transformer(model_cfg)

  ctx, canvas = split_context_canvas(batch, C)
  # The clean contexts are the same for every t, draw and probe: encoded once.
  enc_logits_BTV, cache = jax.jit(lambda: transformer.apply(
      {"params": model.params}, ctx["tokens"], ctx["positions"], ctx["segment_ids"],
      init_cache(model_cfg, ctx["tokens"].shape[0], ctx["tokens"].shape[1], dtype=jnp.dtype(model_cfg.dtype)),
      return_logits=model_cfg.decoder_shift, method=Transformer.encode))()
  prev_BKV = enc_logits_BTV[:, -1:] if model_cfg.decoder_shift else None  # model.decoder_shift: the token before

  @jax.jit
  def model_integrand(noisy_BC, alpha):
    decode = lambda sc: transformer.apply({"params": model.params}, noisy_BC, canvas["positions"],
                                          canvas["segment_ids"], cache, sc_logits_BCV=sc, prev_logits_BKV=prev_BKV,
                                          method=Transformer.decode)
    logits_BCV = decode(None)
    if st.eval.self_conditioning and model_cfg.self_conditioning:
      logits_BCV = decode(logits_BCV)
    a_BC = jnp.full(noisy_BC.shape, alpha, jnp.float32)  # linear schedule: alpha = 1 - t, alpha' = -1
    integrand_BC = record.nelbo_per_token(logits_BCV, canvas["tokens"], noisy_BC, a_BC, -jnp.ones(noisy_BC.shape),
                                          mask_id=st.diffusion.mask_id)
    return integrand_BC, jax.nn.log_softmax(record.loo_prior_logits(logits_BCV, noisy_BC, a_BC))

  rng = np.random.default_rng(seed)
  x_BC = batch["tokens"][:, context_len:]
  sym_ids = np.array([tok.encode(c)[0] for c in chain.alphabet])
  noise_id = min(set(range(V)) - set(sym_ids.tolist()) - {tok.pad_id})  # a drawn id outside the alphabet
  probes = list(range(C))[RIGHT_PROBES]

  def kl_rows(logp_XV, logq_XV):  # KL(p || q) per row; ids where p = 0 add nothing
    p_XV = np.exp(logp_XV)
    return np.sum(np.where(p_XV > 0, p_XV * (logp_XV - logq_XV), 0.0), axis=-1)

  out = []
  for t in grid:
    alpha = 1.0 - t
    got, exact, kl, drawn, right_model, right_exact = [], [], [], [], [], []
    for _ in range(draws):
      drawn_BC = rng.random(x_BC.shape) < t
      noisy_BC = np.where(drawn_BC, rng.integers(0, V, x_BC.shape), x_BC).astype(np.int32)
      integrand_BC, model_loo_BCV = model_integrand(jnp.asarray(noisy_BC), jnp.float32(alpha))
      model_loo_BCV = np.asarray(model_loo_BCV)
      got.append(np.asarray(integrand_BC))
      z_sym_BC = np.vectorize(lambda i: symbol_of_id.get(int(i), -1))(noisy_BC)
      exact_loo_BCS = []
      for b, prefix in enumerate(prefixes):
        _, loo_CS = markov.canvas_posteriors(chain, prefix, z_sym_BC[b], alpha, V)
        exact_loo_BCS.append(loo_CS)
        exact_CV = np.asarray(jax.nn.log_softmax(markov.vocab_logits(loo_CS, sym_ids, V)))
        exact.append(np.asarray(objectives.uniform_nelbo_per_token(
            jnp.asarray(exact_CV), jnp.asarray(x_BC[b]), jnp.asarray(noisy_BC[b]), jnp.full((C,), alpha, jnp.float32),
            -jnp.ones((C,)))))
        kl.append(kl_rows(exact_CV, model_loo_BCV[b]))
      drawn.append(drawn_BC)
      for i in probes:  # the right side of position i removed: later tokens become known noise
        cut_BC = noisy_BC.copy()
        cut_BC[:, i + 1:] = noise_id
        _, cut_loo_BCV = model_integrand(jnp.asarray(cut_BC), jnp.float32(alpha))
        rows_B = np.nonzero(drawn_BC[:, i])[0]
        right_model += list(kl_rows(model_loo_BCV[rows_B, i], np.asarray(cut_loo_BCV)[rows_B, i]))
        for b in rows_B:
          _, cut_CS = markov.canvas_posteriors(chain, prefixes[b], np.where(np.arange(C) > i, -1, z_sym_BC[b]), alpha, V)
          right_exact.append(kl_rows(np.log(np.maximum(exact_loo_BCS[b][i], 1e-300)),
                                     np.log(np.maximum(cut_CS[i], 1e-300))))
    got, exact, kl, drawn = (np.concatenate(a).reshape(-1) for a in (got, exact, kl, drawn))
    mean = lambda a, where: float(np.mean(a[where])) if np.any(where) else float("nan")
    out.append({"t": t, "model": float(np.mean(got)), "exact": float(np.mean(exact)),
                "model_kept": mean(got, ~drawn), "model_drawn": mean(got, drawn),
                "exact_kept": mean(exact, ~drawn), "exact_drawn": mean(exact, drawn),
                "kl_kept": mean(kl, ~drawn), "kl_drawn": mean(kl, drawn), "drawn_fraction": float(np.mean(drawn)),
                "right_kl_model": float(np.mean(right_model)) if right_model else float("nan"),
                "right_kl_exact": float(np.mean(right_exact)) if right_exact else float("nan")})
  return out


def plot(rows: list[dict], out_png: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
  ts = [r["t"] for r in rows]
  ax.plot(ts, [r["model"] for r in rows], "o-", label="model")
  ax.plot(ts, [r["exact"] for r in rows], "s--", label="exact denoiser (integrates to the entropy)")
  ax.set_xlabel("noise level t")
  ax.set_ylabel("NELBO integrand (nats / token)")
  ax.set_title(title, fontsize=8)
  ax.legend(fontsize=7)
  run_report.save_figure(fig, out_png)


def main(argv):
  cli.no_extra_args(argv)
  builder_lib.check_files([_FLAGS['data'].value])
  chain = markov.read_chain(_FLAGS['truth'].value)
  texts = list(builder_lib.iter_file_documents(_FLAGS['data'].value, "line", "text", "strict"))
  texts = texts[:_FLAGS['max_documents'].value]
  try:
    grid = tuple(float(t) for t in _FLAGS['grid'].value)
  except ValueError as e:
    raise ConfigError(f"--grid: {_FLAGS['grid'].value!r} is not a list of numbers") from e
  if not grid or not all(0.0 < t < 1.0 for t in grid):
    raise ConfigError(f"--grid: every noise level must lie in (0, 1), got {grid}")
  model = dgemma.load(_FLAGS['checkpoint'].value, step=_FLAGS['step'].value, field=checkpoints.CHECKPOINT_FLAG)
  rows = profile(model, chain, texts, grid=grid, draws=_FLAGS['draws'].value, seed=_FLAGS['seed'].value)
  for r in rows:
    print(json.dumps(r))
  out_dir = Path(_FLAGS['out_dir'].value)
  trapezoid = lambda key: float(np.trapezoid([r[key] for r in rows], [r["t"] for r in rows]))
  files.write_json_atomic(out_dir / "profile.json", {"checkpoint": _FLAGS['checkpoint'].value, "step": model.step,
                                                     "rows": rows, "trapezoid_model": trapezoid("model"),
                                                     "trapezoid_exact": trapezoid("exact")})
  plot(rows, out_dir / "integrand_vs_t.png", f"{_FLAGS['checkpoint'].value} step {model.step}")
  print(f"wrote {out_dir}/profile.json and integrand_vs_t.png")


if __name__ == "__main__":
  define_flags()
  cli.run(main, "proj.markov.profile")
