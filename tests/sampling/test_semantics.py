"""sample.semantics='official' against a direct reading of the official JAX sampler's rules
(google-deepmind/gemma `gemma/diffusion/_sampler.py`, `_early_stopping.py`; docs/model.md "Two references"):
the per-query sliding window, the committed canvas, the bf16 self-conditioning embedding, the stopping
rule and the end ids. HF semantics (the default) are checked alongside, so each test shows the switch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

from configs import base, tiny_test
from configs.models import tiny
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig, Transformer, init_cache
from dgemma.model.attention import decoder_masks
from dgemma.sampling import (FixedNoise, SamplerConfig, accept_entropy_bound, canvas_result, denoise_canvas, entropy,
                             generate, rules)
from tests.model_utils import random_params

V, C = 16, 4


def official_window(E: int, W: int, C: int) -> np.ndarray:
  """allowed[i, k] of the official decoder for canvas query i over context positions k < E: the block-local
  mask [max(E - W, 0), E) times the layer's positional window q - k < W, q = E + i."""
  k, i = np.arange(E)[None, :], np.arange(C)[:, None]
  return (k >= max(E - W, 0)) & (k > E + i - W)


def test_the_reading_of_the_official_window():
  allowed = official_window(1100, 1024, 256)
  assert allowed[0].sum() == 1023 and allowed[255].sum() == 768  # W - 1 - i context positions
  assert official_window(500, 1024, 256).all()  # a short context: every query sees all of it


@pytest.mark.parametrize("official", [False, True])
def test_decoder_sliding_mask_per_query_vs_hf(official):
  cfg = dataclasses.replace(ModelConfig.from_config_dict(tiny.get_config()), sliding_window=8)
  E = 12
  pos_BS = jnp.arange(E, dtype=jnp.int32)[None]
  seg_BS = jnp.ones((1, E), jnp.int32)
  pos_BC = E + jnp.arange(C, dtype=jnp.int32)[None]
  slide, glob = decoder_masks(cfg, pos_BC, jnp.ones((1, C), jnp.int32), pos_BS, seg_BS, jnp.int32(E),
                              per_query_window=official)
  cache_part = np.asarray(slide[0, :, :E])
  if official:
    np.testing.assert_array_equal(cache_part, official_window(E, 8, C))  # rows: {5..11}, {6..11}, {7..11}, {8..11}
  else:
    np.testing.assert_array_equal(cache_part, np.broadcast_to(np.arange(E) > E - 8, (C, E)))  # HF: W - 1 for all
  assert np.asarray(glob[0, :, :E]).all() and np.asarray(slide[0, :, E:]).all()  # globals and the canvas alike


def _one_step(semantics, logits_CV, init_C, renoise_C, steps=1, confidence=0.005):
  """denoise_canvas with a constant decoder (`logits_CV` every step) and fixed noise: the draw is the argmax
  (huge Gumbel margin there), re-noise tokens `renoise_C`."""
  cfg = SamplerConfig(canvas_len=C, max_denoising_steps=steps, end_ids=(1,), semantics=semantics,
                      t_max=1.0, t_min=1.0, confidence_threshold=confidence)
  argmax = np.argmax(logits_CV, -1)
  gumbel = np.where(np.arange(V)[None, None, None, None, :] == argmax[None, None, None, :, None], 50.0, 0.0)
  noise = FixedNoise(init_canvas_NBC=jnp.asarray(init_C, jnp.int32)[None, None],
                     gumbel_NSBCV=jnp.asarray(np.broadcast_to(gumbel, (1, steps, 1, C, V)), jnp.float32),
                     renoise_NSBC=jnp.asarray(np.broadcast_to(renoise_C, (1, steps, 1, C)), jnp.int32))
  decode = lambda canvas, sc, mask: jnp.asarray(logits_CV, jnp.float32)[None]
  state = jax.jit(lambda: denoise_canvas(decode, cfg, noise, noise.init_canvas(0, C, V), V))()
  return jax.device_get(state), cfg


def test_official_commits_the_last_sampled_canvas_hf_the_argmax():
  """Position 0 is confident (near one-hot); the entropy bound accepts it and the next-lowest (its running
  sum minus itself is ~0): the official result keeps the re-noise tokens at the others, HF's is the argmax
  canvas."""
  logits = np.zeros((C, V))
  logits[0, 7] = 40.0                   # entropy ~0
  logits[1:, 3] = 0.5                   # nearly flat: entropy ~ log V
  renoise = np.array([9, 10, 11, 12])
  official, cfg_o = _one_step("official", logits, np.zeros(C), renoise)
  hf, cfg_h = _one_step("hf", logits, np.zeros(C), renoise)
  accepted = np.asarray(accept_entropy_bound(entropy(jnp.asarray(logits, jnp.float32)[None])[0], 0.1))[0]
  np.testing.assert_array_equal(accepted, [True, True, False, False])
  np.testing.assert_array_equal(np.asarray(canvas_result(official, cfg_o))[0], np.where(accepted, [7, 3, 3, 3], renoise))
  np.testing.assert_array_equal(np.asarray(canvas_result(hf, cfg_h))[0], [7, 3, 3, 3])


def test_official_stops_when_the_argmax_equals_the_input_canvas():
  """A confident decoder whose argmax is the initial canvas: official stops after one pass (argmax ==
  input), HF needs two (its argmax history starts empty)."""
  target = np.array([2, 5, 7, 9])
  logits = 40.0 * np.eye(V)[target]
  official, _ = _one_step("official", logits, target, np.zeros(C), steps=6)
  hf, _ = _one_step("hf", logits, target, np.zeros(C), steps=6)
  assert int(official.num_forwards_B[0]) == 1 and int(hf.num_forwards_B[0]) == 2


def test_the_stopping_rules_read_directly():
  """rules.stopping on explicit arrays: official compares the argmax with the step's input canvas and
  accepts mean(H) == threshold; HF compares with the previous argmax, counts, and needs mean(H) < threshold."""
  argmax = jnp.asarray([[2, 5, 7, 9]])
  ent = jnp.full((1, C), 0.25)
  hf = SamplerConfig(canvas_len=C, end_ids=(1,), confidence_threshold=0.25, stability_threshold=2)
  official = dataclasses.replace(hf, semantics="official")
  stable, stops = rules.stopping(official, argmax, argmax, jnp.full((1, C), -1), jnp.zeros((1,), jnp.int32), ent)
  assert (int(stable[0]), bool(stops[0])) == (1, True)        # argmax == input, mean H <= 0.25
  stable, stops = rules.stopping(official, argmax, argmax + 1, argmax, jnp.zeros((1,), jnp.int32), ent)
  assert (int(stable[0]), bool(stops[0])) == (0, False)       # argmax != input (the previous argmax is ignored)
  stable, stops = rules.stopping(hf, argmax, argmax + 1, argmax, jnp.ones((1,), jnp.int32), ent)
  assert (int(stable[0]), bool(stops[0])) == (2, False)       # stable twice, but 0.25 < 0.25 fails
  stable, stops = rules.stopping(dataclasses.replace(hf, confidence_threshold=0.26), argmax, argmax + 1, argmax,
                                 jnp.ones((1,), jnp.int32), ent)
  assert (int(stable[0]), bool(stops[0])) == (2, True)


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_the_official_self_conditioning_signal_is_the_bf16_soft_embedding():
  """The signal carried to the next step is sc_signal_fn(processed logits); the official one is
  bf16(softmax(L / T) @ table * sqrt(D)), and decoding from it (unrounded) equals decoding from the logits."""
  cfg = ModelConfig.from_config_dict(tiny.get_config())
  params = random_params(cfg)
  model = Transformer(cfg)
  g = np.random.default_rng(0)
  logits = jnp.asarray(g.normal(0, 2, (1, C, cfg.vocab_size)), jnp.float32)
  emb = model.apply({"params": params}, logits, method=Transformer.self_conditioning_embedding)
  table = np.asarray(params["embedder"]["embedding"], np.float64)
  p = np.exp(np.asarray(logits, np.float64) - np.asarray(logits, np.float64).max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  # fp32 probabilities times the table: a sum of V products, each with relative error <= ~2 eps32
  np.testing.assert_allclose(np.asarray(emb), p @ table * np.sqrt(cfg.d_model),
                             atol=8 * np.finfo(np.float32).eps * np.abs(table).max() * np.sqrt(cfg.d_model))
  # The decoder's two inputs agree exactly when the embedding is not rounded (same ops in the same order).
  cache = init_cache(cfg, 1, 4)
  tokens = jnp.zeros((1, 4), jnp.int32)
  _, cache = model.apply({"params": params}, tokens, jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32), cache,
                         return_logits=False, method=Transformer.encode)
  canvas, pos, seg = jnp.ones((1, C), jnp.int32), 4 + jnp.arange(C)[None], jnp.ones((1, C), jnp.int32)
  dec = lambda **kw: np.asarray(model.apply({"params": params}, canvas, pos, seg, cache, method=Transformer.decode, **kw))
  np.testing.assert_array_equal(dec(sc_logits_BCV=logits), dec(sc_embeddings_BCD=emb))
  # The loop carries what sc_signal_fn returns, and hands it to the next decoder call.
  seen = []
  def decode(canvas_BC, sc_BCX, sc_mask_B):
    jax.debug.callback(lambda x: seen.append(np.asarray(x)), sc_BCX)
    return logits
  signal_fn = lambda proc: model.apply({"params": params}, proc, method=Transformer.self_conditioning_embedding
                                       ).astype(jnp.bfloat16)
  scfg = SamplerConfig(canvas_len=C, max_denoising_steps=2, end_ids=(1,), semantics="official",
                       confidence_threshold=0.0, early_exit=False)
  noise = FixedNoise(jnp.zeros((1, 1, C), jnp.int32), jnp.zeros((1, 2, 1, C, cfg.vocab_size), jnp.float32),
                     jnp.zeros((1, 2, 1, C), jnp.int32))
  jax.block_until_ready(jax.jit(lambda: denoise_canvas(decode, scfg, noise, jnp.zeros((1, C), jnp.int32),
                                                       cfg.vocab_size, sc_signal_fn=signal_fn))())
  jax.effects_barrier()
  assert seen[0].dtype == jnp.bfloat16 and seen[0].shape == (1, C, cfg.d_model) and not seen[0].any()  # step 0: zero
  from dgemma.sampling import temperature
  expected = np.asarray(signal_fn(logits / temperature(scfg, 0)))
  np.testing.assert_array_equal(seen[1], expected)


def test_official_generate_runs_and_differs_only_where_the_rules_do(tmp_path):
  """End to end on a tiny model: official semantics compile and generate; with one denoising step and a
  context shorter than the window the decoder's inputs match HF's, and the committed canvas is the sampled
  one (so the outputs differ where HF keeps the argmax)."""
  cfg = ModelConfig.from_config_dict(tiny.get_config())
  params = random_params(cfg)
  prompts = np.array([[2, 40, 41, 42]], np.int32)
  base_cfg = SamplerConfig(canvas_len=8, max_denoising_steps=1, end_ids=(), confidence_threshold=0.0)
  out = {s: jax.device_get(generate(Transformer(cfg), params, prompts, [4], dataclasses.replace(base_cfg, semantics=s),
                                    jax.random.key(0), 8, return_trajectory=True)) for s in ("hf", "official")}
  hf_traj, off_traj = out["hf"].trajectory, out["official"].trajectory
  np.testing.assert_array_equal(hf_traj.argmax_SBC, off_traj.argmax_SBC)  # same decoder pass, same argmax
  np.testing.assert_array_equal(out["hf"].tokens_BN[0], hf_traj.argmax_SBC[0, 0, 0])
  sampled = np.where(off_traj.accepted_SBC[0, 0, 0], off_traj.sampled_SBC[0, 0, 0], out["official"].tokens_BN[0])
  np.testing.assert_array_equal(out["official"].tokens_BN[0], sampled)


def test_official_end_ids_and_checks(tmp_path):
  lines = [f"user {i} says hello to the model and the model answers {i * 7}" for i in range(200)]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "gemma_like"),
                                 vocab_size=150, pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False,
                                 control_symbols=["<|turn>", "<turn|>"], minloglevel=2)
  config = base.get_config()
  config.data.tokenizer.kind, config.data.tokenizer.path = "file", str(tmp_path / "gemma_like.model")
  config.model.vocab_size = 256
  turn_end = spm.SentencePieceProcessor(model_file=config.data.tokenizer.path).piece_to_id("<turn|>")
  assert settings_lib.from_config(config).end_ids == (1, turn_end)
  config.sample.semantics = "official"
  assert settings_lib.from_config(config).end_ids == (1, turn_end, 50)  # + <begin_of_tool_response>
  byte = tiny_test.get_config()
  byte.sample.semantics = "official"
  assert settings_lib.from_config(byte).end_ids == (1,)  # not the Gemma 4 vocabulary: EOS only
  for bad, pattern in ((dict(sampler="ancestral"), "released sampler"), (dict(top_k=5), "top_k=0"),
                       (dict(semantics="vllm"), "sample.semantics")):
    with pytest.raises(ConfigError, match=pattern):
      SamplerConfig(**{"semantics": "official", **bad})
