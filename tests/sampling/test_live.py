"""dgemma.sampling.live: the live printer redraws each step with accepted / noise highlights."""

from __future__ import annotations

import numpy as np


def test_live_printer_redraws_with_highlights():
  from dgemma.sampling import LivePrinter, StepView
  from dgemma.sampling import live
  from dgemma.tokenizers import ByteTokenizer
  tok = ByteTokenizer()
  stream = __import__("io").StringIO()
  printer = LivePrinter(tok.decode, ["Q: "], stream=stream, total_steps=2, end_ids=(1,))
  ids = lambda text: np.array([tok.encode(text)], np.int32)
  act = np.array([True])
  printer(StepView(0, 0, ids("ab"), np.array([[True, False]]), ids("ab"), act))
  printer(StepView(0, 1, ids("cd"), np.array([[True, True]]), ids("cd"), act))
  end = np.array([[tok.encode("e")[0], 1]], np.int32)
  printer(StepView(1, 0, ids("xy"), np.array([[False, True]]), end, act))
  frames = stream.getvalue().split(live.CLEAR_HOME)[1:]
  assert printer.frames == len(frames) == 3
  assert f"Q: {live.ACCEPTED}a{live.RESET}{live.NOISE}b{live.RESET}" in frames[0]
  assert "step 2/2" in frames[1]
  assert f"Q: cd{live.NOISE}x{live.RESET}{live.ACCEPTED}y{live.RESET}" in frames[2]  # canvas 1 committed
