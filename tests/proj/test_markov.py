"""proj/markov/data.py (behind proj/markov/make_text.py): the synthetic source whose entropy rate is exact."""

import itertools
import json
import math

import numpy as np
import pytest

from proj.markov import data as markov
from dgemma.errors import ConfigError


def _state_matrix(chain):
  """The explicit [S^k, S^k] state-transition matrix (slow, obvious reference)."""
  S, k = chain.num_symbols, chain.order
  M = np.zeros((S ** k, S ** k))
  for state in range(S ** k):
    for symbol in range(S):
      M[state, (state * S + symbol) % S ** k] += chain.transitions[state, symbol]
  return M


@pytest.mark.parametrize("order", [1, 2, 3])
def test_stationary_and_entropy_rate_match_an_eigenvector(order):
  chain = markov.MarkovChain.random(alphabet="abcd", order=order, concentration=0.3, seed=order)
  M = _state_matrix(chain)
  w, v = np.linalg.eig(M.T)
  pi = np.real(v[:, np.argmin(np.abs(w - 1))])
  pi /= pi.sum()
  # Both are float64 solutions of the same linear system; power iteration stops at an L1 step of 1e-15.
  np.testing.assert_allclose(chain.stationary(), pi, atol=1e-10)
  h = -np.sum(pi[:, None] * chain.transitions * np.log(chain.transitions))
  assert chain.entropy_rate() == pytest.approx(h, rel=1e-9)


def test_log_prob_is_a_normalised_distribution_over_documents():
  chain = markov.MarkovChain.random(alphabet="xyz", order=2, concentration=0.5, seed=3)
  total = sum(math.exp(chain.log_prob("".join(t))) for t in itertools.product("xyz", repeat=5))
  assert total == pytest.approx(1.0, abs=1e-12)
  # and it is the obvious product of pi and transitions
  text = "zxyyxz"
  idx = ["xyz".index(c) for c in text]
  expected = math.log(chain.stationary()[idx[0] * 3 + idx[1]])
  for a, b, c in zip(idx, idx[1:], idx[2:]):
    expected += math.log(chain.transitions[a * 3 + b, c])
  assert chain.log_prob(text) == pytest.approx(expected, rel=1e-12)


def test_samples_follow_the_chain():
  chain = markov.MarkovChain.random(alphabet="ab c", order=2, concentration=0.5, seed=5)
  docs = chain.sample(200, 500, seed=1)
  assert len(docs) == 200 and all(len(d) == 500 and set(d) <= set("ab c") for d in docs)
  assert docs == chain.sample(200, 500, seed=1) and docs != chain.sample(200, 500, seed=2)
  counts = np.zeros_like(chain.transitions)
  index = {c: i for i, c in enumerate(chain.alphabet)}
  for d in docs:
    ids = [index[c] for c in d]
    for a, b, c in zip(ids, ids[1:], ids[2:]):
      counts[a * 4 + b, c] += 1
  n_s = counts.sum(axis=1, keepdims=True)
  # Each empirical frequency is a multinomial proportion: std sqrt(p (1 - p) / n); 6 std is far in the tail
  # for all 64 cells together (a wrong row, e.g. an off-by-one state, moves cells by O(p), not O(1/sqrt(n))).
  p = chain.transitions
  assert np.all(np.abs(counts / n_s - p) <= 6 * np.sqrt(p * (1 - p) / n_s) + 1e-12)
  # The mean log-loss of the samples estimates the entropy rate (documents independent: std over documents).
  per_doc = np.array([-chain.log_prob(d) / len(d) for d in docs])
  assert abs(per_doc.mean() - chain.entropy_rate()) <= 6 * per_doc.std() / math.sqrt(len(docs)) + 0.02
  # (+0.02: the first two symbols cost log pi, not the rate, a bias of at most ~2 log 16 / 500)


def test_bad_arguments_name_the_field():
  with pytest.raises(ConfigError, match="alphabet"):
    markov.MarkovChain.random(alphabet="aa")
  with pytest.raises(ConfigError, match="concentration"):
    markov.MarkovChain.random(concentration=0.0)
  chain = markov.MarkovChain.random(alphabet="ab", order=1)
  with pytest.raises(ConfigError, match="not in the chain's alphabet"):
    chain.log_prob("abc")


def test_write_splits_writes_documents_and_their_exact_bits_per_byte(tmp_path):
  truth = markov.write_splits(str(tmp_path), num_train=30, num_valid=5, length=200, order=2,
                                   concentration=0.1, seed=7)
  on_disk = json.loads((tmp_path / "truth.json").read_text())
  assert on_disk == pytest.approx(truth)
  train = (tmp_path / "train.txt").read_text().splitlines()
  valid = (tmp_path / "valid.txt").read_text().splitlines()
  assert len(train) == 30 and len(valid) == 5 and all(len(d) == 200 for d in train + valid)
  assert not set(train) & set(valid)
  chain = markov.chain_of_truth(on_disk)
  np.testing.assert_array_equal(chain.transitions, markov.MarkovChain.random(
      order=2, concentration=0.1, seed=int(np.random.SeedSequence((7, 0)).generate_state(1)[0])).transitions)
  nats = -sum(chain.log_prob(d) for d in valid)
  assert truth["valid_bits_per_byte"] == pytest.approx(nats / (5 * 200 * math.log(2)), rel=1e-12)
  assert truth["entropy_rate_bits_per_char"] == pytest.approx(chain.entropy_rate() / math.log(2), rel=1e-12)


def test_samples_are_scored_under_the_source_itself(tmp_path):
  markov.write_splits(str(tmp_path), num_train=2, num_valid=2, length=50, order=2, concentration=0.1, seed=3)
  chain = markov.read_chain(str(tmp_path / "truth.json"))
  docs = chain.sample(200, 400, seed=1)
  scores = markov.sample_scores(chain, docs + ["a", "a!bc"])  # too short / a byte outside the alphabet
  assert scores["truth_scored_fraction"] == pytest.approx(200 / 202)
  want = -sum(chain.log_prob(d) for d in docs) / (200 * 400 * math.log(2))
  assert scores["truth_bits_per_byte"] == pytest.approx(want, rel=1e-12)
  # the standard error: equal lengths, so the sd of the per-sample bits per byte over sqrt(n)
  per_doc = np.asarray([-chain.log_prob(d) / (400 * math.log(2)) for d in docs])
  assert scores["truth_bits_per_byte_se"] == pytest.approx(per_doc.std(ddof=1) / math.sqrt(200), rel=1e-9)
  # the source's own samples score its entropy rate: 80k symbols put the estimate's standard error near
  # 0.01 bits (per-symbol surprisal sd ~ 2-3 bits); 0.06 bits is 5 of them
  assert scores["truth_bits_per_byte"] == pytest.approx(scores["truth_entropy_rate_bits"], abs=0.06)
  # the yardstick of short samples: the entropy of the source's documents of that length, by enumeration
  small = markov.MarkovChain.random(alphabet="abc", order=2, concentration=0.5, seed=3)
  docs3 = ["".join(x) for x in itertools.product("abc", repeat=3)]
  entropy_3 = -sum(math.exp(small.log_prob(d)) * small.log_prob(d) for d in docs3) / (3 * math.log(2))
  assert sum(math.exp(small.log_prob(d)) for d in docs3) == pytest.approx(1.0, abs=1e-9)
  assert markov.sample_scores(small, ["abc", "cab"])["truth_expected_bits"] == pytest.approx(entropy_3, rel=1e-9)
  assert scores["truth_expected_bits"] > scores["truth_entropy_rate_bits"]
  # a sampler that repeats one letter is far from it, here above it (a rare transition repeated)
  assert markov.sample_scores(chain, ["z" * 400])["truth_bits_per_byte"] != pytest.approx(
      scores["truth_entropy_rate_bits"], abs=0.5)
  with pytest.raises(FileNotFoundError, match="eval.truth"):
    markov.read_chain(str(tmp_path / "missing.json"), "eval.truth")


@pytest.mark.parametrize("prefix", ["ca", ""])
def test_canvas_posteriors_match_enumeration(prefix):
  """Forward-backward posteriors p(x_i | z) and p(x_i | z_-i) of a noisy canvas against summing over every
  clean canvas (4^6 of them), float64; after a clean prefix, and at a document's start (no prefix: the
  canvas is the document's first symbols, scored by log_prob from the stationary start)."""
  chain = markov.MarkovChain.random(alphabet="abc ", order=2, concentration=0.3, seed=2)
  S, C, V, alpha = 4, 6, 11, 0.6
  z = np.array([0, -1, 3, 3, -1, 1])  # -1: a noisy id outside the alphabet
  full, loo = markov.canvas_posteriors(chain, prefix, z, alpha, V)
  want_full, want_loo = np.zeros((C, S)), np.zeros((C, S))
  for xs in itertools.product(range(S), repeat=C):
    text = prefix + "".join(chain.alphabet[x] for x in xs)
    p = math.exp(chain.log_prob(text) - (chain.log_prob(prefix) if prefix else 0.0))   # p(canvas | prefix)
    emit = [alpha * (zi == xi) + (1 - alpha) / V for zi, xi in zip(z, xs)]
    joint = p * np.prod(emit)
    for i, xi in enumerate(xs):
      want_full[i, xi] += joint
      want_loo[i, xi] += joint / emit[i]
  want_full /= want_full.sum(1, keepdims=True)
  want_loo /= want_loo.sum(1, keepdims=True)
  np.testing.assert_allclose(full, want_full, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(loo, want_loo, rtol=1e-9, atol=1e-12)
  assert not np.allclose(full, loo)
  # a batch of canvases is each canvas alone
  z2 = np.array([2, 2, -1, 0, 1, 3])
  full_B, loo_B = markov.canvas_posteriors(chain, prefix, np.stack([z, z2]), alpha, V)
  np.testing.assert_allclose(full_B[0], full, rtol=1e-12)
  np.testing.assert_allclose(loo_B[1], markov.canvas_posteriors(chain, prefix, z2, alpha, V)[1], rtol=1e-12)
  # as a model's logits over V ids: the softmax is the posterior on the alphabet's ids, zero elsewhere
  ids = [7, 2, 9, 4]
  logits = markov.vocab_logits(full_B, ids, V)
  assert logits.shape == (2, C, V) and logits.dtype == np.float32
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(probs[..., ids], full_B, rtol=1e-5, atol=1e-7)  # fp32 logs of float64 posteriors
  assert probs[..., [i for i in range(V) if i not in ids]].max() == 0.0


def test_blind_posteriors_match_enumeration():
  """The leave-one-out posterior of a denoiser not told t (`blind_loo_posteriors`) against summing over every clean
  canvas (4^5), every noise level of the grid and, for p(z_-i | t), every id z_i could have been, float64."""
  chain = markov.MarkovChain.random(alphabet="abc ", order=2, concentration=0.3, seed=5)
  S, C, V, prefix = 4, 5, 9, "b "
  z = np.array([1, -1, 0, 2, 2])  # -1: the id 8, outside the alphabet (ids 0..3 are the symbols)
  t_grid = np.array([0.1, 0.4, 0.8])
  ids_C = np.where(z < 0, 8, z)
  want = np.zeros((C, S))
  log_ev = np.zeros((len(t_grid), C))
  for g, t in enumerate(t_grid):
    alpha = 1.0 - t
    q = lambda zid, x: alpha * (zid == x) + (1 - alpha) / V  # q(z | x) over ids; symbols are ids 0..S-1
    ev = np.zeros(C)
    for xs in itertools.product(range(S), repeat=C):
      text = prefix + "".join(chain.alphabet[x] for x in xs)
      p = math.exp(chain.log_prob(text) - chain.log_prob(prefix))
      emit = np.array([q(zi, xi) for zi, xi in zip(ids_C, xs)])
      for i, xi in enumerate(xs):  # p(x_i, z_-i | t): the other positions' emissions only
        joint = p * np.prod(np.delete(emit, i))
        want[i, xi] += joint / len(t_grid)
        ev[i] += joint
    log_ev[g] = np.log(ev)
  want /= want.sum(1, keepdims=True)
  np.testing.assert_allclose(markov.blind_loo_posteriors(chain, prefix, z, V, t_grid), want, rtol=1e-9, atol=1e-12)
  # the evidence itself, and the posterior at each t is canvas_posteriors'
  _, loo_T, got_ev = markov._forward_backward(chain, prefix, np.stack([z] * 3), 1.0 - t_grid, V)
  np.testing.assert_allclose(got_ev, log_ev, rtol=1e-10)
  np.testing.assert_allclose(loo_T[1], markov.canvas_posteriors(chain, prefix, z, 0.6, V)[1], rtol=1e-12)
  # one noise level: the blind denoiser is the exact one; the noise level matters to it otherwise
  np.testing.assert_allclose(markov.blind_loo_posteriors(chain, prefix, z, V, [0.4]), loo_T[1], rtol=1e-12)
  assert not np.allclose(want, loo_T[1], atol=1e-3)
