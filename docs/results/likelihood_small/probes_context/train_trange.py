"""train.py with training times t ~ TLO + (THI - TLO) u, u ~ U(0, 1) (a probe; the eval pass keeps uniform t)."""
import os, sys
sys.path.insert(0, os.getcwd())
from dgemma.diffusion import loss as loss_lib
TLO, THI = float(os.environ["TLO"]), float(os.environ["THI"])
orig_times, orig_loss = loss_lib.sample_times, loss_lib.diffusion_loss
state = {"eval": False}
def sample_times(keys_B, example_ids_B, rng, num_examples, loss_cfg):
  t = orig_times(keys_B, example_ids_B, rng, num_examples, loss_cfg)
  return t if state["eval"] else TLO + (THI - TLO) * t
def diffusion_loss(*a, eval_metrics=False, **k):
  state["eval"] = eval_metrics   # read at trace time
  try:
    return orig_loss(*a, eval_metrics=eval_metrics, **k)
  finally:
    state["eval"] = False
loss_lib.sample_times = sample_times
loss_lib.diffusion_loss = diffusion_loss
import runpy
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
