"""Live view of the denoising loop: a host callback per step, and a terminal printer.

With `SamplerConfig.show == 'live'` (static: otherwise the program holds no callback at all) every
denoising step runs `jax.debug.callback(emit, callback_id, canvas_idx, step, tokens_BC,
accepted_BC, result_BC, active_B, ordered=True)` inside the jitted loop; `emit` hands a `StepView`
to the function `register` stored under `callback_id`. The id is a traced argument, so a new
printer reuses the compiled program. `generate(..., step_callback=fn)` registers `fn` for the call.

  printer = LivePrinter(tokenizer.decode, prompts=["ROMEO:"], total_steps=cfg.max_denoising_steps)
  generate(model, params, ..., sampler_cfg (show='live'), ..., step_callback=printer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
from typing import Callable, Optional, Sequence

import numpy as np

CLEAR_HOME = "\x1b[2J\x1b[H"   # erase the screen, cursor to the top-left corner
ACCEPTED = "\x1b[1;32m"        # bold green: tokens held on the canvas
NOISE = "\x1b[2m"              # dim: everything else (noise, not yet accepted)
RESET = "\x1b[0m"


@dataclasses.dataclass(frozen=True)
class StepView:
  """One executed denoising step, on the host.

  tokens_BC: what the step produced (released: the newly accepted samples, the input token
    elsewhere; ancestral: z_s). accepted_BC: tokens held on the canvas (highlighted).
  result_BC: the canvas result so far (released: the argmax canvas; ancestral: z_s).
  active_B: rows that ran the step (ended or finished rows did not).
  texts: each row's result_BC decoded, where the caller has a tokenizer (dgemma.load's Model fills it in for
    on_step); () otherwise.
  """

  canvas_idx: int
  step: int
  tokens_BC: np.ndarray
  accepted_BC: np.ndarray
  result_BC: np.ndarray
  active_B: np.ndarray
  texts: tuple[str, ...] = ()


_lock = threading.Lock()
_callbacks: dict[int, Callable[[StepView], None]] = {}
_next_id = itertools.count(1)


def register(fn: Callable[[StepView], None]) -> int:
  """Stores `fn` for `emit`; returns its id (pass it to the jitted program)."""
  with _lock:
    cb_id = next(_next_id)
    _callbacks[cb_id] = fn
  return cb_id


def unregister(cb_id: int) -> None:
  with _lock:
    _callbacks.pop(int(cb_id), None)


@contextlib.contextmanager
def registered(fn: Callable[[StepView], None]):
  cb_id = register(fn)
  try:
    yield cb_id
  finally:
    unregister(cb_id)


def emit(callback_id, canvas_idx, step, tokens_BC, accepted_BC, result_BC, active_B) -> None:
  """The `jax.debug.callback` target (host side): forwards the step to the registered function."""
  with _lock:
    fn = _callbacks.get(int(callback_id))
  if fn is not None:
    fn(StepView(canvas_idx=int(canvas_idx), step=int(step), tokens_BC=np.asarray(tokens_BC),
                accepted_BC=np.asarray(accepted_BC, bool), result_BC=np.asarray(result_BC),
                active_B=np.asarray(active_B, bool)))


def _printable(piece: str, keep_newlines: bool) -> str:
  piece = piece.replace("\x1b", "").replace("\r", "")
  return piece if keep_newlines else piece.replace("\n", "\u21b5")


class LivePrinter:
  """Redraws every row in the terminal at each step (ANSI clear + home): the prompt, the committed
  text of earlier canvases, then the current canvas with held tokens bold green and the rest dim.

  decode: token ids -> text (e.g. `tokenizer.decode`); None shows ids. Per-token pieces come from
  decoding growing prefixes, so SentencePiece word boundaries survive.
  prompts: prompt text per row (or one for every row). stream: default sys.stdout.
  end_ids: a finished canvas is cut after its first end token before it joins the committed text.
  """

  def __init__(self, decode: Optional[Callable[[Sequence[int]], str]] = None, prompts: Sequence[str] = (), *,
               stream=None, end_ids: Sequence[int] = (1,), total_steps: Optional[int] = None,
               max_rows: int = 8):
    self._decode = decode
    self._prompts = list(prompts)
    self._stream = stream
    self._end_ids = tuple(int(i) for i in end_ids)
    self._total_steps = total_steps
    self._max_rows = max_rows
    self._canvas = -1
    self._result_BC: Optional[np.ndarray] = None
    self._ran_B: Optional[np.ndarray] = None
    self._committed: list[list[int]] = []
    self.frames = 0

  def _text(self, ids: Sequence[int]) -> str:
    if self._decode is None:
      return "".join(f"[{int(i)}]" for i in ids)
    return self._decode([int(i) for i in ids])

  def _pieces(self, ids: Sequence[int]) -> list[str]:
    if self._decode is None:
      return [f"[{int(i)}]" for i in ids]
    pieces, prev = [], ""
    for i in range(len(ids)):
      text = self._text(ids[:i + 1])
      pieces.append(text[len(prev):] if text.startswith(prev) else self._text(ids[i:i + 1]))
      prev = text
    return pieces

  def _cut(self, tokens_C) -> list[int]:
    row = [int(t) for t in tokens_C]
    ends = [c for c, t in enumerate(row) if t in self._end_ids]
    return row[:ends[0] + 1] if ends else row

  def _commit(self) -> None:
    """The finished canvas's result joins the committed text of the rows that ran it."""
    if self._result_BC is None:
      return
    for b, ran in enumerate(self._ran_B):
      if ran:
        self._committed[b].extend(self._cut(self._result_BC[b]))

  def render(self, view: StepView) -> str:
    batch = view.tokens_BC.shape[0]
    steps = f"/{self._total_steps}" if self._total_steps else ""
    lines = [f"dgemma: canvas {view.canvas_idx + 1}, step {view.step + 1}{steps}  "
             f"({ACCEPTED}held{RESET}, {NOISE}noise{RESET})"]
    for b in range(min(batch, self._max_rows)):
      prompt = self._prompts[b] if b < len(self._prompts) else (self._prompts[0] if self._prompts else "")
      committed = _printable(self._text(self._committed[b]), keep_newlines=True)
      spans = []
      if view.active_B[b]:
        for piece, held in zip(self._pieces(view.tokens_BC[b]), view.accepted_BC[b]):
          spans.append(f"{ACCEPTED if held else NOISE}{_printable(piece, keep_newlines=False)}{RESET}")
        status = f"{int(view.accepted_BC[b].sum())}/{view.tokens_BC.shape[1]} held"
      elif self._ran_B is not None and self._ran_B[b]:  # stopped early in this canvas: its result
        spans.append(_printable(self._text(self._cut(view.result_BC[b])), keep_newlines=True))
        status = "canvas done"
      else:
        status = "ended"
      lines.append(f"--- sample {b} ({status}) ---")
      lines.append(prompt + committed + "".join(spans))
    if batch > self._max_rows:
      lines.append(f"... {batch - self._max_rows} more rows")
    return CLEAR_HOME + "\n".join(lines) + "\n"

  def __call__(self, view: StepView) -> None:
    batch = view.tokens_BC.shape[0]
    if not self._committed:
      self._committed = [[] for _ in range(batch)]
    if view.canvas_idx != self._canvas:
      self._commit()
      self._canvas, self._ran_B = view.canvas_idx, np.zeros((batch,), bool)
    self._ran_B = self._ran_B | view.active_B
    self._result_BC = view.result_BC
    stream = self._stream if self._stream is not None else sys.stdout
    stream.write(self.render(view))
    stream.flush()
    self.frames += 1
