"""Countdown success rate of a run: one sample per held-out problem (the released sampler of the run's settings),
checked exactly (proj/countdown/data.py).

  python -m proj.countdown.eval --checkpoint=workdirs/countdown --data=data/countdown/test.jsonl [--step=500]
  # -> prints {"success_rate", "problems"}; predictions (prompt, response, prediction, solved) to --predictions
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import dgemma
from dgemma import files
from dgemma.tools import cli
from proj.countdown import data


def success(model, problems: list[dict], batch_size: int, seed: int) -> tuple[float, list[dict]]:
  """(share solved, per-problem records) with one sample per problem, each prompt a user turn as in training."""
  records = []
  for start in range(0, len(problems), batch_size):
    chunk = problems[start:start + batch_size]
    outs = model.chat([[{"role": "user", "content": p["prompt"]}] for p in chunk], max_new_tokens=16,
                      seed=seed + start)
    for problem, out in zip(chunk, outs):
      parsed = data.parse_prompt(problem["prompt"])
      solved = parsed is not None and data.check(out.text.strip(), *parsed)
      records.append(dict(prompt=problem["prompt"], response=problem["response"], prediction=out.text,
                          solved=bool(solved)))
  return sum(r["solved"] for r in records) / max(len(records), 1), records


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="a run (or any checkpoint dgemma.load takes)")
  parser.add_argument("--data", required=True, help="a JSONL of {prompt, response} problems (make_jsonl's test.jsonl)")
  parser.add_argument("--predictions", default="", help="one JSON object per problem goes here ('' = not written)")
  parser.add_argument("--batch_size", type=int, default=100, help="problems sampled at once")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed")
  parser.add_argument("--step", type=int, default=-1, help="a run's checkpoint step (-1 = the latest)")
  args = parser.parse_args(argv)
  try:
    problems = list(files.read_jsonl_records(args.data))
    rate, records = success(dgemma.load(args.checkpoint, step=args.step), problems, args.batch_size, args.seed)
  except cli.USER_ERRORS + (ValueError, OSError) as e:
    sys.exit(f"proj.countdown.eval: {e}")
  if args.predictions:
    files.write_text_atomic(args.predictions, "".join(json.dumps(r) + "\n" for r in records))
  print(json.dumps({"success_rate": rate, "problems": len(records)}))


if __name__ == "__main__":
  main()
