"""A synthetic text source whose entropy rate is known exactly: an order-k character Markov chain.

Text models trained on it can be compared with the truth, not only with each other: the chain gives every
document's exact log-probability, so a likelihood bound (eval.likelihood) can be read as a ratio to the
true bits per byte (issue #18, item 1).

The chain: an alphabet of S symbols (default a-z and space, S = 27), states = the last k symbols (S^k of
them), and one next-symbol distribution per state drawn from a symmetric Dirichlet(concentration) with a
seeded numpy RNG (small concentration: peaked rows, a low entropy rate). A document is k symbols drawn from
the stationary distribution over states, then length - k transitions; it is written as one line of text, so
a file of documents reads with data.txt_mode='line'.

  python -m proj.markov.make_text --out_dir=data_cache/markov --num_train=4000 --num_valid=64

Exact quantities (float64):
  entropy_rate      H = sum_s pi(s) H(P(. | s)) nats per symbol, pi the stationary distribution of the
                    chain on states (power iteration from uniform; the chain is irreducible and aperiodic
                    because every Dirichlet draw is strictly positive).
  log_prob(text)    log pi(text[:k]) + sum_i log P(text[i] | text[i-k:i]); -log_prob / (len * ln 2) is the
                    document's true bits per byte (one byte per symbol: the alphabet is ASCII).
  canvas_posteriors the exact denoising posteriors of a noisy canvas (forward-backward over the states), as
                    p(x_i | z) and leave-one-out p(x_i | z_-i); `blind_loo_posteriors` the latter for a
                    denoiser not told the noise level (proj.markov.profile, proj.markov.oracle,
                    proj.markov.denoisers).
"""

from __future__ import annotations

import dataclasses
import json
import functools
import math
import string

from pathlib import Path

import numpy as np

from dgemma import files
from dgemma.errors import ConfigError

DEFAULT_ALPHABET = string.ascii_lowercase + " "


@dataclasses.dataclass(frozen=True)
class MarkovChain:
  """An order-`order` chain over `alphabet`; `transitions_SS` is float64 [S^order, S] (rows sum to 1)."""

  alphabet: str
  order: int
  transitions: np.ndarray

  @classmethod
  def random(cls, *, alphabet: str = DEFAULT_ALPHABET, order: int = 2, concentration: float = 0.1,
             seed: int = 0) -> "MarkovChain":
    """Dirichlet(concentration) rows, floored at 1e-6 and renormalised (every transition possible)."""
    if len(set(alphabet)) != len(alphabet) or len(alphabet) < 2 or not alphabet.isascii():
      raise ConfigError(f"markov alphabet: {alphabet!r} must be >= 2 distinct ASCII characters")
    if order < 1:
      raise ConfigError(f"markov order: {order} must be >= 1")
    if concentration <= 0:
      raise ConfigError(f"markov concentration: {concentration} must be > 0")
    rng = np.random.default_rng(seed)
    num_symbols = len(alphabet)
    rows = rng.dirichlet(np.full(num_symbols, concentration), size=num_symbols ** order)
    rows = np.maximum(rows, 1e-6)
    return cls(alphabet, order, rows / rows.sum(axis=1, keepdims=True))

  @property
  def num_symbols(self) -> int:
    return len(self.alphabet)

  def _state(self, symbols) -> int:
    state = 0
    for s in symbols:
      state = state * self.num_symbols + int(s)
    return state

  def _next_state(self, state: int, symbol: int) -> int:
    return (state * self.num_symbols + symbol) % (self.num_symbols ** self.order)

  @functools.cached_property
  def _stationary(self) -> np.ndarray:
    return self._power_iteration()

  def stationary(self) -> np.ndarray:
    """pi over states [S^order] (float64): the fixed point of the state-transition operator."""
    return self._stationary.copy()

  def _power_iteration(self) -> np.ndarray:
    num_states, S = self.num_symbols ** self.order, self.num_symbols
    pi = np.full(num_states, 1.0 / num_states)
    # state s = (prefix, last k-1 symbols); next state = (s mod S^(k-1)) * S + symbol
    shift = np.arange(num_states) % (num_states // S)
    for _ in range(10_000):
      flow_SS = pi[:, None] * self.transitions                       # [state, symbol]
      new = np.zeros(num_states)
      np.add.at(new, (shift[:, None] * S + np.arange(S)[None, :]).reshape(-1), flow_SS.reshape(-1))
      if np.abs(new - pi).sum() < 1e-15:
        return new
      pi = new
    return pi

  def entropy_rate(self) -> float:
    """Nats per symbol of the stationary chain."""
    h_rows = -np.sum(self.transitions * np.log(self.transitions), axis=1)
    return float(np.dot(self.stationary(), h_rows))

  def stationary_entropy(self) -> float:
    """H(pi) in nats: the expected cost of a document's first `order` symbols (its start state)."""
    pi = self.stationary()
    return float(-np.sum(pi[pi > 0] * np.log(pi[pi > 0])))

  def sample(self, num_documents: int, length: int, seed: int) -> list[str]:
    """`num_documents` documents of `length` symbols (seeded; start state from the stationary pi). All
    documents advance together, one transition per array step (inverse CDF of each row's next symbol)."""
    if length < self.order:
      raise ConfigError(f"markov document length: {length} must be >= the order {self.order}")
    rng = np.random.default_rng(seed)
    S, num_states = self.num_symbols, self.num_symbols ** self.order
    cdf_rows = np.cumsum(self.transitions, axis=1)
    cdf_rows /= cdf_rows[:, -1:]
    state_N = rng.choice(num_states, size=num_documents, p=self.stationary())
    symbols_NL = np.zeros((num_documents, length), np.int64)
    for j in range(self.order):  # the start state's symbols, most significant first
      symbols_NL[:, j] = (state_N // S ** (self.order - 1 - j)) % S
    for i in range(self.order, length):
      u_N = rng.random(num_documents)
      symbol_N = np.minimum(np.sum(cdf_rows[state_N] <= u_N[:, None], axis=1), S - 1)
      symbols_NL[:, i] = symbol_N
      state_N = (state_N * S + symbol_N) % num_states
    table = np.array(list(self.alphabet))
    return ["".join(row) for row in table[symbols_NL]]

  def log_prob(self, text: str) -> float:
    """Exact log p(text) in nats (start from pi, then the transitions)."""
    index = {c: i for i, c in enumerate(self.alphabet)}
    bad = sorted(set(text) - set(index))
    if bad:
      raise ConfigError(f"markov log_prob: characters {bad!r} are not in the chain's alphabet")
    if len(text) < self.order:
      raise ConfigError(f"markov log_prob: a text of {len(text)} characters is shorter than the order {self.order}")
    symbols = [index[c] for c in text]
    state = self._state(symbols[:self.order])
    total = math.log(self._stationary[state])
    for s in symbols[self.order:]:
      total += math.log(self.transitions[state, s])
      state = self._next_state(state, s)
    return total

  def bits_per_byte(self, texts: list[str]) -> float:
    """The true bits per byte of `texts` together (total -log2 p / total bytes; ASCII: one byte a symbol)."""
    nats = -sum(self.log_prob(t) for t in texts)
    return nats / (sum(len(t) for t in texts) * math.log(2.0))


def _stream_seed(seed: int, stream: int) -> int:
  return int(np.random.SeedSequence((seed, stream)).generate_state(1)[0])


def chain_of_truth(truth: dict) -> MarkovChain:
  """The chain a truth.json record (`write_splits`) describes, rebuilt exactly."""
  missing = [k for k in ("alphabet", "order", "concentration", "seed") if k not in truth]
  if missing:
    raise ConfigError(f"markov truth record: missing {missing} (written by python -m proj.markov.make_text)")
  return MarkovChain.random(alphabet=truth["alphabet"], order=int(truth["order"]),
                            concentration=float(truth["concentration"]), seed=_stream_seed(int(truth["seed"]), 0))


def read_chain(path: str, field: str = "--truth") -> MarkovChain:
  """The chain of a truth.json file (python -m proj.markov.make_text); a missing file is an error naming
  `field`."""
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"{field}: {path} is not a file (the truth.json of python -m proj.markov.make_text)")
  return chain_of_truth(json.loads(p.read_text()))


def sample_scores(chain: MarkovChain, texts: list[str]) -> dict[str, float]:
  """How a model's samples of this source score under the source itself:
    truth_bits_per_byte     the exact bits per byte of the samples together, i.e. their cross-entropy under
                            the truth (above the entropy rate = errors, below = mode-seeking)
    truth_bits_per_byte_se  its standard error over samples
    truth_entropy_rate_bits the source's entropy rate, the yardstick's limit for long samples
    truth_expected_bits     the yardstick: the expected score of the source's own documents of the scored
                            samples' lengths, (H(pi) + (L - order) H) per document of L symbols over their
                            total length (a document's first `order` symbols cost the stationary entropy
                            H(pi), more than the rate: 1.49 against 1.42 bits for 32 symbols of an order-1
                            chain)
    truth_scored_fraction   samples wholly in the alphabet and at least `order` long, the ones scored (the rest
                            hold bytes the source never emits)
  """
  alphabet = set(chain.alphabet)
  scored = [t for t in texts if len(t) >= chain.order and set(t) <= alphabet]
  out = {"truth_entropy_rate_bits": chain.entropy_rate() / math.log(2.0),
         "truth_scored_fraction": len(scored) / max(len(texts), 1)}
  bits = np.asarray([-chain.log_prob(t) / math.log(2.0) for t in scored])
  lengths = np.asarray([len(t) for t in scored], np.float64)
  n = len(scored)
  out["truth_bits_per_byte"] = float(bits.sum() / lengths.sum()) if n else math.nan
  out["truth_expected_bits"] = (float(np.sum(chain.stationary_entropy() + (lengths - chain.order) * chain.entropy_rate())
                                      / (lengths.sum() * math.log(2.0))) if n else math.nan)
  # Its standard error over samples (the ratio estimator's: sum of bits / sum of bytes). One transition the
  # source almost never makes costs tens of bits, so this mean is heavy-tailed: read it with its error.
  out["truth_bits_per_byte_se"] = (float(np.sqrt(np.sum((bits - out["truth_bits_per_byte"] * lengths) ** 2)
                                                 / (n * (n - 1))) / lengths.mean()) if n > 1 else math.nan)
  return out


def write_splits(out_dir: str, *, num_train: int, num_valid: int, length: int, order: int, concentration: float,
                 seed: int) -> dict:
  """out_dir/train.txt and valid.txt (one document per line; independent seed streams) and truth.json (the
  chain's entropy rate, each file's exact bits per byte), written atomically; returns the truth record.
  The chain is `MarkovChain.random(order, concentration, seed=stream 0)` (python -m proj.markov.make_text)."""
  if num_train < 1 or num_valid < 1:
    raise ValueError(f"--num_train={num_train} and --num_valid={num_valid} must both be >= 1")
  stream = lambda k: _stream_seed(seed, k)
  chain = MarkovChain.random(order=order, concentration=concentration, seed=stream(0))
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  truth = {"alphabet": chain.alphabet, "order": order, "concentration": concentration, "seed": seed,
           "length": length, "entropy_rate_nats_per_char": chain.entropy_rate(),
           "entropy_rate_bits_per_char": chain.entropy_rate() / math.log(2.0)}
  for name, count, k in (("train", num_train, 1), ("valid", num_valid, 2)):
    docs = chain.sample(count, length, seed=stream(k))
    files.write_text_atomic(out / f"{name}.txt", "\n".join(docs) + "\n")
    truth[f"{name}_documents"] = count
    truth[f"{name}_bits_per_byte"] = chain.bits_per_byte(docs)
  files.write_json_atomic(out / "truth.json", truth)
  return truth


NO_MASS_LOGIT = -1e30  # an id the source never emits: finite, so a shift like f - delta onehot(z) is never inf - inf


def vocab_logits(probs_XS: np.ndarray, ids_S, vocab_size: int) -> np.ndarray:
  """float32 [..., vocab_size] log-probabilities of distributions over the alphabet (`canvas_posteriors`'
  [..., S] arrays) as a model's logits: symbol j at id ids_S[j], NO_MASS_LOGIT elsewhere."""
  out = np.full(probs_XS.shape[:-1] + (vocab_size,), NO_MASS_LOGIT, np.float32)
  out[..., np.asarray(ids_S)] = np.log(np.maximum(probs_XS, 1e-300))
  return out


def canvas_posteriors(chain: MarkovChain, prefix: str, noisy_symbols_C: np.ndarray, alpha,
                      vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """The exact denoising posteriors of a canvas of the chain: float64 [C, S] arrays (p(x_i | z), p(x_i | z_-i)).

  The canvas x_1..x_C follows `prefix` (its last `order` symbols, clean) under the chain, or starts a
  document where `prefix` is empty (the previous state drawn from the stationary pi: a stationary chain's
  windows are pi-distributed, so x_1..x_order is pi-distributed as `sample` draws it); each token was
  kept with probability alpha and otherwise replaced by one of `vocab_size` ids uniformly (the uniform-state
  forward process over the model's vocabulary). noisy_symbols_C: the index in the alphabet of each noisy
  token z_i, or -1 where z_i is an id outside the alphabet; a batch [B, C] of canvases (one prefix) gives
  [B, C, S] arrays, and alpha may then be one value per canvas ([B]). Forward-backward on the states (last
  `order` symbols), emissions q(z_i | x_i) = alpha [z_i = x_i] + (1 - alpha) / vocab_size; the leave-one-out
  posterior divides position i's emission out (dgemma/diffusion/objectives.py docstring: it is the x_theta that
  makes the uniform-state NELBO exact)."""
  full, loo, _ = _forward_backward(chain, prefix, noisy_symbols_C, alpha, vocab_size)
  return full, loo


def _forward_backward(chain: MarkovChain, prefix: str, noisy_symbols_C: np.ndarray, alpha, vocab_size: int):
  """`canvas_posteriors`' two arrays and log p(z_-i | prefix, alpha) [(B,) C]: the probability of the canvas's
  other noisy tokens, from log p(z) (the forward pass's normalisers) and p(z_-i) = p(z) sum_x p(x_i = x | z) /
  q(z_i | x)."""
  S, k = chain.num_symbols, chain.order
  index = {c: i for i, c in enumerate(chain.alphabet)}
  if 0 < len(prefix) < k:
    raise ConfigError(f"markov canvas_posteriors: prefix {prefix!r} is shorter than the order {k} (and not empty)")
  z_BC = np.asarray(noisy_symbols_C, np.int64)
  single = z_BC.ndim == 1
  z_BC = z_BC[None] if single else z_BC
  B, C = z_BC.shape
  alpha_B = np.broadcast_to(np.asarray(alpha, np.float64), (B,))[:, None, None]
  emit_BCS = (1.0 - alpha_B) / vocab_size + alpha_B * (z_BC[..., None] == np.arange(S))
  num_states, tail = S ** k, S ** (k - 1)
  # state p = (h, r): h its oldest symbol, r the other k-1; after symbol x the state is (r, x)
  P_HRS = chain.transitions.reshape(S, tail, S)
  if prefix:
    prev_BN = np.zeros((B, num_states))
    prev_BN[:, chain._state([index[c] for c in prefix[-k:]])] = 1.0
  else:
    prev_BN = np.broadcast_to(chain.stationary(), (B, num_states))
  fwd_BCN = np.zeros((B, C, num_states))
  log_evidence_B = np.zeros(B)
  for i in range(C):  # fwd[:, i, s]: p(state after x_i = s | z_1..i), normalised per step
    cur_BRS = np.einsum("bhr,hrx->brx", prev_BN.reshape(B, S, tail), P_HRS) * emit_BCS[:, i, None, :]
    cur_BN = cur_BRS.reshape(B, num_states)
    norm_B = cur_BN.sum(axis=1)
    log_evidence_B += np.log(norm_B)  # log p(z_i | z_1..i-1)
    fwd_BCN[:, i] = prev_BN = cur_BN / norm_B[:, None]
  bwd_BCN = np.ones((B, C, num_states))
  for i in range(C - 2, -1, -1):  # bwd[:, i, s]: p(z_i+1..C | state after x_i = s), normalised per step
    nxt_BRS = bwd_BCN[:, i + 1].reshape(B, tail, S) * emit_BCS[:, i + 1, None, :]
    b_BN = np.einsum("hrx,brx->bhr", P_HRS, nxt_BRS).reshape(B, num_states)
    bwd_BCN[:, i] = b_BN / b_BN.sum(axis=1, keepdims=True)
  # x_i is the newest symbol of the state after it
  full_BCS = (fwd_BCN * bwd_BCN).reshape(B, C, tail, S).sum(axis=2)
  full_BCS /= full_BCS.sum(axis=-1, keepdims=True)
  loo_BCS = full_BCS / emit_BCS
  loo_mass_BC = loo_BCS.sum(axis=-1)
  loo_BCS /= loo_mass_BC[..., None]
  log_loo_evidence_BC = log_evidence_B[:, None] + np.log(loo_mass_BC)
  if single:
    return full_BCS[0], loo_BCS[0], log_loo_evidence_BC[0]
  return full_BCS, loo_BCS, log_loo_evidence_BC


def blind_loo_posteriors(chain: MarkovChain, prefix: str, noisy_symbols_C: np.ndarray, vocab_size: int,
                         t_grid: np.ndarray) -> np.ndarray:
  """float64 [C, S]: the leave-one-out posterior of a denoiser that is not told the noise level, as a network
  without a time input (DiffusionGemma's decoder) must be: p(x_i | z_-i) = sum_t p(t | z_-i) p(x_i | z_-i, t)
  over the noise levels `t_grid` (t = 1 - alpha of the linear schedule), equally likely a priori, each weighted
  by p(z_-i | t) (the canvas's other tokens say how noisy it is). One canvas; `canvas_posteriors`' arguments."""
  t_T = np.asarray(t_grid, np.float64)
  z_C = np.asarray(noisy_symbols_C, np.int64)
  if z_C.ndim != 1:
    raise ValueError(f"blind_loo_posteriors: one canvas [C], got shape {z_C.shape}")
  _, loo_TCS, log_ev_TC = _forward_backward(chain, prefix, np.broadcast_to(z_C, (len(t_T),) + z_C.shape),
                                            1.0 - t_T, vocab_size)
  w_TC = np.exp(log_ev_TC - log_ev_TC.max(axis=0))
  w_TC /= w_TC.sum(axis=0)
  return np.einsum("tc,tcs->cs", w_TC, loo_TCS)
