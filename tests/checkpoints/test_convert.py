"""dgemma.checkpoints.convert / python -m dgemma.tools.convert: any checkpoint kind to a params checkpoint or an
HF directory that keeps the tokenizer and the run's settings, so the result loads and samples as the run does."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dgemma
from dgemma import checkpoints
from dgemma.checkpoints import convert, hf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
  """A 'trained' run with a SentencePiece tokenizer (WORKDIR/tokenizer.model), 16-token canvases and the
  ancestral sampler at 1.0 -> 0.7: settings that differ from every default an export could fall back to."""
  from configs import tiny_test
  from tests.model_utils import save_random_run
  from tests.test_api import _sentencepiece
  tmp = tmp_path_factory.mktemp("sp_run")
  config = tiny_test.get_config()
  config.model.vocab_size = 512
  config.data.tokenizer.update(kind="file", path=str(_sentencepiece(tmp / "sp.model")))
  config.sample.update(sampler="ancestral", t_max=1.0, t_min=0.7, max_new_tokens=24)
  workdir = tmp / "run"
  save_random_run(config, workdir)
  (workdir / "tokenizer.model").write_bytes((tmp / "sp.model").read_bytes())
  return workdir


def _same_generation(a, b):
  kw = dict(max_new_tokens=24, seed=3)
  ga, gb = a.generate(["the king", "hence"], **kw), b.generate(["the king", "hence"], **kw)
  assert [g.token_ids for g in ga] == [g.token_ids for g in gb]


def test_a_run_converts_to_params_and_hf_that_load_and_sample_as_the_run(sp_run, tmp_path):
  run = dgemma.load(str(sp_run))
  params_dir, hf_dir = tmp_path / "params", tmp_path / "hf"
  convert.to_params(sp_run, params_dir)
  convert.to_hf(sp_run, hf_dir)
  for path in (params_dir, hf_dir):
    assert (path / "tokenizer.model").read_bytes() == (sp_run / "tokenizer.model").read_bytes()
    model = dgemma.load(str(path))
    for group in ("sample", "diffusion", "data"):
      assert getattr(model.settings, group) == getattr(run.settings, group), (path, group)
    assert model.settings.model.to_dict() == run.settings.model.to_dict()
    _same_generation(run, model)
  config = json.loads((hf_dir / "config.json").read_text())
  assert config["canvas_length"] == 16 and config[hf.RUN_CONFIG_KEY]["sample"]["sampler"] == "ancestral"
  assert hf.is_text_only(config)
  generation = json.loads((hf_dir / hf.GENERATION_CONFIG).read_text())
  assert (generation["t_max"], generation["t_min"], generation["max_denoising_steps"]) == (1.0, 0.7, 4)
  assert generation["max_new_tokens"] == 24 and generation["sampler_config"]["entropy_bound"] == 0.1
  mode = stat.S_IMODE((hf_dir / hf.SINGLE_FILE).stat().st_mode)
  umask = os.umask(0)
  os.umask(umask)
  assert mode == 0o666 & ~umask  # safetensors alone would leave it 0600
  assert all(stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask for p in hf_dir.iterdir())


def test_every_kind_converts(sp_run, tmp_path):
  # params -> params, hf -> params, an adapter -> params (its factors folded in), and params -> hf
  convert.to_params(sp_run, tmp_path / "p1")
  convert.to_hf(tmp_path / "p1", tmp_path / "h1")
  convert.to_params(tmp_path / "h1", tmp_path / "p2")
  ref = checkpoints.load(sp_run).params
  for path in ("p1", "h1", "p2"):
    got = checkpoints.load(tmp_path / path).params
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert checkpoints.header(tmp_path / path).config_json is not None  # the run's settings travel along


def test_an_existing_output_is_refused_before_reading(sp_run, tmp_path, monkeypatch):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "x").write_text("mine")
  monkeypatch.setattr(checkpoints, "load_as", lambda *a, **k: pytest.fail("read weights"))
  with pytest.raises(FileExistsError, match="--to_hf: .*out already exists"):
    convert.to_hf(sp_run, tmp_path / "out")
  with pytest.raises(FileExistsError, match="--to: .*out already exists"):
    convert.to_params(sp_run, tmp_path / "out")


def test_generation_config_round_trips_and_names_what_transformers_cannot_run(sp_run):
  settings = dgemma.load(str(sp_run)).settings
  generation, unrepresented = convert.generation_config(settings)
  assert unrepresented == ["sample.sampler='ancestral'"]
  back = convert.sample_settings_from_generation_config(generation)
  for key, value in back.items():
    assert value == (settings.end_ids if key == "end_ids" else getattr(settings.sample, key)), key
  constant = settings.replace(**{"sample.sampler": "released", "sample.t_min": 1.0, "sample.t_max": 1.0,
                                 "sample.confidence_threshold": 0.0})
  generation, unrepresented = convert.generation_config(constant)
  assert "t_max" not in generation and "confidence_threshold" not in generation  # transformers would reject them
  assert [u.split(" (")[0] for u in unrepresented] == ["a constant temperature 1.0", "confidence_threshold=0"]


@pytest.mark.slow  # imports transformers (the torch reference: tests/conftest.py, the fast tier)
def test_transformers_loads_the_export_text_only_with_the_runs_generation_settings(sp_run, tmp_path):
  from transformers import DiffusionGemmaForBlockDiffusion
  convert.to_hf(sp_run, tmp_path / "hf")
  model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "hf", output_loading_info=True)
  assert info["missing_keys"] == set() and info["unexpected_keys"] == set()  # no weight initialised afresh
  vision = sum(p.numel() for n, p in model.named_parameters() if "vision" in n)
  assert vision < 1000  # the stub tower, not a default Gemma 4 one (170M)
  assert model.config.canvas_length == 16
  gen = model.generation_config
  assert (gen.t_max, gen.t_min, gen.max_denoising_steps, gen.max_new_tokens) == (1.0, 0.7, 4, 24)


@pytest.mark.slow  # a subprocess (the command line; its --from_hf / --from_ckpt parsing: test_hf.py's end to end)
def test_convert_command_from_a_run_warns_what_transformers_cannot_run(sp_run, tmp_path):
  r = subprocess.run([sys.executable, "-m", "dgemma.tools.convert", "--from_ckpt", str(sp_run), "--to_hf",
                      str(tmp_path / "hf")], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "transformers' DiffusionGemma generate() runs the released entropy-bound sampler" in r.stderr
  assert "sample.sampler='ancestral'" in r.stderr and (tmp_path / "hf" / "tokenizer.model").is_file()
