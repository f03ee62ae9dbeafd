"""The likelihood estimator (dgemma/diffusion/likelihood.py, behind eval/likelihood.py and Model.score): the
batched block-AR bound against a slow per-canvas loop with the facts file's literal formula, the Monte-Carlo
estimator against known entropies, the AR exact NLL, units, the checks before anything is allocated, and the
loader's errors."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dgemma
from dgemma import settings as settings_lib
from dgemma.checkpoints import params as params_ckpt
from dgemma.diffusion.config import DiffusionSettings
from dgemma.diffusion import corrupt_rows, likelihood
from dgemma.errors import ConfigError
from dgemma.model import Transformer, init_cache
from dgemma.tokenizers import ByteTokenizer
from eval import likelihood as eval_likelihood
from tests.model_utils import random_params, save_random_run
from tests.diffusion.test_objectives import _softmax, ref_nelbo

TEXTS = ("thou art fair; the king doth go", "h\u00e9llo \u20ac!")  # 32 + 12 scored tokens; multi-byte UTF-8


def _config(tiny_config, objective="base_ce"):
  config = tiny_config
  config.diffusion.objective = objective
  config.eval.context_len = 16   # canvas 2 of doc 0 sees a 16-token window (BOS falls out of it)
  config.eval.num_t_samples = 2
  config.eval.batch_size = 2     # 3 canvases: two batches, the last topped up with a padding row
  config.eval.seed = 3
  return config


def _literal_canvas_bound(logits_MCV, x_C, z_MC, times, t_eps):
  """(1 - t_eps) mean over the MC times of sum_i ref_nelbo + the reconstruction at t_eps (last row), float64,
  one token at a time (facts file formulas; linear schedule alpha = 1 - t, alpha' = -1), for a model whose
  logits are a posterior p(x | z) (base_ce): ref_nelbo gets it divided by q(z | x), the leave-one-out prior."""
  V = logits_MCV.shape[-1]
  integrands = []
  for m, t in enumerate(times[:-1]):  # x_theta = the posterior output with z's evidence divided out
    a = 1.0 - float(np.float32(t))
    q_V = lambda z: a * (np.arange(V) == z) + (1.0 - a) / V
    integrands.append(sum(ref_nelbo(logits_MCV[m, i] - np.log(q_V(z_MC[m, i])), x_C[i], z_MC[m, i], a, -1.0)
                          for i in range(len(x_C))))
  recon = 0.0
  for i in range(len(x_C)):  # the posterior output p(x | z) itself
    recon -= math.log(_softmax(logits_MCV[-1, i])[x_C[i]])
  return (1.0 - t_eps) * np.mean(integrands) + recon, recon


def _draws(key, canvas_len, num_t, t_eps, vocab, tokens_C):
  """The times and noisy canvases of one canvas key, drawn as documented in canvas_bound_terms (the
  canvas padded to canvas_len, so the draws match the batched path)."""
  k_t, k_z = jax.random.split(key)
  times = list(np.asarray(likelihood.antithetic_times(k_t, num_t, t_eps))) + [t_eps]
  padded = np.zeros((canvas_len,), np.int32)
  padded[:len(tokens_C)] = tokens_C
  z = [np.asarray(corrupt_rows(jax.random.fold_in(k_z, m)[None], padded[None],
                               jnp.asarray([1.0 - (1.0 - np.float32(t))]), vocab)[0][0, :len(tokens_C)])
       for m, t in enumerate(times)]
  return times, np.stack(z)


def test_canvas_bound_terms_match_the_literal_formula():
  """No model: x_theta(z)_i = softmax(W[z_i] + U[i]); padded positions must not count."""
  V, C, B, M = 7, 5, 3, 3
  rng = np.random.default_rng(0)
  W, U = rng.normal(size=(V, V)) * 2, rng.normal(size=(C, V))
  x_BC = rng.integers(0, V, (B, C)).astype(np.int32)
  w_BC = np.ones((B, C), bool)
  w_BC[2, 3:] = False  # a partial canvas
  loss_cfg = DiffusionSettings(canvas_len=C, objective="base_ce")
  keys_B = likelihood.canvas_keys(5, jnp.arange(B), jnp.full((B,), 2))
  fn = lambda z_BC, alpha_B: jnp.asarray(W, jnp.float32)[z_BC] + jnp.asarray(U, jnp.float32)
  integrand_BM, recon_B = likelihood.canvas_bound_terms(fn, jnp.asarray(x_BC), jnp.asarray(w_BC), keys_B, num_t=M,
                                                        loss_cfg=loss_cfg, vocab_size=V)
  fast = likelihood.canvas_estimate(np.asarray(integrand_BM), np.asarray(recon_B), loss_cfg.t_eps)
  for b in range(B):
    n = int(w_BC[b].sum())
    times, z_MC = _draws(keys_B[b], C, M, loss_cfg.t_eps, V, x_BC[b, :n])
    logits = np.stack([W[z_MC[m]] + U[:n] for m in range(M + 1)])
    slow, slow_recon = _literal_canvas_bound(logits, x_BC[b, :n], z_MC, times, loss_cfg.t_eps)
    # fp32 vs float64 (which also sees W, U unrounded): measured <= 5% of rtol 1e-5 and <= 10% of the
    # reconstruction's 1e-4 (a V = 7 posterior normalised in fp32); a formula error is >> 1e-3
    np.testing.assert_allclose(fast[b], slow, rtol=1e-5)
    np.testing.assert_allclose(recon_B[b], slow_recon, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
@pytest.mark.parametrize("decoder_shift", [False, True])
def test_block_bound_matches_slow_per_canvas_loop_and_ar_nll(tiny_config, decoder_shift):
  """The batched model path (left-padded windows, padding rows, partial canvas) against one right-padded
  encode / decode per canvas and the literal formulas. The two programs differ in layout and shapes, so
  model logits agree only to ~1e-4 in fp32, which the NELBO's 1/t weight amplifies: rtol 2e-3.
  decoder_shift: the slow path runs the unshifted model and shifts by hand (position p scored by the decoder's
  output at p - 1, the first by the encoder's logits at the canvas's last context token)."""
  config = _config(tiny_config)
  config.model.decoder_shift = decoder_shift
  model_cfg = settings_lib.from_config(config).model
  plain_cfg = dataclasses.replace(model_cfg, decoder_shift=False)
  params = random_params(model_cfg)
  tok = ByteTokenizer()
  docs = [likelihood.cut_document(t, tok, 0) for t in TEXTS]
  assert [d.num_scored for d in docs] == [32, 12]

  def evaluate(config):
    st = settings_lib.from_config(config)
    return likelihood.score_documents(params, model_cfg, st.diffusion, st.eval, docs, seq_len=st.data.seq_len,
                                      pad_id=tok.pad_id, max_positions=st.sample.max_context)

  out = evaluate(config)
  assert out["canvases"] == 3 and out["measure"] == "nelbo_bound"
  loss_cfg = settings_lib.from_config(config).diffusion
  model = Transformer(plain_cfg)
  K, C, M, V = 16, 16, 2, model_cfg.vocab_size

  @jax.jit
  def slow_logits(ctx_K, ctx_len, z_MC, n):
    """Right-padded (the batched path left-pads): the window in slots [0, ctx_len), then the M + 1 noisy
    canvases in one batch, their first n positions real. One program for every canvas."""
    R = z_MC.shape[0]
    ctx_RK = jnp.broadcast_to(ctx_K, (R, K))
    seg_RK = jnp.broadcast_to(jnp.arange(K) < ctx_len, (R, K)).astype(jnp.int32)
    enc_RKV, cache = model.apply({"params": params}, ctx_RK, jnp.broadcast_to(jnp.arange(K), (R, K)), seg_RK,
                                 init_cache(plain_cfg, R, K), return_logits=True, method=Transformer.encode)
    pos = jnp.broadcast_to(ctx_len + jnp.arange(C), (R, C))
    seg = jnp.broadcast_to(jnp.arange(C) < n, (R, C)).astype(jnp.int32)
    dec = lambda sc: model.apply({"params": params}, z_MC, pos, seg, cache, sc_logits_BCV=sc, method=Transformer.decode)
    if not decoder_shift:
      return dec(dec(None))
    prev_RV = enc_RKV[:, ctx_len - 1]
    shift = lambda out_RCV: jnp.concatenate([prev_RV[:, None], out_RCV[:, :-1]], axis=1)
    return shift(dec(shift(dec(None))))  # the second pass reads the first pass's (shifted) logits

  def right_pad(x, length):
    out = np.zeros((length,), np.int32)
    out[:len(x)] = x
    return out

  slow, slow_recon = 0.0, 0.0
  for d, tokens in enumerate(d.tokens for d in docs):
    for k, s in enumerate(range(1, len(tokens), C)):
      ctx, canvas = tokens[max(0, s - K):s], tokens[s:s + C]
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), d), k)
      times, z_MC = _draws(key, C, M, loss_cfg.t_eps, V, canvas)
      z_padded = np.stack([right_pad(z, C) for z in z_MC])
      logits = np.asarray(slow_logits(right_pad(ctx, K), len(ctx), z_padded, len(canvas)), np.float64)
      bound, recon = _literal_canvas_bound(logits[:, :len(canvas)], canvas, z_MC, times, loss_cfg.t_eps)
      slow, slow_recon = slow + bound, slow_recon + recon
  np.testing.assert_allclose(out["total_nats"], slow, rtol=2e-3)
  np.testing.assert_allclose(out["reconstruction_nats_per_token"] * out["tokens"], slow_recon, rtol=2e-3)
  # units: every scored token is an id or EOS; bits per UTF-8 byte of the original text
  n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
  assert out["tokens"] == 44 and out["bytes"] == n_bytes == 42
  # unit conversions of one float64 total: the same formulas
  np.testing.assert_allclose(out["bits_per_byte"], out["total_nats"] / n_bytes / math.log(2), rtol=1e-6)
  np.testing.assert_allclose(out["perplexity"], math.exp(out["total_nats"] / 44), rtol=1e-6)
  assert out["nats_per_token_se"] > 0
  assert evaluate(config)["total_nats"] == out["total_nats"]  # deterministic

  if decoder_shift:
    return
  # AR: the exact NLL of the same canvases given the same windows, against per-canvas prefix scoring
  config.diffusion.objective = "ar"
  ar = evaluate(config)
  assert ar["measure"] == "exact_nll" and ar["tokens"] == 44
  score_row = jax.jit(lambda r, n: model.apply(  # right-padded rows of K + C slots, the first n real
      {"params": params}, r[None], jnp.arange(K + C)[None], (jnp.arange(K + C) < n).astype(jnp.int32)[None],
      init_cache(model_cfg, 1, K + C), method=Transformer.encode)[0])
  slow_ar = 0.0
  for tokens in (d.tokens for d in docs):
    for s in range(1, len(tokens), C):
      row = tokens[max(0, s - K):s + C]
      logp = jax.nn.log_softmax(np.asarray(score_row(right_pad(row, K + C), len(row))[0], np.float64), axis=-1)
      first = min(s, K)  # index of the canvas's first token in `row`
      slow_ar -= sum(float(logp[i - 1, row[i]]) for i in range(first, len(row)))
  # another program layout (fp32 model round-off, ~1e-4 on a logit, i.e. on one token's NLL) summed over
  # 44 tokens of ~6 nats each: <= 44 * 2e-4 absolute, rtol 1e-4 of ~270 nats = 0.027
  np.testing.assert_allclose(ar["total_nats"], slow_ar, rtol=1e-4)


@pytest.mark.parametrize("objective", ["loo_nelbo", "nelbo", "mdlm"])
def test_estimator_is_tight_for_an_iid_source_and_bounds_other_denoisers(objective):
  """Tokens i.i.d. ~ pi (entropy H). With x_theta = pi the uniform-state (and masked) reverse process is
  the exact time reversal, so the bound -- MC integral over [t_eps, 1] plus the reconstruction -- must
  come out at H (a reconstruction that ignored z_t would add another H); a wrong constant denoiser must
  stay above its own exact NLL (its cross-entropy), and every denoiser above H. A leave-one-out model
  (loo_nelbo) outputs pi itself; a posterior model (nelbo, and base_ce alike) outputs the posterior
  p(x | z_t), proportional to pi(x) q(z_t | x), which the estimator must read back as pi."""
  V, B, C, M = 12, 256, 16, 8
  rng = np.random.default_rng(0)
  pi = rng.dirichlet(np.full(V, 0.8))
  if objective == "mdlm":
    pi[4] = 0.0  # the mask token is never data
    pi /= pi.sum()
  entropy = float(-np.sum(pi[pi > 0] * np.log(pi[pi > 0])))
  x_BC = jnp.asarray(rng.choice(V, size=(B, C), p=pi), jnp.int32)
  loss_cfg = DiffusionSettings(canvas_len=C, objective=objective, mask_id=4)
  keys_B = likelihood.canvas_keys(0, jnp.arange(B), jnp.zeros(B, jnp.int32))
  wrong = rng.dirichlet(np.ones(V))
  if objective == "mdlm":
    wrong[4] = 0.0
    wrong /= wrong.sum()

  def bound(log_probs_V):
    def fn(noisy_BC, alpha_B):
      logits_BCV = jnp.broadcast_to(jnp.asarray(log_probs_V, jnp.float32), noisy_BC.shape + (V,))
      if objective != "nelbo":
        return logits_BCV
      a_BC1 = alpha_B[:, None, None]
      q_BCV = a_BC1 * (jnp.arange(V) == noisy_BC[..., None]) + (1.0 - a_BC1) / V  # q(z_t | x) for each x
      return logits_BCV + jnp.log(q_BCV)
    integrand_BM, recon_B = jax.jit(lambda: likelihood.canvas_bound_terms(
        fn, x_BC, jnp.ones((B, C)), keys_B, num_t=M, loss_cfg=loss_cfg, vocab_size=V))()
    per_canvas = likelihood.canvas_estimate(np.asarray(integrand_BM), np.asarray(recon_B), loss_cfg.t_eps)
    return per_canvas.sum() / (B * C), likelihood.ratio_stderr(per_canvas, np.full(B, C))

  safe_log = lambda p: np.log(np.maximum(p, 1e-30))
  tight, tight_se = bound(safe_log(pi))
  assert abs(tight - entropy) < 4 * tight_se + 0.01 * entropy, (tight, tight_se, entropy)
  wrong_bound, wrong_se = bound(safe_log(wrong))
  cross_entropy = float(-np.sum(pi[pi > 0] * np.log(wrong[pi > 0])))
  assert wrong_bound > cross_entropy - 4 * wrong_se, (wrong_bound, cross_entropy)
  assert cross_entropy > entropy + 0.1


def test_units_and_document_cutting():
  tok = ByteTokenizer()
  doc = likelihood.cut_document("héllo €", tok, 0)
  assert doc.complete and doc.num_bytes == 10 and doc.num_scored == 11  # 10 bytes + EOS
  assert doc.tokens[0] == tok.bos_id and doc.tokens[-1] == tok.eos_id
  cut = likelihood.cut_document("one two three four", tok, 9)
  assert not cut.complete and cut.text == "one two" and cut.num_scored == 7 and cut.tokens[-1] != tok.eos_id
  with pytest.raises(ValueError, match="eval.max_tokens"):
    likelihood.cut_document("abcdefgh ij", tok, 3)
  s = likelihood.summarize(np.array([10.0, 20.0]), np.array([4, 6]), num_bytes=15)
  assert s["nats_per_token"] == 3.0 and s["tokens"] == 10
  np.testing.assert_allclose(s["bits_per_byte"], 30.0 / 15 / math.log(2))
  np.testing.assert_allclose(s["perplexity"], math.exp(3.0))
  # ratio standard error: residuals 10 - 12 = -2 and 20 - 18 = 2 -> sqrt(8 / 2) / mean count 5
  np.testing.assert_allclose(s["nats_per_token_se"], 2.0 / 5.0)
  assert s["canvas_nats"] == [10.0, 20.0] and s["canvas_tokens"] == [4, 6]
  # paired with a reference's [8, 18] on the same canvases: ratio 30 / 26, residuals 10 - 8 r and 20 - 18 r
  # (= +-10/13) -> sqrt(2 (10/13)^2 / 2) / mean 13; excess 2 and 2 over 4 and 6 tokens: 0.4 nats/token,
  # residuals 2 - 1.6 and 2 - 2.4 -> sqrt(0.32 / 2) / mean 5
  paired = likelihood.paired_ratio(np.array([10.0, 20.0]), np.array([8.0, 18.0]), np.array([4, 6]))
  np.testing.assert_allclose(paired["ratio_to_reference"], 30.0 / 26.0)
  np.testing.assert_allclose(paired["ratio_to_reference_se"], (10.0 / 13.0) / 13.0)
  np.testing.assert_allclose(paired["excess_nats_per_token"], 0.4)
  np.testing.assert_allclose(paired["excess_nats_per_token_se"], 0.4 / 5.0)
  rows = likelihood.block_rows([np.arange(1, 8)], canvas_len=4, context_len=3, pad_id=0)
  # tokens after BOS (1): canvases [2..5], [6, 7]; the second sees the 3 tokens before it
  np.testing.assert_array_equal(rows.tokens, [[0, 0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 0, 0]])
  np.testing.assert_array_equal(rows.positions, [[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 0]])
  np.testing.assert_array_equal(rows.segment_ids, [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])


def test_checkpoint_errors(tmp_path, tiny_config):
  with pytest.raises(FileNotFoundError, match="^path: .*nope does not exist"):  # a Python caller: its argument
    dgemma.load(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="is none of: a training workdir"):
    dgemma.load(tmp_path)
  ckpt_dir = tmp_path / "params_ckpt"
  (ckpt_dir / params_ckpt.PARAMS).mkdir(parents=True)
  model_cfg = settings_lib.from_config(tiny_config).model
  (ckpt_dir / params_ckpt.MODEL_CONFIG).write_text(json.dumps(model_cfg.to_dict()))
  with pytest.raises(ConfigError, match=r"holds no tokenizer.*pass a config .*dgemma.load\(\.\.\., config=\).*--config="):  # and no config given
    dgemma.load(ckpt_dir)
  tiny_config.eval.data = str(tmp_path / "missing.txt")
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    eval_likelihood.eval_texts(settings_lib.from_config(tiny_config))
  tiny_config.eval.data = "nosuchsplit"
  with pytest.raises(ConfigError, match="eval.data"):
    eval_likelihood.eval_texts(settings_lib.from_config(tiny_config))
  with pytest.raises(ConfigError, match="not a config key"):
    settings_lib.with_overrides(tiny_config, {"sample.nope": 1})


@pytest.mark.parametrize("overrides, message", [
    # eval.likelihood --context_len=100000 once tried to allocate ~16 TB of attention scores
    ({"eval.context_len": 100_000}, r"eval\.context_len: 100000 needs about \d+ GiB for the attention scores"),
    # beyond the model's positions (sample.max_context)
    ({"eval.context_len": 100, "sample.max_context": 64}, r"eval\.context_len: 100 context \+ 16 canvas tokens exceed"),
])
def test_context_len_checked_before_anything_is_allocated(tiny_config, tmp_path, corpus_file, monkeypatch,
                                                          overrides, message):
  """eval.likelihood.run fails fast, naming eval.context_len, before a row or an attention buffer exists
  (the row builder and the scoring programs are never reached); Model.score(..., context_len=...) takes
  the same check."""
  tiny_config.eval.data = str(corpus_file)
  tiny_config.eval.max_documents = 2
  workdir = tmp_path / "run"
  save_random_run(tiny_config, workdir)

  def unreachable(*args, **kwargs):
    raise AssertionError("the request was not checked before rows / programs were built")

  for name in ("block_rows", "_diffusion_batch", "causal_nll"):
    monkeypatch.setattr(likelihood, name, unreachable)
  config = settings_lib.with_overrides(tiny_config, overrides)
  with pytest.raises(ConfigError, match=message):
    eval_likelihood.run(str(workdir), config, print_fn=lambda _: None)
  model = dgemma.load(str(workdir), config=settings_lib.with_overrides(
      tiny_config, {k: v for k, v in overrides.items() if not k.startswith("eval.")}))
  with pytest.raises(ConfigError, match=message):
    model.score(TEXTS, context_len=overrides["eval.context_len"])
