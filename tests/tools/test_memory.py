"""dgemma.tools.memory: the jaxpr working-set walk on programs with known answers, and the inference
and training estimates of the tiny preset against direct byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny
from dgemma import quant
from dgemma.model import ModelConfig, init_cache, param_shapes
from dgemma.tools import memory

TINY = ModelConfig.from_config_dict(tiny.get_config())


def test_activation_peak_known_programs():
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)  # 4000 bytes

  def chain(x):
    y = x * 2.0          # x dies here: live x + y = 8000
    z = y + 1.0          # live y + z
    return jnp.sum(y * z)  # y and z live while y * z is made: 12000

  assert memory.activation_peak(jax.make_jaxpr(chain)(x)) == 12000

  def keep_input(x):
    y = x * 2.0
    return x + y         # x, y and the output: 12000

  assert memory.activation_peak(jax.make_jaxpr(keep_input)(x)) == 12000

  def scanned(x):
    def body(c, _):
      t = jnp.outer(c, c)  # a 1000 x 1000 fp32 temporary inside the loop body (4e6 bytes)
      return c + t[0], None
    return jax.lax.scan(body, x, None, length=3)[0]

  peak = memory.activation_peak(jax.make_jaxpr(scanned)(x))
  assert 4_000_000 <= peak <= 4_000_000 + 5 * 4000, peak  # the body's temporary counted once, not 3x
  # int4 counts half a byte
  assert memory._aval_bytes(jax.ShapeDtypeStruct((10, 3), jnp.int4)) == 15


def test_inference_estimate_tiny():
  qcfg = quant.QuantConfig("int8")
  est = memory.inference_estimate(TINY, qcfg, context=48, canvas=16, batch=2)
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_shapes(TINY))
  q = jax.eval_shape(lambda p: quant.quantize_params(p, qcfg), shapes)
  assert est["weights"] == quant.tree_bytes(q)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert est["kv_cache"] == nbytes(init_cache(TINY, 2, 48, sliding_ring=True))  # what the samplers allocate
  # = the full cache less the (48 - W) slots the sliding layers drop, plus the ring's positions / segment ids
  K, H = TINY.num_kv_heads, TINY.head_dim
  sliding = sum(t == "sliding" for t in TINY.layer_types)
  dropped = sliding * 2 * 2 * (48 - TINY.sliding_window) * K * H * 4  # layers x (k, v) x batch x slots x K x H x fp32
  assert est["kv_cache"] == nbytes(init_cache(TINY, 2, 48)) - dropped + 2 * 2 * TINY.sliding_window * 4
  # at least the fp32 logits, the self-conditioning logits and the sampler's log-probs [2, 16, V]
  assert est["canvas_step"] > 3 * 2 * 16 * TINY.vocab_size * 4
  text = memory.report(_experiment(), quantize="int4", group_size=16, context=48, canvas=16, batch=1,
                       mesh_shape={"data": -1}, devices=2, budget_gib=1.0, training=False)
  assert "fits in 1 GiB" in text and "KV cache" in text


def _experiment():
  config = memory._experiment_config(tiny.get_config())
  config.data.batch_size, config.data.seq_len = 4, 64
  config.diffusion.canvas_len = 16
  return config


@pytest.mark.slow  # 8 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_training_estimate_tiny():
  one = memory.training_estimate(_experiment(), dict(data=1, fsdp=1, expert=1, tensor=1))
  full_bytes = quant.tree_bytes(param_shapes(TINY))
  assert one["params"] == one["grads"] == full_bytes
  assert abs(one["opt_state"] - 2 * full_bytes) <= 64  # Adam mu and nu (fp32) + step counters
  assert one["batch_per_device"] == 4
  fsdp = memory.training_estimate(_experiment(), dict(data=1, fsdp=2, expert=1, tensor=1))
  # 'embed' -> fsdp: every matrix is split in two, the norm vectors are not
  norms = sum(int(np.prod(s.shape)) * 4 for p, s in jax.tree_util.tree_leaves_with_path(param_shapes(TINY))
              if "scale" in jax.tree_util.keystr(p) or "scalar" in jax.tree_util.keystr(p))
  assert fsdp["params"] == (full_bytes - norms) // 2 + norms, (fsdp["params"], full_bytes, norms)
  assert fsdp["batch_per_device"] == 2 and fsdp["activations"] < one["activations"]
