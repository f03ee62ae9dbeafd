import sys, dataclasses
sys.argv = ["x"]
import os; sys.path.insert(0, os.path.join(os.getcwd(), "docs/results/likelihood_small/probes_blind")); sys.path.insert(0, os.getcwd())
import blind  # patches
import jax, jax.numpy as jnp, numpy as np
from dgemma.model import Transformer, init_cache
from configs import likelihood_small
import dgemma.settings as S
mc = dataclasses.replace(S.from_config(likelihood_small.get_config("x")).model, decoder_right_readout=0)
m = Transformer(mc)
T, C = 16, 8
rng = np.random.default_rng(0)
ctx = jnp.asarray(rng.integers(5, 200, (1, T)), jnp.int32)
can = jnp.asarray(rng.integers(5, 200, (1, C)), jnp.int32)
pos_t = jnp.arange(T)[None]; pos_c = (T + jnp.arange(C))[None]
one_t = jnp.ones((1, T), jnp.int32); one_c = jnp.ones((1, C), jnp.int32)
params = m.init(jax.random.key(0), ctx, pos_t, one_t, can, pos_c, one_c)
params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
def dec(canvas):
  cache = init_cache(mc, 1, T + C, jnp.float32)
  enc, cache = m.apply(params, ctx, pos_t, one_t, cache, method=Transformer.encode)
  return m.apply(params, canvas, pos_c, one_c, cache, prev_logits_BKV=enc[:, -1:], method=Transformer.decode)
a = dec(can)
for p in range(C):
  b = dec(can.at[0, p].set(7))
  d = jnp.max(jnp.abs(a - b), axis=-1)[0]
  print(p, "own position change:", float(d[p]), " max elsewhere:", float(jnp.max(jnp.delete(d, p))))
