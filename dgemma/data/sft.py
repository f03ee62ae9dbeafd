"""Supervised fine-tuning data (`data.format = 'sft'`): .jsonl prompt/response pairs or chats -> rows.

Records (one JSON object per line of a .jsonl file in data.files):
  {data.prompt_field: str, data.response_field: str}              a single user turn and its answer, or
  {data.messages_field: [{"role": r, "content": str}, ...]}       a chat; the last turn (role 'model' or
                                                                  'assistant') is the response.
The builder stores each record normalised as JSON {"turns": [[role, content], ...], "response": str}.

Rendering (`render`), Gemma 4 chat format (../shared/reference/diffusiongemma.md, "Tokenizer"):
  prompt   = BOS, then per turn `<|turn>{role}\\n{content}<turn|>\\n`, then `<|turn>model\\n`
  response = the response's ids, then the end token.
With a tokenizer that has the `<|turn>` / `<turn|>` pieces (a Gemma tokenizer.model file) the markers
are those special ids and the end token is `<turn|>` (id 106 in Gemma 4, which the sampler stops at);
with any other tokenizer (byte, a SentencePiece model trained here) the same structure is written as
plain text and the end token is EOS. `prompt_ids` renders a sampling prompt the same way.

One row per example (no packing), [L] = [left padding | clean context | one canvas of C]:
  the response (with its end token) is cut into n = ceil((R + 1) / C) canvases, the last one filled up
  with end tokens (scored: the model must learn to stop); ONE canvas k is chosen per example, uniformly,
  from (seed, shard, example index in the stream), so a resumed iterator picks the same ones; the clean
  context is the prompt and the clean canvases 0..k-1. Positions count from the prompt's first token, so
  canvas k sits at positions len(prompt) + k*C + [0, C), where the sampler denoises it
  (dgemma/sampling/generation.py: a prompt at positions [0, len), canvas after the committed tokens).
  Left padding has segment 0 (never attended, never scored). The noisy canvas is the last C tokens,
  so the diffusion loss (dgemma/diffusion/loss.py) corrupts only it; the context reaches the model only
  through the clean causal encoder pass.
  `loss_mask` is 1 on response tokens: the canvas (fully scored, end-token fill included) and the clean
  earlier canvases (targets of the encoder's next-token loss); the prompt is never a target.
Context longer than L - C (prompt + earlier canvases): `data.sft_overflow = 'truncate_left'` keeps the
most recent L - C tokens (positions unchanged, so RoPE offsets stay those of sampling); 'error' raises
naming the example, checked for the whole split when the iterator is made.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from dgemma import tokenizers
from dgemma.data import jsonl
from dgemma.errors import DataError

TURN_START, TURN_END = tokenizers.TURN_START, tokenizers.TURN_END
MODEL_ROLE = "model"
ROLES = ("system", "user", MODEL_ROLE)  # Gemma 4's turn roles
ROLE_ALIASES = {"assistant": MODEL_ROLE}


def canonical_role(role: str, where: str) -> str:
  """A turn's role in Gemma 4's names ('assistant' -> 'model'); any other role is an error naming `where`."""
  role = ROLE_ALIASES.get(role, role)
  if role not in ROLES:
    raise DataError(f"{where}: role {role!r} is not one of {ROLES + tuple(ROLE_ALIASES)}")
  return role


def iter_jsonl_examples(path: str | Path, prompt_field: str, response_field: str, messages_field: str,
                        encoding_errors: str = "strict") -> Iterator[str]:
  """Normalised records (JSON text) of one .jsonl file; errors name the file, line and field."""
  path = Path(path)
  if path.suffix != ".jsonl":
    raise DataError(f"data.files: {path} is not a .jsonl file (data.format='sft' reads .jsonl records)")
  count = 0
  for where, record in jsonl.records(path, encoding_errors):
    if not isinstance(record, dict):
      raise DataError(f"{where}: expected a JSON object")
    if messages_field in record:
      turns = _chat_turns(record[messages_field], f"{where}: field {messages_field!r} (data.messages_field)")
      response = turns.pop()[1]
    elif prompt_field in record and response_field in record:
      for field, key in ((prompt_field, "data.prompt_field"), (response_field, "data.response_field")):
        if not isinstance(record[field], str):
          raise DataError(f"{where}: field {field!r} ({key}) is {type(record[field]).__name__}, not a string")
      turns, response = [["user", record[prompt_field]]], record[response_field]
    else:
      raise DataError(f"{where}: needs fields {prompt_field!r} and {response_field!r} (data.prompt_field, "
                       f"data.response_field) or {messages_field!r} (data.messages_field)")
    count += 1
    yield json.dumps({"turns": turns, "response": response}, ensure_ascii=False)
  if count == 0:
    raise DataError(f"data.files: {path} has no records")


def _chat_turns(messages, where: str) -> list[list[str]]:
  if not isinstance(messages, list) or len(messages) < 2:
    raise DataError(f"{where}: expected a list of at least 2 {{role, content}} turns")
  turns = []
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
      raise DataError(f"{where}: turn {i} is not {{'role': str, 'content': str}}")
    turns.append([canonical_role(m["role"], f"{where}: turn {i}"), m["content"]])
  if turns[-1][0] != MODEL_ROLE:
    raise DataError(f"{where}: the last turn (the response) must have role 'model' or 'assistant', "
                     f"got {messages[-1]['role']!r}")
  return turns


def record_text(record_json: str) -> str:
  """The plain text of a normalised record (turn contents and response), e.g. to train a tokenizer on."""
  record = json.loads(record_json)
  return "\n".join([content for _, content in record["turns"]] + [record["response"]])


def render_turns(tokenizer: tokenizers.Tokenizer, turns) -> list[int]:
  """BOS + every turn ([role, content] pairs) + the opening of the model's turn: Gemma 4's
  `<|turn>role\ncontent<turn|>\n` with the turn-marker pieces when the tokenizer has them, else the same
  text encoded as plain text."""
  special = tokenizers.chat_turn_ids(tokenizer)
  ids = [tokenizer.bos_id]
  for role, content in list(turns) + [[MODEL_ROLE, None]]:
    body = f"{role}\n" + ("" if content is None else content)
    if special is None:  # the same structure as plain text
      ids += tokenizer.encode(TURN_START + body + ("" if content is None else TURN_END + "\n"))
    else:
      ids += [special[0]] + tokenizer.encode(body)
      if content is not None:
        ids += [special[1]] + tokenizer.encode("\n")
  return ids


def render_text(turns, add_generation_prompt: bool = True) -> str:
  """The text of `render_turns` without BOS ([role, content] pairs, roles as Gemma 4 names them), with the
  model's turn opened when add_generation_prompt: a chat prompt as a string (lm-eval's chat templates)."""
  text = "".join(f"{TURN_START}{role}\n{content}{TURN_END}\n" for role, content in turns)
  return text + (f"{TURN_START}{MODEL_ROLE}\n" if add_generation_prompt else "")


def encode_turn_text(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
  """The ids of text that may hold turn markers (`render_text`'s output): each marker as its piece when the
  tokenizer has it, the text between encoded as plain text, so BOS + this equals `render_turns` of the same
  turns; without the pieces, the whole text encoded as plain text (what `render_turns` does then too)."""
  special = tokenizers.chat_turn_ids(tokenizer)
  if special is None or (TURN_START not in text and TURN_END not in text):
    return tokenizer.encode(text)
  ids = []
  for piece in re.split(f"({re.escape(TURN_START)}|{re.escape(TURN_END)})", text):
    if piece in (TURN_START, TURN_END):
      ids.append(special[piece == TURN_END])
    elif piece:
      ids += tokenizer.encode(piece)
  return ids


def end_id(tokenizer: tokenizers.Tokenizer) -> int:
  """The token that ends a response: `<turn|>` with a Gemma tokenizer, else EOS."""
  special = tokenizers.chat_turn_ids(tokenizer)
  return tokenizer.eos_id if special is None else special[1]


def render(tokenizer: tokenizers.Tokenizer, record_json: str) -> tuple[list[int], list[int]]:
  """(prompt ids, response ids without the end token) of a normalised record."""
  record = json.loads(record_json)
  return render_turns(tokenizer, record["turns"]), tokenizer.encode(record["response"])


def prompt_ids(tokenizer: tokenizers.Tokenizer, prompt: str) -> list[int]:
  """A sampling prompt rendered as in training: one user turn, then the model's turn opened."""
  return render_turns(tokenizer, [["user", prompt]])


def num_canvases(response_len: int, canvas_len: int) -> int:
  """Canvases of a response of `response_len` tokens plus at least one end token."""
  return math.ceil((response_len + 1) / canvas_len)


def make_row(prompt: list[int], response: list[int], end: int, canvas_index: int, *, seq_len: int,
             canvas_len: int, pad_id: int, overflow: str = "truncate_left") -> dict[str, np.ndarray]:
  """One training row (module docstring) for canvas `canvas_index` of the response."""
  C = canvas_len
  n = num_canvases(len(response), C)
  if not 0 <= canvas_index < n:
    raise ValueError(f"canvas_index {canvas_index} not in [0, {n})")
  filled = np.full(n * C, end, np.int32)
  filled[:len(response)] = response
  context = np.concatenate([np.asarray(prompt, np.int32), filled[:canvas_index * C]])
  context_is_response = np.arange(len(context)) >= len(prompt)
  slots = seq_len - C
  dropped = max(0, len(context) - slots)
  if dropped and overflow == "error":
    raise DataError(f"data.sft_overflow='error': the prompt ({len(prompt)} tokens) and {canvas_index} earlier "
                     f"canvas(es) need {len(context)} context slots > data.seq_len - diffusion.canvas_len = {slots}")
  context, context_is_response = context[dropped:], context_is_response[dropped:]
  pad = slots - len(context)
  tokens = np.concatenate([np.full(pad, pad_id, np.int32), context, filled[canvas_index * C:(canvas_index + 1) * C]])
  positions = np.concatenate([np.zeros(pad, np.int32), dropped + np.arange(len(context) + C, dtype=np.int32)])
  segment_ids = np.concatenate([np.zeros(pad, np.int32), np.ones(len(context) + C, np.int32)])
  loss_mask = np.concatenate([np.zeros(pad, np.int32), context_is_response.astype(np.int32), np.ones(C, np.int32)])
  return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}


def choose_canvas(seed: int, shard_index: int, index: int, num: int) -> int:
  """The canvas trained for the example at stream position `index` (deterministic)."""
  return int(np.random.default_rng([seed, shard_index, index]).integers(num))


class SftRows:
  """grain map_with_index transform: (stream index, {text_key: normalised record}) -> one row."""

  def __init__(self, tokenizer, text_key: str, *, seq_len: int, canvas_len: int, overflow: str, seed: int,
               shard_index: int):
    self._tokenizer, self._text_key = tokenizer, text_key
    self._kw = dict(seq_len=seq_len, canvas_len=canvas_len, pad_id=tokenizer.pad_id, overflow=overflow)
    self._end = end_id(tokenizer)
    self._seed, self._shard = seed, shard_index

  def __call__(self, index, element):
    text = element[self._text_key]
    prompt, response = render(self._tokenizer, text.decode("utf-8") if isinstance(text, bytes) else str(text))
    n = num_canvases(len(response), self._kw["canvas_len"])
    k = choose_canvas(self._seed, self._shard, index, n)
    return make_row(prompt, response, self._end, k, **self._kw)


def check_fits(tokenizer, records: Iterator[str], *, seq_len: int, canvas_len: int, split: str) -> None:
  """data.sft_overflow='error': every canvas of every record fits (prompt + earlier canvases <= L - C)."""
  for i, record in enumerate(records):
    prompt, response = render(tokenizer, record)
    needed = len(prompt) + (num_canvases(len(response), canvas_len) - 1) * canvas_len
    if needed > seq_len - canvas_len:
      raise DataError(f"data.sft_overflow='error': example {i} of split {split!r} needs {needed} context "
                       f"tokens (prompt {len(prompt)} + earlier canvases) > data.seq_len - diffusion.canvas_len = "
                       f"{seq_len - canvas_len}; raise data.seq_len or use data.sft_overflow='truncate_left'")
