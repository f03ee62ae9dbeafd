"""Ablation runner: sweep named settings of a run config, evaluate each, write a CSV and PNG plots.

  python -m eval.ablate --config=configs/ablations/steps_quality.py
  python -m eval.ablate --config=configs/ablations/steps_quality.py --config.out_dir=/tmp/sq \
      --config.checkpoint=workdirs/demo

Interface (an ablation config's `get_config()` returns a ConfigDict with these fields):
  base        str: the run config every setting starts from, a config file ('configs/demo.py', or
              'file.py:arg' for a get_config(arg)).
  checkpoint  str: a trained run of `base` (any checkpoint kind dgemma.load reads, dgemma/checkpoints/)
              for the settings that change only evaluation keys; '' = train `base` (+ `overrides`) into
              out_dir/runs/base first.
  overrides   tuple of (dotted key, value) pairs applied to `base` before every setting (e.g. fewer samples);
              pairs because ConfigDict field names cannot contain dots (a plain dict works from Python).
  settings    tuple of (name, group, overrides): one CSV row each, overrides as (dotted key, value) pairs;
              `group` names the line the point belongs to in the plots (e.g. the sampler), so a sweep can
              draw several curves.
  metric      str: a name in METRICS ('samples', 'likelihood') or 'package.module:function' (a study's:
              'proj.sudoku.eval:ablation_metrics').
  plots       tuple of (x column, y column, file name): one PNG each, one line per group, points in
              settings order.
  out_dir     str: results.csv, results.json (rows + the exact config) and the PNGs go here.

A setting whose overrides touch only `sample.*`, `eval.*` or `seed` is evaluated on `checkpoint`. One that
changes anything else (model, data, diffusion, opt, train: e.g. diffusion.objective='mdlm' for masked vs
uniform noise) needs its own model: the runner trains base + overrides + setting into out_dir/runs/<name>
(train.py semantics: re-running resumes, a finished run is reused) and evaluates that run.

A metric function is `fn(model: dgemma.Model) -> dict[str, number]`: the run's weights with the setting's
evaluation overrides applied to its settings (`model.settings`). Register one with `register_metric(name, fn)` or by
adding `name: 'module:function'` to METRICS (imported on first use). CSV columns: name, group, then every
override key of any setting, then the metric keys (union over settings), in first-seen order.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any, Callable, Union

import ml_collections

import dgemma
from dgemma import api, checkpoints, files, registry, run_report
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.tools import cli
from dgemma.train import loop as train_loop

MetricFn = Callable[[dgemma.Model], dict]

# name -> callable or 'module:function' (imported lazily, so a metric's module loads only when used).
METRICS: dict[str, Union[str, MetricFn]] = {
    "samples": "eval.samples:ablation_metrics",
    "likelihood": "eval.likelihood:ablation_metrics",
}

ABLATION_FIELDS = ("base", "checkpoint", "overrides", "settings", "metric", "plots", "out_dir")


def register_metric(name: str, fn: MetricFn) -> None:
  METRICS[name] = fn


def metric_fn(name: str) -> MetricFn:
  """The metric function for a registry name or 'module:function' (error names the field)."""
  spec = METRICS.get(name, name)
  if callable(spec):
    return spec
  if ":" not in spec:
    raise ConfigError(f"metric: {name!r} is not a registered metric ({sorted(METRICS)}) nor 'module:function'")
  return registry.load_function(spec, "metric")


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """The `base` config file ('configs/demo.py' or 'file.py:arg')."""
  try:
    return cli.load_config_file(spec)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"base: {e}") from None


def as_overrides(value, field: str) -> dict[str, Any]:
  """(dotted key, value) pairs or a dict -> dict (error names the field)."""
  if isinstance(value, (dict, ml_collections.ConfigDict)):
    return dict(value)
  try:
    pairs = [(str(k), v) for k, v in value]
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{field}: expected (dotted key, value) pairs, got {value!r}") from e
  return dict(pairs)


def _needs_training(overrides: dict) -> bool:
  return any(key.split(".")[0] not in api.EVAL_GROUPS for key in overrides)


def check_ablation(ablation: ml_collections.ConfigDict) -> list[tuple[str, str, dict]]:
  """Validates the ablation config cheaply (every setting's config too); returns the settings."""
  missing = [f for f in ABLATION_FIELDS if f not in ablation]
  if missing:
    raise ConfigError(f"ablation config: missing field(s) {missing} (eval/ablate.py docstring)")
  settings = []
  names = set()
  for i, item in enumerate(ablation.settings):
    if len(item) != 3:
      raise ConfigError(f"settings[{i}]: expected (name, group, overrides), got {item!r}")
    name, group, overrides = str(item[0]), str(item[1]), as_overrides(item[2], f"settings[{i}]")
    if name in names or not name or "/" in name:
      raise ConfigError(f"settings[{i}]: name {name!r} is empty, contains '/' or repeats an earlier one")
    names.add(name)
    settings.append((name, group, overrides))
  if not settings:
    raise ConfigError("settings: empty")
  metric_fn(str(ablation.metric))
  base = settings_lib.with_overrides(load_config_file(ablation.base), as_overrides(ablation.overrides, "overrides"))
  for name, _, overrides in settings:
    try:
      checked = settings_lib.from_config(settings_lib.with_overrides(base, overrides))
      if not checked.objective.autoregressive:  # e.g. an 'mdlm' setting without sample.sampler='masked'
        checked.canvas_sampler  # pylint: disable=pointless-statement
    except (ConfigError, ValueError) as e:
      raise ConfigError(f"settings {name!r}: {e}") from e
  for x, y, png in ablation.plots:
    if not str(png).endswith(".png"):
      raise ConfigError(f"plots: {png!r} must be a .png file name")
  return settings


def _train(config: ml_collections.ConfigDict, workdir: Path, log) -> str:
  log(f"training {workdir} ({config.train.num_steps} steps)")
  train_loop.train_and_evaluate(config, str(workdir))
  return str(workdir)


def run_ablation(ablation: ml_collections.ConfigDict, log=print) -> list[dict[str, Any]]:
  """Runs every setting; writes out_dir/results.csv, results.json and the plots; returns the rows."""
  settings = check_ablation(ablation)
  fn = metric_fn(str(ablation.metric))
  out_dir = Path(ablation.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  base = settings_lib.with_overrides(load_config_file(ablation.base), as_overrides(ablation.overrides, "overrides"))
  base_path = str(ablation.checkpoint)
  loaded: dict[str, dgemma.Model] = {}

  rows = []
  for name, group, overrides in settings:
    config = settings_lib.with_overrides(base, overrides)
    if _needs_training(overrides):
      path = _train(config, out_dir / "runs" / name, log)
    else:
      if not base_path:
        base_path = _train(base, out_dir / "runs" / "base", log)
      path = base_path
    if path not in loaded:
      loaded[path] = dgemma.load(path, config=config)
    model = loaded[path].with_config(api.run_config(checkpoints.header(path), config))
    start = time.perf_counter()
    metrics = fn(model)
    row = {"name": name, "group": group, **{k: _plain(v) for k, v in overrides.items()}, **metrics}
    log(f"[{name}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
        + f" ({time.perf_counter() - start:.1f} s)")
    rows.append(row)
  write_results(rows, ablation, out_dir)
  return rows


def _plain(value):
  return list(value) if isinstance(value, tuple) else value


def _fmt(value) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_results(rows: list[dict], ablation: ml_collections.ConfigDict, out_dir: Path) -> None:
  columns: list[str] = []
  for row in rows:
    columns += [k for k in row if k not in columns]
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
  writer.writeheader()
  for row in rows:
    writer.writerow({k: row.get(k, "") for k in columns})
  files.write_text_atomic(out_dir / "results.csv", buf.getvalue())
  files.write_text_atomic(out_dir / "results.json", json.dumps(
      {"ablation": json.loads(ablation.to_json_best_effort()), "rows": rows}, indent=2, default=str) + "\n")
  for x, y, png in ablation.plots:
    run_report.plot_sweep(rows, str(x), str(y), out_dir / str(png), title=f"{Path(str(ablation.out_dir)).name}: {y} vs {x}")


def main(argv):
  cli.no_extra_args(argv)
  run_ablation(cli.config(_CONFIG))


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Ablation config (configs/ablations/*.py).")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "eval.ablate")
