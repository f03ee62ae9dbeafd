"""Installing dgemma fits its host: pyproject.toml declares ranges that hold the exact lock of
requirements.txt, and pip keeps an accelerated JAX that is already installed (Colab's GPU / TPU runtime)
instead of replacing it with the CPU build of the lock; and what the runtime imports leaves out the test extra."""

import base64
import hashlib
import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def _declared() -> list[Requirement]:
  return [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]


def _locked() -> dict[str, str]:
  pins = {}
  for line in (REPO / "requirements.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      pins[canonicalize_name(name)] = version
  return pins


def test_declared_ranges_hold_the_lock_and_pin_nothing():
  locked = _locked()
  for req in _declared():
    assert not any(spec.operator in ("==", "===") for spec in req.specifier), f"{req}: a pin, not a range"
    name = canonicalize_name(req.name)
    assert name in locked, f"{req.name} is declared but not locked in requirements.txt"
    assert req.specifier.contains(locked[name]), f"{req.name}=={locked[name]} (the lock) is outside {req.specifier}"
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert {"cuda13", "tpu", "lm_eval"} <= set(extras)
  for extra in ("cuda13", "tpu"):
    (jax_req,) = [Requirement(r) for r in extras[extra]]
    assert jax_req.name == "jax" and extra in jax_req.extras and jax_req.specifier.contains(locked["jax"])


def _fake_wheel(directory: Path, name: str, version: str, requires=()) -> Path:
  """A metadata-only wheel (what pip's resolver reads), built without any build backend."""
  dist = f"{name.replace('-', '_')}-{version}"
  path = directory / f"{dist}-py3-none-any.whl"
  files = {f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
               name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)),
           f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
  record = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},"
                   f"{len(v)}\n" for k, v in files.items()) + f"{dist}.dist-info/RECORD,,\n"
  with zipfile.ZipFile(path, "w") as z:
    for k, v in {**files, f"{dist}.dist-info/RECORD": record}.items():
      z.writestr(k, v)
  return path


@pytest.mark.slow  # a virtual environment and pip runs (offline: only fake metadata wheels are involved)
def test_installing_keeps_an_accelerated_jax_already_there(tmp_path):
  """An environment with jax 0.11.2 + its CUDA 13 plugin (the H200 image's versions) and every other
  dependency already present: resolving dgemma's declared requirements installs nothing, while the
  exact lock would replace jax by the locked CPU version. Offline: every package is a metadata-only
  wheel in a local folder (the lock's versions for the others), so this checks pip's decision, not PyPI."""
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  locked = _locked()
  accelerated = {"jax": "0.11.2", "jaxlib": "0.11.2"}
  for name, version in locked.items():
    _fake_wheel(wheels, name, version)  # the lock, as an index would offer it
    if name not in accelerated:
      continue
    _fake_wheel(wheels, name, accelerated[name])
  _fake_wheel(wheels, "jax-cuda13-plugin", "0.11.2")
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # pip from the bundled wheel (offline)
  pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input"]
  present = [w for w in wheels.iterdir() if canonicalize_name(w.name.split("-")[0]) not in accelerated]
  present = [w for w in present if not w.name.startswith("jax_cuda13")] + [
      next(wheels.glob(f"{n}-{v}-*.whl")) for n, v in accelerated.items()] + [next(wheels.glob("jax_cuda13_plugin-*"))]
  subprocess.run([*pip, "install", "--no-index", "--no-deps", *map(str, present)], check=True, capture_output=True)

  def plan(requirements: list[str]) -> dict[str, str]:
    report = tmp_path / "report.json"
    subprocess.run([*pip, "install", "--dry-run", "--no-index", "--find-links", str(wheels), "--report", str(report),
                    *requirements], check=True, capture_output=True)
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}

  declared = [str(r) for r in _declared()]
  assert plan(declared) == {}  # nothing replaced: the accelerated jax stays
  pinned = [f"{n}=={v}" for n, v in locked.items()]
  assert plan(pinned).get("jax") == locked["jax"]  # a pinned install would have swapped it for the CPU lock


@pytest.mark.slow  # a subprocess: a fresh interpreter's sys.modules
def test_training_sampling_and_eval_import_no_test_only_package():
  """The test extra (torch, transformers, the tensorboardX reference) is installed here, as on a researcher's
  machine; the runtime must not import it (train.py, and what sample.py and the eval commands call). tensorboardX did, through torch (1.4 s at every start of a process
  that trained or sampled): dgemma/train/metrics.py now writes the event files itself."""
  test_only = ("torch", "transformers", "tensorboardX", "tensorflow")
  code = ("import sys; import train, dgemma, dgemma.api, dgemma.train.loop, eval.likelihood, eval.samples, "
          f"eval.ablate; print([m for m in {test_only!r} if m in sys.modules])")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split("\n")[-2] == "[]", run.stdout
