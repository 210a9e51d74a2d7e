"""The import graph of flash_layers: no cycles, a declared layer order, no unlisted lazy imports.

The graph is read from the source (ast), so a lazy `import` in a function body is an
edge like any other: a cycle hidden behind a function-level import still fails here.
`LAYERS` ranks the package's modules; an import may only go to the same rank or a lower
one. Every import of a flash_layers module inside a function is listed in `LAZY` with its
reason (an optional or platform-only dependency loaded on demand, never a dodged cycle).
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


# Module prefix -> rank: a module takes the rank of its longest matching prefix (a prefix matches the
# module itself and everything under it, so "flash_layers.layers" covers the whole layers/ package).
# Imports may only go to the same rank or a lower one.
LAYERS: dict[str, int] = {
    # leaves: errors, how a call is lowered, the host's platform setup, the strict-interpreter helpers
    "flash_layers.errors": 0, "flash_layers.lowering": 0, "flash_layers.host": 0,
    "flash_layers.testing": 1,
    # what every impl computes; fl.masks re-exports its named mask_mods
    "flash_layers.contract": 1, "flash_layers.masks": 1,
    "flash_layers.impls": 2,
    # the tuning cache is data the choice reads; the tuner itself runs calls, so it sits above dispatch
    "flash_layers.tuning.cache": 3,
    "flash_layers.validate": 4,
    "flash_layers.auto": 5,
    "flash_layers.dispatch": 6,
    "flash_layers.tuning": 7,
    "flash_layers.parallel": 8,
    "flash_layers.api": 9, "flash_layers.paged_api": 9,
    "flash_layers.layers": 10, "flash_layers.nnx": 10, "flash_layers.haiku": 10,
    "flash_layers.rotary": 10,
    # models and data read each other's assets (a tokenizer's files, a model's vocabulary)
    "flash_layers.models": 11, "flash_layers.data": 11,
    "flash_layers.training": 12,
    "flash_layers.export": 13,
    "flash_layers.demo": 15,  # a demo of the public API: `import flash_layers as fl`
}
ROOT_RANK = 14  # the package's __init__: the public names, from every layer

# (module, what it imports in a function body) -> why it is not a top-level import. A dynamic
# `importlib.import_module(expr)` is listed by its expression's source text.
LAZY: dict[tuple[str, str], str] = {
    ("flash_layers.impls.flash_pallas", "_FAMILY_MODULES[name]"):
        "the kernel family of the platform lowered for (tpu.py imports Mosaic, gpu.py Triton), loaded "
        "and checked against KernelFamily on first use",
    ("flash_layers.impls.flash_pallas.decode", "_MODULES[family]"):
        "the decode kernels of the platform lowered for (tpu_decode / gpu_decode), on first use",
    ("flash_layers.impls.flash_pallas.decode", "f'flash_layers.impls.flash_pallas.{call.family}'"):
        "the family's backward kernels, only when a decode call is differentiated",
    ("flash_layers.impls.paged.kernels", "_FAMILY_MODULES[family]"):
        "the paged kernel of the platform lowered for (tpu_paged imports Mosaic, gpu_paged Triton), on "
        "first use",
    ("flash_layers.impls.flash_pallas.tuning_space", "flash_layers.impls.flash_pallas.tpu_config"):
        "only when tuning for a TPU",
    ("flash_layers.impls.flash_pallas.tuning_space", "flash_layers.impls.flash_pallas.gpu_config"):
        "only when tuning for a GPU (gpu_config imports Pallas)",
    ("flash_layers.testing.strict", "_INTERPRETER_MODULE"):
        "a private jax module, present only in jax versions with the strict TPU interpreter",
    ("flash_layers.testing.strict", "_THREAD_MAP_MODULE"):
        "a private jax module, present only in jax versions with the strict TPU interpreter",
}


def rank(module: str) -> int:
  """`module`'s rank in LAYERS (longest matching prefix); KeyError when none matches."""
  if module == PACKAGE:
    return ROOT_RANK
  matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
  if not matches:
    raise KeyError(f"{module} has no rank in LAYERS: add its prefix")
  return LAYERS[max(matches, key=len)]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
  """Every import from a lower rank to a higher one, as 'a (rank) -> b (rank)'."""
  return sorted(f"{a} ({rank(a)}) -> {b} ({rank(b)})"
                for a, targets in graph.items() for b in targets if rank(b) > rank(a))


def lazy_imports() -> set[tuple[str, str]]:
  """(module, target) of every import of a flash_layers module inside a function body, and of every
  `importlib.import_module` call there (its argument's source text when not a constant)."""
  found = set()
  for name, path in _modules().items():
    is_package = path.name == "__init__.py"
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(fn):
        if isinstance(node, ast.Import):
          found |= {(name, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
          source = _absolute(node, name, is_package)
          if source.split(".")[0] == PACKAGE:
            found |= {(name, f"{source}.{a.name}" if f"{source}.{a.name}" in _modules() else source)
                      for a in node.names}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args):
          arg = node.args[0]
          found.add((name, arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)))
  return found


def test_every_module_has_a_rank():
  for module in import_graph():
    rank(module)


def test_no_import_runs_upward():
  assert upward_imports(import_graph()) == []


def test_the_layer_check_catches_an_upward_import():
  graph = {"flash_layers.impls.xla_dense": {"flash_layers.dispatch"}, "flash_layers.dispatch": set()}
  assert upward_imports(graph) == ["flash_layers.impls.xla_dense (2) -> flash_layers.dispatch (6)"]
  assert rank("flash_layers.layers.linen") == rank("flash_layers.layers")  # a package covers its modules
  assert rank("flash_layers.tuning.cache") < rank("flash_layers.validate") < rank("flash_layers.tuning.tuner")


def test_every_lazy_import_is_listed_with_its_reason():
  found = lazy_imports()
  unlisted = sorted(found - set(LAZY))
  assert unlisted == [], "a function-level import of flash_layers: move it to the top, or list it in LAZY"
  assert sorted(set(LAZY) - found) == [], "LAZY lists an import that is gone: remove it"


@pytest.mark.parametrize("module", ["flash_layers.api", "flash_layers.parallel.sharded",
                                    "flash_layers.parallel.ring"])
def test_dispatch_is_imported_at_the_top(module):
  """api and the parallel paths run calls through dispatch directly (the parallel ones not through api)."""
  graph = import_graph()
  assert "flash_layers.dispatch" in graph[module]
  if module != "flash_layers.api":
    assert "flash_layers.api" not in graph[module]


def test_the_layers_call_attention_through_api_only():
  """The layers validate (validate, auto) and run through api.run, the path of fl.attention itself."""
  graph = import_graph()
  core = graph["flash_layers.layers.core"]
  assert "flash_layers.api" in core and "flash_layers.dispatch" not in core
