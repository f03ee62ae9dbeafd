"""Bad command lines end in one line `<prog>: <what, naming the flag, field or file>` and a non-zero exit, never
a traceback (dgemma/tools/cli.py; docs/reliability.md lists the cases)."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma.errors import DataError
from dgemma.tools import cli
from dgemma.train import loop

REPO = Path(__file__).resolve().parents[2]


def test_data_file_errors_are_user_errors(tiny_config, tmp_path):
  # train.py prints USER_ERRORS as one line; each bad data file is one of them, naming the file
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "adir").mkdir()
  (tmp_path / "x.bin").write_bytes(b"\x00\x01")
  for name, pattern in (("empty.txt", "is empty"), ("adir", "is a directory"), ("x.bin", "has unsupported extension")):
    tiny_config.data.files = (str(tmp_path / name),)
    with pytest.raises(cli.USER_ERRORS, match=f"data.files: .*{name} {pattern}") as caught:
      loop.train_and_evaluate(tiny_config, str(tmp_path / "wd"))
    assert isinstance(caught.value, DataError)
    assert not (tmp_path / "wd").exists()


def test_bad_checkpoints_and_outputs_are_user_errors(tiny_run, tmp_path):
  # what sample.py / train.py print as one line (cli.USER_ERRORS), raised before any weight is read
  from dgemma import api
  workdir, config = tiny_run
  (tmp_path / "plain").write_text("")
  broken = tmp_path / "broken_run"
  (broken / "checkpoints").mkdir(parents=True)
  (broken / "config.json").write_text((workdir / "config.json").read_text()[:40])  # cut short
  broken_hf = tmp_path / "broken_hf"
  broken_hf.mkdir()
  (broken_hf / "config.json").write_text('{"model_type": "diffusion_gemma", "text_')
  (broken_hf / "model.safetensors").write_bytes(b"")
  cases = [(lambda: loop.train_and_evaluate(config, str(tmp_path / "plain")),
            f"--workdir: {tmp_path / 'plain'} is a file, not a directory"),
           # a workdir that cannot be written (sysfs refuses new entries, even to root): refused before any work
           (lambda: loop.train_and_evaluate(config, "/sys/dgemma_workdir/run"),
            r"--workdir: /sys/dgemma_workdir/run cannot be written \(/sys: [^)]+\); use a writable --workdir"),
           (lambda: api.sample_command(str(broken)), f"{broken / 'config.json'}: not valid JSON"),
           (lambda: api.sample_command(str(broken_hf)), f"{broken_hf / 'config.json'}: not valid JSON"),
           (lambda: api.sample_command(str(workdir), out=str(tmp_path)), f"--out: {tmp_path} is a directory; name a file"),
           (lambda: api.sample_command(str(workdir), step=2), r"sample.checkpoint_step: step 2 not in .* \(have \[3\]\)")]
  for call, message in cases:
    with pytest.raises(cli.USER_ERRORS, match=message):
      call()


_BAD_CONFIGS = {
    "syntax.py": ("def get_config(:\n  pass\n", r"syntax\.py:1: SyntaxError: "),
    "no_get.py": ("X = 1\n", r"no_get\.py: defines no get_config\(\)"),
    "raises.py": ("import ml_collections\n\ndef get_config():\n  c = ml_collections.ConfigDict()\n  return c.nope\n",
                  r"raises\.py:5: in get_config: AttributeError: "),
}


def test_a_config_file_that_fails_is_one_line_at_its_own_line(tmp_path):
  """A config file with a syntax error, without get_config(), or whose get_config() raises: one ConfigError naming the
  file and the line of the file (not the loader's), as every command loads one (cli.load_config_file)."""
  for name, (text, pattern) in _BAD_CONFIGS.items():
    (tmp_path / name).write_text(text)
    with pytest.raises(cli.USER_ERRORS, match="config file .*" + pattern):
      cli.load_config_file(str(tmp_path / name))
  # an exception from elsewhere is not the config file's, and is not dressed as one
  try:
    raise KeyError("x")
  except KeyError as e:
    assert cli.config_file_failure(e, [str(tmp_path / "raises.py")]) is None


def test_an_override_without_its_config_says_what_it_needs():
  """`sample.py --checkpoint=X --config.sample.num_samples=2`: absl knows no such flag until --config= names a file,
  so the line says so; with --config= given, an unknown override is the plain message."""
  from absl import flags
  from ml_collections import config_flags
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values)
  flags.DEFINE_string("checkpoint", None, "", flag_values=values)
  argv = ["sample.py", "--checkpoint=w", "--config.sample.num_samples=2"]
  with pytest.raises(flags.Error) as raised:
    values(argv)
  with pytest.raises(SystemExit, match=r"^sample\.py: Unknown command line flag 'config\.sample\.num_samples'; a "
                     r"--config\.KEY override needs --config=FILE first"):
    cli._flag_error(raised.value, argv, "sample.py", "")  # pylint: disable=protected-access
  unknown = flags.UnrecognizedFlagError("config.nope", "config.nope=1")
  with_config = ["train.py", "--config=configs/tiny_test.py", "--config.nope=1"]
  with pytest.raises(SystemExit) as plain:
    cli._flag_error(unknown, with_config, "train.py", "")  # pylint: disable=protected-access
  assert "needs --config" not in str(plain.value)


def test_a_command_collects_garbage_as_set_for_tracing(monkeypatch):
  """cli.run sets the collector's thresholds (GC_THRESHOLDS) before the command's main runs."""
  seen = []
  before = gc.get_threshold()
  gc.set_threshold(700, 10, 10)  # CPython's defaults
  monkeypatch.setattr(sys, "argv", ["prog"])
  try:
    with pytest.raises(SystemExit) as done:
      cli.run(lambda argv: seen.append(gc.get_threshold()), "prog")
  finally:
    gc.set_threshold(*before)
  assert done.value.code in (0, None) and seen == [cli.GC_THRESHOLDS]


@pytest.mark.slow  # subprocesses: the command lines themselves
def test_bad_command_lines_are_one_line(tiny_run, tmp_path):
  workdir, _ = tiny_run
  cases = [
      ([sys.executable, "sample.py", f"--checkpoint={workdir}", "--stepz=2"], "sample.py: Unknown command line flag 'stepz'"),
      ([sys.executable, "train.py", "--config.train.num_steps=3", "--config=configs/tiny_test.py", "--workdir=w"],
       "train.py: Found --config.train.num_steps=3 in argv before a value for --config was specified; put --config=FILE first"),
      ([sys.executable, "sample.py", f"--checkpoint={workdir}", "--step=2"],  # a user error, printed as one line
       "sample.py: sample.checkpoint_step: step 2 not in"),
  ]
  for name, (text, _) in _BAD_CONFIGS.items():  # what config_flags raises while it loads --config: the file's line
    (tmp_path / name).write_text(text)
  cases += [
      ([sys.executable, "train.py", f"--config={tmp_path / 'raises.py'}", "--workdir=w"],
       f"train.py: --config: {tmp_path / 'raises.py'}:5: in get_config: AttributeError: "),
      ([sys.executable, "train.py", f"--config={tmp_path / 'syntax.py'}", "--config.train.num_steps=2", "--workdir=w"],
       f"train.py: --config: {tmp_path / 'syntax.py'}:1: SyntaxError: "),
  ]
  for cmd, expected in cases:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert out.returncode != 0 and last.startswith(expected), (cmd, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, (cmd, out.stderr[-2000:])
