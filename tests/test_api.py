"""The front door (dgemma/api.py): `dgemma.load` any checkpoint kind, then generate / chat / score, against
the lower-level functions on the same params and key; the tokenizer that belongs to the weights; sample.py
on a converted checkpoint end to end."""

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sentencepiece as spm

import dgemma
from dgemma import api, checkpoints, quant, tokenizers
from dgemma import settings as settings_lib
from dgemma.checkpoints import convert
from dgemma.data import sft
from dgemma.errors import ConfigError, DataError
from dgemma.model import Transformer
from dgemma.sampling import generate
from dgemma.sampling.generation import bucketed_shape
from eval import likelihood as eval_likelihood
from configs.models import tiny
from dgemma.model import ModelConfig
from tests.model_utils import save_random_hf, save_random_run

REPO = Path(__file__).resolve().parents[1]
VOCAB = 320  # the tiny HF model's vocabulary = the test tokenizers' size
_WORDS = "the king queen crown love death fair foul heart speak hence thou thee lord lady night day".split()


def _corpus(n=400):
  rng = np.random.default_rng(0)
  return [" ".join(rng.choice(_WORDS, 8)) for _ in range(n)]


def _sentencepiece(path: Path) -> Path:
  """A SentencePiece model with Gemma's special ids (pad 0, eos 1, bos 2, unk 3) and chat turn pieces."""
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_corpus()), model_prefix=str(path.with_suffix("")), vocab_size=VOCAB,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True, hard_vocab_limit=False,
      user_defined_symbols=[tokenizers.TURN_START, tokenizers.TURN_END], minloglevel=2)
  return path


def _tokenizer_json(path: Path) -> Path:
  """A Hugging Face tokenizer.json (byte-level BPE) with <pad>, <eos>, <bos>, <unk> as ids 0-3."""
  import tokenizers as hf_tokenizers
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                              initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_corpus(), trainer)
  tok.save(str(path))
  return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """Two tiny random HF DiffusionGemma directories: one with tokenizer.model, one with only tokenizer.json."""
  root = tmp_path_factory.mktemp("hf")
  cfg = ModelConfig.from_config_dict(dict(tiny.get_config(), vocab_size=VOCAB))
  sp_dir, json_dir = save_random_hf(cfg, root / "sp"), save_random_hf(cfg, root / "json")
  _sentencepiece(sp_dir / "tokenizer.model")
  _tokenizer_json(json_dir / "tokenizer.json")
  return sp_dir, json_dir


@pytest.fixture(scope="module")
def loaded(hf_dirs, tmp_path_factory):
  """The SentencePiece HF directory loaded directly, and after conversion."""
  sp_dir, _ = hf_dirs
  converted = tmp_path_factory.mktemp("ckpt") / "dgemma"
  convert.to_params(sp_dir, converted)
  return dgemma.load(str(sp_dir)), dgemma.load(str(converted)), converted


def _bucketed(model, ids, max_new_tokens):
  """(prompts_BP, lengths_B, row_active_B) as the API pads a request (bucketed_shape; padding rows: BOS, inactive).
  That padding changes no token is tests/sampling/test_generation_buckets.py's (in float64); here the API's
  plumbing is compared with the low-level generate on the same shapes, so fp32 results are equal exactly."""
  batch, length = bucketed_shape(batch=len(ids), prompt_len=max(map(len, ids)), max_new_tokens=max_new_tokens,
                                 canvas_len=model.settings.diffusion.canvas_len,
                                 max_context=model.settings.sample.max_context)
  out = np.full((batch, length), model.tokenizer.pad_id, np.int32)
  out[:, 0] = model.tokenizer.bos_id
  lengths = np.ones((batch,), np.int32)
  for b, x in enumerate(ids):
    out[b, :len(x)], lengths[b] = x, len(x)
  return out, lengths, np.arange(batch) < len(ids)


def test_loads_an_hf_directory_directly_and_converted_with_its_tokenizer(loaded):
  direct, converted, path = loaded
  assert direct.checkpoint.kind == "hf" and converted.checkpoint.kind == "params"
  assert (path / "tokenizer.model").is_file()  # convert copies the tokenizer beside the weights
  for model in (direct, converted):
    assert isinstance(model.tokenizer, tokenizers.SentencePieceTokenizer)
    assert model.settings.diffusion.canvas_len == 8  # the HF config's canvas length
    assert model.settings.end_ids == (1, model.tokenizer.piece_id(tokenizers.TURN_END))  # EOS and <turn|>
  for a, b in zip(jax.tree.leaves(direct.params), jax.tree.leaves(converted.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_generate_a_batch_of_prompts_equals_the_low_level_generate(loaded):
  model = loaded[0]
  # a first prompt of 36 tokens: the batch pads to the chat test's shapes (prompts of 64), whose programs it shares
  prompts = ["the king speaks of love and death, and the queen of night and day: hence, thou foul lord", "hence"]
  outs = model.generate(prompts, max_new_tokens=16, steps=3, seed=7)
  ids = [model.prompt_ids(p) for p in prompts]
  prompts_BP, lengths_B, active_B = _bucketed(model, ids, 16)
  sampler = model.call_settings(max_new_tokens=16, steps=3).canvas_sampler
  ref = jax.device_get(generate(Transformer(model.model_cfg), model.params, prompts_BP, lengths_B, sampler,
                                jax.random.key(7), 16, row_active_B=active_B))
  for b, out in enumerate(outs):
    assert out.prompt == prompts[b]
    assert out.token_ids == ref.tokens_BN[b, :ref.lengths_B[b]].tolist()
    assert out.num_forwards == int(ref.num_forwards_B[b])
    assert out.text == model.tokenizer.decode(out.token_ids[:-1] if out.ended else out.token_ids)
  assert isinstance(model.generate(prompts[0], max_new_tokens=16, steps=3, seed=7), api.Generation)


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_chat_renders_turns_and_equals_the_low_level_generate(loaded):
  model = loaded[0]
  conversation = [{"role": "user", "content": "speak of love"}, {"role": "assistant", "content": "thou art fair"},
                  {"role": "user", "content": "and death?"}]
  out = model.chat(conversation, max_new_tokens=16, steps=3, seed=1)
  start, end = tokenizers.chat_turn_ids(model.tokenizer)
  ids = sft.render_turns(model.tokenizer, [["user", "speak of love"], ["model", "thou art fair"], ["user", "and death?"]])
  assert ids.count(start) == 4 and ids.count(end) == 3  # three closed turns, the model's opened
  assert model.chat_ids(conversation) == ids
  sampler = model.call_settings(max_new_tokens=16, steps=3).canvas_sampler
  ref = jax.device_get(generate(Transformer(model.model_cfg), model.params, *_bucketed(model, [ids], 16)[:2],
                                sampler, jax.random.key(1), 16))
  assert out.token_ids == ref.tokens_BN[0, :ref.lengths_B[0]].tolist()
  both = model.chat([conversation, conversation[:1]], max_new_tokens=16, steps=3, seed=1)  # a batch of chats
  assert len(both) == 2 and all(x.num_forwards > 0 for x in both)


# The two streaming tests make one request (the same compiled program): three prompts, padded to a batch of 4.
STREAMED = dict(prompts=["the king", "hence", "love"], max_new_tokens=16, steps=3, seed=2)


def _streamed(model, **callbacks):
  request = dict(STREAMED)
  return model.generate(request.pop("prompts"), **request, **callbacks)


def test_streaming_calls_back_per_step_and_per_canvas(loaded):
  model = loaded[0]
  steps, canvases = [], []
  outs = _streamed(model, on_step=steps.append, on_canvas=canvases.append)
  assert [c.canvas_idx for c in canvases] == list(range(len(canvases))) and 1 <= len(canvases) <= 2
  for b, out in enumerate(outs):
    assert sum(v.active_B[b] for v in steps) == out.num_forwards  # a view per executed denoising step of the row
    assert sum((c.token_ids[b] for c in canvases), [])[:len(out.token_ids)] == out.token_ids


def _likelihood_texts_and_config(model, tmp_path):
  """Two texts written to tmp_path/texts.txt, and the model's run config scoring that file with 2 t samples."""
  texts = ["the king speaks of love and death", "thou art fair and foul"]
  (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
  config = api.run_config(checkpoints.header(model.path))
  config.eval.data, config.eval.num_t_samples = str(tmp_path / "texts.txt"), 2
  return texts, config


def test_score_equals_eval_likelihood(loaded, tmp_path):
  model, _, _ = loaded
  texts, config = _likelihood_texts_and_config(model, tmp_path)
  printed = []
  cli = eval_likelihood.run(model.path, config, print_fn=printed.append)
  scored = model.score(texts, num_t_samples=2)
  for key in ("nats_per_token", "bits_per_byte", "perplexity", "tokens", "total_nats", "nats_per_token_se"):
    assert scored[key] == cli[key], key
  # the uniform baseline beside the bound; a bound above it (this random model's) gets the note pointing to the docs
  assert cli["uniform_nats_per_token"] == pytest.approx(np.log(model.model_cfg.vocab_size), rel=1e-12)
  above = cli["nats_per_token"] > cli["uniform_nats_per_token"]
  assert above and len(printed) == 2 and printed[1] == eval_likelihood.loose_bound_note(cli)
  assert "docs/model.md, section 6" in printed[1]


def test_eval_likelihood_against_a_reference(loaded, tmp_path):
  """--reference scores a second checkpoint on the same canvases and pairs them canvas by canvas."""
  model, converted, converted_dir = loaded
  texts, config = _likelihood_texts_and_config(model, tmp_path)
  config.eval.reference, config.eval.out = str(converted_dir), str(tmp_path / "ll.json")
  printed = []
  out = eval_likelihood.run(model.path, config, print_fn=printed.append)
  # the reference under its own settings (another num_t_samples: other numbers than the model's)
  ref = converted.score(texts, context_len=out["context_len"], max_tokens=config.eval.max_tokens)
  assert out["reference"]["nats_per_token"] == ref["nats_per_token"] != out["nats_per_token"]
  # both sums in float64 over the same per-canvas values, in the same order: equal to round-off of a few ulp
  nats, ref_nats = np.sum(out["canvas_nats"]), np.sum(ref["canvas_nats"])
  np.testing.assert_allclose(out["ratio_to_reference"], nats / ref_nats, rtol=1e-14)
  np.testing.assert_allclose(out["excess_nats_per_token"], (nats - ref_nats) / out["tokens"], rtol=1e-14)
  written = json.loads((tmp_path / "ll.json").read_text())
  assert written["canvas_nats"] == out["canvas_nats"] and len(out["canvas_nats"]) == out["canvases"]
  assert "canvas_nats" not in json.loads(printed[0])
  with pytest.raises(ConfigError, match="eval.reference: .* other canvases"):  # texts cut into other canvases
    eval_likelihood.compare(out, converted, texts[:1], max_tokens=config.eval.max_tokens)
  config.eval.reference = str(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match=r"eval.reference \(--reference\)"):
    eval_likelihood.run(model.path, config, print_fn=lambda *_: None)


def test_tokenizer_json_only(hf_dirs, tmp_path):
  _, json_dir = hf_dirs
  model = dgemma.load(str(json_dir))
  assert isinstance(model.tokenizer, tokenizers.JsonTokenizer)
  text = "the queen speaks"
  assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
  assert model.prompt_ids(text)[0] == model.tokenizer.bos_id == 2
  out = model.generate(text, max_new_tokens=8, steps=2)
  assert out.num_forwards > 0
  convert.to_params(json_dir, tmp_path / "ckpt")
  assert checkpoints.header(tmp_path / "ckpt").tokenizer_file.name == "tokenizer.json"


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_load_options_dtype_and_quantize(hf_dirs):
  sp_dir, _ = hf_dirs
  bf16 = dgemma.load(str(sp_dir), dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(bf16.params)} == {np.dtype("bfloat16")}
  assert bf16.model_cfg.dtype == "bfloat16"
  int8 = dgemma.load(str(sp_dir), quantize="int8")
  assert any(quant.is_quantized(x) for x in jax.tree.leaves(int8.params, is_leaf=quant.is_quantized))
  assert int8.generate("the", max_new_tokens=8, steps=2).num_forwards > 0
  with pytest.raises(ConfigError, match="sample.quantize"):
    dgemma.load(str(sp_dir), quantize="int3")


def test_weights_without_a_run_take_the_callers_compute_choices(hf_dirs):
  """An HF directory carries the architecture, not how to compute it: a config's model.moe_impl / moe_dense_block /
  attention_impl / remat are used (and its architecture keys are not); without a config, the defaults."""
  sp_dir, _ = hf_dirs
  header = checkpoints.header(str(sp_dir))
  config = settings_lib.default_config()
  config.model.moe_impl, config.model.moe_dense_block, config.model.remat = "dense", 2, "full"
  config.model.num_layers = header.model.num_layers + 1
  chosen = api.run_settings(header, config).model
  assert (chosen.moe_impl, chosen.moe_dense_block, chosen.remat) == ("dense", 2, "full")
  assert chosen.num_layers == header.model.num_layers and chosen.d_model == header.model.d_model
  assert set(settings_lib.COMPUTE_MODEL_FIELDS) <= set(settings_lib.RUNTIME_MODEL_FIELDS)
  default = api.run_settings(header).model
  assert (default.moe_impl, default.moe_dense_block) == ("auto", 0)


@pytest.mark.slow  # trains a SentencePiece tokenizer and a run
def test_a_run_is_loaded_with_its_own_tokenizer_without_building_data(tmp_path, monkeypatch):
  """A SentencePiece run keeps its trained tokenizer in the workdir; loading it builds no dataset."""
  from configs import tiny_test
  from dgemma.train import loop
  config = tiny_test.get_config()
  (tmp_path / "toy.txt").write_text("\n".join(_corpus(200)) + "\n")
  config.data.source, config.data.files, config.data.cache_dir = "files", (str(tmp_path / "toy.txt"),), str(tmp_path / "c")
  config.data.tokenizer.kind, config.data.tokenizer.vocab_size = "sentencepiece", VOCAB
  config.model.vocab_size = VOCAB
  config.model.num_experts, config.diffusion.self_cond_prob = 0, 0.0  # any model will do: a quicker compile
  config.model.num_layers, config.model.layer_types = 2, ("global", "global")  # (one scanned layer)
  config.train.num_steps, config.opt.warmup_steps, config.train.async_checkpointing = 1, 0, False
  loop.train_and_evaluate(config, str(tmp_path / "wd"))
  assert (tmp_path / "wd" / "tokenizer.model").is_file()
  from dgemma import data
  monkeypatch.setattr(data, "prepare", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built the dataset")))
  counts = _count_request(monkeypatch)
  model = dgemma.load(str(tmp_path / "wd"))
  model.generate("the king", max_new_tokens=model.settings.sample.max_new_tokens)
  assert counts == {"settings": 1, "check_request": 1, "tokenizer": 1, "config.json": 1}, counts  # one request
  assert isinstance(model.tokenizer, tokenizers.SentencePieceTokenizer) and model.step == 1
  assert model.tokenizer.encode("the king") == tokenizers.SentencePieceTokenizer(
      tmp_path / "wd" / "tokenizer.model").encode("the king")


def test_an_autoregressive_model_generates_with_the_ar_decoder(loaded):
  from dgemma.sampling import ar_generate
  _, converted, path = loaded
  config = api.run_config(checkpoints.header(path))
  config.diffusion.objective = "ar"
  model = dgemma.load(str(path), config=config)
  out = model.generate("the king", max_new_tokens=6, temperature=0.0)
  ids = model.prompt_ids("the king")
  tokens, lengths = jax.device_get(ar_generate(Transformer(model.model_cfg), model.params, np.asarray([ids]),
                                               np.asarray([len(ids)]), jax.random.key(0), 6, 0.0,
                                               model.settings.end_ids, pad_id=model.tokenizer.pad_id))
  assert out.token_ids == tokens[0, :lengths[0]].tolist() and out.num_forwards == len(out.token_ids)


def test_bad_requests_fail_before_weights_are_read(loaded, monkeypatch):
  model = loaded[0]
  with pytest.raises(ConfigError, match=r"^steps \(sample.max_denoising_steps; sample.py --steps\): must be an "
                                        r"integer >= 1, got 0"):  # the argument's name first, then the CLI's
    model.generate("x", steps=0)
  with pytest.raises(ConfigError, match=r"sample\.lol"):
    model.generate("x", lol=1)
  with pytest.raises(ValueError, match=r"messages\[0\]"):
    model.chat([{"role": "user"}])
  monkeypatch.setattr(checkpoints, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read weights")))
  with pytest.raises(ConfigError, match="sample.t_max"):
    config = api.run_config(checkpoints.header(model.path))
    config.sample.t_max = -1.0
    dgemma.load(model.path, config=config)


@pytest.mark.slow  # a subprocess
def test_sample_py_on_a_converted_checkpoint_with_prompts_and_out(loaded, tmp_path):
  _, _, path = loaded
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": "the king"}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "speak"}]}) + "\n")
  out = tmp_path / "out.jsonl"
  r = subprocess.run([sys.executable, "sample.py", f"--checkpoint={path}", f"--prompts={prompts}", f"--out={out}",
                      "--steps=2", "--seed=3"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt"] for r in records] == ["the king", "speak"]
  assert all(set(r) == {"prompt", "text", "decoder_passes", "tokens_per_pass", "seconds_per_prompt"} for r in records)
  assert all(r["decoder_passes"] > 0 for r in records)
  bad = subprocess.run([sys.executable, "sample.py", f"--checkpoint={path}", "--temperature=-1"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0 and "sample.py: temperature (sample.t_max and t_min; sample.py --temperature): must be > 0" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_bad_inputs_are_one_error_naming_the_argument_before_any_work(loaded, monkeypatch):
  from dgemma.sampling import generation
  model = loaded[0]
  monkeypatch.setattr(generation, "_generate_jit", lambda *a, **k: pytest.fail("reached the sampler"))
  monkeypatch.setattr(api, "ar_generate", lambda *a, **k: pytest.fail("reached the sampler"))
  for prompts, pattern in (([None], r"prompts\[0\]: expected a string, got NoneType"),
                           (b"x", "prompts: expected a string or a list of strings, got bytes"),
                           (["a", b"x"], r"prompts\[1\]: expected a string, got bytes \(decode bytes first")):
    with pytest.raises(ValueError, match=pattern):
      model.generate(prompts)
  with pytest.raises(ValueError, match=r"messages\[1\]: role 'wizard' is not one of"):
    model.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}])
  with pytest.raises(ConfigError, match=r"sample.max_new_tokens=1000000000 .* does not fit sample.max_context=262144 "
                                        r"positions even after a one-token prompt; lower it to at most 262136"):
    model.generate("x", max_new_tokens=10**9)
  # a prompt whose prompt-encode buffers cannot fit: refused with the numbers, before anything is allocated
  free = 2**30
  monkeypatch.setattr(generation.mesh_lib, "free_memory_bytes", lambda: free)
  need = generation.request_bytes(model.model_cfg, model.call_settings().canvas_sampler, batch=1, prompt_len=20_001,
                                  max_new_tokens=16)
  assert sum(need.values()) > free
  with pytest.raises(ConfigError, match=r"prompt: 1 row\(s\) of a 20001-token prompt \+ 2 canvas\(es\) of 8 need about "
                                        r"\d+\.\d GiB \(kv cache .* GiB, prompt attention scores .* GiB\), more than the "
                                        r"1\.0 GiB of free memory.*or encode the prompt in chunks "
                                        r"\(sample.prompt_chunk=1024\)"):
    model.generate_ids([[2] * 20_001], ["long"], max_new_tokens=16)
  chunked = generation.request_bytes(model.model_cfg, dataclasses.replace(
      model.call_settings().canvas_sampler, prompt_chunk=1024), batch=1, prompt_len=20_001, max_new_tokens=16)
  assert chunked["kv_cache"] == need["kv_cache"]  # the scores of one 1,024-token chunk, not the prompt's
  assert chunked["prompt_attention_scores"] * 20_001 == need["prompt_attention_scores"] * 1024


def test_score_refuses_an_empty_document_before_scoring(loaded, monkeypatch):
  from dgemma.diffusion import likelihood
  model = loaded[0]
  monkeypatch.setattr(likelihood, "score_documents", lambda *a, **k: pytest.fail("scored"))
  for texts in ([""], ["some text", "  \n"]):
    with pytest.raises(ValueError, match=rf"texts\[{len(texts) - 1}\]: an empty document has no tokens to score"):
      model.score(texts)


@pytest.mark.slow  # a live generate program (its compile): over the fast tier's budget
def test_on_step_views_carry_texts_and_only_the_requests_rows(loaded):
  model = loaded[0]
  steps = []
  outs = _streamed(model, on_step=steps.append)
  assert steps and all(len(v.texts) == 3 and v.result_BC.shape[0] == 3 for v in steps)  # not the padded 4
  last = steps[-1]
  assert last.texts == tuple(model.tokenizer.decode([int(t) for t in row]) for row in last.result_BC)
  assert len(outs) == 3


@pytest.mark.slow  # a generate compile on another model: over the fast tier's budget
def test_chat_on_a_tokenizer_without_turn_markers_warns_once(tiny_config, tmp_path, caplog):
  save_random_run(tiny_config, tmp_path / "run")  # any run of the byte tokenizer: no <|turn> / <turn|>
  model = dgemma.load(str(tmp_path / "run"))
  conversation = [{"role": "user", "content": "hi"}]
  for _ in range(2):
    model.chat(conversation, max_new_tokens=8, steps=2)
  warned = [r for r in caplog.records if "has no Gemma 4 turn markers" in r.getMessage()]
  assert len(warned) == 1 and warned[0].levelname == "WARNING"


def test_sample_command_checks_its_outputs_before_reading_weights(loaded, tmp_path, monkeypatch):
  _, _, path = loaded
  monkeypatch.setattr(checkpoints, "load", lambda *a, **k: pytest.fail("read weights"))
  (tmp_path / "adir").mkdir()
  with pytest.raises(ConfigError, match=r"--out: .*adir is a directory; name a file"):
    api.sample_command(str(path), out=str(tmp_path / "adir"))
  (tmp_path / "ro").mkdir()
  (tmp_path / "ro").chmod(0o500)
  try:
    if not os.access(tmp_path / "ro", os.W_OK):  # (root may write anywhere)
      with pytest.raises(ConfigError, match=r"--text_out: cannot write .*ro/x.txt: no write permission in"):
        api.sample_command(str(path), text_out=str(tmp_path / "ro" / "x.txt"))
  finally:
    (tmp_path / "ro").chmod(0o700)
  (tmp_path / "afile").write_text("")
  with pytest.raises(ConfigError, match=r"--out: cannot create .*afile/out.jsonl: .*afile is a file"):
    api.sample_command(str(path), out=str(tmp_path / "afile" / "out.jsonl"))


def test_sample_command_prints_a_chat_reply_on_its_own_line_and_writes_what_is_asked(loaded, tmp_path):
  _, _, path = loaded
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Speak, ghost."}]}) + "\n")
  printed = []
  results = api.sample_command(str(path), prompts_file=str(prompts), steps=2, temperature=0.7,  # the next test's
                               text_out=str(tmp_path / "s.txt"), out=str(tmp_path / "o.jsonl"),  # request
                               print_fn=printed.append)
  header, prompt, reply = printed[0].split("\n", 2)
  assert header.startswith("--- sample 0 (") and prompt == "Speak, ghost." and reply == results[0].text  # not glued
  assert (tmp_path / "s.txt").read_text() == printed[0] + "\n"
  record = json.loads((tmp_path / "o.jsonl").read_text())
  assert record["seconds_per_prompt"] > 0 and "seconds" not in record


def _count_request(monkeypatch) -> collections.Counter:
  """Counts what a request does: Settings built (each runs its checks), generation requests checked, tokenizer files
  read, and each JSON file opened (by name)."""
  import builtins
  import io
  from dgemma.sampling import generation
  counts = collections.Counter()

  def counting(name, fn):
    def wrapped(*args, **kwargs):
      counts[name] += 1
      return fn(*args, **kwargs)
    return wrapped

  real_open = io.open

  def counting_open(file, *args, **kwargs):
    if str(file).endswith(".json"):
      counts[Path(file).name] += 1
    return real_open(file, *args, **kwargs)

  monkeypatch.setattr(settings_lib.Settings, "__post_init__", counting("settings", settings_lib.Settings.__post_init__))
  monkeypatch.setattr(api, "check_request", counting("check_request", api.check_request))
  monkeypatch.setattr(generation, "check_request", counting("check_request", generation.check_request))
  monkeypatch.setattr(tokenizers.SentencePieceTokenizer, "__init__",
                      counting("tokenizer", tokenizers.SentencePieceTokenizer.__init__))
  monkeypatch.setattr(io, "open", counting_open)
  monkeypatch.setattr(builtins, "open", counting_open)
  tokenizers._read_tokenizer_file.cache_clear()  # pylint: disable=protected-access  (a fresh process reads it once)
  return counts


def test_a_sample_request_checks_reads_and_builds_once(loaded, monkeypatch):
  """One request (sample.py's; dgemma.load + generate) builds its Settings once, checks the request once, and reads
  each of the checkpoint's JSON files and its tokenizer once."""
  _, _, path = loaded  # a params checkpoint with its tokenizer and the HF config it was converted from
  counts = _count_request(monkeypatch)
  api.sample_command(str(path), steps=2, seed=1, temperature=0.7, print_fn=lambda *_: None)
  assert counts == {"settings": 1, "check_request": 1, "tokenizer": 1, "model_config.json": 1,
                    "hf_config.json": 1}, counts
  counts = _count_request(monkeypatch)
  model = dgemma.load(str(path))
  model.generate("the king", max_new_tokens=model.settings.sample.max_new_tokens, seed=0)
  assert counts == {"settings": 1, "check_request": 1, "tokenizer": 1, "model_config.json": 1,
                    "hf_config.json": 1}, counts


def test_a_prompts_file_that_is_not_utf8_names_the_flag_file_and_line(tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_bytes("the king\n".encode() + "caf\u00e9\n".encode("latin-1"))
  with pytest.raises(DataError, match=rf"^--prompts: {prompts} line 2: not valid UTF-8 \(byte 0xe9 .*\); save the "
                     "prompts as UTF-8$"):
    api.read_prompts(str(prompts))
