"""Tokenizers: one small interface, a lossless byte tokenizer and SentencePiece.

Special ids follow Gemma: PAD 0, EOS 1, BOS 2, UNK 3.

  tok = build_tokenizer(config.data, train_texts=..., cache_key=...)
  ids = tok.encode("To be, or not to be")
  text = tok.decode(ids)
"""

from __future__ import annotations

import abc
import functools
import io
import logging
import os
from pathlib import Path
import tempfile
from typing import Callable, Iterable, Iterator, Sequence

import sentencepiece as spm
import tokenizers as hf_tokenizers  # Hugging Face's `tokenizers` package (this module is dgemma.tokenizers)

from dgemma.errors import ConfigError

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
NUM_SPECIAL = 4
TOKENIZER_KINDS = ("sentencepiece", "byte", "file")
TURN_START, TURN_END = "<|turn>", "<turn|>"  # Gemma's chat turn markers

# A byte-fallback SentencePiece model always holds the 4 specials, the newline piece and 256 byte
# pieces; the corpus's characters and merges come on top.
_SP_FIXED_PIECES = NUM_SPECIAL + 1 + 256
MIN_SENTENCEPIECE_VOCAB = _SP_FIXED_PIECES + 39
# Training reads at most this much text (the first lines, in order): keeps training to seconds.
_SP_MAX_TRAIN_BYTES = 32 * 1024 * 1024
_SP_MAX_TRAIN_LINE_BYTES = 4096


class Tokenizer(abc.ABC):
  """Text <-> token ids; ids below `vocab_size`, specials as in Gemma."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids this tokenizer can emit."""

  # the special ids (Gemma's); a tokenizer read from a file has its own
  pad_id, eos_id, bos_id, unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without BOS/EOS."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; special ids (PAD/BOS/EOS/...) and ids >= vocab_size are dropped."""

  def piece_id(self, piece: str) -> int | None:
    """The id of a whole vocabulary piece (e.g. Gemma's `<|turn>`), or None if there is none."""
    return None


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes: byte b -> id b + 4. Lossless, so bits-per-byte is exact."""

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + 256

  def encode(self, text: str) -> list[int]:
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(int(i) - NUM_SPECIAL for i in ids if NUM_SPECIAL <= int(i) < NUM_SPECIAL + 256)
    return data.decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class _ModelFileTokenizer(Tokenizer):
  """A tokenizer read from a model file: its special ids and vocabulary size are set by the subclass's
  __init__ (`_pad`, `_eos`, `_bos`, `_unk`, `_vocab_size`), and decoding drops `_dropped_ids` (control
  and special pieces) and ids outside the vocabulary."""

  vocab_size = property(lambda self: self._vocab_size)
  pad_id = property(lambda self: self._pad)
  eos_id = property(lambda self: self._eos)
  bos_id = property(lambda self: self._bos)
  unk_id = property(lambda self: self._unk)

  def _decodable(self, ids: Sequence[int]) -> list[int]:
    return [int(i) for i in ids if 0 <= int(i) < self._vocab_size and int(i) not in self._dropped_ids]


class SentencePieceTokenizer(_ModelFileTokenizer):
  """A SentencePiece model file (trained here or Gemma's `tokenizer.model`)."""

  def __init__(self, model_path: str | os.PathLike[str]):
    self.model_path = Path(model_path)
    if not self.model_path.is_file():
      raise FileNotFoundError(f"SentencePiece model {self.model_path} does not exist")
    self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
    ids = dict(pad=self._sp.pad_id(), eos=self._sp.eos_id(), bos=self._sp.bos_id(),
               unk=self._sp.unk_id())
    missing = [name for name, i in ids.items() if i < 0]
    if missing:
      raise ValueError(f"SentencePiece model {self.model_path} defines no id for {missing}; "
                       "dgemma needs pad, eos, bos and unk ids")
    self._pad, self._eos, self._bos, self._unk = ids["pad"], ids["eos"], ids["bos"], ids["unk"]
    self._vocab_size = self._sp.vocab_size()
    self._dropped_ids = frozenset(
        i for i in range(self._vocab_size) if self._sp.is_control(i)) | {self._pad, self._eos,
                                                                          self._bos}

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def piece_id(self, piece: str) -> int | None:
    i = self._sp.piece_to_id(piece)
    return i if 0 <= i < self._vocab_size and self._sp.id_to_piece(i) == piece else None

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode(self._decodable(ids))

  def __repr__(self) -> str:
    return f"SentencePieceTokenizer({str(self.model_path)!r}, vocab_size={self._vocab_size})"


class JsonTokenizer(_ModelFileTokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library), as HF checkpoints without a
  SentencePiece `tokenizer.model` ship it. Special ids are those of the pieces <pad>, <eos>, <bos>, <unk>
  (Gemma's names); a file without them is an error naming it."""

  SPECIAL_PIECES = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"}

  def __init__(self, path: str | os.PathLike[str]):
    self.model_path = Path(path)
    try:
      self._tok = hf_tokenizers.Tokenizer.from_file(str(self.model_path))
    except Exception as e:  # the library's errors name no file
      raise ValueError(f"{self.model_path}: not a readable tokenizer.json ({e})") from e
    ids = {name: self._tok.token_to_id(piece) for name, piece in self.SPECIAL_PIECES.items()}
    missing = [self.SPECIAL_PIECES[name] for name, i in ids.items() if i is None]
    if missing:
      raise ValueError(f"{self.model_path}: has no token(s) {missing}; dgemma needs pad, eos, bos and unk ids")
    self._pad, self._eos, self._bos, self._unk = ids["pad"], ids["eos"], ids["bos"], ids["unk"]
    self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    self._dropped_ids = frozenset(self._tok.token_to_id(t) for t in special) | {self._pad, self._eos, self._bos}

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(self._decodable(ids), skip_special_tokens=False)

  def piece_id(self, piece: str) -> int | None:
    return self._tok.token_to_id(piece)

  def __repr__(self) -> str:
    return f"JsonTokenizer({str(self.model_path)!r}, vocab_size={self._vocab_size})"


def chat_turn_ids(tokenizer: Tokenizer) -> tuple[int, int] | None:
  """(`<|turn>`, `<turn|>`) ids when the tokenizer has those pieces (Gemma), else None."""
  ids = [tokenizer.piece_id(p) for p in (TURN_START, TURN_END)]
  return None if None in ids else (ids[0], ids[1])


def end_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
  """The ids that end a response: EOS, and `<turn|>` when the tokenizer has Gemma's chat pieces (the
  token supervised fine-tuning ends a response with)."""
  turns = chat_turn_ids(tokenizer)
  return (tokenizer.eos_id,) if turns is None else tuple(dict.fromkeys((tokenizer.eos_id, turns[1])))


def load_tokenizer_file(path: str | os.PathLike[str]) -> Tokenizer:
  """Loads an existing tokenizer file: a SentencePiece model (e.g. Gemma's tokenizer.model) or, for a
  `.json` file, a Hugging Face tokenizer.json. Read once per process while the file is unchanged (the settings'
  end ids and a loaded model share one read)."""
  if not str(path):
    raise FileNotFoundError("data.tokenizer.path is empty; set it to a SentencePiece .model or a tokenizer.json file")
  if not Path(path).is_file():
    raise FileNotFoundError(f"data.tokenizer.path: {path} does not exist")
  stat = os.stat(path)
  return _read_tokenizer_file(str(Path(path).absolute()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_tokenizer_file(path: str, mtime_ns: int, size: int) -> Tokenizer:
  del mtime_ns, size  # the cache key: a rewritten file is read again
  return JsonTokenizer(path) if path.endswith(".json") else SentencePieceTokenizer(path)


def _training_lines(texts: Iterable[str]) -> Iterator[str]:
  """Non-empty lines of `texts`, cut to SentencePiece's line limit, up to the byte budget."""
  budget = _SP_MAX_TRAIN_BYTES
  for text in texts:
    for line in text.split("\n"):
      if not line.strip():
        continue
      line = line.encode("utf-8")[:_SP_MAX_TRAIN_LINE_BYTES].decode("utf-8", errors="ignore")
      yield line
      budget -= len(line) + 1
      if budget <= 0:
        return


def check_sentencepiece_vocab_size(vocab_size: int) -> None:
  """Raises ConfigError when vocab_size cannot hold a byte-fallback model."""
  if vocab_size < 2 * NUM_SPECIAL:
    raise ConfigError(f"data.tokenizer.vocab_size={vocab_size} is too small for the "
                      f"{NUM_SPECIAL} special tokens")
  if vocab_size < MIN_SENTENCEPIECE_VOCAB:
    raise ConfigError(
        f"data.tokenizer.vocab_size={vocab_size} is too small for a byte-fallback SentencePiece "
        f"model ({NUM_SPECIAL} special + 1 newline + 256 byte pieces + the corpus's characters); "
        f"use at least {MIN_SENTENCEPIECE_VOCAB}, or data.tokenizer.kind='byte'")


def train_sentencepiece(text_iterator: Iterable[str], vocab_size: int,
                        model_prefix: str | os.PathLike[str],
                        model_type: str = "bpe") -> Path:
  """Trains a byte-fallback SentencePiece model; writes and returns `<model_prefix>.model`.

  Deterministic: reads the first lines of `text_iterator` in order (at most ~32 MB, no sampling
  or shuffling). Lossless on text: identity normalisation, whitespace kept, '\\n' is a piece.
  `vocab_size` is an upper bound (a tiny corpus may yield fewer pieces).
  """
  check_sentencepiece_vocab_size(vocab_size)
  if model_type not in ("bpe", "unigram"):
    raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
  lines = list(_training_lines(text_iterator))
  if not lines:
    raise ValueError("train_sentencepiece: no text to train on (the train split is empty)")
  model_bytes = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model_bytes,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        byte_fallback=True,
        user_defined_symbols=["\n"],
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        character_coverage=0.9995,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=_SP_MAX_TRAIN_LINE_BYTES * 4,
        hard_vocab_limit=False,
        num_threads=min(8, os.cpu_count() or 1),
        minloglevel=2,
    )
  except RuntimeError as e:
    raise ValueError(f"SentencePiece training failed (data.tokenizer.vocab_size={vocab_size}): "
                     f"{e}") from e
  model_path = Path(f"{model_prefix}.model")
  model_path.parent.mkdir(parents=True, exist_ok=True)
  # Write atomically: a concurrent reader sees either no model or the whole one.
  fd, tmp_name = tempfile.mkstemp(dir=model_path.parent, prefix=model_path.name, suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(model_bytes.getvalue())
  os.replace(tmp_name, model_path)
  return model_path


def build_tokenizer(data_config, *, train_texts: Callable[[], Iterable[str]] | None = None,
                    cache_key: str = "") -> Tokenizer:
  """The tokenizer `data_config.tokenizer` asks for.

  kind 'byte': ByteTokenizer (vocab_size is ignored; always 260).
  kind 'file': the SentencePiece model at data.tokenizer.path.
  kind 'sentencepiece': trained on `train_texts()` (the train split's documents) the first time,
    cached as `<data.cache_dir>/tokenizers/<cache_key>_bpe<vocab_size>.model` and reused after.
  """
  tok_config = data_config.tokenizer
  kind = tok_config.kind
  if kind == "byte":
    return ByteTokenizer()
  if kind == "file":
    return load_tokenizer_file(tok_config.path)
  if kind != "sentencepiece":
    raise ConfigError(f"data.tokenizer.kind: {kind!r} not in {TOKENIZER_KINDS}")
  vocab_size = int(tok_config.vocab_size)
  check_sentencepiece_vocab_size(vocab_size)
  if not cache_key:
    raise ValueError("build_tokenizer: kind 'sentencepiece' needs a cache_key naming the dataset")
  model_prefix = Path(data_config.cache_dir) / "tokenizers" / f"{cache_key}_bpe{vocab_size}"
  model_path = Path(f"{model_prefix}.model")
  if not model_path.is_file():
    if train_texts is None:
      raise ValueError(f"build_tokenizer: {model_path} is not cached and no train_texts were given")
    logging.info("Training a %d-piece SentencePiece model -> %s", vocab_size, model_path)
    train_sentencepiece(train_texts(), vocab_size, model_prefix)
  tokenizer = SentencePieceTokenizer(model_path)
  if tokenizer.vocab_size < vocab_size:
    logging.warning("SentencePiece model %s has %d pieces (< data.tokenizer.vocab_size=%d): "
                    "the corpus is too small for more", model_path, tokenizer.vocab_size,
                    vocab_size)
  return tokenizer
