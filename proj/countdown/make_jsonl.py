"""Writes Countdown problems as SFT JSONL files ({"prompt", "response"} per line, proj/countdown/data.py):

  python -m proj.countdown.make_jsonl --out_dir=data/countdown --num_train=20000 --num_test=500
  # -> data/countdown/train.jsonl (seed stream 0) and test.jsonl (stream 1; problems in train removed)
"""

from __future__ import annotations

import json
from pathlib import Path

import argparse
from typing import Sequence

from dgemma import files
from proj.countdown import data


def write(out_dir, num_train: int, num_test: int, seed: int = 0, **kwargs) -> tuple[int, int]:
  """train.jsonl (seed stream 2 seed) and test.jsonl (odd streams, problems in train left out) in `out_dir`."""
  train = data.generate(num_train, seed=seed * 2, **kwargs)
  seen = {r["prompt"] for r in train}
  test, stream = [], 1
  while len(test) < num_test:
    for r in data.generate(num_test, seed=seed * 2 + stream, **kwargs):
      if r["prompt"] not in seen:
        seen.add(r["prompt"])
        test.append(r)
    stream += 2
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  for name, rows in (("train.jsonl", train), ("test.jsonl", test[:num_test])):
    files.write_text_atomic(out / name, "".join(json.dumps(r) + "\n" for r in rows))
  return len(train), num_test


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out_dir", default="data/countdown", help="where train.jsonl and test.jsonl go")
  parser.add_argument("--num_train", type=int, default=20000, help="training problems")
  parser.add_argument("--num_test", type=int, default=500, help="held-out problems (none of them in train.jsonl)")
  parser.add_argument("--count", type=int, default=3, help="numbers per problem")
  parser.add_argument("--max_number", type=int, default=20, help="numbers drawn from 1..max_number")
  parser.add_argument("--max_target", type=int, default=100, help="targets in 1..max_target")
  parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
  args = parser.parse_args(argv)
  n_train, n_test = write(args.out_dir, args.num_train, args.num_test, args.seed, count=args.count,
                          max_number=args.max_number, max_target=args.max_target)
  print(f"wrote {n_train} train and {n_test} test problems to {args.out_dir}")


if __name__ == "__main__":
  main()
