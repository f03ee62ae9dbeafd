"""The config boundary (dgemma/settings.py): bad input fails fast, with one clear error naming the field or
file, before anything is built, compiled or written."""

import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import dgemma
from configs import adapt_from_gemma4, base, demo, finetune_head_lora, tiny_test
from configs.models import diffusiongemma_26b_a4b, small, tiny
from dgemma import settings as settings_lib
from dgemma.errors import ConfigError
from dgemma.model import ModelConfig
from dgemma.train import loop

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_compile(monkeypatch):
  """Fails the test if anything is jitted or data is built: errors must come first."""
  def boom(*a, **k):
    raise AssertionError("compiled or built data before rejecting bad input")
  monkeypatch.setattr(jax, "jit", boom)
  monkeypatch.setattr(loop.data_lib, "prepare", boom)


@pytest.mark.parametrize("get_config", [base.get_config, demo.get_config, tiny_test.get_config, adapt_from_gemma4.get_config,
                                        finetune_head_lora.get_config])
def test_shipped_configs_are_valid(get_config):
  settings = settings_lib.from_config(get_config())
  assert settings.model.num_layers == len(settings.model.layer_types)


def _config_files():
  return sorted(str(p.relative_to(REPO)) for pattern in ("configs/**/*.py", "proj/*/configs/*.py")
                for p in REPO.glob(pattern) if p.name != "__init__.py")


@pytest.mark.parametrize("path", _config_files())
def test_every_config_file_builds_through_the_boundary(path):
  # every get_config() of the tree: experiment configs through from_config, presets through their group's checks,
  # ablation sweeps through eval.ablate's check (each of its settings a valid config)
  from dgemma import settings_fields
  from dgemma.tools import cli
  from eval import ablate
  config = cli.load_config_file(path)
  if "/ablations/" in path or path.endswith("proj/sudoku/configs/renoise.py"):
    assert ablate.check_ablation(config)
  elif "/models/" in path:
    assert ModelConfig.from_config_dict(config).num_layers >= 1
  elif "/mesh/" in path:
    assert settings_fields.from_raw(settings_lib.MeshSettings, config).axis_rules
  else:
    if config.distill.method == "dcd" and not config.train.init_from:
      config.train.init_from = "/a/teacher"  # configs/distill_dcd.py:TEACHER names the run it distils
    settings_lib.from_config(config)


def test_settings_are_typed_frozen_and_round_trip(tiny_config):
  settings = settings_lib.from_config(tiny_config)
  assert settings.data.seq_len == tiny_config.data.seq_len and settings.diffusion.canvas_len == 16
  assert settings.canvas_sampler.canvas_len == settings.diffusion.canvas_len  # the sampler gets the canvas
  assert settings.mesh.shape.data == -1 and settings.opt.lr == tiny_config.opt.lr
  with pytest.raises(Exception):  # frozen
    settings.data.seq_len = 3
  again = settings_lib.from_config(settings_lib.from_json(settings.config_json))
  assert again == settings  # config.json holds everything the settings came from


def test_training_differences_name_what_changes_training_and_nothing_else(tiny_config):
  current = settings_lib.from_config(tiny_config)
  saved = settings_lib.load_json(current.config_json)  # as read back from disk
  assert settings_lib.training_differences(saved, current) == []  # the json round trip changes nothing
  new = saved.replace(**{"train.log_every": 7, "sample.num_samples": 3, "eval.split": "train",  # bookkeeping and
                         "model.moe_impl": "dense", "mesh.shape.data": 2})                        # inference
  assert settings_lib.training_differences(saved, new) == []
  new = new.replace(**{"diffusion.canvases_per_row": 2, "seed": 5, "model.router_aux_loss_weight": 0.5,
                       "data.files": ("a.txt", "b.txt")})
  assert settings_lib.training_differences(saved, new) == [
      f"data.files: {saved.data.files!r} -> ('a.txt', 'b.txt')", "diffusion.canvases_per_row: 1 -> 2",
      f"model.router_aux_loss_weight: {saved.model.router_aux_loss_weight!r} -> 0.5", "seed: 0 -> 5"]
  new = new.replace(**{"model.d_model": 2 * saved.model.d_model})  # architecture: refused by
  assert not any(d.startswith("model.d_model") for d in settings_lib.training_differences(saved, new))  # the other


@pytest.mark.parametrize("preset", [tiny, small, diffusiongemma_26b_a4b])
def test_presets_build(preset):
  cfg = ModelConfig.from_config_dict(preset.get_config())
  assert cfg.num_layers == len(cfg.layer_types) and cfg.layer_types[-1] == "global"


def test_26b_preset_pattern():
  cfg = ModelConfig.from_config_dict(diffusiongemma_26b_a4b.get_config())
  assert cfg.layer_types == (("sliding",) * 5 + ("global",)) * 5
  assert cfg.block_period == 6 and cfg.num_blocks == 5


@pytest.mark.parametrize("mutate, field", [
    (lambda c: setattr(c.opt, "lrr", 1.0), "opt.lrr"),
    (lambda c: setattr(c.diffusion, "canvas_len", 64), "diffusion.canvas_len"),
    (lambda c: setattr(c.model, "vocab_size", 100), "model.vocab_size"),
    (lambda c: setattr(c.data.tokenizer, "kind", "wordpiece"), "data.tokenizer.kind"),
    (lambda c: setattr(c.model, "num_kv_heads", 3), "model.num_kv_heads"),
    (lambda c: setattr(c.model, "experts_per_token", 9), "model.experts_per_token"),
    (lambda c: setattr(c.opt, "lr", -1.0), "opt.lr"),
    (lambda c: setattr(c.mesh.shape, "data", 3), "mesh.shape"),
    (lambda c: setattr(c.finetune, "mode", "qlora"), "finetune.mode"),
    (lambda c: c.finetune.update(mode="lora", lora_targets=("attn", "lm_head")), "finetune.lora_targets"),
    (lambda c: setattr(c.diffusion, "objective", "score_entropy"), "diffusion.objective"),
    (lambda c: setattr(c.diffusion, "schedule", "sqrt"), "diffusion.schedule"),
    (lambda c: setattr(c.sample, "acceptance", "top_half"), "sample.acceptance"),
    (lambda c: setattr(c.data, "encoding_errors", "ignore"), "data.encoding_errors"),
])
def test_bad_config_names_field(tiny_config, tmp_path, no_compile, mutate, field):
  mutate(tiny_config)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()  # a run that fails validation leaves no workdir behind


# Optimiser and loop settings (issue: grad_clip=-1 trained by gradient ascent; inf, b1 >= 1 ... were accepted).
@pytest.mark.parametrize("field, value", [
    ("opt.grad_clip", -1.0), ("opt.grad_clip", 0.0), ("opt.lr", math.inf), ("opt.lr", math.nan), ("opt.lr", 0.0),
    ("opt.b1", 1.5), ("opt.b1", 1.0), ("opt.b2", 2.0), ("opt.b2", -0.1), ("opt.eps", 0.0), ("opt.eps", -1e-8),
    ("opt.weight_decay", -1.0), ("opt.weight_decay", math.inf), ("opt.warmup_steps", 1e9), ("opt.warmup_steps", -1),
    ("opt.warmup_steps", 2.5), ("opt.end_lr_fraction", 1.5), ("opt.grad_accum_steps", 0), ("opt.state_dtype", "int8"),
    ("train.num_steps", 0), ("train.num_steps", 2.5), ("train.log_every", 0), ("train.eval_batches", 0),
    ("train.keep_checkpoints", 0), ("train.nonfinite", "ignore"), ("train.max_nonfinite_skips", 0),
    ("train.restore_step", -2), ("train.on_corrupt_checkpoint", "delete"), ("train.progress_bar", "yes"),
])
def test_impossible_optimizer_and_loop_values_are_rejected(tiny_config, tmp_path, no_compile, field, value):
  group, key = field.split(".")
  with tiny_config[group].ignore_type():
    tiny_config[group][key] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()


def test_warmup_longer_than_the_run_names_both(tiny_config):
  tiny_config.opt.warmup_steps = tiny_config.train.num_steps + 1
  with pytest.raises(ConfigError, match=r"opt\.warmup_steps.*train\.num_steps"):
    settings_lib.from_config(tiny_config)


def test_sentencepiece_vocab_too_small(tiny_config):
  tiny_config.data.tokenizer.kind = "sentencepiece"
  tiny_config.data.tokenizer.vocab_size = 3
  with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size.*special"):
    settings_lib.from_config(tiny_config)


def test_unknown_mesh_axis_names_it(tiny_config):
  tiny_config.mesh.shape.foo = 2
  with pytest.raises(ConfigError, match=r"mesh\.shape.*foo"):
    settings_lib.from_config(tiny_config)


def test_missing_data_file_names_file(tiny_config, tmp_path):
  tiny_config.data.files = (str(tmp_path / "nope.txt"),)
  with pytest.raises((FileNotFoundError, ValueError), match="nope.txt"):
    loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()


def test_empty_data_file_names_file(tiny_config, tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  tiny_config.data.files = (str(empty),)
  with pytest.raises((FileNotFoundError, ValueError), match="empty.txt"):
    loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))


def test_a_mistyped_key_names_the_nearest_one(tiny_config):
  """Every place that refuses a key no group declares suggests the nearest declared key (or group)."""
  from dgemma import settings as settings_lib
  tiny_config.sample.tmax = 0.5
  with pytest.raises(ConfigError, match=r"unknown config key\(s\): sample\.tmax \(did you mean sample\.t_max\?\)"):
    settings_lib.from_config(tiny_config)
  del tiny_config.sample["tmax"]
  settings = settings_lib.from_config(tiny_config)
  with pytest.raises(ConfigError, match=r"train\.num_step: not a config key \(did you mean train\.num_steps\?\)"):
    settings.replace(**{"train.num_step": 3})
  with pytest.raises(ConfigError, match=r"smaple\.t_max: no config group 'smaple' \(did you mean sample\.t_max\?\)"):
    settings_lib.set_key(tiny_config, "smaple.t_max", 0.5)
  assert settings_lib.did_you_mean("wholly_unrelated") == ""


def test_the_settings_command_lists_a_prefix_shows_a_run_or_refuses(tmp_path, capsys):
  from dgemma import settings as settings_lib
  from dgemma.settings.__main__ import main
  main(["prog", "sample.t_max"])
  assert capsys.readouterr().out.startswith("sample.t_max (float) = ")
  main(["prog", "sample.max_context"])  # a default of 0 within the bounds it lists: what 0 stands for
  assert capsys.readouterr().out.startswith("sample.max_context (int) = 0  [>= 1, or 0 = 262144]")
  run = tmp_path / "run"
  run.mkdir()
  config = settings_lib.default_config()
  config.opt.lr = 0.0123
  (run / "config.json").write_text(settings_lib.from_config(config).config_json)
  main(["prog", str(run)])
  assert "opt.lr = 0.0123\n" in capsys.readouterr().out
  for arg, said in (("sampel", "no key or group (did you mean sample?)"),
                    (str(tmp_path), "a directory without config.json")):
    with pytest.raises(SystemExit, match=re.escape(said)):
      main(["prog", arg])


def test_missing_checkpoint_names_it(tmp_path):
  with pytest.raises(FileNotFoundError, match="never_trained"):
    dgemma.load(str(tmp_path / "never_trained"))


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("args, expect", [
    (["--config=configs/tiny_test.py", "--config.opt.learning_rate=1.0"], "--config.opt.learning_rate: no such config key"),
    (["--config=configs/tiny_test.py", "--config.sample.tmax=1.0"],
     "--config.sample.tmax: no such config key (did you mean sample.t_max?)"),
    (["--config=configs/tiny_test.py", "--config.mesh.shape.foo=2"], "--config.mesh.shape.foo: no such config key"),
    (["--config=configs/nope.py"], "configs/nope.py"),
    (["--config=configs/tiny_test.py", "--config.opt.grad_clip=-1"], "opt.grad_clip: must be > 0.0, got -1.0"),
    (["--config=configs/tiny_test.py", "--num_processes=1", "--process_id=1"], "--process_id: 1 not in [0, --num_processes=1)"),
])
def test_command_line_errors_are_one_line(tmp_path, args, expect):
  out = subprocess.run([sys.executable, "train.py", f"--workdir={tmp_path / 'wd'}", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert expect in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "wd").exists()
