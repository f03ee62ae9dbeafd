"""Mixture-of-experts branch: router (HF `DiffusionGemmaTextRouter`) and GeGLU experts.

Interchangeable expert implementations (`cfg.moe_impl`), all dropless:
  'ragged': the T*k (token, slot) pairs are sorted by expert id and run through
            `jax.lax.ragged_dot` with per-expert group sizes, then unsorted and combined.
  'dense':  every expert on every token, combined with a dense [T, E] weight matrix (test reference).
  'capacity': each expert's (token, slot) pairs are scattered into a fixed [C, D] slab and all experts
            run as one batched matmul per projection (`experts_capacity`), which reads every expert's
            weights once; C is the smallest of `capacity_rungs(T, k, E, cfg.moe_capacity_factor)`
            (factor x the mean load, doubling up to C = T) that holds the busiest expert, picked at
            run time by `lax.switch`, so it is dropless and costs what the routing's balance allows.
  'expert_parallel': experts sharded over the mesh axis 'expert', tokens exchanged with
            `jax.lax.all_to_all` inside `jax.shard_map` (`experts_expert_parallel`); 'ragged' when
            no mesh is installed (`jax.set_mesh`, see dgemma.mesh.mesh_context).
  'tokamax': the 'ragged' sorting with `tokamax.ragged_dot` (Pallas kernels on GPU / TPU, XLA on CPU;
            `experts_tokamax`, dgemma/model/moe_kernels.py); quantized expert weights go to its
            quantized kernels as they are, never dequantized here.
  'auto':   one of the above per platform (`resolve_impl`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dgemma.model.config import ModelConfig
from dgemma.model import layers, moe_kernels, sharding
from dgemma.model import lora as lora_lib
from dgemma.model import qarray


class Router(nn.Module):
  """Routing weights from the residual stream, all in fp32.

  HF: RMSNorm without scale, * scale * d^-0.5, linear to E logits, softmax (fp32) over all experts,
  top-k by probability, renormalised to sum 1, * per_expert_scale[idx].
  Returns (logits_TE, probs_TE, weights_Tk, index_Tk). LoRA (target 'router') adapts `proj`.
  """

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_TD: jax.Array):
    cfg = self.cfg
    D, E = cfg.d_model, cfg.num_experts
    pdtype = layers.param_dtype(cfg)
    scale = self.param("scale", layers.ones_init(("norm",)), (D,), pdtype)
    per_expert_scale = self.param("per_expert_scale", layers.ones_init(("expert",)), (E,), pdtype)
    f32 = layers.at_least_f32(layers.compute_dtype(cfg))
    h_TD = layers.rms_norm(x_TD, cfg.rms_eps)
    h_TD = h_TD * scale.astype(h_TD.dtype) * (D ** -0.5)
    logits_TE = layers.Einsum((D, E), "td,de->te", ("embed", "expert"), dtype=f32,
                              param_dtype=pdtype, lora=lora_lib.for_target(cfg.lora, "router"),
                              lora_active=self.lora_active, name="proj")(h_TD)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    top_Tk, index_Tk = jax.lax.top_k(probs_TE, cfg.experts_per_token)
    weights_Tk = top_Tk / jnp.sum(top_Tk, axis=-1, keepdims=True)
    weights_Tk = weights_Tk * per_expert_scale.astype(weights_Tk.dtype)[index_Tk]
    return logits_TE, probs_TE, weights_Tk, index_Tk


# Expert LoRA: `adapters` maps 'gate_proj' / 'up_proj' / 'down_proj' to a lora.LowRank with per-expert
# factors A [E, in, r], B [E, r, out]; each adds s (x A_e) B_e to expert e's projection.

def experts_dense(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, adapters=None, block: int = 0):
  """Reference: all experts for all tokens, as three plain matmuls over the E*F expert units: gate / up
  x [T, D] @ [D, E*F]; the routing weights (dense [T, E], zero for unpicked experts) scale each expert's
  hidden units; down [T, E*F] @ [E*F, D] sums the experts. sum_e w_te (h_te @ W_e) = (w h) @ W stacked,
  so this is the per-expert combine, with 2-D matmuls whose gradients need no activation-sized
  transposes on XLA CPU (docs/benchmarks.md, "Training").

  block (model.moe_dense_block): the experts `block` at a time, a lax.scan over E / block blocks whose outputs are
  summed in (at least) fp32: one block's [T, block, F] activations and, for quantized weights, one block's
  dequantized weights at once instead of every expert's (the sum over experts is linear, so this is the same
  product; only its rounding differs). 0 (or E): every expert at once."""
  E = gate_EDF.shape[0]
  adapters = adapters or {}
  x_TD = x_TD.astype(dtype)
  f32 = layers.at_least_f32(dtype)
  comb_TE = jnp.sum(jax.nn.one_hot(index_Tk, E, dtype=f32) * weights_Tk[..., None], axis=1)
  if not block or block >= E:
    return _dense_experts(x_TD, gate_EDF, up_EDF, down_EFD, comb_TE, dtype, adapters).astype(dtype)
  if E % block:
    raise ValueError(f"model.moe_dense_block: {block} does not divide the {E} experts")
  blocks = E // block
  split = lambda w: jax.tree.map(lambda a: a.reshape(blocks, block, *a.shape[1:]), qarray.stored(w))
  factors = {name: (split(lr.a), split(lr.b)) for name, lr in adapters.items()}
  comb_NTb = comb_TE.reshape(-1, blocks, block).transpose(1, 0, 2)

  def one(y_TD, xs):
    gate, up, down, comb_Tb, ab = xs
    ad = {name: lora_lib.LowRank(a, b, adapters[name].scale) for name, (a, b) in ab.items()}
    return y_TD + _dense_experts(x_TD, gate, up, down, comb_Tb, dtype, ad).astype(f32), None

  y_TD, _ = jax.lax.scan(one, jnp.zeros(x_TD.shape, f32),
                         (split(gate_EDF), split(up_EDF), split(down_EFD), comb_NTb, factors))
  return y_TD.astype(dtype)


def _dense_experts(x_TD, gate_EDF, up_EDF, down_EFD, comb_TE, dtype, adapters):
  """experts_dense's products for the experts of the weights given (all, or one block), weighted by comb_TE."""
  E, D, F = gate_EDF.shape
  T = x_TD.shape[0]

  def low_rank(name, eqn_a, eqn_b, h):
    lr = adapters[name]
    return jnp.einsum(eqn_b, jnp.einsum(eqn_a, h, lr.a.astype(dtype)), lr.b.astype(dtype)) * jnp.asarray(lr.scale, dtype)

  def product(f, x, w):  # a quantized (frozen) weight is dequantized where it is used, in both passes
    return qarray.frozen_product(f, x, w, dtype) if qarray.is_quantized(w) else f(x, w.astype(dtype))

  def in_proj(w_EDF):
    return product(lambda x, w: (x @ w.transpose(1, 0, 2).reshape(D, E * F)).reshape(T, E, F), x_TD, w_EDF)

  g_TEF, u_TEF = in_proj(gate_EDF), in_proj(up_EDF)
  if "gate_proj" in adapters:
    g_TEF = g_TEF + low_rank("gate_proj", "td,edr->ter", "ter,erf->tef", x_TD)
  if "up_proj" in adapters:
    u_TEF = u_TEF + low_rank("up_proj", "td,edr->ter", "ter,erf->tef", x_TD)
  h_TEF = layers.gelu(g_TEF) * u_TEF * comb_TE[:, :, None].astype(dtype)
  y_TD = product(lambda h, w: h.reshape(T, E * F) @ w.reshape(E * F, D), h_TEF, down_EFD)
  if "down_proj" in adapters:
    y_TD = y_TD + low_rank("down_proj", "tef,efr->ter", "ter,erd->td", h_TEF)
  return y_TD


def sort_by_expert(index_Tk, num_experts: int):
  """The routing plan of the sorted paths: (expert_M, order_M, group_sizes_E) for the M = T * k (token,
  slot) pairs in row-major order: their expert ids, the stable permutation that sorts them by expert,
  and the number of pairs of each expert (int32)."""
  expert_M = index_Tk.reshape(-1)
  order_M = jnp.argsort(expert_M, stable=True)
  group_sizes_E = jnp.bincount(expert_M, length=num_experts).astype(jnp.int32)
  return expert_M, order_M, group_sizes_E


def combine_sorted(y_MD, order_M, weights_Tk, dtype):
  """Expert outputs of the sorted pairs back to (token, slot) order (gather by the inverse permutation),
  weighted by the routing weights and summed over the k slots in (at least) fp32."""
  T, k = weights_Tk.shape
  y_TkD = y_MD[jnp.argsort(order_M)].reshape(T, k, y_MD.shape[-1])
  return jnp.sum(y_TkD.astype(layers.at_least_f32(dtype)) * weights_Tk[..., None], axis=1).astype(dtype)


def grouped_geglu(xs_MD, gate_EDF, up_EDF, down_EFD, group_sizes_E, dtype, adapters=None,
                  dot=jax.lax.ragged_dot, fuse_gate_up: bool = False):
  """GeGLU of rows sorted by expert: `dot(h_MX, w_EXY, group_sizes_E)` for each projection (plus the
  adapters as dots of their factors). Weights are cast to `dtype` unless they are `qarray.QArray`s,
  which go to `dot` as they are. `fuse_gate_up`: one dot with gate and up concatenated [E, D, 2F]."""
  adapters = adapters or {}
  cast = lambda w: w if qarray.is_quantized(w) else w.astype(dtype)

  def lora(name, h_MX, y_MY):
    if name not in adapters:
      return y_MY
    lr = adapters[name]
    h_Mr = dot(h_MX, lr.a.astype(dtype), group_sizes_E)
    return y_MY + dot(h_Mr, lr.b.astype(dtype), group_sizes_E) * jnp.asarray(lr.scale, dtype)

  if fuse_gate_up:
    F = gate_EDF.shape[-1]
    gu_MF = dot(xs_MD, moe_kernels.concatenate([cast(gate_EDF), cast(up_EDF)], -1), group_sizes_E)
    g_MF, u_MF = gu_MF[:, :F], gu_MF[:, F:]
  else:
    g_MF = dot(xs_MD, cast(gate_EDF), group_sizes_E)
    u_MF = dot(xs_MD, cast(up_EDF), group_sizes_E)
  h_MF = layers.gelu(lora("gate_proj", xs_MD, g_MF)) * lora("up_proj", xs_MD, u_MF)
  return lora("down_proj", h_MF, dot(h_MF, cast(down_EFD), group_sizes_E))


def experts_ragged(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, adapters=None):
  """Dropless sorted grouped matmuls (`jax.lax.ragged_dot`); adapters as ragged_dots of the factors."""
  k = index_Tk.shape[1]
  _, order_M, group_sizes_E = sort_by_expert(index_Tk, gate_EDF.shape[0])
  xs_MD = x_TD.astype(dtype)[order_M // k]
  y_MD = grouped_geglu(xs_MD, gate_EDF, up_EDF, down_EFD, group_sizes_E, dtype, adapters)
  return combine_sorted(y_MD, order_M, weights_Tk, dtype)


def experts_tokamax(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, adapters=None,
                    width_multiple: int | None = None, implementation=None):
  """The 'ragged' path on `tokamax.ragged_dot` (`moe_kernels.ragged_dot`). Weights may be `qarray.QArray`s:
  they reach tokamax as `qwix.QArray`s (its quantized kernels dequantize tiles in-kernel; its XLA
  implementation, the one on CPU, dequantizes the weight it is given). The expert width F is zero-padded
  to a multiple of `width_multiple` (default `moe_kernels.width_multiple()`: none on CPU, 256 on GPU /
  TPU, for the kernels' block shapes) and, when padded, gate and up run as one fused dot [E, D, 2Fp]."""
  k = index_Tk.shape[1]
  multiple = moe_kernels.width_multiple() if width_multiple is None else width_multiple
  gate_EDF, up_EDF, down_EFD, adapters = moe_kernels.pad_experts(gate_EDF, up_EDF, down_EFD, adapters, multiple)
  _, order_M, group_sizes_E = sort_by_expert(index_Tk, gate_EDF.shape[0])
  xs_MD = x_TD.astype(dtype)[order_M // k]
  dot = lambda h, w, gs: moe_kernels.ragged_dot(h, w, gs, implementation)
  y_MD = grouped_geglu(xs_MD, gate_EDF, up_EDF, down_EFD, group_sizes_E, dtype, adapters, dot=dot,
                       fuse_gate_up=multiple > 1)
  return combine_sorted(y_MD, order_M, weights_Tk, dtype)


def _dispatch_local(x_MD, dest_M, local_expert_M, num_dest: int):
  """Scatters the M (token, slot) rows into a [num_dest, M, D] send buffer, row (d, j) = the j-th row
  bound for device d. Capacity M per destination = the worst case (every row to one device), so
  nothing is ever dropped. Returns (send_NMD, send_expert_NM (local expert id, -1 = empty), pos_M)."""
  M = x_MD.shape[0]
  order_M = jnp.argsort(dest_M, stable=True)
  counts_N = jnp.bincount(dest_M, length=num_dest)
  starts_N = (jnp.cumsum(counts_N) - counts_N).astype(jnp.int32)
  pos_sorted_M = jnp.arange(M, dtype=jnp.int32) - starts_N[dest_M[order_M]]
  pos_M = jnp.zeros((M,), jnp.int32).at[order_M].set(pos_sorted_M)  # slot of each row in its destination
  send_NMD = jnp.zeros((num_dest, M, x_MD.shape[1]), x_MD.dtype).at[dest_M, pos_M].set(x_MD)
  send_expert_NM = jnp.full((num_dest, M), -1, jnp.int32).at[dest_M, pos_M].set(local_expert_M)
  return send_NMD, send_expert_NM, pos_M


def _local_experts(recv_RD, expert_R, gate_LDF, up_LDF, down_LFD, dtype):
  """GeGLU of the local experts over received rows (expert -1 = empty slot, output 0), with
  ragged_dot over rows sorted by local expert (the empty rows sort last, outside every group)."""
  L = gate_LDF.shape[0]
  key_R = jnp.where(expert_R < 0, L, expert_R)
  order_R = jnp.argsort(key_R, stable=True)
  group_sizes_L = jnp.bincount(key_R, length=L + 1)[:L].astype(jnp.int32)
  xs_RD = recv_RD.astype(dtype)[order_R]
  y_RD = grouped_geglu(xs_RD, gate_LDF, up_LDF, down_LFD, group_sizes_L, dtype)
  y_RD = y_RD[jnp.argsort(order_R)]
  return jnp.where((expert_R >= 0)[:, None], y_RD, 0)


def experts_expert_parallel(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype):
  """Dropless expert parallelism (GShard / Switch all-to-all dispatch, without a capacity factor).

  Inside `jax.shard_map` over the context mesh, each device holds E / n experts (n = size of the
  'expert' axis) and T / (batch shards * n) tokens (the token axis is split over the logical 'batch'
  axes plus 'expert'). Per device:
    1. its M = t * k (token, slot) rows go into a [n, M, D] send buffer by destination device
       (owner = expert // (E / n)); 2. `all_to_all` over 'expert'; 3. ragged_dot of the local experts
       on the n * M received rows; 4. `all_to_all` back; 5. gather, weight and sum the k slots.
  With 'expert_mlp' sharded over 'tensor' each device computes a slice of F and the results are
  summed over 'tensor' (`psum`). Memory: the send / receive buffers hold n * M rows per device
  (worst case: every row to one device), n times the M rows a capacity-limited dispatch would
  need; this buys the guarantee that no token is dropped. `jax.lax.ragged_all_to_all` would send
  only the real rows but still needs an n * M receive buffer to be dropless.
  Without a context mesh this is `experts_ragged` (same math on one device).
  """
  mesh = sharding.context_mesh()
  if mesh is None or "expert" not in mesh.shape:
    return experts_ragged(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype)
  T, D = x_TD.shape
  E, F = gate_EDF.shape[0], gate_EDF.shape[2]
  n = mesh.shape["expert"]
  if E % n:
    raise ValueError(f"model.num_experts: {E} experts do not split over mesh.shape.expert={n} devices "
                     "(moe_impl='expert_parallel' needs num_experts % expert == 0)")
  L = E // n
  tok_axes = tuple(a for a in sharding.mesh_axes_of("batch") if a in mesh.shape and a != "expert") + ("expert",)
  shards = math.prod(mesh.shape[a] for a in tok_axes)
  pad = -T % shards  # pad the token axis to whole shards; padded rows get weight 0 and are cut below
  if pad:
    x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
    weights_Tk = jnp.pad(weights_Tk, ((0, pad), (0, 0)))
    index_Tk = jnp.pad(index_Tk, ((0, pad), (0, 0)))
  tp = "tensor" if "tensor" in mesh.shape and mesh.shape["tensor"] > 1 and F % mesh.shape["tensor"] == 0 else None

  def per_device(x_tD, w_tk, idx_tk, gate_LDF, up_LDF, down_LFD):
    t, k = idx_tk.shape
    expert_M = idx_tk.reshape(-1)
    send_NMD, send_expert_NM, pos_M = _dispatch_local(x_tD.astype(dtype)[jnp.arange(t * k) // k],
                                                      expert_M // L, expert_M % L, n)
    # One all_to_all for rows and their expert ids (bit-cast into an extra column): collectives stay
    # in a single dependency chain (dispatch -> experts -> return), none independent of another.
    # (A float64 model, numerical tests only, bit-casts the ids through int64.)
    f32 = layers.at_least_f32(dtype)
    int_t = jnp.int32 if f32 == jnp.float32 else jnp.int64
    packed_NMd = jnp.concatenate(
        [send_NMD.astype(f32), jax.lax.bitcast_convert_type(send_expert_NM.astype(int_t), f32)[..., None]], -1)
    recv_NMd = jax.lax.all_to_all(packed_NMd, "expert", 0, 0)
    recv_NMD = recv_NMd[..., :D].astype(dtype)
    recv_expert_NM = jax.lax.bitcast_convert_type(recv_NMd[..., D], int_t).astype(jnp.int32)
    y_RD = _local_experts(recv_NMD.reshape(-1, D), recv_expert_NM.reshape(-1), gate_LDF, up_LDF, down_LFD, dtype)
    back_NMD = jax.lax.all_to_all(y_RD.reshape(n, -1, D), "expert", 0, 0)
    y_tkD = back_NMD[expert_M // L, pos_M].reshape(t, k, D)
    out_tD = jnp.sum(y_tkD.astype(f32) * w_tk[..., None], axis=1)
    if tp is not None:
      out_tD = jax.lax.psum(out_tD, tp)  # partial sums over the F slices
    return out_tD.astype(dtype)

  tokens = P(tok_axes)
  out_TD = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(tokens, tokens, tokens, P("expert", None, tp), P("expert", None, tp), P("expert", tp, None)),
      out_specs=tokens)(x_TD, weights_Tk, index_Tk, gate_EDF, up_EDF, down_EFD)
  return out_TD[:T]


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
  """Rows per expert slab: factor x the mean load T*k/E, rounded up to a multiple of 8, at most T
  (a token picks an expert at most once, so C = T can never overflow)."""
  mean = num_tokens * k / num_experts
  return int(min(num_tokens, 8 * math.ceil(capacity_factor * mean / 8)))


def capacity_rungs(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> tuple[int, ...]:
  """The slab sizes 'capacity' chooses among, ascending: C_j = `expert_capacity` at factor x 2^j,
  j = 0, 1, ..., ending with C = T (which never overflows). A call runs the smallest rung that holds its
  busiest expert, so a balanced router pays about factor x the useful expert FLOPs and a collapsed one
  (every token sends a slot to one expert) pays the C = T slabs, never a drop."""
  rungs, factor = [], float(capacity_factor)
  while not rungs or rungs[-1] < num_tokens:
    c = expert_capacity(num_tokens, k, num_experts, factor)
    if not rungs or c > rungs[-1]:
      rungs.append(c)
    factor *= 2
  return tuple(rungs)


def capacity_rung(group_sizes_E, rungs) -> jax.Array:
  """Index of the smallest of `rungs` (ascending, the last >= every load) that holds the busiest expert."""
  return jnp.sum(jnp.asarray(rungs[:-1], jnp.int32) < jnp.max(group_sizes_E)).astype(jnp.int32)


def experts_capacity(x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk, index_Tk, dtype, capacity_factor,
                     adapters=None, ladder: bool = True):
  """Dropless capacity dispatch: pair m = (token t, slot j) of expert e with rank r among e's pairs
  (in (t, j) order) goes to row e*C + r of an [E*C, D] slab; gate/up/down are batched matmuls over e
  (every expert's weights read once, E*C rows computed, empty rows are zeros); outputs are gathered
  back and combined with the routing weights in fp32. C is the smallest of `capacity_rungs` that holds
  the busiest expert's pairs, picked at run time by `lax.switch` (one compiled branch per rung).
  `ladder=False` runs the first rung whatever the load, dropping the overflowing pairs: only for tests
  that the ladder is needed."""
  T, D = x_TD.shape
  E, k = gate_EDF.shape[0], index_Tk.shape[1]
  rungs = capacity_rungs(T, k, E, capacity_factor)
  adapters = adapters or {}
  expert_M, order_M, group_sizes_E = sort_by_expert(index_Tk, E)  # M = T * k (token, slot) pairs
  start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  rank_sorted_M = jnp.arange(T * k, dtype=jnp.int32) - start_E[expert_M[order_M]]
  rank_M = jnp.zeros_like(rank_sorted_M).at[order_M].set(rank_sorted_M)  # pair's rank within its expert

  def slabs(C, x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk):
    slot_M = jnp.where(rank_M < C, expert_M * C + rank_M, E * C)  # E * C: out of range, dropped
    x_SD = jnp.zeros((E * C, D), dtype).at[slot_M].set(
        jnp.repeat(x_TD.astype(dtype), k, axis=0), mode="drop")

    def proj(name, h_ECX, w_EXY):
      y = jnp.einsum("ecx,exy->ecy", h_ECX, w_EXY.astype(dtype))
      if name in adapters:
        lr = adapters[name]
        h_ECr = jnp.einsum("ecx,exr->ecr", h_ECX, lr.a.astype(dtype))
        y = y + jnp.einsum("ecr,ery->ecy", h_ECr, lr.b.astype(dtype)) * jnp.asarray(lr.scale, dtype)
      return y

    x_ECD = x_SD.reshape(E, C, D)
    g_ECF = proj("gate_proj", x_ECD, gate_EDF)
    u_ECF = proj("up_proj", x_ECD, up_EDF)
    y_SD = proj("down_proj", layers.gelu(g_ECF) * u_ECF, down_EFD).reshape(E * C, D)
    y_TkD = jnp.take(y_SD, slot_M, axis=0, mode="fill", fill_value=0).reshape(T, k, D)
    return jnp.sum(y_TkD.astype(layers.at_least_f32(dtype)) * weights_Tk[..., None], axis=1).astype(dtype)

  args = (x_TD, gate_EDF, up_EDF, down_EFD, weights_Tk)
  if len(rungs) == 1 or not ladder:
    return slabs(rungs[0], *args)
  branches = [lambda *a, C=C: slabs(C, *a) for C in rungs]
  return jax.lax.switch(capacity_rung(group_sizes_E, rungs), branches, *args)


_AUTO_IMPL = {"cpu": "capacity", "gpu": "dense", "tpu": "ragged"}


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """`cfg.moe_impl` with 'auto' replaced by the implementation for `backend` (default: JAX's default
  backend, read at trace time): CPU -> 'capacity', GPU -> 'dense', TPU and any other backend -> 'ragged'.
  Measured (docs/benchmarks.md):
  - CPU, `bench/moe.py --sizes=small` (2 shared cores, the `small` preset's MoE layer: d 256, 8 experts
    top-2, expert hidden 256, 2048 tokens, fp32; median ms of 3 / 5 interleaved rounds, two runs),
    forward | forward+backward:
      capacity (factor 2)  53 / 52 | 325 / 208      ragged   177 / 175 | 633 / 619
      tokamax (XLA)       265 / 178 | 630 / 629      dense    155 / 154 | 588 / 618
      capacity (factor 4, then the default; C = T here) 102 | 307, ragged 177 | 623, tokamax 178 | 615.
    ('tokamax' on CPU is XLA's ragged_dot, i.e. 'ragged'.) These are factor 2 and 4 as single slabs,
    before the ladder (`capacity_rungs`) replaced the ragged fallback.
    One layer at the sampler's size (d 256, 8 experts top-2, expert hidden 256, 256 canvas tokens): random
    routing (max load 73 of mean 64) 5.6 ms with C = T, 2.5-3.2 ms with the ladder at factor 1.25-2;
    collapsed routing (every token sends a slot to one expert) 5.0-6.9 ms at every factor (the C = T rung).
    Whole sampler step, bench/sampler_vs_hf.py (d 256, 8 experts top-2, 256-token canvas), 2026-12-02:
    the ladder at factor 1.5 (the default) 0.068-0.076 s, one C = T slab (factor 4) 0.089-0.108 s.
    Before the ladder, factor 2 with a ragged fallback ran the fallback on every call of a trained router
    (workdirs/quant_small: the busiest expert took 4x the mean load).
  - GPU (one H200, the full 26B-A4B, bf16, bench/gpu_full_model.py): dense 56.9 ms per denoising step,
    ragged 176.8 ms (jax 0.11.2's ragged_dot lowering is no grouped GEMM). 'tokamax' (its Mosaic GPU
    kernel) and 'capacity' have no GPU figure yet (issue #17), so 'auto' takes the measured best.
  - TPU: not measured; 'ragged' (XLA's native ragged dot)."""
  if impl != "auto":
    return impl
  return _AUTO_IMPL.get(backend or jax.default_backend(), "ragged")


class Experts(nn.Module):
  """E GeGLU experts; weights are plain arrays gate_proj/up_proj [E, D, Fe], down_proj [E, Fe, D]
  (or `qarray.QArray`s, dequantized here to the compute dtype; with moe_impl='tokamax' they go to
  tokamax's quantized kernels as they are).
  LoRA (target 'experts'): a per-expert factor pair next to each (gate_proj_lora_a, ...)."""

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_TD, weights_Tk, index_Tk):
    cfg = self.cfg
    E, D, F = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    pdtype = layers.param_dtype(cfg)
    in_axes, out_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
    gate = self.param("gate_proj", layers.matrix_init(in_axes), (E, D, F), pdtype)
    up = self.param("up_proj", layers.matrix_init(in_axes), (E, D, F), pdtype)
    down = self.param("down_proj", layers.matrix_init(out_axes), (E, F, D), pdtype)
    adapters = {}
    lora = lora_lib.for_target(cfg.lora, "experts")
    if lora is not None:
      for name, axes, (i, o) in (("gate_proj", in_axes, (D, F)), ("up_proj", in_axes, (D, F)),
                                 ("down_proj", out_axes, (F, D))):
        adapters[name] = lora_lib.factor_params(self, name, lora, (i,), axes[1:2], (o,), axes[2:], pdtype,
                                                batch_shape=(E,), batch_axes=axes[:1])
    adapters = adapters if self.lora_active else {}
    dtype = layers.compute_dtype(cfg)
    impl = resolve_impl(cfg.moe_impl)
    if impl == "tokamax":
      gate, up, down = (qarray.unpack(w) if isinstance(w, qarray.PackedInt4) else w for w in (gate, up, down))
      return experts_tokamax(x_TD, gate, up, down, weights_Tk, index_Tk, dtype, adapters or None)
    if impl == "dense":  # quantized weights dequantized inside its products (qarray.frozen_product)
      return experts_dense(x_TD, gate, up, down, weights_Tk, index_Tk, dtype, adapters or None, cfg.moe_dense_block)
    gate, up, down = (qarray.dequantize(w, dtype) for w in (gate, up, down))
    if impl == "expert_parallel":
      if adapters:  # fold W_e + s A_e B_e per expert (a full-size copy of the expert weights)
        fold = lambda w, lr: w + (jnp.einsum("eir,ero->eio", lr.a, lr.b) * lr.scale).astype(w.dtype)
        gate, up, down = (fold(w, adapters[n]) if n in adapters else w
                          for w, n in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")))
      return experts_expert_parallel(x_TD, gate, up, down, weights_Tk, index_Tk, dtype)
    if impl == "capacity":
      return experts_capacity(x_TD, gate, up, down, weights_Tk, index_Tk, dtype, cfg.moe_capacity_factor,
                              adapters or None)
    return experts_ragged(x_TD, gate, up, down, weights_Tk, index_Tk, dtype, adapters or None)


def router_losses(logits_TE, probs_TE, index_Tk, valid_T):
  """Unweighted (Switch load-balancing loss, router z-loss) over valid tokens.

  load balance = E * sum_e f_e * P_e, f_e = fraction of the T*k routing slots sent to e, P_e = mean
  router probability of e; z = mean_t logsumexp(logits_t)^2.
  """
  E, k = probs_TE.shape[-1], index_Tk.shape[-1]
  w_T = valid_T.astype(probs_TE.dtype)
  n = jnp.maximum(jnp.sum(w_T), 1.0)
  counts_TE = jnp.sum(jax.nn.one_hot(index_Tk, E, dtype=probs_TE.dtype), axis=1)
  f_E = jnp.sum(counts_TE * w_T[:, None], axis=0) / (n * k)
  p_E = jnp.sum(probs_TE * w_T[:, None], axis=0) / n
  balance = E * jnp.sum(f_E * p_E)
  z = jnp.sum(jax.nn.logsumexp(logits_TE, axis=-1) ** 2 * w_T) / n
  return balance, z


class MoE(nn.Module):
  """Router reads the residual `x_BTD`; experts read `xn_BTD` (= moe_pre_norm(x), HF
  `pre_feedforward_layernorm_2`). Returns (out_BTD, aux) where aux is {} unless a router loss weight
  is non-zero, then {'router_aux_loss', 'router_z_loss'} (unweighted scalars for this layer).
  `lora_active` False leaves out the LoRA adapters of router and experts (head_only encoder)."""

  cfg: ModelConfig
  lora_active: bool = True

  @nn.compact
  def __call__(self, x_BTD, xn_BTD, valid_BT):
    cfg = self.cfg
    B, T, D = x_BTD.shape
    logits_TE, probs_TE, weights_Tk, index_Tk = Router(cfg, self.lora_active, name="router")(
        x_BTD.reshape(B * T, D))
    out_TD = Experts(cfg, self.lora_active, name="experts")(xn_BTD.reshape(B * T, D), weights_Tk, index_Tk)
    aux = {}
    if cfg.router_aux_loss_weight or cfg.router_z_loss_weight:
      balance, z = router_losses(logits_TE, probs_TE, index_Tk, valid_BT.reshape(B * T))
      aux = {"router_aux_loss": balance, "router_z_loss": z}
    return out_TD.reshape(B, T, D), aux
