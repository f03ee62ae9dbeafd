"""train.py plus a backward (right-to-left) next-token loss in the ORIGINAL positions: the causal encoder reads
the clean context reversed with descending positions, so each query at position p attends keys at positions
>= p (the right context in RoPE geometry) and predicts the token at p - 1. Weight BWD_WEIGHT. Probe only."""
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from dgemma.diffusion import loss as loss_lib
from dgemma.model import Transformer, init_cache
W = float(os.environ.get("BWD_WEIGHT", "1.0"))
orig = loss_lib.diffusion_loss
def diffusion_loss(params, batch, rng, **k):
  loss, metrics = orig(params, batch, rng, **k)
  if k.get("eval_metrics"):
    return loss, metrics
  model_cfg, loss_cfg = k["model_cfg"], k["loss_cfg"]
  T = batch["tokens"].shape[1] - loss_cfg.canvas_len
  tokens, seg = batch["tokens"][:, :T][:, ::-1], batch["segment_ids"][:, :T][:, ::-1]
  positions = batch["positions"][:, :T][:, ::-1]
  model = Transformer(model_cfg)
  cache = init_cache(model_cfg, tokens.shape[0], T, dtype=jnp.dtype(model_cfg.dtype))
  (logits, _), _ = model.apply({"params": params}, tokens, positions, seg, cache, return_logits=True,
                               method=Transformer.encode, mutable=["intermediates"])
  w = loss_lib.next_token_weights(seg).astype(jnp.float32)
  s, n, _ = loss_lib.masked_cross_entropy(logits[:, :-1], tokens[:, 1:], w)
  bwd = s / jnp.maximum(n, 1.0)
  metrics = dict(metrics, backward_loss=bwd)
  return loss + W * bwd, metrics
loss_lib.diffusion_loss = diffusion_loss
import runpy
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
