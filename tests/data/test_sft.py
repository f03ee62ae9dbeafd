"""SFT data (data.format='sft'): row layout, chat rendering, the jsonl pipeline, and that noisy canvas
tokens never reach the clean context."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

from configs import tiny_test
from dgemma import data
from dgemma.diffusion.config import DiffusionSettings
from dgemma import settings as settings_lib
from dgemma import diffusion, tokenizers
from dgemma.data import sft
from dgemma.settings import from_config as S
from dgemma.errors import ConfigError, DataError
from tests.model_utils import random_params
from tests.diffusion.test_block_causal import CFG, jitted_loss

E = 1  # end token (EOS)


# ---- rows --------------------------------------------------------------------------------------

def test_make_row_layout_positions_and_overflow():
  prompt = [2, 10, 11, 12, 13]
  response = list(range(20, 39))  # 19 tokens + end -> 3 canvases of 8, the last filled with end tokens
  C, L = 8, 24
  assert sft.num_canvases(19, C) == 3 and sft.num_canvases(15, C) == 2 and sft.num_canvases(16, C) == 3
  filled = response + [E] * 5
  rows = [sft.make_row(prompt, response, E, k, seq_len=L, canvas_len=C, pad_id=0) for k in range(3)]
  for k, row in enumerate(rows):
    # The canvas is response canvas k, at the positions the sampler denoises it at (prompt length + k*C).
    np.testing.assert_array_equal(row["tokens"][-C:], filled[k * C:(k + 1) * C])
    np.testing.assert_array_equal(row["positions"][-C:], len(prompt) + k * C + np.arange(C))
    np.testing.assert_array_equal(row["loss_mask"][-C:], 1)
  # k = 0: [11 pad | prompt | canvas 0]; only the canvas is a target.
  np.testing.assert_array_equal(rows[0]["tokens"], [0] * 11 + prompt + filled[:8])
  np.testing.assert_array_equal(rows[0]["segment_ids"], [0] * 11 + [1] * 13)
  np.testing.assert_array_equal(rows[0]["positions"], [0] * 11 + list(range(13)))
  np.testing.assert_array_equal(rows[0]["loss_mask"], [0] * 16 + [1] * 8)
  # k = 1: the clean canvas 0 is context (targets of the encoder's next-token loss), the prompt is not.
  np.testing.assert_array_equal(rows[1]["tokens"], [0] * 3 + prompt + filled[:16])
  np.testing.assert_array_equal(rows[1]["positions"], [0] * 3 + list(range(21)))
  np.testing.assert_array_equal(rows[1]["loss_mask"], [0] * 8 + [1] * 16)
  # k = 2: prompt + 2 canvases = 21 > 16 context slots: the oldest 5 are dropped, positions kept.
  np.testing.assert_array_equal(rows[2]["tokens"], filled)
  np.testing.assert_array_equal(rows[2]["positions"], np.arange(5, 29))
  np.testing.assert_array_equal(rows[2]["loss_mask"], 1)
  assert rows[2]["tokens"][-3:].tolist() == [E] * 3  # end-token fill, scored
  with pytest.raises(ValueError, match="data.sft_overflow='error'"):
    sft.make_row(prompt, response, E, 2, seq_len=L, canvas_len=C, pad_id=0, overflow="error")
  # The canvas choice is a pure function of (seed, shard, index).
  picks = [sft.choose_canvas(0, 0, i, 3) for i in range(60)]
  assert picks == [sft.choose_canvas(0, 0, i, 3) for i in range(60)] and set(picks) == {0, 1, 2}
  assert picks != [sft.choose_canvas(1, 0, i, 3) for i in range(60)]


def _gemma_like_tokenizer(tmp_path):
  """A SentencePiece model with Gemma's chat pieces <|turn> / <turn|> (as control symbols)."""
  lines = [f"user {i} says hello to the model and the model answers {i * 7}" for i in range(200)]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "g"), vocab_size=120,
                                 pad_id=0, eos_id=1, bos_id=2, unk_id=3, control_symbols=["<|turn>", "<turn|>"],
                                 hard_vocab_limit=False, minloglevel=2)
  return tokenizers.SentencePieceTokenizer(tmp_path / "g.model")


def test_chat_rendering_gemma_special_ids_and_plain_text(tmp_path):
  record = json.dumps({"turns": [["system", "be brief"], ["user", "hello"]], "response": "hi 7"})
  byte = tokenizers.ByteTokenizer()
  prompt, response = sft.render(byte, record)
  assert prompt[0] == byte.bos_id and sft.end_id(byte) == byte.eos_id and tokenizers.chat_turn_ids(byte) is None
  assert byte.decode(prompt) == "<|turn>system\nbe brief<turn|>\n<|turn>user\nhello<turn|>\n<|turn>model\n"
  assert byte.decode(response) == "hi 7"
  assert sft.prompt_ids(byte, "hello") == [2] + byte.encode("<|turn>user\nhello<turn|>\n<|turn>model\n")

  gemma = _gemma_like_tokenizer(tmp_path)
  start, end = tokenizers.chat_turn_ids(gemma)
  assert (gemma.piece_id("<|turn>"), gemma.piece_id("<turn|>")) == (start, end) and gemma.piece_id("nope") is None
  prompt, response = sft.render(gemma, record)
  enc = gemma.encode
  assert prompt == ([2, start] + enc("system\nbe brief") + [end] + enc("\n") + [start] + enc("user\nhello") + [end]
                    + enc("\n") + [start] + enc("model\n"))
  assert response == enc("hi 7") and sft.end_id(gemma) == end


def test_chat_text_encodes_to_the_rendered_ids(tmp_path):
  """A chat prompt as text (render_text: lm-eval's chat template) encodes, BOS added, to the ids render_turns
  gives the same turns: the markers as their pieces (Gemma-like tokenizer) or as plain text (bytes)."""
  turns = [["system", "be brief"], ["user", "hello"], ["model", "hi 7"], ["user", "and you"]]
  for tok in (tokenizers.ByteTokenizer(), _gemma_like_tokenizer(tmp_path)):
    text = sft.render_text(turns)
    assert [tok.bos_id] + sft.encode_turn_text(tok, text) == sft.render_turns(tok, turns)
    assert sft.render_text(turns, add_generation_prompt=False) + "<|turn>model\n" == text
  gemma = _gemma_like_tokenizer(tmp_path)
  assert sft.encode_turn_text(gemma, "no markers here") == gemma.encode("no markers here")


def test_jsonl_records_and_errors(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"q": "2+2?", "a": "4"}) + "\n\n" + json.dumps({"chat": [
      {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
  records = [json.loads(r) for r in sft.iter_jsonl_examples(path, "q", "a", "chat")]
  assert records == [{"turns": [["user", "2+2?"]], "response": "4"},
                     {"turns": [["user", "hi"]], "response": "hello"}]
  # sample.py renders a prompt (dgemma/sample_lib.py) exactly as training renders a prompt/response pair.
  byte = tokenizers.ByteTokenizer()
  assert sft.render(byte, json.dumps(records[0]))[0] == sft.prompt_ids(byte, "2+2?")
  with pytest.raises(ValueError, match=r"line 1: needs fields 'prompt' and 'response' \(data.prompt_field"):
    list(sft.iter_jsonl_examples(path, "prompt", "response", "messages"))
  path.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}) + "\n")
  with pytest.raises(ValueError, match="last turn .* must have role 'model'"):
    list(sft.iter_jsonl_examples(path, "q", "a", "chat"))
  path.write_text(json.dumps({"chat": [{"role": "wizard", "content": "hi"}, {"role": "model", "content": "x"}]}) + "\n")
  with pytest.raises(DataError, match=r"line 1: field 'chat' \(data.messages_field\): turn 0: role 'wizard' is not one of \('system', 'user', 'model', "):
    list(sft.iter_jsonl_examples(path, "q", "a", "chat"))
  path.write_text(json.dumps({"q": "2+2?", "a": 4}) + "\n")
  with pytest.raises(ValueError, match=r"'a' \(data.response_field\) is int"):
    list(sft.iter_jsonl_examples(path, "q", "a", "chat"))
  config = tiny_test.get_config()
  config.data.format = "sft"
  with pytest.raises(ConfigError, match="data.format.*data.source='files'"):
    settings_lib.from_config(config)
  config.data.source = "files"
  config.diffusion.canvases_per_row = 2
  with pytest.raises(ConfigError, match="diffusion.canvases_per_row.*one response canvas"):
    settings_lib.from_config(config)
  config.data.format, config.diffusion.canvases_per_row = "text", 5
  with pytest.raises(ConfigError, match="diffusion.canvases_per_row.*do not fit"):
    settings_lib.from_config(config)
  config.diffusion.canvases_per_row, config.data.sft_overflow = 1, "cut"
  with pytest.raises(ConfigError, match="data.sft_overflow"):
    settings_lib.from_config(config)


# ---- the pipeline ------------------------------------------------------------------------------

def write_sft_file(path, num=24, seed=0):
  """prompt/response pairs with responses of 1 to 3 canvases of 16 bytes, and one chat."""
  g = np.random.default_rng(seed)
  lines = []
  for i in range(num):
    words = " ".join(str(x) for x in g.integers(0, 99, int(g.integers(1, 14))))
    lines.append(json.dumps({"prompt": f"sum of {i}?", "response": words}))
  lines.append(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "model", "content": "hello"}]}))
  path.write_text("\n".join(lines) + "\n")
  return path


def _sft_config(tmp_path, path):
  config = tiny_test.get_config()
  config.data.update(dict(source="files", files=(str(path),), format="sft", cache_dir=str(tmp_path / "cache"),
                          validation_fraction=0.0, seq_len=96, batch_size=4))
  config.diffusion.canvas_len = 16
  return config


def test_pipeline_rows_are_make_row_of_a_record_and_resume_exactly(tmp_path):
  path = write_sft_file(tmp_path / "sft.jsonl")
  config = _sft_config(tmp_path, path)
  prepared = data.prepare(S(config))
  tok = prepared.tokenizer
  by_prompt = {}
  for record in prepared.texts("train"):
    prompt, response = sft.render(tok, record)
    by_prompt[tuple(prompt)] = response
  assert len(by_prompt) == 25
  it = data.make_iterator(S(config), prepared, "train")
  batches = [next(it) for _ in range(2)]
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(12)]
  picked = []
  for batch in batches + expected:
    assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
    for r in range(4):
      row = {k: v[r] for k, v in batch.items()}
      prompt = tuple(row["tokens"][(row["segment_ids"] != 0) & (row["loss_mask"] == 0)])
      response = by_prompt[prompt]
      k = (int(row["positions"][-16]) - len(prompt)) // 16
      want = sft.make_row(list(prompt), response, tok.eos_id, k, seq_len=96, canvas_len=16, pad_id=0)
      for key in want:
        np.testing.assert_array_equal(row[key], want[key], err_msg=key)
      picked.append((k, sft.num_canvases(len(response), 16)))
  assert any(k > 0 for k, _ in picked) and any(k == 0 and n > 1 for k, n in picked)
  resumed = data.make_iterator(S(config), prepared, "train")
  next(resumed)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  # sft_overflow='error' checks the whole split up front, naming the setting (a ~44-byte prompt and up
  # to 2 earlier canvases of 16 do not fit in 48 - 16 context slots).
  config.data.sft_overflow, config.data.seq_len = "error", 48
  with pytest.raises(ValueError, match="data.sft_overflow='error': example"):
    data.make_iterator(S(config), prepared, "train")


# ---- no leak: the context never sees noisy canvas tokens ---------------------------------------

def test_sft_rows_noise_reaches_only_the_canvas():
  """6 SFT rows (seq 40, canvas 8; one truncated) through diffusion_loss (the program
  test_block_causal compiles): every context quantity is bit-identical whatever the canvas noise;
  the canvas loss depends on the clean earlier canvas; padding slots are never read."""
  g = np.random.default_rng(5)
  V = CFG.vocab_size
  examples = [(5, 3, 0), (7, 20, 1), (3, 20, 2), (9, 12, 1), (20, 30, 3), (4, 7, 0)]  # prompt len, resp len, k
  rows = []
  for plen, rlen, k in examples:
    prompt, response = [2] + list(g.integers(5, V, plen - 1)), list(g.integers(5, V, rlen))
    rows.append(sft.make_row(prompt, response, E, k, seq_len=40, canvas_len=8, pad_id=0))
  batch = {key: jnp.asarray(np.stack([r[key] for r in rows])) for key in rows[0]}
  loss_cfg = DiffusionSettings(canvas_len=8)
  totals = diffusion.batch_totals(batch, loss_cfg)
  # Scored: every canvas token; encoder targets: response tokens of the context only (row 4 truncated:
  # 20 + 24 > 32 slots, so its context is 32 response-or-prompt tokens).
  assert float(totals["canvas_tokens"]) == 6 * 8
  enc_targets = sum(int(np.sum(r["loss_mask"][1:32] & r["segment_ids"][:31].astype(bool))) for r in rows)
  assert float(totals["encoder_tokens"]) == enc_targets == 0 + 8 + 16 + 8 + (24 - 0) + 0
  params = random_params(CFG)
  fn = jitted_loss(1)
  ids = jnp.arange(6, dtype=jnp.int32)
  run = lambda b, seed: jax.device_get(fn(params, b, jax.random.PRNGKey(seed), ids, diffusion.batch_totals(b, loss_cfg))[1])
  m1, m2 = run(batch, 1), run(batch, 2)
  assert m1["encoder_loss"] == m2["encoder_loss"]  # bit-identical: the context never sees the noise
  assert m1["canvas_loss"] != m2["canvas_loss"]
  # A clean earlier canvas token (row 1, k = 1) changes the canvas loss.
  changed = dict(batch, tokens=batch["tokens"].at[1, 30].set((batch["tokens"][1, 30] + 1) % V))
  assert run(changed, 1)["canvas_loss"] != m1["canvas_loss"]
  # Left padding (row 0 has 28 pad slots) is never attended.
  padded = dict(batch, tokens=batch["tokens"].at[0, :20].set(17))
  m3 = run(padded, 1)
  assert m3["canvas_loss"] == m1["canvas_loss"] and m3["encoder_loss"] == m1["encoder_loss"]
