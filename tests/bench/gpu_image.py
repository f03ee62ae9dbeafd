"""Shared by the tests of the GPU benchmark scripts (bench/gpu_*.py): load a script as a module, and import it in a
subprocess where the packages the GPU image lacks cannot be imported (the image has jax, flax, optax and numpy)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NOT_ON_THE_GPU_IMAGE = ("ml_collections", "grain", "tensorflow_datasets", "tensorflow", "tensorboardX", "sentencepiece",
                        "torch", "transformers")


def load_script(script: Path):
  """The script as a module (it is not a package module)."""
  spec = importlib.util.spec_from_file_location(script.stem, script)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def import_on_gpu_image(script: Path, expression: str) -> subprocess.CompletedProcess:
  """Runs `print(<expression>)` with the script loaded as `g`, in a subprocess whose imports of
  NOT_ON_THE_GPU_IMAGE raise ImportError."""
  code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in {NOT_ON_THE_GPU_IMAGE!r}:
      raise ImportError('blocked on the GPU image: ' + name)
sys.meta_path.insert(0, Block())
import importlib.util
spec = importlib.util.spec_from_file_location('g', {str(script)!r})
g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
print({expression})
"""
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
