"""No import cycles among flash_layers modules, counting imports inside functions too.

The graph is read from the source (ast), so a lazy `import` in a function body is an
edge like any other: a cycle hidden behind a function-level import still fails here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "flash_layers"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in ROOT.rglob("*.py"):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
  if node.level == 0:
    return node.module or ""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[: len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
  """module -> the flash_layers modules it imports (anywhere in its body)."""
  modules = _modules()
  graph: dict[str, set[str]] = {name: set() for name in modules}
  for name, path in modules.items():
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        source = _absolute(node, name, is_package)
        # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
        targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        targets = [node.args[0].value]
      for target in targets:
        if target in modules and target != name:
          graph[name].add(target)
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  cycles: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return cycles


def test_no_import_cycles():
  graph = import_graph()
  assert len(graph) > 30, sorted(graph)  # the walk found the package
  assert find_cycles(graph) == []


def test_the_check_sees_lazy_imports(tmp_path, monkeypatch):
  """A cycle made only of function-level imports is still found."""
  package = tmp_path / PACKAGE
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "a.py").write_text("def f():\n  from flash_layers import b\n")
  (package / "b.py").write_text("from flash_layers.a import f\n")
  (package / "c.py").write_text("import importlib\nm = importlib.import_module('flash_layers.a')\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", package)
  graph = import_graph()
  assert graph["flash_layers.c"] == {"flash_layers.a"}
  assert find_cycles(graph) == [["flash_layers.a", "flash_layers.b"]]


@pytest.mark.parametrize("module", ["flash_layers.api", "flash_layers.parallel.sharded",
                                    "flash_layers.parallel.ring", "flash_layers.layers"])
def test_dispatch_is_imported_at_the_top(module):
  """The layers and the parallel paths use dispatch directly, not through api."""
  graph = import_graph()
  assert "flash_layers.dispatch" in graph[module]
  if module != "flash_layers.api":
    assert "flash_layers.api" not in graph[module] or module == "flash_layers.layers"
