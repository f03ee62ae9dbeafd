"""What the diffusion likelihood's Monte-Carlo noise does to multiple-choice accuracy (docs/evaluation.md), and the
time per lm-eval request on this host.

  .venv/bin/python train.py --config=configs/demo.py --workdir=workdirs/demo        # or `make demo`
  .venv/bin/python bench/lm_eval_noise.py --checkpoint=workdirs/demo [--questions=100] [--seeds=5] \\
      [--samples=8,32,128] [--out=lm_eval_noise.json]

The task: a local four-way multiple choice built from the run's held-out text (its validation split, or --text, a
.txt file): the first words of a line as the context, its next --answer_words words as the right ending, and as the
wrong ones that ending with each word's inner letters shuffled (--distractors=scrambled: which ending is spelled
right) or the endings of three other lines at the same word offset (other_lines, HellaSwag-like). Each question's choices
are scored by `eval.lm_eval`'s loglikelihood (the model class lm-eval runs; its accuracy is lm-eval's `acc`,
tests/eval/test_lm_eval.py) at each number of time samples M and each seed (eval.seed), with common random numbers
(one question's choices share their noise: the class's default) and without (each choice its own noise). Per M and
mode: accuracy over the seeds (mean, std, min, max) and how often a question's pick agrees with the pick of the
largest M at seed 0. Times: seconds per loglikelihood request (one choice) at each M, and per generate_until
request (--gen_tokens new tokens, the run's sampler), after a first call that compiles. Prints one JSON object.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from bench.timing import host_cpu

def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="a trained run (or any checkpoint dgemma.load takes)")
  parser.add_argument("--text", default="", help="a .txt file of held-out lines (default: the run's validation split)")
  parser.add_argument("--questions", type=int, default=100, help="questions in the task")
  parser.add_argument("--answer_words", type=int, default=4, help="words in each ending")
  parser.add_argument("--distractors", choices=["scrambled", "other_lines"], default="scrambled",
                      help="wrong endings: the true one with each word's inner letters shuffled, or other lines'")
  parser.add_argument("--seeds", type=int, default=5, help="noise seeds (eval.seed) per number of samples")
  parser.add_argument("--samples", default="8,32,128", help="numbers of time samples (eval.num_t_samples)")
  parser.add_argument("--batch_size", type=int, default=32, help="canvases per likelihood batch")
  parser.add_argument("--gen_tokens", type=int, default=32, help="new tokens per timed generate_until request")
  parser.add_argument("--out", default="", help="also write the JSON here")
  return parser.parse_args(argv)


def scramble(word: str, rnd: random.Random) -> str:
  """The word with its inner letters shuffled (first and last kept), or the word itself when that cannot change it."""
  inner = list(word[1:-1])
  for _ in range(10):
    rnd.shuffle(inner)
    if "".join(inner) != word[1:-1]:
      break
  return word[0] + "".join(inner) + word[-1] if len(word) > 3 else word


def make_questions(lines: list[str], num: int, answer_words: int, seed: int = 0,
                   distractors: str = "scrambled") -> list[dict]:
  """Four-way questions from lines of at least 2 * answer_words words (module docstring)."""
  rnd = random.Random(seed)
  pool = [line.split() for line in lines if len(line.split()) >= 2 * answer_words]
  if len(pool) < 4:
    raise SystemExit(f"lm_eval_noise: {len(pool)} lines with >= {2 * answer_words} words; need at least 4")
  questions = []
  while len(questions) < num:
    words, *others = rnd.sample(pool, 4)
    cut = rnd.randint(answer_words, len(words) - answer_words)
    true = words[cut:cut + answer_words]
    if distractors == "scrambled":
      wrong = [[scramble(w, rnd) for w in true] for _ in range(3)]
    else:  # the endings of three other lines at the same word offset
      wrong = [o[min(cut, len(o) - answer_words):][:answer_words] for o in others]
    choices = [" " + " ".join(c) for c in [true] + wrong]
    if len(set(choices)) < 4:
      continue
    order = list(range(4))
    rnd.shuffle(order)
    questions.append({"context": " ".join(words[:cut]), "choices": [choices[i] for i in order],
                      "label": order.index(0)})
  return questions


def noise_keys(questions: list[dict], common: bool) -> list[int]:
  """One noise key per (question, choice): the context's (the model class's default: one question's choices share
  their noise) or each choice its own."""
  from eval.lm_eval import context_key
  return [context_key(q["context"]) if common else 2 ** 30 + i * len(q["choices"]) + j
          for i, q in enumerate(questions) for j in range(len(q["choices"]))]


def choice_ids(lm, questions: list[dict]) -> tuple[list[list[int]], list[int]]:
  """(BOS + context + choice ids, where the choice starts) per (question, choice): the model class's `score_ids`
  arguments."""
  return lm.pair_ids([(q["context"], choice) for q in questions for choice in q["choices"]])


def picks(lm, questions: list[dict], common: bool) -> np.ndarray:
  """Each question's argmax choice under `noise_keys`."""
  scores = lm.score_ids(*choice_ids(lm, questions), noise_keys(questions, common))
  logprobs = np.asarray([s.logprob for s in scores]).reshape(len(questions), -1)
  return np.argmax(logprobs, axis=1)


def main(argv=None):
  args = parse_args(argv)
  import dgemma
  from eval import likelihood as likelihood_cli
  from eval.lm_eval import dgemma_lm
  from lm_eval.api.instance import Instance
  model = dgemma.load(args.checkpoint)
  lines = [line for doc in likelihood_cli.read_texts(model.settings, args.text or model.settings.eval.split)
           for line in doc.splitlines()]
  questions = make_questions(lines, args.questions, args.answer_words, distractors=args.distractors)
  labels = np.asarray([q["label"] for q in questions])
  samples = [int(m) for m in args.samples.split(',')]
  out = {"checkpoint": args.checkpoint, "host": host_cpu(), "questions": len(questions), "choices": 4,
         "distractors": args.distractors, "chance": 0.25, "seeds": args.seeds, "accuracy": {}, "agreement_with_largest_m": {},
         "s_per_loglikelihood_request": {}}
  reference = None
  for m in sorted(samples, reverse=True):
    for mode in ("common", "independent"):
      accs, agree = [], []
      for seed in range(args.seeds):
        lm = dgemma_lm(model=model, num_t_samples=m, batch_size=args.batch_size, seed=seed)
        start = time.perf_counter()
        got = picks(lm, questions, common=mode == "common")
        wall = time.perf_counter() - start
        if reference is None:
          reference = got
        accs.append(float(np.mean(got == labels)))
        agree.append(float(np.mean(got == reference)))
        print(f"  M={m} {mode} seed {seed}: accuracy {accs[-1]:.3f} ({wall:.0f} s)", flush=True)
        if mode == "common" and seed == 1:  # seed 0 compiled the program
          out["s_per_loglikelihood_request"][m] = wall / (4 * len(questions))
      out["accuracy"].setdefault(mode, {})[m] = {"mean": float(np.mean(accs)), "std": float(np.std(accs, ddof=1))
                                                 if len(accs) > 1 else 0.0, "min": min(accs), "max": max(accs)}
      out["agreement_with_largest_m"].setdefault(mode, {})[m] = float(np.mean(agree))
      print(f"M={m} {mode}: accuracy {out['accuracy'][mode][m]}, agreement {out['agreement_with_largest_m'][mode][m]:.3f}",
            flush=True)
  lm = dgemma_lm(model=model, batch_size=args.batch_size)
  reqs = [Instance(request_type="generate_until", doc={}, idx=0,
                   arguments=(q["context"], {"until": ["\n"], "max_gen_toks": args.gen_tokens}))
          for q in questions[:args.batch_size]]
  lm.generate_until(reqs, disable_tqdm=True)  # compiles
  start = time.perf_counter()
  lm.generate_until(reqs, disable_tqdm=True)
  out["s_per_generate_until_request"] = (time.perf_counter() - start) / len(reqs)
  out["generate_until_batch"] = len(reqs)
  text = json.dumps(out, indent=2)
  print(text)
  if args.out:
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
  main()
