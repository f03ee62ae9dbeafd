"""eval/samples.py (text statistics, generation + scoring wiring) and eval/ablate.py (the sweep runner)."""

import csv
import json
import math

import numpy as np
import pytest

import dgemma
from dgemma import checkpoints
from dgemma import mesh as mesh_lib
from dgemma import settings as settings_lib
from dgemma import tokenizers
from dgemma.checkpoints import params as params_ckpt
from dgemma.errors import ConfigError
from eval import ablate, samples
from tests.model_utils import random_params


def test_text_statistics_by_hand():
  assert samples.unigram_entropy([5, 5, 5]) == 0.0
  np.testing.assert_allclose(samples.unigram_entropy([1, 2, 1, 2]), math.log(2))
  np.testing.assert_allclose(samples.unigram_entropy([1, 2, 3, 1]), -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
  # bigrams of [1,2,1,2] and [1,2]: (1,2),(2,1),(1,2),(1,2) -> 2 distinct of 4
  assert samples.distinct_n([[1, 2, 1, 2], [1, 2]], 2) == 0.5
  assert samples.distinct_n([[1, 2, 3]], 1) == 1.0
  assert math.isnan(samples.distinct_n([[1]], 2))
  # 4-grams of 1 2 3 1 2 3 1: (123 1),(231 2),(312 3),(123 1) -> one repeat of 4; a sample without repeats: 0
  np.testing.assert_allclose(samples.repetition_rate([[1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 4]], 4), (0.25 + 0.0) / 2)


def test_heldout_unigram_entropy_by_hand():
  byte = tokenizers.ByteTokenizer()
  # windows of 4 tokens in order across documents: "aabb" -> ln 2, "abcd" -> ln 4; "xy" is shorter than one
  assert samples.heldout_unigram_entropy(["aabbabcd", "xy"], byte, 4) == pytest.approx((math.log(2) + math.log(4)) / 2)
  assert samples.heldout_unigram_entropy(["aabbabcd"], byte, 4, max_windows=1) == pytest.approx(math.log(2))
  assert math.isnan(samples.heldout_unigram_entropy(["xy"], byte, 4))


def test_real_word_rate_by_hand(tiny_config, tmp_path):
  assert samples.words("O'er the KING's 2 heads!") == ["o", "er", "the", "king", "s", "heads"]
  vocab = frozenset({"the", "king", "s"})
  # 6 words: the, king, s in the vocabulary (3); o, er, heads not
  assert samples.real_word_rate(["O'er the KING's 2 heads!"], vocab) == 0.5
  assert samples.real_word_rate(["the", "zzz the"], vocab) == pytest.approx(2 / 3)  # pooled over texts
  assert math.isnan(samples.real_word_rate(["123 ..."], vocab))
  # eval.real_words is checked before anything loads, naming the field
  config = tiny_config
  settings = lambda value: settings_lib.from_config(settings_lib.with_overrides(config, {"eval.real_words": value}))
  samples.check_real_words(settings("train"))  # data.source 'files': fine
  with pytest.raises(ConfigError, match="eval.real_words: '/nope.txt' is neither"):
    samples.check_real_words(settings("/nope.txt"))
  sudoku = settings_lib.with_overrides(config, {"eval.real_words": "train", "data.source": "sudoku"})
  with pytest.raises(ConfigError, match="eval.real_words='train' needs"):
    samples.check_real_words(settings_lib.from_config(sudoku))


def _ckpt(config, objective):
  """A dgemma.Model of random weights with `config`'s settings and `objective` (nothing on disk)."""
  config = settings_lib.from_json(settings_lib.to_json(config))
  config.diffusion.objective = objective
  settings = settings_lib.from_config(config)
  model_cfg = settings.model
  ckpt = checkpoints.Checkpoint(f"random_{objective}", "params", model_cfg, random_params(model_cfg))
  return dgemma.Model(ckpt, settings, mesh_lib.make_mesh(settings.mesh.axis_sizes))


@pytest.mark.slow  # 7 s on 2 cores with a warm compile cache (tracing a train step or sampler): over the fast tier's budget
def test_sample_metrics_diffusion_and_ar(tiny_config, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "the king"}\n{"prompt": "thy lord"}\n')
  config = tiny_config
  config.eval.num_samples = 3
  config.eval.prompts = str(prompts)
  config.sample.max_new_tokens = 8
  config.sample.max_denoising_steps = 2
  ref = _ckpt(config, "ar")
  summary, records = samples.sample_metrics(_ckpt(config, "base_ce"), reference=ref)
  tok = ref.tokenizer
  assert [r["prompt"] for r in records] == ["the king", "thy lord", "the king"]  # used cyclically
  total = 0
  for r in records:
    assert 1 <= len(r["tokens"]) <= 8
    body = r["tokens"][:-1] if r["tokens"][-1] == tok.eos_id else r["tokens"]
    assert r["text"] == tok.decode(body)
    assert 1 <= r["decoder_passes"] <= 2  # one canvas, at most 2 steps
    total += len(r["tokens"])
  # the same per-row fp32 NLLs summed in fp32 (library) vs float64 (here): <= 2 roundings; rtol 1e-6 = 8 eps
  np.testing.assert_allclose(summary["gen_nll"], sum(r["reference_nll"] for r in records) / total, rtol=1e-6)
  np.testing.assert_allclose(summary["gen_ppl"], math.exp(summary["gen_nll"]), rtol=1e-6)  # the same formula
  assert summary["tokens_per_forward"] == pytest.approx(total / sum(r["decoder_passes"] for r in records))  # ints
  assert summary["wall_s"] > 0 and summary["tokens_per_s"] > 0 and summary["steps"] == 2
  # a random model's tokens are close to uniform over 260 ids: its reference NLL is near log(260)
  assert abs(summary["gen_nll"] - math.log(260)) < 1.5
  samples.write_jsonl(str(tmp_path / "s.jsonl"), records)
  assert [json.loads(l)["prompt"] for l in (tmp_path / "s.jsonl").read_text().splitlines()] == [r["prompt"] for r in records]

  assert "real_word_rate" not in summary  # eval.real_words = '' (the default)

  # eval.real_words: 'train' (the toy corpus's training split) and a file; the yardstick on validation text
  words_file = tmp_path / "words.txt"
  words_file.write_text("the King thy lord\n")
  model = _ckpt(config, "base_ce")
  for spec in ("train", str(words_file)):
    with_words = model.with_overrides(**{"eval.real_words": spec})
    words_summary, words_records = samples.sample_metrics(with_words)
    vocabulary, heldout = samples.real_word_corpora(with_words.settings)
    want = samples.real_word_rate([r["text"] for r in words_records], vocabulary)
    assert words_summary["real_word_rate"] == want or (math.isnan(want) and math.isnan(words_summary["real_word_rate"]))
    if spec == "train":
      assert {"the", "king"} <= vocabulary and heldout
      assert 0.5 < words_summary["real_word_rate_heldout"] <= 1.0  # held-out text of the same toy corpus
      window = max(1, int(round(words_summary["mean_length"])))
      assert words_summary["unigram_entropy_heldout"] == samples.heldout_unigram_entropy(
          heldout, with_words.tokenizer, window)
    else:
      assert vocabulary == {"the", "king", "thy", "lord"} and "real_word_rate_heldout" not in words_summary

  # AR checkpoint, greedy: one forward per token, deterministic
  greedy = ref.with_overrides(**{"eval.ar_temperature": 0.0})
  ar_summary, ar_records = samples.sample_metrics(greedy, reference=ref)
  assert ar_summary["tokens_per_forward"] == 1.0
  assert ar_records[0]["tokens"] == ar_records[2]["tokens"]  # same prompt, greedy
  # the reference must be an AR run
  with pytest.raises(ConfigError, match="eval.reference"):
    samples.sample_metrics(ref, reference=_ckpt(config, "base_ce"))


def test_ablation_runner_writes_csv_json_and_plots(tiny_config, tmp_path, corpus_file):
  model_cfg = settings_lib.from_config(tiny_config).model
  params_dir = tmp_path / "params"
  params_ckpt.save_params(params_dir, random_params(model_cfg), model_cfg.to_dict())
  seen = []

  def fake_metric(model):  # what the runner hands a metric: the checkpoint's model with the setting's settings
    sampler = model.settings.sample
    seen.append((model.path, sampler.max_denoising_steps, sampler.sampler))
    return {"score": float(sampler.max_denoising_steps) ** 0.5, "sampler_is_ancestral": int(sampler.sampler == "ancestral")}

  ablate.register_metric("fake_for_test", fake_metric)
  import ml_collections
  ablation = ml_collections.ConfigDict(dict(
      base="configs/tiny_test.py", checkpoint=str(params_dir), metric="fake_for_test", out_dir=str(tmp_path / "out"),
      overrides=(("data.source", "files"), ("data.files", (str(corpus_file),)),
                 ("data.cache_dir", tiny_config.data.cache_dir)),
      settings=(("r1", "released", (("sample.max_denoising_steps", 1),)),
                ("r4", "released", (("sample.max_denoising_steps", 4),)),
                ("a4", "ancestral", (("sample.max_denoising_steps", 4), ("sample.sampler", "ancestral")))),
      plots=(("sample.max_denoising_steps", "score", "score.png"),)))
  rows = ablate.run_ablation(ablation, log=lambda *_: None)
  assert seen == [(str(params_dir), 1, "released"), (str(params_dir), 4, "released"), (str(params_dir), 4, "ancestral")]
  with open(tmp_path / "out" / "results.csv") as f:
    table = list(csv.DictReader(f))
  assert list(table[0]) == ["name", "group", "sample.max_denoising_steps", "score", "sampler_is_ancestral",
                            "sample.sampler"]
  assert [r["name"] for r in table] == ["r1", "r4", "a4"] and table[2]["sample.sampler"] == "ancestral"
  assert float(table[1]["score"]) == 2.0
  assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"] == rows
  assert (tmp_path / "out" / "score.png").read_bytes()[:4] == b"\x89PNG"
  # which settings need their own training run
  assert not ablate._needs_training({"sample.max_denoising_steps": 2, "eval.num_samples": 3, "seed": 1})
  assert ablate._needs_training({"diffusion.objective": "mdlm"})
  # bad configs fail before anything runs, naming the field
  for field, value, match in (("metric", "nope", "metric"), ("settings", (("x", "g", (("sample.nope", 1),)),), "sample.nope"),
                              ("settings", (("x", "g", ()), ("x", "g", ())), "repeats")):
    bad = ml_collections.ConfigDict(ablation.to_dict())
    with bad.ignore_type():
      bad[field] = value
    with pytest.raises(ConfigError, match=match):
      ablate.check_ablation(bad)
  # a setting whose sampler does not fit its objective fails here, not after its training run
  bad = ml_collections.ConfigDict(ablation.to_dict())
  with bad.ignore_type():
    bad.settings = (("masked", "noise", (("diffusion.objective", "mdlm"), ("diffusion.mask_id", 260),
                                         ("model.vocab_size", 264))),)
  with pytest.raises(ConfigError, match="settings 'masked'.*sample.sampler"):
    ablate.check_ablation(bad)
  # the shipped sweeps are valid
  from configs.ablations import pc_sampler, steps_quality, training_choices
  from proj.sudoku.configs import renoise as renoise_sudoku
  assert len(ablate.check_ablation(steps_quality.get_config())) == 10
  pcs = ablate.check_ablation(pc_sampler.get_config())
  assert len(pcs) == 15 and not any(ablate._needs_training(overrides) for _, _, overrides in pcs)
  assert len(ablate.check_ablation(renoise_sudoku.get_config())) == 9
  choices = ablate.check_ablation(training_choices.get_config())
  assert [name for name, _, overrides in choices if ablate._needs_training(overrides)] == [
      "reweighted_ce", "nelbo", "loo_ce", "loo_nelbo_ce", "masked_mdlm", "no_self_cond"]


@pytest.mark.slow  # several whole training runs with checkpoints (the loop end to end)
def test_ablation_runner_trains_settings_that_change_the_run(tiny_config, tmp_path, corpus_file):
  """A setting that changes training keys gets its own run in out_dir/runs/<name> (train.py semantics),
  and the metric is evaluated on that run; re-running reuses the finished run."""
  import ml_collections
  from dgemma.checkpoints import workdir as workdir_ckpt
  seen = []

  def fake_metric(model):
    num_steps = model.settings.train.num_steps
    seen.append((model.path, num_steps))
    return {"steps_trained": num_steps}

  ablate.register_metric("fake_trained_for_test", fake_metric)
  out = tmp_path / "out"
  ablation = ml_collections.ConfigDict(dict(
      base="configs/tiny_test.py", checkpoint="", metric="fake_trained_for_test", out_dir=str(out),
      overrides=(("data.source", "files"), ("data.files", (str(corpus_file),)),
                 ("data.cache_dir", tiny_config.data.cache_dir), ("train.async_checkpointing", False)),
      # tiny_test's own 6 steps (the program test_train compiles too); the key alone makes it a training setting
      settings=(("six_steps", "trained", (("train.num_steps", 6),)),),
      plots=()))
  rows = ablate.run_ablation(ablation, log=lambda *_: None)
  run_dir = out / "runs" / "six_steps"
  assert seen == [(str(run_dir), 6)] and rows[0]["steps_trained"] == 6
  assert workdir_ckpt.make_manager(run_dir, read_only=True).latest_step() == 6
  assert json.loads((run_dir / "config.json").read_text())["train"]["num_steps"] == 6
  before = sorted(p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file())
  ablate.run_ablation(ablation, log=lambda *_: None)  # finished: resumed at its last step, nothing retrained
  assert sorted(p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file()) == before
  assert not (out / "runs" / "base").exists()  # no setting needed the base checkpoint
