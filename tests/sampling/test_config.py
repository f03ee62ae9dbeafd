"""dgemma.sampling.config: SamplerConfig from the config boundary, its checks, end ids from the tokenizer
file, and which samplers fit which training objective."""

from __future__ import annotations

import pytest

from dgemma import settings_fields
from dgemma.errors import ConfigError
from dgemma.sampling import SamplerConfig, SamplerSettings
from tests.sampling.helpers import sampler_of


# ---- config ----------------------------------------------------------------------------------------


def test_automatic_end_ids_come_from_the_tokenizer_file(tmp_path):
  """kind='file': EOS and `<turn|>` are read from the SentencePiece file, so a foreign model (EOS at 2, an
  ordinary piece at 106) does not stop at 106; a Gemma-like file stops at its EOS and its <turn|>."""
  import sentencepiece as spm
  from configs import base
  lines = [f"user {i} says hello to the model and the model answers {i * 7}" for i in range(200)]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "foreign"),
                                 vocab_size=150, pad_id=3, hard_vocab_limit=False, minloglevel=2)  # unk 0 bos 1 eos 2
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "gemma_like"),
                                 vocab_size=150, pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False,
                                 control_symbols=["<|turn>", "<turn|>"], minloglevel=2)
  config = base.get_config()
  config.data.tokenizer.kind = "file"
  config.model.vocab_size = 256
  config.data.tokenizer.path = str(tmp_path / "foreign.model")
  foreign = spm.SentencePieceProcessor(model_file=config.data.tokenizer.path)
  assert foreign.eos_id() == 2 and foreign.id_to_piece(106) not in ("<turn|>", "</s>")
  assert sampler_of(config).end_ids == (2,)
  config.data.tokenizer.path = str(tmp_path / "gemma_like.model")
  assert sampler_of(config).end_ids == (1, spm.SentencePieceProcessor(
      model_file=config.data.tokenizer.path).piece_to_id("<turn|>"))


def test_sampler_config_from_config_and_validation():
  from configs import base, tiny_test
  config = base.get_config()
  cfg = sampler_of(config)
  released = SamplerConfig()
  declared = [f.name for f, _ in settings_fields.declared(SamplerSettings)]
  assert len(declared) == 25  # every sampler key: one declaration, the config's default and the class's
  for name in declared + ["canvas_len", "pad_id", "mask_id", "loo_logits"]:
    assert getattr(cfg, name) == getattr(released, name), name
  assert cfg.end_ids == (1,)                       # trained SentencePiece: no <turn|> piece
  config.data.tokenizer.kind = "file"
  assert sampler_of(config).end_ids == (1, 106)  # no file yet: Gemma 4's ids
  tiny = tiny_test.get_config()                     # byte tokenizer: id 106 is the letter 'f'
  assert sampler_of(tiny).end_ids == (1,)
  assert sampler_of(tiny).canvas_len == tiny.diffusion.canvas_len
  tiny.sample.end_ids = (1, 7, 9999)               # explicit ids; outside the vocabulary dropped
  assert sampler_of(tiny).end_ids == (1, 7)
  tiny.sample.t_min = 0.9
  with pytest.raises(ConfigError, match=r"sample.t_min: must be <= sample.t_max"):
    sampler_of(tiny)
  for bad, pattern in ((dict(acceptance="greedy"), "sample.acceptance"), (dict(renoise="x"), "sample.renoise"),
                       (dict(max_denoising_steps=0), "sample.max_denoising_steps"),
                       (dict(top_p=0.0), "sample.top_p"), (dict(end_ids=(0,)), "sample.end_ids")):
    with pytest.raises(ConfigError, match=pattern):
      SamplerConfig(**bad)


def test_sampler_must_fit_the_training_objective():
  from configs import tiny_test
  config = tiny_test.get_config()
  config.diffusion.objective = "mdlm"
  config.diffusion.mask_id, config.model.vocab_size = 260, 261  # an added id (the byte tokenizer uses 0..259)
  with pytest.raises(ConfigError, match="sample.sampler='released' does not fit diffusion.objective='mdlm'"):
    sampler_of(config)
  config.sample.sampler = "masked"
  cfg = sampler_of(config)
  assert cfg.mask_id == config.diffusion.mask_id and not cfg.loo_logits
  config.diffusion.objective = "base_ce"
  with pytest.raises(ConfigError, match="'masked' does not fit diffusion.objective='base_ce'"):
    sampler_of(config)
  config.sample.sampler = "ancestral"
  config.diffusion.objective = "reweighted_loo_ce"
  assert sampler_of(config).loo_logits
  config.diffusion.objective = "ar"
  with pytest.raises(ConfigError, match="ar_generate"):
    sampler_of(config)
