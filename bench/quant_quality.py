"""Quality of weight-only quantized inference: the likelihood bound of a trained run at fp32 / int8 / int4.

  .venv/bin/python bench/quant_quality.py --workdir=workdirs/demo [--batches=16] [--group_size=64]
  .venv/bin/python bench/quant_quality.py --workdir=workdirs/quant_small --cache_dir=data_cache  # small preset

The run's params (latest checkpoint) are quantized with `dgemma.quant.quantize_params` and scored by
the training eval step (`diffusion_loss(..., eval_metrics=True)`) on the same validation batches with
the same diffusion times (antithetic t), so the rows differ only by the weights: `canvas_nelbo` is the
Monte-Carlo estimate of the uniform-state NELBO integrand per canvas token (nats; an upper bound on
the NLL without the t=0 term), `canvas_ce` the clean-token cross-entropy, `canvas_accuracy` the
argmax accuracy. The Sudoku solve-rate delta needs the Sudoku benchmark and is not measured here.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
from absl import app, flags

from dgemma import diffusion, quant, sample_lib, trainer
from dgemma.data import pipeline as data_pipeline

_WORKDIR = flags.DEFINE_string("workdir", None, "A dgemma training workdir (config.json + checkpoints).")
_BATCHES = flags.DEFINE_integer("batches", 16, "Validation batches scored per scheme (the same for all).")
_GROUP = flags.DEFINE_integer("group_size", 64, "int4 group size (sample.quant_group_size; 0 = per channel).")
_SCHEMES = flags.DEFINE_list("schemes", ["none", "int8", "int4"], "Schemes to compare; 'none' is the reference.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", "", "Override data.cache_dir of the run (where its dataset lives).")
flags.mark_flag_as_required("workdir")


def main(argv):
  del argv
  config = sample_lib.run_config(_WORKDIR.value)
  if _CACHE_DIR.value:
    config.data.cache_dir = _CACHE_DIR.value
  config.diffusion.antithetic_t = True  # low-variance t over each batch (the NELBO eval setting)
  qcfgs = {s: quant.QuantConfig(s, _GROUP.value) for s in _SCHEMES.value}
  model_cfg, params, step = trainer.load_params(_WORKDIR.value, config)
  for q in qcfgs.values():
    quant.check(model_cfg, q)
  prepared = data_pipeline.prepare(config)
  loss_cfg = diffusion.DiffusionLossConfig.from_config(config)
  eval_step = jax.jit(trainer.make_eval_step(model_cfg, loss_cfg))
  sharding = trainer.batch_sharding(trainer.make_mesh(config.mesh), config)
  rng = jax.random.PRNGKey(123)
  rows = {}
  for name, qcfg in qcfgs.items():
    t0 = time.perf_counter()
    qparams = quant.quantize_params(params, qcfg)
    data_iter = data_pipeline.make_iterator(config, prepared, config.eval.split)
    metrics = trainer.evaluate(eval_step, qparams, data_iter, _BATCHES.value, sharding, rng)
    rows[name] = (metrics, quant.tree_bytes(qparams), time.perf_counter() - t0)

  print(f"command: {' '.join(sys.argv)}")
  print(f"run: {_WORKDIR.value} step {step}, model {config.model.get('preset', '?')} (d={model_cfg.d_model}, "
        f"{model_cfg.num_layers} layers, {model_cfg.num_experts} experts, vocab {model_cfg.vocab_size}); "
        f"{_BATCHES.value} validation batches of {config.data.batch_size}x{config.data.seq_len}, canvas "
        f"{config.diffusion.canvas_len}, antithetic t; int4 group size {_GROUP.value}")
  ref = rows[_SCHEMES.value[0]][0]
  print(f"{'weights':<8} {'MiB':>7} {'canvas_nelbo':>12} {'delta':>8} {'canvas_ce':>10} {'delta':>8} "
        f"{'accuracy':>9} {'delta':>8} {'s':>6}")
  for name, (m, nbytes, secs) in rows.items():
    print(f"{name:<8} {nbytes / 2**20:>7.2f} {m['canvas_nelbo']:>12.4f} {m['canvas_nelbo'] - ref['canvas_nelbo']:>+8.4f} "
          f"{m['canvas_ce']:>10.4f} {m['canvas_ce'] - ref['canvas_ce']:>+8.4f} {m['canvas_accuracy']:>9.4f} "
          f"{m['canvas_accuracy'] - ref['canvas_accuracy']:>+8.4f} {secs:>6.1f}")


if __name__ == "__main__":
  app.run(main)
