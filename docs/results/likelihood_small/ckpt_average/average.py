"""Probe: is an average of a run's last checkpoints (a stand-in for an EMA of the weights) a better likelihood
model than its last checkpoint? Scores each listed set with the `eval.likelihood` estimator and settings.

  python docs/results/likelihood_small/ckpt_average/average.py WORKDIR data_cache/markov/valid.txt 16 1300 1200,1300 1000,1200,1300
"""
import json
import sys

import jax

import dgemma
from eval import likelihood as likelihood_cli

workdir, data, max_docs, *sets = sys.argv[1:]
step_sets = [[int(s) for s in group.split(",")] for group in sets]
models = {s: dgemma.load(workdir, step=s) for s in sorted({s for group in step_sets for s in group})}
texts = likelihood_cli.read_texts(models[step_sets[0][-1]].settings, data)[:int(max_docs)]
for group in step_sets:
  model = models[group[-1]]
  saved = model.params
  model.params = jax.tree.map(lambda *xs: sum(xs) / len(xs), *[models[s].params for s in group])
  out = model.score(texts)
  model.params = saved
  print(json.dumps({"steps": group, "bits_per_byte": out["bits_per_byte"],
                    "nats_per_token": out["nats_per_token"], "nats_per_token_se": out["nats_per_token_se"]}),
        flush=True)
