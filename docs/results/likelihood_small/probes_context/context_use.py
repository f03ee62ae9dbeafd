"""Does the decoder read the clean context? Every canvas token is a known-noise id (256), so the prediction at a canvas's
first position can come only from the context: the mean CE of the true token there over 16 validation rows (offset
argv[2] into each document), with the contexts intact and shifted by one row (shuffled). Usage: context_use.py RUN 200"""
import sys, numpy as np, jax, jax.numpy as jnp
import dgemma
from dgemma.data import builder as builder_lib
from dgemma.model import Transformer, init_cache
ck = sys.argv[1]; model = dgemma.load(ck)
cfg = model.model_cfg; tr = Transformer(cfg); tok = model.tokenizer
texts = list(builder_lib.iter_file_documents('data_cache/markov/valid.txt', "line", "text", "strict"))[:16]
L, C = 128, 32; OFF = int(sys.argv[2])
rows = np.array([tok.encode(t)[OFF:OFF + L] for t in texts], np.int32)
B = rows.shape[0]
pos = np.tile(np.arange(OFF, OFF + L, dtype=np.int32), (B, 1)); seg = np.ones((B, L), np.int32)
noise_id = 256
def run(K, shuffle):
  T = L - C
  ctx_tok = rows[:, :T]
  if shuffle: ctx_tok = ctx_tok[np.roll(np.arange(B), 1)]
  cache = init_cache(cfg, B, T, dtype=jnp.dtype(cfg.dtype))
  _, cache = tr.apply({"params": model.params}, ctx_tok, pos[:, :T], seg[:, :T], cache, return_logits=False, method=Transformer.encode)
  z = np.full((B, K * C), noise_id, np.int32)
  lg = tr.apply({"params": model.params}, z, pos[:, L - K * C:], seg[:, L - K * C:], cache, num_canvases=K, method=Transformer.decode)
  if isinstance(lg, tuple): lg = lg[0]
  lp = np.asarray(jax.nn.log_softmax(lg, -1))
  x = rows[:, L - K * C:]
  return [float(-lp[np.arange(B), k * C, x[:, k * C]].mean()) for k in range(K)]
for K in (1, 3):
  print(K, 'ctx', np.round(run(K, False), 3), 'shuffled', np.round(run(K, True), 3))
