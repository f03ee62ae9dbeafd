"""sample.py and the report end to end on a freshly trained tiny run."""

import subprocess
import sys
from pathlib import Path

import pytest

from dgemma import api, checkpoints, run_report

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def trained_workdir(tiny_run):
  """The shared 3-step tiny run (tests/conftest.py)."""
  return tiny_run[0]


@pytest.mark.slow  # subprocesses (sample.py)
def test_sample_py_end_to_end(trained_workdir, tmp_path):
  html = tmp_path / "traj.html"
  cmd = [sys.executable, "sample.py", "--config=configs/tiny_test.py", f"--workdir={trained_workdir}",
         "--config.sample.prompt=the king", "--config.sample.num_samples=2", "--steps=3", "--seed=5",
         f"--config.sample.trajectory_html={html}", "--config.sample.show=live"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "--- sample 0" in out.stdout and "--- sample 1" in out.stdout
  assert "decoder passes" in out.stdout and "tokens/pass" in out.stdout
  # show=live: one terminal frame (clear + home) per executed step, held tokens highlighted
  from dgemma.sampling import live
  frames = out.stdout.count(live.CLEAR_HOME)
  assert frames >= 2 and "canvas 1, step 1/3" in out.stdout and live.ACCEPTED in out.stdout
  page = html.read_text()
  assert page.count('class="step"') >= 1 and "accepted" in page
  assert not (trained_workdir / "samples.txt").exists()  # written only when asked (--text_out)


def test_sampling_is_deterministic_and_uses_the_checkpoint(trained_workdir):
  printed = []
  kw = dict(steps=3, print_fn=printed.append)
  a = api.sample_command(str(trained_workdir), seed=1, **kw)
  b = api.sample_command(str(trained_workdir), seed=1, **kw)
  c = api.sample_command(str(trained_workdir), seed=2, **kw)
  assert [g.token_ids for g in a] == [g.token_ids for g in b]
  assert "--- sample 0 (step 3, " in printed[0]  # the latest checkpoint (step 3)
  assert [g.token_ids for g in a] != [g.token_ids for g in c]
  assert a[0].num_forwards >= 1


def test_sample_bad_workdir(tmp_path):
  with pytest.raises(FileNotFoundError, match="^--checkpoint: .*nothing does not exist"):  # sample.py's flag
    api.sample_command(str(tmp_path / "nothing"))
  (tmp_path / "empty").mkdir()  # exists, but is no checkpoint: the error says what was looked for
  with pytest.raises(FileNotFoundError, match="config.json"):
    api.sample_command(str(tmp_path / "empty"))


def test_report_writes_png_and_index(trained_workdir, tmp_path):
  out = run_report.write_report(trained_workdir, tmp_path / "report")
  png = (out / "loss_curve.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
  assert "dgemma run report" in (out / "index.html").read_text()


@pytest.mark.slow  # two generate compiles and a report (kept out of the fast tier's budget)
def test_report_shows_sample_quality_beside_held_out_text(tiny_run, tmp_path):
  # what `make demo` does: eval.samples writes WORKDIR/sample_quality.json, the report shows it
  import copy
  import json
  from eval import samples
  workdir, run_config = tiny_run
  config = copy.deepcopy(run_config)
  quality = tmp_path / "wd_quality.json"
  config.eval.update(real_words="train", num_samples=2, out=str(quality))
  config.sample.max_new_tokens = 8
  summary = samples.run(str(workdir), config, print_fn=lambda *_: None)
  assert quality.read_text() == json.dumps(summary, indent=2) + "\n"
  for key in ("real_word_rate", "real_word_rate_heldout", "unigram_entropy", "unigram_entropy_heldout"):
    assert key in summary
  page = run_report.quality_html(summary)
  assert f"{summary['real_word_rate_heldout']:.3f}" in page and f"{summary['unigram_entropy']:.3f}" in page
  assert "sampler released" in page
  # the report folder carries the table when the workdir has the file, and not otherwise
  quality_in_workdir = workdir / run_report.QUALITY_FILE
  quality_in_workdir.write_text(quality.read_text())
  try:
    out = run_report.write_report(workdir, tmp_path / "report")
    assert "Sample quality" in (out / "index.html").read_text()
  finally:
    quality_in_workdir.unlink()
  assert "Sample quality" not in (run_report.write_report(workdir, tmp_path / "report2") / "index.html").read_text()


def test_bad_sample_requests_fail_before_loading(trained_workdir, monkeypatch):
  """Each bad setting raises a ConfigError naming its key before the checkpoint is read or
  anything is compiled."""
  import jax
  from configs import tiny_test
  from dgemma.errors import ConfigError
  from dgemma.sampling import generation

  def reached(*args, **kwargs):
    raise AssertionError("reached checkpoint loading / jax.jit")

  monkeypatch.setattr(checkpoints, "load", reached)
  monkeypatch.setattr(checkpoints, "load_as", reached)
  monkeypatch.setattr(checkpoints.workdir, "restore_params", reached)
  monkeypatch.setattr(jax, "jit", reached)
  monkeypatch.setattr(generation, "_generate_jit", reached)
  cases = [(dict(num_samples=0), {}, "sample.num_samples"), (dict(max_new_tokens=0), {}, "sample.max_new_tokens"),
           ({}, dict(steps=0), "sample.max_denoising_steps"), (dict(entropy_bound=0.0), {}, "sample.entropy_bound"),
           (dict(sampler="nope"), {}, "sample.sampler"), (dict(acceptance="nope"), {}, "sample.acceptance"),
           (dict(renoise="nope"), {}, "sample.renoise"), (dict(show="nope"), {}, "sample.show"),
           (dict(infill=((32, 5),)), {}, "sample.infill: position 32"),       # max_new_tokens = 32
           (dict(prompt="the king of all the land", max_context=40), {}, "sample.max_context=40")]
  for sample, kwargs, pattern in cases:
    config = tiny_test.get_config()
    config.sample.update(sample)
    with pytest.raises(ConfigError, match=pattern):
      api.sample_command(str(trained_workdir), config, print_fn=lambda *_: None, **kwargs)
