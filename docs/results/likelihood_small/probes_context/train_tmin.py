"""train.py with training times t ~ t_eps + (TMAX - t_eps) u (a probe; the eval pass keeps uniform t)."""
import os, sys
sys.path.insert(0, os.getcwd())
from dgemma.diffusion import loss as loss_lib
TMIN = float(os.environ["TMIN"])
orig_times, orig_loss = loss_lib.sample_times, loss_lib.diffusion_loss
state = {"eval": False}
def sample_times(keys_B, example_ids_B, rng, num_examples, loss_cfg):
  t = orig_times(keys_B, example_ids_B, rng, num_examples, loss_cfg)
  return t if state["eval"] else TMIN + (1.0 - TMIN) * t
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
