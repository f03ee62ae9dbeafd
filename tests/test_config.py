"""Bad input fails fast: one clear error naming the field or file, before anything is compiled."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest

from configs import adapt_from_gemma4, base, demo, finetune_head_lora, tiny_test
from configs.models import diffusiongemma_26b_a4b, small, tiny
from dgemma import config as config_lib
from dgemma import trainer
from dgemma.model import ConfigError, ModelConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_compile(monkeypatch):
  """Fails the test if anything is jitted or data is built: errors must come first."""
  def boom(*a, **k):
    raise AssertionError("compiled or built data before rejecting bad input")
  monkeypatch.setattr(jax, "jit", boom)
  monkeypatch.setattr(trainer.data_pipeline, "prepare", boom)


@pytest.mark.parametrize("get_config", [base.get_config, demo.get_config, tiny_test.get_config, adapt_from_gemma4.get_config,
                                        finetune_head_lora.get_config])
def test_shipped_configs_are_valid(get_config):
  config_lib.validate(get_config())


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
])
def test_bad_config_names_field(tiny_config, tmp_path, no_compile, mutate, field):
  mutate(tiny_config)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    trainer.train_and_evaluate(tiny_config, str(tmp_path))


def test_sentencepiece_vocab_too_small(tiny_config):
  tiny_config.data.tokenizer.kind = "sentencepiece"
  tiny_config.data.tokenizer.vocab_size = 3
  with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size.*special"):
    config_lib.validate(tiny_config)


def test_unknown_key_on_command_line_is_rejected(tmp_path):
  out = subprocess.run([sys.executable, "train.py", "--config=configs/tiny_test.py", f"--workdir={tmp_path}",
                        "--config.opt.learning_rate=1.0"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "learning_rate" in out.stderr


def test_missing_data_file_names_file(tiny_config, tmp_path):
  tiny_config.data.files = (str(tmp_path / "nope.txt"),)
  with pytest.raises((FileNotFoundError, ValueError), match="nope.txt"):
    trainer.train_and_evaluate(tiny_config, str(tmp_path / "wd"))


def test_empty_data_file_names_file(tiny_config, tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  tiny_config.data.files = (str(empty),)
  with pytest.raises((FileNotFoundError, ValueError), match="empty.txt"):
    trainer.train_and_evaluate(tiny_config, str(tmp_path / "wd"))


def test_missing_checkpoint_names_workdir(tiny_config, tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoints"):
    trainer.load_params(str(tmp_path / "never_trained"), tiny_config)
