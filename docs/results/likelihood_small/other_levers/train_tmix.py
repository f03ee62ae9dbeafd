"""train.py with training times from a mixture: with probability 1 - MIX, t ~ U(t_eps, 1) (the recipe); with
probability MIX, t ~ U(TLO, THI) (a probe; the eval pass keeps uniform t)."""
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from dgemma.diffusion import loss as loss_lib
MIX, TLO, THI = float(os.environ["MIX"]), float(os.environ["TLO"]), float(os.environ["THI"])
orig_times, orig_loss = loss_lib.sample_times, loss_lib.diffusion_loss
state = {"eval": False}
def sample_times(keys_B, example_ids_B, rng, num_examples, loss_cfg):
  t = orig_times(keys_B, example_ids_B, rng, num_examples, loss_cfg)
  if state["eval"]:
    return t
  k = jax.vmap(lambda key: jax.random.fold_in(key, 7))(keys_B)
  pick = jax.vmap(lambda key: jax.random.uniform(key, ()))(k) < MIX
  u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), ()))(k)
  return jnp.where(pick, TLO + (THI - TLO) * u, t)
def diffusion_loss(*a, eval_metrics=False, **kw):
  state["eval"] = eval_metrics   # read at trace time
  try:
    return orig_loss(*a, eval_metrics=eval_metrics, **kw)
  finally:
    state["eval"] = False
loss_lib.sample_times = sample_times
loss_lib.diffusion_loss = diffusion_loss
import runpy
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
