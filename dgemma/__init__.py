"""dgemma: DiffusionGemma-style text diffusion in JAX/Flax.

  import dgemma
  model = dgemma.load("workdirs/demo")        # a run, a converted checkpoint, an adapter or an HF directory
  print(model.generate("ROMEO:", max_new_tokens=64).text)

`load`, `Model`, `Generation` and `CanvasView` come from dgemma/api.py (see its docstring). They are
imported on first use, so `import dgemma.model` (e.g. on an accelerator image that has only jax and flax)
does not pull in the data and checkpoint stacks.
"""

_API = ("load", "Model", "Generation", "CanvasView")

__all__ = list(_API)


def __getattr__(name):
  if name in _API:
    from dgemma import api  # pylint: disable=g-import-not-at-top  (first use only; see the docstring)
    return getattr(api, name)
  raise AttributeError(f"module 'dgemma' has no attribute {name!r}")
