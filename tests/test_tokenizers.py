"""Tokenizers: byte and SentencePiece round trips, special ids, config errors."""

import ml_collections
import pytest

from dgemma import tokenizers
from dgemma.errors import ConfigError

UNICODE_TEXT = "Thou art  more lovely, and more temperate:\n\tnaïve café — 你好, мир 🙂\n"


def _corpus_lines():
  words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler",
           "in", "mind", "suffer", "slings", "arrows", "outrageous", "fortune", "King", "Queen"]
  return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 9)) + f" {i}."
          for i in range(400)]


def _data_config(tmp_path, **tokenizer):
  data = ml_collections.ConfigDict()
  data.cache_dir = str(tmp_path / "cache")
  data.tokenizer = ml_collections.ConfigDict(dict(kind="sentencepiece", vocab_size=400, path=""))
  data.tokenizer.update(tokenizer)
  return data


def test_byte_round_trip_and_special_ids():
  tok = tokenizers.ByteTokenizer()
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id, tok.vocab_size) == (0, 1, 2, 3, 260)
  ids = tok.encode(UNICODE_TEXT)
  assert len(ids) == len(UNICODE_TEXT.encode("utf-8"))
  assert min(ids) >= 4 and max(ids) < 260
  assert tok.decode(ids) == UNICODE_TEXT
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == UNICODE_TEXT
  assert tok.encode("") == [] and tok.decode([]) == ""
  assert tok.decode([4 + 0xFF]) == "\ufffd"  # An invalid byte decodes with errors='replace'.


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
  prefix = tmp_path_factory.mktemp("sp") / "tiny"
  return tokenizers.train_sentencepiece(iter(["\n".join(_corpus_lines())]), 400, prefix)


def test_sentencepiece_round_trip_and_special_ids(sp_model):
  tok = tokenizers.SentencePieceTokenizer(sp_model)
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
  assert 300 <= tok.vocab_size <= 400
  for text in ["\n".join(_corpus_lines()[:5]), UNICODE_TEXT, "  leading and  double spaces ",
               "x"]:
    ids = tok.encode(text)
    assert all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
  # Merges were learnt: corpus text takes fewer pieces than bytes.
  line = _corpus_lines()[10]
  assert len(tok.encode(line)) < len(line.encode("utf-8")) / 2
  assert tok.decode([tok.vocab_size + 5] + tok.encode("ok")) == "ok"


def test_sentencepiece_training_is_deterministic(sp_model, tmp_path):
  again = tokenizers.train_sentencepiece(iter(["\n".join(_corpus_lines())]), 400, tmp_path / "b")
  assert again.read_bytes() == sp_model.read_bytes()


def test_build_tokenizer_trains_once_then_reuses_cache(tmp_path):
  data = _data_config(tmp_path)
  calls = []

  def train_texts():
    calls.append(1)
    return iter(_corpus_lines())

  first = tokenizers.build_tokenizer(data, train_texts=train_texts, cache_key="corpus_a")
  assert len(calls) == 1
  assert first.model_path == tmp_path / "cache" / "tokenizers" / "corpus_a_bpe400.model"
  second = tokenizers.build_tokenizer(data, train_texts=train_texts, cache_key="corpus_a")
  assert len(calls) == 1
  assert second.encode(UNICODE_TEXT) == first.encode(UNICODE_TEXT)


def test_build_tokenizer_byte_and_file(tmp_path, sp_model):
  assert isinstance(tokenizers.build_tokenizer(_data_config(tmp_path, kind="byte")),
                    tokenizers.ByteTokenizer)
  tok = tokenizers.build_tokenizer(_data_config(tmp_path, kind="file", path=str(sp_model)))
  assert tok.decode(tok.encode(UNICODE_TEXT)) == UNICODE_TEXT


def test_vocab_too_small(tmp_path):
  with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size=3 is too small for the 4 "
                                        r"special tokens"):
    tokenizers.build_tokenizer(_data_config(tmp_path, vocab_size=3), cache_key="x")
  with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size=100 is too small"):
    tokenizers.build_tokenizer(_data_config(tmp_path, vocab_size=100), cache_key="x")


def test_unknown_kind_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match=r"data\.tokenizer\.kind"):
    tokenizers.build_tokenizer(_data_config(tmp_path, kind="wordpiece"))
  missing = tmp_path / "nope" / "tokenizer.model"
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path: .*nope/tokenizer\.model"):
    tokenizers.build_tokenizer(_data_config(tmp_path, kind="file", path=str(missing)))
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path"):
    tokenizers.load_tokenizer_file("")
