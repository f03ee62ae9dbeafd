"""The tree keeps its shape (docs/architecture.md): no import cycle in dgemma/, imports that only go down
the layers, lower layers that never import the config boundary, and a README table that matches the tree, and no test module
that imports transformers when collected (the fast-tier guard of tests/conftest.py)."""

import ast
import re
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]

# docs/architecture.md's layers, by top-level module of dgemma.
LAYERS = {
    "dgemma.errors": 0, "dgemma.files": 0, "dgemma.reductions": 0, "dgemma.settings_fields": 0, "dgemma.registry": 0,
    "dgemma.model": 1, "dgemma.tokenizers": 1,
    "dgemma.diffusion": 2, "dgemma.quant": 2, "dgemma.finetune": 2, "dgemma.mesh": 2, "dgemma.distributed": 2,
    "dgemma.jax_cache": 2,
    "dgemma.data": 2,
    "dgemma.sampling": 3,
    "dgemma.settings": 4, "dgemma.rl": 4,
    "dgemma.checkpoints": 5,
    "dgemma.train": 6,
    "dgemma.run_report": 7, "dgemma.api": 7,
    "dgemma.tools": 8, "dgemma": 8,
}


def _modules() -> dict[str, Path]:
  out = {}
  for path in (REPO / "dgemma").rglob("*.py"):
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
  """Every dgemma module `path` imports, at module level or inside a function (as the shared
  import-cycle tool counts them): `import a.b.c` is an edge to a, a.b and a.b.c."""
  targets = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        stem = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
      else:
        stem = node.module or ""
      names = [stem] + [f"{stem}.{a.name}" for a in node.names]
    for name in names:
      parts = name.split(".")
      targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
  return targets


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  graph = {}
  for module, path in mods.items():
    graph[module] = {t for t in _imports(path, module, path.name == "__init__.py")
                     if t in mods and t != module and not module.startswith(t + ".")}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
  """Strongly connected sets of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(component)

  for v in graph:
    if v not in index:
      visit(v)
  return out


def _top(module: str) -> str:
  return ".".join(module.split(".")[:2])


def test_no_import_cycles():
  assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_imports_only_go_down_the_layers():
  graph = _graph()
  assert set(map(_top, graph)) <= set(LAYERS), set(map(_top, graph)) - set(LAYERS)
  upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if _top(t) != _top(m) and LAYERS[_top(t)] > LAYERS[_top(m)])
  assert upward == []


def test_the_library_never_imports_configs():
  """configs/ sits above the settings boundary (docs/architecture.md): what a library module needs of a config
  arrives as typed settings."""
  found = []
  for path in (REPO / "dgemma").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
      found += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "configs" or n.startswith("configs.")]
  assert found == []


def test_readme_table_matches_the_tree():
  readme = (REPO / "README.md").read_text()
  table = readme.split("## Where things live", 1)[1].split("\n## ", 1)[0]
  named = set(re.findall(r"`([\w./-]+)`", table))
  paths = {n for n in named if "/" in n or n in ("train.py", "sample.py")}  # repository paths (not `cli.py` mentions)
  assert all((REPO / p.rstrip("/")).exists() for p in paths), [p for p in paths if not (REPO / p.rstrip("/")).exists()]
  listed = {p.rstrip("/") for p in paths}
  for entry in sorted((REPO / "dgemma").iterdir()):
    if entry.name.startswith("__") or entry.name == "__pycache__":
      continue
    assert f"dgemma/{entry.name}" in listed, f"dgemma/{entry.name} is not in README's 'Where things live'"


def test_tests_mirror_the_package():
  """tests/<dir>/ holds the tests of dgemma/<dir>/ (or of the top-level eval/, bench/); tests of a top-level
  module dgemma/<name>.py, of the entry points and of the repository as a whole stay in tests/."""
  dirs = [d for d in (REPO / "tests").iterdir() if d.is_dir() and not d.name.startswith((".", "__")) and d.name != "golden"]
  assert dirs, "tests/ has no package subdirectories"
  for d in dirs:
    assert (REPO / "dgemma" / d.name).is_dir() or (REPO / d.name).is_dir(), f"tests/{d.name}/ mirrors nothing"
    assert (d / "__init__.py").exists(), f"tests/{d.name}/ needs an __init__.py (test module names repeat)"
  for pkg in (REPO / "dgemma").iterdir():
    if (pkg / "__init__.py").exists():
      assert (REPO / "tests" / pkg.name).is_dir(), f"dgemma/{pkg.name}/ has no tests/{pkg.name}/"


def _module_level_imports_of(tree: ast.Module, package: str) -> list[int]:
  """Line numbers where a module imports `package` when it is imported (collected): import statements outside
  any function, and pytest.importorskip(package) calls outside any function."""
  hits = []

  def visit(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      return  # runs only when called
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
      hits.append(node.lineno)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package and not node.level:
      hits.append(node.lineno)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
          and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] == package):
      hits.append(node.lineno)
    for child in ast.iter_child_nodes(node):
      visit(child)

  visit(tree)
  return hits


def test_no_test_module_imports_transformers_when_collected():
  """tests/conftest.py fails a fast test that leaves `transformers` imported when it was not before. A test module
  importing it at collection would import it in every worker before any test runs, and the guard would never fire
  (it did not, until tests/sampling/test_parity.py imported it inside its HF helper)."""
  offenders = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "tests").rglob("*.py"))
               for line in _module_level_imports_of(ast.parse(path.read_text()), "transformers")]
  assert offenders == []


def test_the_collection_import_check_sees_module_level_imports():
  source = ("import transformers\nfrom transformers.models import x\nimport pytest\npytest.importorskip('transformers')\n"
            "def f():\n  import transformers\n  from transformers import y\n")
  assert _module_level_imports_of(ast.parse(source), "transformers") == [1, 2, 4]


# ---- pointers: every repository path and `python -m` module the documents and the code's text name exists -----

_TRACKED_TOPS = ("bench", "configs", "dgemma", "docs", "eval", "notebooks", "proj", "tests")
_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*\w)" % "|".join(_TRACKED_TOPS))
_MODULE = re.compile(r"python3? -m ((?:%s)(?:\.\w+)*)" % "|".join(("dgemma", "eval", "proj", "bench", "configs")))
# What a line may say about a path that is not in the tree: an output a command writes, a file kept in git history
# (REV:path, "in git at REV under path"), a path in another project ("MaxText's configs/types.py").
_NOT_A_POINTER = re.compile(r"(--\w*out\w*[= ]|> ?|\b[0-9a-f]{7,40}:|in git at \w+ under `?|"
                            r"(?i:maxtext|big_vision|google-deepmind|tunix|qwix|tokamax|vllm|lm-eval)\W+(\w+\W+){0,2})$")


def _texts() -> Iterator[tuple[str, int, str]]:
  """(file, line, text) of the README, docs/ and the comments and strings of every Python file outside tests/."""
  import io
  import tokenize
  for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
      yield str(path.relative_to(REPO)), n, line
  for path in sorted(REPO.rglob("*.py")):
    rel = path.relative_to(REPO)
    if rel.parts[0] in ("tests", ".venv", "workdirs", "data_cache") or rel.parts[0].startswith("."):
      continue
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
      if tok.type in (tokenize.COMMENT, tokenize.STRING):
        for i, line in enumerate(tok.string.splitlines()):
          yield str(rel), tok.start[0] + i, line


def stale_pointers(texts) -> list[str]:
  """'file:line: path' for each repository path (under a tracked top-level folder) or `python -m` module of ours
  that `texts` name and the tree does not hold; placeholders (<study>, *, {}) and outputs a command writes pass."""
  out = []
  for where, n, line in texts:
    for match in _PATH.finditer(line):
      p = match.group(1).rstrip(".")
      if any(c in p for c in "<*{$") or _NOT_A_POINTER.search(line[:match.start()]):
        continue
      if not ((REPO / p).exists() or (REPO / f"{p}.py").exists()):
        out.append(f"{where}:{n}: {p}")
    for m in _MODULE.findall(line):
      base = REPO.joinpath(*m.split("."))
      if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
        out.append(f"{where}:{n}: python -m {m}")
  return out


def test_every_path_and_module_named_exists():
  assert stale_pointers(_texts()) == []


def test_the_pointer_check_finds_a_stale_path_and_module():
  texts = [("README.md", 1, "see dgemma/nope.py and docs/model.md; python -m dgemma.tools.gone, python -m pip"),
           ("README.md", 2, "python train.py --out=docs/written_here.json; git show a116924:docs/results/x.csv"),
           ("README.md", 3, "a study's proj/<study>/ folder and configs/models/*.py")]
  assert stale_pointers(texts) == ["README.md:1: dgemma/nope.py", "README.md:1: python -m dgemma.tools.gone"]


def test_the_library_does_not_know_its_studies():
  """dgemma/ names no study module (proj/...): a study registers its data source, rewards and settings group from
  the modules its config names in `imports`, so adding one touches only proj/<study>/ and its config."""
  named = [f"{where}:{n}" for where, n, line in _texts()
           if where.startswith("dgemma/") and re.search(r"(?<![\w./])proj[./](?!<study>)", line)]
  found = [f"{p.relative_to(REPO)}" for p in (REPO / "dgemma").rglob("*.py")
           if re.search(r"^\s*(from|import) proj\b", p.read_text(), re.M)]
  assert named == [] and found == []
