"""The DiffusionGemma canvas sampler (released defaults) and the uniform-state ancestral ablation.

One canvas is denoised by up to `max_denoising_steps` decoder passes against a read-only KV cache.

sampler='released' (reference doc, "Sampler (released defaults)"; numerics follow HF transformers
5.24, `generation_diffusion_gemma.py`). Per step s = 0 .. S-1:

  logits   = decoder(canvas, cache, self-conditioning logits)            (no signal at s = 0)
  T_s      = t_min + (t_max - t_min) * (S - s) / S                        (HF counts steps S..1, so
                                                                           T_0 = t_max, T_{S-1} > t_min)
  proc     = logits / T_s                                                 (+ optional top-k / top-p)
  sampled  ~ softmax(proc) at every position;  argmax = argmax(proc)
  H_i      = entropy(softmax(proc_i));  accept lowest-H positions while cumsum(H) - H_i <= bound
  canvas'  = accepted ? sampled : fresh uniform token                     (nothing is frozen)
  stop row when argmax == previous argmax for `stability_threshold` steps and mean(H) < threshold;
  finished rows keep canvas, argmax and self-conditioning logits unchanged
  sc_logits = proc
The canvas result is the argmax canvas (HF appends `argmax_canvas`, not the sampled canvas).

sampler='ancestral' (reference doc, "Uniform-state diffusion likelihood", posterior): the time grid
t_s = 1 - s / S runs from 1 to 0; step s draws z_{t_{s+1}} ~ q(. | z_{t_s}, x_theta) with
x_theta = softmax(proc) (same temperature schedule, shaping and self-conditioning as released) and,
with `greedy_last_step`, the last step takes the argmax of its posterior q(z_0 | z_t, x_theta). No
acceptance, no early stopping (the sample is only complete at t = 0); the canvas result is the final canvas
z_0. x_theta is the model's leave-one-out prior p(x_i | z_t without i), the distribution for which
q(z_s | z_t, x_theta) is the true reverse step (dgemma/diffusion/objectives.py docstring): for a model whose
output f is a posterior (every objective but the loo ones, and the released model) softmax(f - delta(alpha_t)
onehot(z_t)) (objectives.loo_from_posterior), for a leave-one-out model (`loo_logits`) softmax(f), before the
temperature. The self-conditioning signal stays the tempered network output, as in training.

sampler='masked': ancestral sampling of the masked-diffusion baseline (diffusion.objective='mdlm';
MDLM, Sahoo et al. 2024). The canvas starts as all `mask_id`; on the same time grid a masked position
is revealed with probability (alpha_s - alpha_t) / (1 - alpha_t), drawing its token from x_theta (the
mask token excluded), and a revealed token is never changed again (SUBS parameterisation). At
t = 0 (alpha = 1) every position is revealed; the canvas result is z_0.

The released sampler uses the network logits as they are for every objective: its canvas mixes
accepted samples and fresh noise, so no diffusion time (and no loo shift) is defined for it: it reads a
posterior model's output as the posterior, and a leave-one-out model's as it is.

Two loop forms with identical results: `lax.scan` over all steps (finished rows frozen) and
`lax.while_loop` that exits as soon as every row has finished (`early_exit`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from dgemma import reductions
from dgemma.sampling import live, rules
from dgemma.sampling.config import SamplerConfig
from dgemma.sampling.rules import KINDS

# ---- the denoising loop --------------------------------------------------------------------------


@struct.dataclass
class Trajectory:
  """Per-step record of one canvas ([S, B, C]; `active_SB` [S, B]). Entries of steps a row did not
  run (finished or never reached) keep the fill: tokens -1, accepted False, entropy 0.

  canvas: the decoder input; sampled: the denoiser's sample (released) or z_s (ancestral);
  argmax: the argmax prediction; accepted: tokens held on the canvas after the step (released:
  the acceptance mask, plus tokens kept by renoise='low_confidence' and infilled ones; ancestral:
  z_s == argmax); shown: what the step produced before re-noising (released: the newly accepted
  positions' samples, elsewhere the input token; ancestral: z_s); entropy: per-position entropy
  of the tempered distribution.
  """

  canvas_SBC: jax.Array
  sampled_SBC: jax.Array
  argmax_SBC: jax.Array
  accepted_SBC: jax.Array
  shown_SBC: jax.Array
  entropy_SBC: jax.Array
  active_SB: jax.Array

  @classmethod
  def empty(cls, steps: int, batch: int, canvas_len: int) -> "Trajectory":
    tok = jnp.full((steps, batch, canvas_len), -1, jnp.int32)
    return cls(canvas_SBC=tok, sampled_SBC=tok, argmax_SBC=tok,
               accepted_SBC=jnp.zeros((steps, batch, canvas_len), bool), shown_SBC=tok,
               entropy_SBC=jnp.zeros((steps, batch, canvas_len), jnp.float32),
               active_SB=jnp.zeros((steps, batch), bool))


@struct.dataclass
class DenoiseState:
  """Carry of the per-canvas loop."""

  step: jax.Array            # int32 [], next step to run (0-based)
  canvas_BC: jax.Array       # int32, the decoder input
  sc_BCX: jax.Array          # self-conditioning signal from the previous step: its processed logits [B, C, V]
                             # (semantics 'hf'), or their bf16 soft embedding [B, C, D] ('official')
  argmax_BC: jax.Array       # int32, the latest argmax canvas (-1 before the first step)
  held_BC: jax.Array         # bool, accepted tokens kept on the canvas (renoise='low_confidence')
  stable_B: jax.Array        # int32, consecutive steps with an unchanged argmax canvas
  done_B: jax.Array          # bool, row finished (stable and confident, or inactive from the start)
  num_forwards_B: jax.Array  # int32, decoder passes the row needed
  traj: Optional[Trajectory] = None


# decode_fn(canvas_BC, sc_BCX, sc_mask_B) -> logits_BCV; sc_signal_fn(processed logits_BCV) -> sc_BCX
DecodeFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def returns_argmax(cfg: SamplerConfig) -> bool:
  """Whether the canvas result is the argmax canvas (the released sampler with HF semantics) or the final
  canvas (ancestral / masked z_0; the official sampler's last sampled, re-noised canvas)."""
  return KINDS[cfg.sampler].returns_argmax and cfg.semantics == "hf"


def canvas_result(state: DenoiseState, cfg: SamplerConfig) -> jax.Array:
  """The canvas a denoising run produced (`returns_argmax`)."""
  return state.argmax_BC if returns_argmax(cfg) else state.canvas_BC


def initial_canvas(cfg: SamplerConfig, noise: Any, canvas_idx, canvas_len: int, vocab_size: int) -> jax.Array:
  """Step 1: uniform random tokens, or all mask tokens for sampler='masked'."""
  if KINDS[cfg.sampler].starts_masked:
    batch = noise.init_canvas(canvas_idx, canvas_len, vocab_size).shape[0]
    return jnp.full((batch, canvas_len), cfg.mask_id, jnp.int32)
  return noise.init_canvas(canvas_idx, canvas_len, vocab_size)


def _denoise_step(state: DenoiseState, *, decode_fn: DecodeFn, sc_signal_fn: Callable, cfg: SamplerConfig,
                  noise: Any, canvas_idx, fixed_BC, fixed_mask_BC, callback_id) -> DenoiseState:
  s = state.step
  batch = state.canvas_BC.shape[0]
  done_B = state.done_B
  kind = KINDS[cfg.sampler]

  # 2. decoder forward; no self-conditioning signal at the first step (reference doc, step 8)
  sc_mask_B = jnp.broadcast_to((s > 0) & cfg.self_conditioning, (batch,))
  logits_BCV = decode_fn(state.canvas_BC, state.sc_BCX, sc_mask_B).astype(jnp.float32)
  # 3. temperature (+ optional shaping): HF's processed logits, which are also the self-conditioning signal;
  # a kind with x0_logits steps on its own reading of the network output (the ancestral kinds: the
  # leave-one-out prior), tempered and shaped the same way. Without self-conditioning the signal is zeroed
  # by the decoder, so that kind shapes one [B, C, V] array, not two.
  temperature = rules.temperature(cfg, s)
  if kind.x0_logits is None:
    proc_BCV = step_BCV = rules.shape_logits(logits_BCV / temperature, cfg)
  else:
    step_BCV = rules.shape_logits(kind.x0_logits(logits_BCV, state, cfg, s) / temperature, cfg)
    proc_BCV = rules.shape_logits(logits_BCV / temperature, cfg) if cfg.self_conditioning else step_BCV
  argmax_BC = reductions.argmax(step_BCV)
  canvas_BC, held_BC, accepted_BC, shown_BC, sampled_BC, argmax_BC, ent_BC = kind.step(
      state, cfg, noise, canvas_idx, s, step_BCV, argmax_BC, fixed_BC, fixed_mask_BC)

  # 7. finished rows stop changing (HF freezes canvas, argmax and self-conditioning logits)
  canvas_BC = jnp.where(done_B[:, None], state.canvas_BC, canvas_BC)
  argmax_BC = jnp.where(done_B[:, None], state.argmax_BC, argmax_BC)
  held_BC = jnp.where(done_B[:, None], state.held_BC, held_BC)
  # (HF: the processed logits in the embedding dtype, `processed_logits.to(embed_tokens.weight.dtype)`)
  sc_BCX = jnp.where(done_B[:, None, None], state.sc_BCX, sc_signal_fn(proc_BCV))
  stable_B, stops_B = rules.stopping(cfg, argmax_BC, state.canvas_BC, state.argmax_BC, state.stable_B, ent_BC)
  # the sample of ancestral kinds is complete only at t = 0
  new_done_B = (done_B | stops_B) if kind.stops_early else done_B

  active_B = ~done_B
  if cfg.show == "live":  # host view of the step (dgemma.sampling.live), in execution order
    view_result_BC = argmax_BC if returns_argmax(cfg) else canvas_BC
    jax.debug.callback(live.emit, callback_id, canvas_idx, s, shown_BC, accepted_BC, view_result_BC, active_B,
                       ordered=True)

  traj = state.traj
  if traj is not None:

    def put(buf_SBX, new_BX):
      mask = active_B.reshape((batch,) + (1,) * (new_BX.ndim - 1))
      return buf_SBX.at[s].set(jnp.where(mask, new_BX, buf_SBX[s]))

    traj = Trajectory(canvas_SBC=put(traj.canvas_SBC, state.canvas_BC),
                      sampled_SBC=put(traj.sampled_SBC, sampled_BC),
                      argmax_SBC=put(traj.argmax_SBC, argmax_BC),
                      accepted_SBC=put(traj.accepted_SBC, accepted_BC),
                      shown_SBC=put(traj.shown_SBC, shown_BC),
                      entropy_SBC=put(traj.entropy_SBC, ent_BC),
                      active_SB=traj.active_SB.at[s].set(active_B))

  # 8. this step's processed logits condition the next step
  return DenoiseState(step=s + 1, canvas_BC=canvas_BC, sc_BCX=sc_BCX, argmax_BC=argmax_BC,
                      held_BC=held_BC, stable_B=stable_B.astype(jnp.int32), done_B=new_done_B,
                      num_forwards_B=state.num_forwards_B + active_B.astype(jnp.int32), traj=traj)


def init_state(init_canvas_BC: jax.Array, vocab_size: int, *, done_B: jax.Array | None = None,
               steps: int = 0, record: bool = False, sc_signal_fn: Callable | None = None,
               sc_dtype=jnp.float32) -> DenoiseState:
  batch, canvas_len = init_canvas_BC.shape
  sc_signal_fn = sc_signal_fn or (lambda proc_BCV: proc_BCV.astype(sc_dtype))
  signal = jax.eval_shape(sc_signal_fn, jax.ShapeDtypeStruct((batch, canvas_len, vocab_size), jnp.float32))
  return DenoiseState(
      step=jnp.zeros((), jnp.int32),
      canvas_BC=init_canvas_BC.astype(jnp.int32),
      sc_BCX=jnp.zeros(signal.shape, signal.dtype),
      argmax_BC=jnp.full((batch, canvas_len), -1, jnp.int32),
      held_BC=jnp.zeros((batch, canvas_len), bool),
      stable_B=jnp.zeros((batch,), jnp.int32),
      done_B=jnp.zeros((batch,), bool) if done_B is None else done_B,
      num_forwards_B=jnp.zeros((batch,), jnp.int32),
      traj=Trajectory.empty(steps, batch, canvas_len) if record else None)


def denoise_canvas(decode_fn: DecodeFn, cfg: SamplerConfig, noise: Any, init_canvas_BC: jax.Array,
                   vocab_size: int, *, canvas_idx=0, done_B: jax.Array | None = None,
                   fixed_BC: jax.Array | None = None, fixed_mask_BC: jax.Array | None = None,
                   record: bool = False, sc_dtype=jnp.float32, sc_signal_fn: Callable | None = None,
                   callback_id=0) -> DenoiseState:
  """Denoises one canvas; traceable (call under `jax.jit`).

  decode_fn(canvas_BC, sc_BCX, sc_mask_B) -> logits_BCV runs the decoder against the cache, given the
  previous step's self-conditioning signal sc_BCX = sc_signal_fn(processed logits) (default: the logits
  in `sc_dtype`, HF's signal; the official semantics pass their bf16 soft embedding).
  noise: a source from `dgemma.sampling.noise` (draws indexed by `canvas_idx` and step).
  done_B: rows that take no step (e.g. already ended); they keep the initial state.
  fixed_BC / fixed_mask_BC: infilling; masked positions hold the given token throughout and in the
    output, are never re-noised, and do not count against the acceptance budget.
  sc_dtype: dtype the self-conditioning logits are kept in by the default sc_signal_fn (HF: the embedding
    dtype).
  callback_id: with cfg.show == 'live', the `live.register` id whose function receives every step.
  Returns the final state: `canvas_result(state, cfg)` is the canvas result, `num_forwards_B` the
  passes per row, `traj` the per-step record when `record`.
  """
  steps = cfg.max_denoising_steps
  if fixed_mask_BC is not None:
    if fixed_mask_BC.shape != init_canvas_BC.shape or fixed_BC.shape != init_canvas_BC.shape:
      raise ValueError(f"fixed_BC / fixed_mask_BC: expected the canvas shape {init_canvas_BC.shape}, got "
                       f"{fixed_BC.shape} / {fixed_mask_BC.shape}")
    fixed_BC = fixed_BC.astype(jnp.int32)
    init_canvas_BC = jnp.where(fixed_mask_BC, fixed_BC, init_canvas_BC)
  sc_signal_fn = sc_signal_fn or (lambda proc_BCV: proc_BCV.astype(sc_dtype))
  state = init_state(init_canvas_BC, vocab_size, done_B=done_B, steps=steps, record=record, sc_signal_fn=sc_signal_fn)
  step_fn = lambda st: _denoise_step(st, decode_fn=decode_fn, sc_signal_fn=sc_signal_fn, cfg=cfg, noise=noise,
                                     canvas_idx=canvas_idx, fixed_BC=fixed_BC, fixed_mask_BC=fixed_mask_BC,
                                     callback_id=callback_id)
  if cfg.early_exit:
    state = jax.lax.while_loop(lambda st: (st.step < steps) & ~jnp.all(st.done_B), step_fn, state)
  else:
    state, _ = jax.lax.scan(lambda st, _: (step_fn(st), None), state, None, length=steps)
  return state
