"""dgemma/model/decoder_variants.py: the research decoder options are a table of ModelConfig fields, all off in the
released model, whose parameters exist only when their option is on (their behaviour: test_two_stream.py,
test_right_readout.py, test_decoder_head.py, test_decoder_shift.py)."""

import dataclasses

import flax

from dgemma.model import ModelConfig, decoder_variants
from dgemma.model.transformer import param_shapes
from configs.models import tiny


def test_every_variant_is_a_model_field_off_in_the_released_model():
  released = ModelConfig()
  assert set(decoder_variants.VARIANTS) <= {f.name for f in dataclasses.fields(ModelConfig)}
  assert decoder_variants.enabled(released) == [] and not any(getattr(released, name) for name in decoder_variants.VARIANTS)


def test_a_variant_adds_parameters_only_when_on():
  cfg = ModelConfig.from_config_dict(tiny.get_config())
  plain = set(flax.traverse_util.flatten_dict(param_shapes(cfg)))
  readout = dataclasses.replace(cfg, decoder_right_readout=2, decoder_head_layers=1)
  added = set(flax.traverse_util.flatten_dict(param_shapes(readout))) - plain
  assert ("right_readout",) in added and any(k[0] == "decoder_head_0" for k in added)
  assert all(k[0] in ("right_readout", "decoder_head_0") for k in added)
  assert decoder_variants.enabled(readout) == ["decoder_right_readout", "decoder_head_layers"]
