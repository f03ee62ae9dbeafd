"""dgemma's jitted sampler vs Hugging Face `DiffusionGemmaForBlockDiffusion.generate` (eager PyTorch, CPU).

  .venv/bin/python bench/sampler_vs_hf.py [--steps=12] [--canvases=2] [--reps=3] [--ar_tokens=256]

Same weights on both sides: a random HF model of the reference doc's measured configuration
(d=256, 6 layers 5 sliding + 1 global, 8 experts top-2, vocab 8192, canvas 256; the `small` preset's
other sizes), saved with `save_pretrained` and read into dgemma with `dgemma.hf.load_hf_checkpoint`.
Both run one prompt for `canvases` canvases of exactly `steps` denoising steps each (early stopping
off: HF confidence_threshold=1e-30 keeps its stopping test running but never met; dgemma
confidence_threshold=0 and early_exit=False; no end tokens), and the decoder passes are counted on
both sides. HF: eager attention and experts (as tests/hf_utils builds it), torch threads = 2, no
torch.compile. dgemma: `dgemma.sampling.generate`, with the MoE paths of --impls (default 'ragged', 'dense'
and 'auto', the default: 'capacity' on CPU); compile excluded (reported). Runs are interleaved (HF, then
each dgemma path, `reps` times); the
median and the best run are reported (on a shared machine the best run is the least disturbed one:
eager torch with 2 threads on 2 busy cores slows down far more than XLA does), with the CPU
contention measured while timing. Times are whole `generate` calls (prompt prefill and the canvas commit included)
divided by the denoising steps. Last, plain autoregressive decoding (`ar_generate`, greedy, no end
ids) of `ar_tokens` tokens on the same trunk (the first --impls path).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import torch
from absl import app, flags

from bench.timing import host_cpu
from dgemma.checkpoints.hf import load_hf_checkpoint
from dgemma.model import Transformer
from dgemma.sampling import SamplerConfig, generate
from dgemma.sampling.autoregressive import ar_generate
from tests import hf_utils

_STEPS = flags.DEFINE_integer("steps", 12, "Denoising steps per canvas (forced on both sides).")
_CANVASES = flags.DEFINE_integer("canvases", 2, "Canvases of 256 tokens.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed runs per side (interleaved).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_AR_TOKENS = flags.DEFINE_integer("ar_tokens", 256, "Tokens decoded autoregressively.")
_THREADS = flags.DEFINE_integer("threads", 2, "torch intra-op threads.")
_IMPLS = flags.DEFINE_list("impls", ["ragged", "dense", "auto"],
                           "dgemma MoE paths to time (model.moe_impl; 'capacity:F' sets moe_capacity_factor=F).")

CANVAS = 256
TEXT = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
            num_global_key_value_heads=1, sliding_window=256, num_experts=8, top_k_experts=2,
            moe_intermediate_size=256)


def hf_model():
  from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
  config = DiffusionGemmaConfig(text_config=hf_utils.text_config("sssssg", **TEXT),
                                vision_config=hf_utils.vision_config(), canvas_length=CANVAS)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"
  torch.manual_seed(0)
  model = DiffusionGemmaForBlockDiffusion(config).float().eval()
  hf_utils.randomize_(model, 0)
  return model


def cpu_pressure():
  """Seconds (cumulative) some task waited for a CPU, or None where PSI is unavailable."""
  try:
    line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    return int(line.split("total=")[1]) / 1e6
  except (OSError, IndexError, ValueError):
    return None


def moe_overrides(spec: str) -> dict:
  """'ragged' | 'dense' | 'auto' | 'capacity:F' -> model config overrides."""
  impl, _, factor = spec.partition(":")
  return dict(moe_impl=impl, **({"moe_capacity_factor": float(factor)} if factor else {}))


def main(argv):
  del argv
  torch.set_num_threads(_THREADS.value)
  S, K, N = _STEPS.value, _CANVASES.value, _CANVASES.value * CANVAS
  hf = hf_model()
  with tempfile.TemporaryDirectory() as tmp:
    hf_utils.save(hf, tmp)
    dg = {spec: load_hf_checkpoint(tmp, config_overrides=moe_overrides(spec)) for spec in _IMPLS.value}
  prompt = np.random.default_rng(0).integers(3, TEXT["vocab_size"], (1, _PROMPT_LEN.value)).astype(np.int32)
  prompt[0, 0] = 2  # BOS

  decoder_calls = [0]
  hf.model.decoder.register_forward_hook(lambda *_: decoder_calls.__setitem__(0, decoder_calls[0] + 1))

  def run_hf(steps=S, new=N):
    decoder_calls[0] = 0
    t = time.perf_counter()
    out = hf.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new, max_denoising_steps=steps,
                      confidence_threshold=1e-30, eos_token_id=None)
    dt = time.perf_counter() - t
    assert out.sequences.shape[1] == prompt.shape[1] + new, out.sequences.shape
    assert decoder_calls[0] == steps * new // CANVAS, decoder_calls[0]
    return dt

  scfg = SamplerConfig(canvas_len=CANVAS, max_denoising_steps=S, confidence_threshold=0.0, early_exit=False,
                       end_ids=())
  runners, compile_s = {}, {}
  for impl, (mcfg, params) in dg.items():
    model, params = Transformer(mcfg), jax.device_put(params)

    def run_dg(model=model, params=params):
      t = time.perf_counter()
      out = generate(model, params, prompt, [prompt.shape[1]], scfg, jax.random.key(0), N)
      jax.block_until_ready(out.tokens_BN)
      assert int(out.num_forwards_B[0]) == S * K, int(out.num_forwards_B[0])
      return time.perf_counter() - t

    compile_s[impl] = run_dg()  # compile + first run
    runners[f"dgemma (MoE {impl})"] = run_dg

  run_hf(steps=2, new=CANVAS)  # warm up torch
  pressure0, t_start = cpu_pressure(), time.perf_counter()
  times = {"HF eager": []} | {name: [] for name in runners}
  for _ in range(_REPS.value):
    times["HF eager"].append(run_hf())
    for name, fn in runners.items():
      times[name].append(fn())
  med = {name: statistics.median(v) for name, v in times.items()}
  best = {name: min(v) for name, v in times.items()}

  # autoregressive decoding on the same trunk (greedy, no end ids: exactly ar_tokens tokens)
  mcfg, params = dg[_IMPLS.value[0]]
  model, params = Transformer(mcfg), jax.device_put(params)
  A = _AR_TOKENS.value

  def run_ar():
    t = time.perf_counter()
    toks, lens = ar_generate(model, params, prompt, [prompt.shape[1]], None, A, end_ids=())
    jax.block_until_ready(toks)
    assert int(lens[0]) == A
    return time.perf_counter() - t

  ar_compile = run_ar()
  ar_s = statistics.median([run_ar() for _ in range(_REPS.value)])

  steps = S * K
  print(f"command: {' '.join(sys.argv)}")
  print(f"cpu: {host_cpu()}")
  print(f"model: d=256, 6 layers (5 sliding + 1 global), 8 experts top-2, vocab 8192, canvas {CANVAS}; "
        f"float32; prompt {prompt.shape[1]} tokens; {K} canvas(es) x {S} steps = {steps} decoder passes, "
        f"{N} tokens; torch {torch.__version__} threads={torch.get_num_threads()}, jax {jax.__version__} "
        f"{jax.devices()[0].platform}")
  print("dgemma compile + first run: " + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items())
        + f"; ar_generate {ar_compile:.1f} s (excluded below)")
  print(f"{'sampler':<22} {'s/run':>8} {'s/step':>8} {'tokens/s':>9} {'x HF':>6} {'best s/step':>12} "
        f"{'x HF':>6}   runs (s)")
  for name, t in med.items():
    print(f"{name:<22} {t:>8.2f} {t / steps:>8.3f} {N / t:>9.1f} {med['HF eager'] / t:>6.2f} "
          f"{best[name] / steps:>12.3f} {best['HF eager'] / best[name]:>6.2f}   "
          + " ".join(f"{x:.2f}" for x in times[name]))
  print(f"{'AR dgemma (' + _IMPLS.value[0] + ')':<22} {ar_s:>8.2f} {ar_s / A:>8.4f} {A / ar_s:>9.1f}   "
        f"greedy, {A} tokens + {prompt.shape[1]}-token prefill, one T=1 encoder pass per token; s/step = s/token")
  if pressure0 is not None:
    stalled = (cpu_pressure() - pressure0) / (time.perf_counter() - t_start)
    print(f"CPU contention while timing: some task waited for a core {stalled:.0%} of the time "
          "(/proc/pressure/cpu; 0% = machine to ourselves)")


if __name__ == "__main__":
  app.run(main)
