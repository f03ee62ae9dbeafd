"""Bad command lines end in one line `<prog>: <what, naming the flag, field or file>` and a non-zero exit, never
a traceback (dgemma/tools/cli.py; docs/reliability.md lists the cases)."""

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


@pytest.mark.slow  # subprocesses: the command lines themselves
def test_bad_command_lines_are_one_line(tiny_run, tmp_path):
  workdir, _ = tiny_run
  (tmp_path / "plain").write_text("")
  broken = tmp_path / "broken_run"
  broken.mkdir()
  (broken / "checkpoints").mkdir()
  (broken / "config.json").write_text((workdir / "config.json").read_text()[:40])  # cut short
  broken_hf = tmp_path / "broken_hf"
  broken_hf.mkdir()
  (broken_hf / "config.json").write_text('{"model_type": "diffusion_gemma", "text_')
  (broken_hf / "model.safetensors").write_bytes(b"")
  (tmp_path / "empty.txt").write_text("")
  train = [sys.executable, "train.py", "--config=configs/tiny_test.py"]
  cases = [
      ([sys.executable, "sample.py", f"--checkpoint={workdir}", "--stepz=2"], "sample.py: Unknown command line flag 'stepz'"),
      ([sys.executable, "train.py", "--config.train.num_steps=3", "--config=configs/tiny_test.py", "--workdir=w"],
       "train.py: Found --config.train.num_steps=3 in argv before a value for --config was specified; put --config=FILE first"),
      (train + [f"--workdir={tmp_path / 'plain'}"], f"train.py: --workdir: {tmp_path / 'plain'} is a file, not a directory"),
      (train + [f"--workdir={tmp_path / 'w'}", "--config.data.source=files",
                f"--config.data.files=('{tmp_path / 'empty.txt'}',)"], "train.py: data.files: "),
      ([sys.executable, "sample.py", f"--checkpoint={broken}"], f"sample.py: {broken / 'config.json'}: not valid JSON"),
      ([sys.executable, "sample.py", f"--checkpoint={broken_hf}"], f"sample.py: {broken_hf / 'config.json'}: not valid JSON"),
      ([sys.executable, "sample.py", f"--checkpoint={workdir}", f"--out={tmp_path}"],
       f"sample.py: --out: {tmp_path} is a directory; name a file"),
      ([sys.executable, "sample.py", f"--checkpoint={workdir}", "--step=2"],
       "sample.py: sample.checkpoint_step: step 2 not in"),
  ]
  for cmd, expected in cases:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert out.returncode != 0 and last.startswith(expected), (cmd, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, (cmd, out.stderr[-2000:])
  assert not (tmp_path / "w").exists()
