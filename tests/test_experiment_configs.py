"""configs/pretrain_small.py and configs/sft_jsonl.py: valid at full size, and a few training steps of
each through `dgemma.train.loop.train_and_evaluate` with the sizes overridden down to tiny (CPU, seconds).

Compile time dominates: both runs use the same model and row shape (their init program is shared
through the compilation cache), one decoder pass (self_cond_prob 0), and stop after 2 of 100 steps,
before the first evaluation (the eval loss is the same diffusion_loss, tested elsewhere)."""

import json

import numpy as np
import pytest

from configs import pretrain_small, sft_jsonl
from proj.sudoku.configs import sudoku_gpu
from dgemma import settings as settings_lib
from dgemma.tools import model_size
from dgemma.train import loop
from tests.data.test_sft import write_sft_file


def _tiny(config, tmp_path):
  config.model.update(dict(vocab_size=260, d_model=32, num_layers=1, layer_types=("global",),
                           num_heads=2, num_kv_heads=1, head_dim=16, global_head_dim=16, sliding_window=16,
                           mlp_hidden=64, num_experts=0))
  config.data.update(dict(seq_len=96, batch_size=2, cache_dir=str(tmp_path / "cache")))
  config.data.tokenizer.kind = "byte"
  config.diffusion.canvas_len, config.diffusion.self_cond_prob = 8, 0.0
  config.train.update(dict(num_steps=100, log_every=1, eval_every=1000, eval_batches=1, ckpt_every=1000,
                           progress_bar=False, async_checkpointing=False))
  return config


def _run(config, workdir):
  state = loop.train_and_evaluate(config, str(workdir), stop_after_steps=2)
  assert int(state.step) == 2 and (workdir / "checkpoints").is_dir()
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2] and {r["split"] for r in rows} == {"train"}
  assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
  return rows


def test_full_size_configs_validate():
  assert settings_lib.from_config(pretrain_small.get_config()).model.d_model == 256  # the small preset
  config = sft_jsonl.get_config("a.jsonl,b.jsonl")
  assert config.data.files == ("a.jsonl", "b.jsonl") and settings_lib.from_config(config).model.d_model == 256
  gpu = settings_lib.from_config(sudoku_gpu.get_config())  # the GPU Sudoku run (docs/experiments/sudoku.md): 4 + 2 layers, ~6M
  assert gpu.data.batch_size == 256 and gpu.model.decoder_head_layers == 2
  assert 5.5e6 < model_size.count_params(gpu.model)["total"] < 6.5e6


def test_pretrain_small_block_causal_runs(tmp_path, corpus_file):
  config = _tiny(pretrain_small.get_config(), tmp_path)
  config.data.source, config.data.files = "files", (str(corpus_file),)  # tests do not fetch Shakespeare
  assert config.diffusion.canvases_per_row == 4
  train_rows = _run(config, tmp_path / "wd")
  assert all(r["canvas_tokens"] == 2 * 4 * 8 for r in train_rows)  # every row scores 4 canvases


def test_sft_jsonl_runs(tmp_path):
  path = write_sft_file(tmp_path / "sft.jsonl")
  config = _tiny(sft_jsonl.get_config(str(path)), tmp_path)
  train_rows = _run(config, tmp_path / "wd")
  assert all(r["canvas_tokens"] == 2 * 8 for r in train_rows)  # one response canvas per row, all scored


@pytest.mark.slow  # the fast tier's budget: a short run (~5 s)
def test_likelihood_small_trains_on_a_text_file(tmp_path):
  from proj.markov.configs import likelihood_small
  from proj.markov import data as markov
  markov.write_splits(str(tmp_path / "mk"), num_train=40, num_valid=2, length=300, order=2, concentration=0.1, seed=0)
  full = likelihood_small.get_config(str(tmp_path / "mk" / "train.txt"))
  st = settings_lib.from_config(full)  # valid at full size, byte tokens on the given file
  assert st.data.files == (str(tmp_path / "mk" / "train.txt"),) and st.data.tokenizer.kind == "byte"
  assert st.model.vocab_size == 260 and st.model.decoder_shift  # the recipe: shifted decoder output ...
  assert st.model.decoder_two_stream and st.objective.needs_two_stream  # ... blind to its own token, blind_ce
  config = _tiny(full, tmp_path)
  K = config.diffusion.canvases_per_row
  train_rows = _run(config, tmp_path / "wd")
  assert all(r["canvas_tokens"] == 2 * K * 8 for r in train_rows)
  # proj.markov.profile on it: the exact denoiser's integrand beats a 2-step model's at every t
  import json as json_lib
  import dgemma
  from proj.markov import profile as markov_profile
  chain = markov.chain_of_truth(json_lib.loads((tmp_path / "mk" / "truth.json").read_text()))
  texts = (tmp_path / "mk" / "valid.txt").read_text().splitlines()
  rows = markov_profile.profile(dgemma.load(str(tmp_path / "wd")), chain, texts, grid=(0.1, 0.6), draws=1)
  assert [r["t"] for r in rows] == [0.1, 0.6]
  assert all(np.isfinite(r["model"]) and 0 < r["exact"] < r["model"] for r in rows)
  for r in rows:  # the kept / drawn split partitions the positions; KL of two distributions is >= 0
    f = r["drawn_fraction"]
    assert 0 < f < 1
    for who in ("model", "exact"):
      assert r[who] == pytest.approx((1 - f) * r[f"{who}_kept"] + f * r[f"{who}_drawn"], rel=1e-6)
    assert r["kl_kept"] > 0 and r["kl_drawn"] > 0
    assert r["right_kl_exact"] > 0.01 and r["right_kl_model"] > -1e-6  # the chain's right side is informative
