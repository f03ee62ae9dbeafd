"""Probe: train.py with Muon (optax.contrib.muon: momentum, then Newton-Schulz orthogonalised updates) on every
hidden weight matrix, and the recipe's Adam on the rest (embedding, router, norms, biases, scalars).

  MUON_LR=0.02 python docs/results/likelihood_small/muon/train_muon.py --config=configs/likelihood_small.py:data_cache/markov/train.txt --workdir=...

Both learning rates follow the recipe's warmup + cosine schedule (opt.warmup_steps, opt.end_lr_fraction): the
matrices' peak is MUON_LR, the rest's opt.lr. Gradients are clipped by global norm first, as in the library.
"""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import jax  # noqa: E402
import optax  # noqa: E402
from optax.contrib import MuonDimensionNumbers as Dims  # noqa: E402

from dgemma.train import optimizer as optimizer_lib  # noqa: E402

MUON_LR = float(os.environ.get("MUON_LR", "0.02"))


def dims_of(path, leaf):
  """Which axes a matrix reads (reduction) and writes (output); the rest are batch axes (the layer group,
  the experts). None: not a hidden matrix, so Adam."""
  names = [str(getattr(p, "key", "")) for p in path if hasattr(p, "key")]  # (not a box's `.value` attribute:
                                                                          # the init sees logically boxed params)
  name = names[-2] if names[-1] == "kernel" else names[-1]
  if "router" in names or name in ("embedding",) or leaf.ndim < 2:
    return None
  if name in ("q_proj", "k_proj", "v_proj"):   # [group, D, heads, head_dim]
    return Dims(reduction_axis=1, output_axis=(2, 3))
  if name == "o_proj":                          # [group, heads, head_dim, D]
    return Dims(reduction_axis=(1, 2), output_axis=3)
  if "experts" in names:                        # [group, E, in, out]
    return Dims(reduction_axis=2, output_axis=3)
  if "mlp" in names:                            # [group, in, out]
    return Dims(reduction_axis=1, output_axis=2)
  if name in ("two_stream_in", "two_stream_out"):  # [in, out]
    return Dims(reduction_axis=0, output_axis=1)
  if leaf.ndim == 2 and "blocks" not in names:
    return Dims()
  return None


def make_optimizer(opt, num_steps, finetune_cfg=None):
  assert finetune_cfg is None or not getattr(finetune_cfg, "mode", None) or finetune_cfg.mode == "full", finetune_cfg
  adam_schedule = optimizer_lib.make_schedule(opt, num_steps)
  muon_schedule = lambda step: adam_schedule(step) * (MUON_LR / opt.lr)
  dims = lambda params: jax.tree_util.tree_map_with_path(dims_of, params)
  return optax.chain(
      optax.clip_by_global_norm(opt.grad_clip),
      optax.contrib.muon(learning_rate=muon_schedule, beta=0.95, weight_decay=opt.weight_decay,
                         adam_learning_rate=adam_schedule, adam_b1=opt.b1, adam_b2=opt.b2, eps=opt.eps,
                         muon_weight_dimension_numbers=dims))


optimizer_lib.make_optimizer = make_optimizer
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
