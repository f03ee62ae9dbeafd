"""Every notebook in notebooks/ runs headless (nbclient) with its small settings, so none of them rots.

The kernel inherits this process's environment: DGEMMA_NOTEBOOK_SMALL=1 selects the tiny test model (its
compiled programs are shared with the other tests through the persistent compilation cache where it is on), the toy
corpus replaces the Shakespeare download, and everything is written under a temporary directory.
finetune_head.ipynb needs the finetune.* config keys (LoRA / head-only fine-tuning).
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))


def test_all_notebooks_are_covered():
  assert NOTEBOOKS == ["ablations.ipynb", "finetune_colab.ipynb", "finetune_head.ipynb", "quickstart.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, corpus_file, tmp_path, monkeypatch):
  import nbformat
  from nbclient import NotebookClient
  monkeypatch.setenv("DGEMMA_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("DGEMMA_NOTEBOOK_TEXT", str(corpus_file))
  monkeypatch.setenv("DGEMMA_NOTEBOOK_OUT", str(tmp_path / "out"))
  monkeypatch.setenv("DGEMMA_NOTEBOOK_DATA_CACHE", str(tmp_path / "data_cache"))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
  first = notebook.cells[1].source
  assert "find_spec(\"dgemma\")" in first and "pip\", \"install\"" in first  # Colab: installs itself when needed
  # started where Jupyter starts it (the notebook's folder), the notebook moves to the repository root
  NotebookClient(notebook, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
  outputs = "".join(str(o.get("text", "")) for cell in notebook.cells for o in cell.get("outputs", []))
  assert "Traceback" not in outputs
  assert f"working directory {REPO}\n" in outputs
  assert any(p.suffix == ".png" for p in (tmp_path / "out").rglob("*")) or name in ("finetune_head.ipynb", "finetune_colab.ipynb")
