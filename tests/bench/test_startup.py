"""bench/startup.py: each entry is imported in a fresh interpreter, timed, and put against the first entry."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import startup  # noqa: E402


def test_the_program_imports_each_joined_module_then_reports_its_cpu_seconds():
  assert startup.import_code("train+tensorboardX") == (
      "import time; import train; import tensorboardX; print(time.process_time())")


@pytest.mark.slow  # subprocesses (of the standard library only: milliseconds each)
def test_measure_times_fresh_processes_against_the_first_entry():
  result = startup.measure(["json", "json+csv"], repeats=2)
  assert list(result) == ["json", "json+csv"]
  assert result["json"]["ratio"] == 1.0
  for r in result.values():
    assert 0 < r["cpu_s"] and 0 < r["wall_s"] < 60
  assert result["json+csv"]["ratio"] == pytest.approx(result["json+csv"]["wall_s"] / result["json"]["wall_s"])
  with pytest.raises(RuntimeError, match="--modules: importing 'no_such_module_x' failed"):
    startup.measure(["no_such_module_x"], repeats=1)
