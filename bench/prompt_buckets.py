"""First and second call times of generate for new prompt lengths: the request's exact shapes without a persistent
compilation cache (what dgemma.load's Model did before) against its bucketed shapes, with an empty cache and then
in a new process that finds the cache filled.

  .venv/bin/python bench/prompt_buckets.py [--checkpoint=workdirs/demo] [--lengths=3,9,10,20,40] [--max_new_tokens=64]

Each mode runs in its own interpreter (a fresh jit cache): 'exact' calls dgemma.sampling.generate with each
request's own [1, prompt length] shape and the cache off; 'bucketed' calls Model.generate_ids (batch and prompt
length rounded up, dgemma/sampling/generation.py bucketed_shape) with an empty cache directory; 'bucketed_warm'
does the same in a new process with that directory filled. For each prompt length in turn it times the first
call and a second call of the same length. Without --checkpoint the model is the demo's architecture with random
weights and the byte tokenizer (the times do not depend on the weights). Prints one JSON object: per mode, per
length, first_s and second_s; and the ratio of the summed first calls of each mode to 'exact''s.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import app, flags

from bench.timing import host_cpu

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A checkpoint to load (default: random demo-size weights).")
_LENGTHS = flags.DEFINE_list("lengths", ["3", "9", "10", "20", "40"], "Prompt lengths in tokens, in call order.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per call.")
_MODE = flags.DEFINE_enum("mode", None, ["exact", "bucketed"], "(internal) run one mode in this process.")


def random_demo_run(path: Path) -> str:
  """The demo config's model with random weights, saved as a run with the byte tokenizer."""
  from configs import demo
  from dgemma.model import param_shapes
  from dgemma.train import optimizer as optimizer_lib, state as state_lib
  from dgemma import settings as settings_lib
  from dgemma.checkpoints import workdir as workdir_ckpt
  import jax
  import jax.numpy as jnp
  config = demo.get_config()
  config.data.tokenizer.kind = "byte"
  settings = settings_lib.from_config(config)
  rng = iter(jax.random.split(jax.random.key(0), 10_000))
  params = jax.tree.map(lambda s: 0.05 * jax.random.normal(next(rng), s.shape, s.dtype), param_shapes(settings.model))
  state = state_lib.TrainState(step=jnp.ones((), jnp.int32), params=params,
                               opt_state=optimizer_lib.make_optimizer(settings.opt, 1).init(params))
  workdir_ckpt.write_config_json(path, settings.config_json)
  workdir_ckpt.save_step(path, 1, state)
  return str(path)


def run_mode(mode: str, checkpoint: str, lengths: list[int], max_new_tokens: int) -> dict:
  """{length: {first_s, second_s}} of one mode in this process (module docstring)."""
  import jax
  import numpy as np
  import dgemma
  from dgemma.model import Transformer
  from dgemma.sampling import generate
  model = dgemma.load(checkpoint)
  sampler = model.call_settings(max_new_tokens=max_new_tokens).canvas_sampler
  out = {}
  for n in lengths:
    ids = [[model.tokenizer.bos_id] + [int(t) for t in np.random.default_rng(n).integers(5, 200, n - 1)]]

    def call():
      if mode == "bucketed":
        return model.generate_ids(ids, [""], max_new_tokens=max_new_tokens)
      return jax.block_until_ready(generate(Transformer(model.model_cfg), model.params, np.asarray(ids, np.int32),
                                            np.asarray([n], np.int32), sampler, jax.random.key(0), max_new_tokens))

    times = []
    for _ in range(2):
      start = time.perf_counter()
      call()
      times.append(time.perf_counter() - start)
    out[n] = {"first_s": times[0], "second_s": times[1]}
    print(f"{mode}: {n} tokens: first {times[0]:.2f} s, second {times[1]:.2f} s", file=sys.stderr, flush=True)
  return out


def main(argv):
  del argv
  lengths = [int(x) for x in _LENGTHS.value]
  if _MODE.value:  # one mode, in this process
    print(json.dumps(run_mode(_MODE.value, _CHECKPOINT.value, lengths, _MAX_NEW.value)))
    return
  with tempfile.TemporaryDirectory() as tmp:
    checkpoint = _CHECKPOINT.value
    if checkpoint is None:
      checkpoint = random_demo_run(Path(tmp) / "run")
    cache = str(Path(tmp) / "jax_cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    results = {}
    for name, mode, cache_dir in (("exact", "exact", "0"), ("bucketed", "bucketed", cache),
                                  ("bucketed_warm", "bucketed", cache)):
      cmd = [sys.executable, __file__, f"--mode={mode}", f"--checkpoint={checkpoint}",
             f"--lengths={','.join(map(str, lengths))}", f"--max_new_tokens={_MAX_NEW.value}"]
      run = subprocess.run(cmd, cwd=ROOT, env=dict(env, DGEMMA_COMPILATION_CACHE_DIR=cache_dir), capture_output=True,
                           text=True, timeout=3600)
      if run.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{run.stderr[-3000:]}")
      results[name] = json.loads(run.stdout.strip().splitlines()[-1])
  first = {name: sum(r["first_s"] for r in per.values()) for name, per in results.items()}
  print(json.dumps({"host": host_cpu(), "checkpoint": _CHECKPOINT.value or "random demo-size weights",
                    "max_new_tokens": _MAX_NEW.value, "modes": results,
                    "first_calls_s": first, "first_calls_ratio_to_exact": {k: v / first["exact"] for k, v in first.items()}},
                   indent=2))


if __name__ == "__main__":
  app.run(main)
