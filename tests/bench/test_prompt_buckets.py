"""bench/prompt_buckets.py: each mode times a first and a second call per prompt length; the bucketed mode goes
through Model.generate_ids, the exact one through the low-level generate with the request's own shape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import prompt_buckets  # noqa: E402


@pytest.mark.slow  # two generate compiles (one per mode)
def test_each_mode_times_first_and_second_calls_per_length(tiny_run):
  for mode in ("exact", "bucketed"):
    out = prompt_buckets.run_mode(mode, str(tiny_run[0]), [3, 9], max_new_tokens=16)
    assert list(out) == [3, 9]
    assert all(set(r) == {"first_s", "second_s"} and r["first_s"] > 0 and r["second_s"] > 0 for r in out.values())


@pytest.mark.slow  # builds and saves demo-size weights
def test_the_random_demo_run_loads_with_the_demo_architecture(tmp_path):
  import dgemma
  from configs import demo
  model = dgemma.load(prompt_buckets.random_demo_run(tmp_path / "run"))
  assert model.model_cfg.d_model == demo.get_config().model.d_model and model.step == 1
