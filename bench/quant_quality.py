"""Quality of weight-only quantized inference: the likelihood bound of a trained run at fp32 / int8 / int4.

  .venv/bin/python bench/quant_quality.py --workdir=workdirs/demo [--batches=16] [--group_size=64]
  .venv/bin/python bench/quant_quality.py --workdir=workdirs/quant_small --cache_dir=data_cache  # small preset

The run's params (latest checkpoint) are quantized with `dgemma.quant.quantize_params` and scored by
the training eval step (`diffusion_loss(..., eval_metrics=True)`) on the same validation batches with
the same diffusion times (antithetic t), so the rows differ only by the weights: `canvas_nelbo` is the
Monte-Carlo estimate of the uniform-state NELBO integrand per canvas token (nats; an upper bound on
the NLL without the t=0 term), `canvas_ce` the clean-token cross-entropy, `canvas_accuracy` the
argmax accuracy. `passes` is the mean number of decoder passes the released sampler (early exit on,
the run's sample settings) takes per canvas, generating one canvas after each of --prompts prompts (the
text of the first --prompt_len tokens of validation rows, the same prompts and seed for every scheme): worse logits
make the entropy-bound sampler accept fewer tokens per step, so a scheme that saves bytes but costs
steps shows it here (`sem`: the standard error of that mean over the prompts; a weak model may never meet the stopping rule, mean entropy < 0.005, at the
released temperatures: then every scheme shows --steps, and a lower --temperature makes the count
informative). The Sudoku solve-rate delta needs the Sudoku benchmark and is not measured here.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import ml_collections
import numpy as np
from absl import app, flags

from dgemma import api, checkpoints, data, quant
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma.train import evaluate, step as step_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "A dgemma training workdir (config.json + checkpoints).")
_BATCHES = flags.DEFINE_integer("batches", 16, "Validation batches scored per scheme (the same for all).")
_GROUP = flags.DEFINE_integer("group_size", 64, "int4 group size (sample.quant_group_size; 0 = per channel).")
_SCHEMES = flags.DEFINE_list("schemes", ["none", "int8", "int4"], "Schemes to compare; 'none' is the reference.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Prompts generated from per scheme for the decoder-pass count (0 = skip).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Tokens of each validation row used as its prompt.")
_STEPS = flags.DEFINE_integer("steps", 48, "sample.max_denoising_steps for the pass count (48 = released).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature for the pass count (t_max = t_min; "
                                  "default: the run's schedule).")
_CACHE_DIR = flags.DEFINE_string("cache_dir", "", "Override data.cache_dir of the run (where its dataset lives).")
flags.mark_flag_as_required("workdir")


def validation_prompts(settings, prepared, count: int, length: int) -> list[list[int]]:
  """The first `length` real tokens of the first `count` validation rows (the same for every scheme)."""
  prompts, data_iter = [], data.make_iterator(settings, prepared, settings.eval.split)
  while len(prompts) < count:
    batch = next(data_iter)
    for tokens_L, seg_L in zip(np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])):
      ids = [int(t) for t in tokens_L[seg_L != 0][:length]]
      if ids and len(prompts) < count:
        prompts.append(ids)
  return prompts


def mean_decoder_passes(ckpt, config, qcfg, prompts: list[list[int]], canvas_len: int) -> tuple[float, float]:
  """(mean, standard error) of the decoder passes per canvas of the run's sampler with these weights
  (nan without prompts)."""
  if not prompts:
    return float("nan"), float("nan")
  run = ml_collections.ConfigDict(config.to_dict())
  run.sample.quantize, run.sample.quant_group_size = qcfg.scheme, qcfg.group_size
  run.sample.early_exit = True
  settings = settings_lib.from_config(run)
  model = api.Model(ckpt, settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))
  out = model.generate([model.tokenizer.decode(ids) for ids in prompts], max_new_tokens=canvas_len, seed=0,
                       steps=_STEPS.value, temperature=_TEMPERATURE.value)
  passes = np.asarray([g.num_forwards for g in out], np.float64)
  sem = float(np.std(passes, ddof=1) / np.sqrt(len(passes))) if len(passes) > 1 else float("nan")
  return float(np.mean(passes)), sem


def main(argv):
  del argv
  described = checkpoints.header(_WORKDIR.value, "--workdir")
  config = api.run_config(described)
  if _CACHE_DIR.value:
    config.data.cache_dir = _CACHE_DIR.value
  config.diffusion.antithetic_t = True  # low-variance t over each batch (the NELBO eval setting)
  settings = settings_lib.from_config(config)
  qcfgs = {s: quant.QuantConfig(s, _GROUP.value) for s in _SCHEMES.value}
  ckpt = checkpoints.load(described)
  model_cfg, params, step = ckpt.model, ckpt.params, ckpt.step
  for q in qcfgs.values():
    quant.check(model_cfg, q)
  prepared = data.prepare(settings)
  eval_step = jax.jit(step_lib.make_eval_step(model_cfg, settings.diffusion))
  sharding = mesh_lib.batch_sharding(mesh_lib.make_mesh(settings.mesh.axis_sizes), settings.mesh.axis_rules)
  rng = jax.random.PRNGKey(123)
  prompts = validation_prompts(settings, prepared, _PROMPTS.value, _PROMPT_LEN.value)
  rows = {}
  for name, qcfg in qcfgs.items():
    t0 = time.perf_counter()
    qparams = quant.quantize_params(params, qcfg)
    data_iter = data.make_iterator(settings, prepared, settings.eval.split)
    metrics = evaluate.validation_metrics(eval_step, qparams, data_iter, _BATCHES.value, sharding, rng)
    metrics["passes"], metrics["passes_sem"] = mean_decoder_passes(ckpt, config, qcfg, prompts, settings.diffusion.canvas_len)
    rows[name] = (metrics, quant.tree_bytes(qparams), time.perf_counter() - t0)

  print(f"command: {' '.join(sys.argv)}")
  print(f"run: {_WORKDIR.value} step {step}, model {config.model.get('preset', '?')} (d={model_cfg.d_model}, "
        f"{model_cfg.num_layers} layers, {model_cfg.num_experts} experts, vocab {model_cfg.vocab_size}); "
        f"{_BATCHES.value} validation batches of {config.data.batch_size}x{config.data.seq_len}, canvas "
        f"{config.diffusion.canvas_len}, antithetic t; int4 group size {_GROUP.value}; passes: {len(prompts)} "
        f"prompts, <= {_STEPS.value} steps, temperature {_TEMPERATURE.value or 'of the run'}")
  ref = rows[_SCHEMES.value[0]][0]
  print(f"{'weights':<8} {'MiB':>7} {'canvas_nelbo':>12} {'delta':>8} {'canvas_ce':>10} {'delta':>8} "
        f"{'accuracy':>9} {'delta':>8} {'passes':>7} {'delta':>7} {'sem':>5} {'s':>6}")
  for name, (m, nbytes, secs) in rows.items():
    print(f"{name:<8} {nbytes / 2**20:>7.2f} {m['canvas_nelbo']:>12.4f} {m['canvas_nelbo'] - ref['canvas_nelbo']:>+8.4f} "
          f"{m['canvas_ce']:>10.4f} {m['canvas_ce'] - ref['canvas_ce']:>+8.4f} {m['canvas_accuracy']:>9.4f} "
          f"{m['canvas_accuracy'] - ref['canvas_accuracy']:>+8.4f} {m['passes']:>7.2f} "
          f"{m['passes'] - ref['passes']:>+7.2f} {m['passes_sem']:>5.2f} {secs:>6.1f}")


if __name__ == "__main__":
  app.run(main)
