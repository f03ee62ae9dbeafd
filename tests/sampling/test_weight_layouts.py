"""Weights held in the memory layouts the generate program picks (sample.weight_layouts='auto'):
dgemma/sampling/generation.py `compiled_weight_formats` / `lay_out`, and dgemma.load holding them so. On this host's
CPU the compiler picks the default layouts; a TPU's picks tiled ones for the stacked int4 experts
(tests/tools/test_memory.py compiles for a v5e). Here the weights are also laid out transposed (not CPU's default),
so a program that copied them back to the default layouts, or read them as if they were, would show."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from dgemma.sampling import SamplerConfig, generate, generation
from tests.model_utils import f64_config, float64, to_f64
from tests.sampling.helpers import PROMPTS, tiny_model

CFG = SamplerConfig(canvas_len=8, max_denoising_steps=6, end_ids=(1, 106), confidence_threshold=0.05)


def _transposed(x) -> Format:
  """x's sharding with its dimensions in the reverse memory order (column-major for a matrix): not CPU's default."""
  return Format(Layout(major_to_minor=tuple(reversed(range(x.ndim)))), x.sharding)


def _orders(formats) -> list:
  """Each Format's memory order (a given Layout has tiling None where an array's reads ())."""
  return [f.layout.major_to_minor for f in formats]


def _prompts():
  prompts = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
  for b, p in enumerate(PROMPTS):
    prompts[b, :len(p)] = p
  return prompts, np.asarray([len(p) for p in PROMPTS], np.int32)


def test_generate_reads_the_weights_in_the_layouts_they_are_held_in():
  # float64: the transposed weights change only the order XLA sums in; float64 round-off (~1e-16) cannot flip a
  # sampled token, so the tokens must be identical (tests/model_utils.py)
  with float64():
    model, params = tiny_model()
    model = type(model)(f64_config(model.cfg))
    params = jax.device_put(to_f64(params), jax.devices()[0])
    leaves, treedef = jax.tree.flatten(params)
    formats = [_transposed(x) for x in leaves]
    generation.lay_out(leaves, formats)
    laid = jax.tree.unflatten(treedef, leaves)
    assert _orders(x.format for x in jax.tree.leaves(laid)) == _orders(formats)
    assert _orders(x.format for x in jax.tree.leaves(laid)) != _orders(x.format for x in jax.tree.leaves(params))
    prompts, lengths = _prompts()
    want = jax.device_get(generate(model, params, prompts, lengths, CFG, jax.random.key(2), 20))
    got = jax.device_get(generate(model, laid, prompts, lengths, CFG, jax.random.key(2), 20))
    # the program compiled for them takes the weights in their layouts (no copy back to the default ones)
    lowered = generation.lower(model, laid, CFG, batch=len(PROMPTS), prompt_len=prompts.shape[1], max_new_tokens=20)
    assert _orders(jax.tree.leaves(lowered.compile().input_formats[0][0])) == _orders(formats)
  np.testing.assert_array_equal(got.tokens_BN, want.tokens_BN)
  np.testing.assert_array_equal(got.num_forwards_B, want.num_forwards_B)
  assert len(set(map(tuple, want.tokens_BN.tolist()))) == len(PROMPTS)  # the rows differ


def test_compiled_weight_formats_are_the_programs_and_lay_out_keeps_one_extra_weight(monkeypatch):
  """compiled_weight_formats: one Format per weight on its sharding, those the generate program compiled with
  Layout.AUTO weights takes. lay_out moves each weight in turn, the old one let go as the next is copied: the device
  holds the weights and one more at most (a tree copied whole would hold two)."""
  model, params = tiny_model()
  params = jax.device_put(params, jax.devices()[0])
  formats = generation.compiled_weight_formats(model, params, CFG, max_new_tokens=16)
  assert jax.tree.structure(formats) == jax.tree.structure(params)
  assert all(f.sharding == x.sharding for f, x in zip(jax.tree.leaves(formats), jax.tree.leaves(params)))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  auto = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), params)
  lowered = generation.lower(model, abstract, CFG, batch=1, prompt_len=32, max_new_tokens=16, weight_formats=auto)
  assert lowered.compile().input_formats[0][0] == formats

  leaves = [jnp.array(x, copy=True) for x in jax.tree.leaves(params)]  # only this list holds them
  weights, largest = sum(x.nbytes for x in leaves), max(x.nbytes for x in leaves)
  others = {id(x) for x in jax.live_arrays()} - {id(x) for x in leaves}
  peak = [0]
  put = jax.device_put

  def spied(*args, **kwargs):
    out = put(*args, **kwargs)
    peak[0] = max(peak[0], sum(x.nbytes for x in jax.live_arrays() if id(x) not in others))
    return out
  monkeypatch.setattr(jax, "device_put", spied)
  generation.lay_out(leaves, [_transposed(x) for x in leaves])
  monkeypatch.undo()
  assert _orders(x.format for x in leaves) == _orders(_transposed(x) for x in leaves)
  assert weights + largest >= peak[0] > weights, (peak[0], weights, largest)


def test_load_holds_the_weights_in_the_generate_programs_layouts(tiny_run):
  """dgemma.load with sample.weight_layouts='auto': the weights are in the formats `compiled_weight_formats` gives
  for them (a one-row request, the smallest prompt bucket), and they generate the tokens of the default layouts
  (this CPU picks the default layouts: the same program)."""
  import dgemma
  from dgemma import api
  workdir, config = tiny_run
  default = dgemma.load(str(workdir))
  config = config.copy_and_resolve_references()
  config.sample.weight_layouts = "auto"
  laid = dgemma.load(str(workdir), config=config)
  assert laid.settings.sample.weight_layouts == "auto"
  formats = api.compiled_weight_formats(laid.params, laid.settings, laid.mesh)
  assert [x.format for x in jax.tree.leaves(laid.params)] == jax.tree.leaves(formats)
  a = default.generate(["the king", "a"], max_new_tokens=16, steps=3, seed=1)
  b = laid.generate(["the king", "a"], max_new_tokens=16, steps=3, seed=1)
  assert [x.token_ids for x in a] == [x.token_ids for x in b]
