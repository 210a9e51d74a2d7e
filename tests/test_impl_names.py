"""No impl name as code outside flash_layers/impls/: what an impl offers is asked of the registry.

A comparison with an impl name (``impl == "xla_native"``, ``name in ("reference", "xla_dense")``)
or a module constant listing impl names (``SOWS_WEIGHTS = ("reference", ...)``) outside impls/ is a
capability written as code: adding an impl, or a feature to one, would mean finding every such
line. Impls declare capabilities (impls/base.py) and callers ask `registry.impl_has` /
`registry.impls_with`. The auto rule table (auto.py) names impls as data inside a function, in the
order auto tries them; that is the rule itself, not a capability, and is not flagged.
"""

from __future__ import annotations

import ast
import pathlib

from flash_layers.impls import IMPLS

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "flash_layers"
IMPLS_DIR = PACKAGE / "impls"

# file (relative to the repository) -> why its impl names stay for now.
KNOWN: dict[str, str] = {}


def _names_in(node: ast.AST) -> list[str]:
  """The impl names among a literal's constants (a tuple, list or set literal, or one string)."""
  if isinstance(node, ast.Constant):
    return [node.value] if isinstance(node.value, str) and node.value in IMPLS else []
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [name for element in node.elts for name in _names_in(element)
            if isinstance(element, ast.Constant)]
  return []


def impl_names_as_code(source: str, filename: str = "<string>") -> list[str]:
  """'line: what' for each comparison with an impl name and each module constant listing one."""
  tree = ast.parse(source, filename)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      left = node.left
      for op, right in zip(node.ops, node.comparators, strict=True):
        if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)):
          names = _names_in(left) + _names_in(right)
          if names:
            found.append(f"{node.lineno}: comparison with {names}: {ast.unparse(node)}")
        left = right
  for node in tree.body:  # module constants
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)) and _names_in(value):
      found.append(f"{node.lineno}: module constant listing {_names_in(value)}")
  return found


def _modules() -> list[pathlib.Path]:
  return sorted(p for p in PACKAGE.rglob("*.py") if IMPLS_DIR not in p.parents)


def test_no_impl_name_as_code_outside_impls():
  offenders = {}
  for path in _modules():
    relative = str(path.relative_to(PACKAGE.parent))
    found = impl_names_as_code(path.read_text(), relative)
    if found and relative not in KNOWN:
      offenders[relative] = found
  assert offenders == {}, "ask the registry (registry.impl_has / impls_with) instead"


def test_known_exceptions_still_hold():
  """A KNOWN entry whose file no longer names impls as code (or is gone) must be removed."""
  for relative in KNOWN:
    path = PACKAGE.parent / relative
    assert path.exists() and impl_names_as_code(path.read_text()), f"remove {relative} from KNOWN"


def test_the_check_sees_each_form():
  source = '''
SOWS = ("reference", "xla_dense")
OTHER = ("cpu", "tpu")
def f(impl, name):
  if impl == "xla_native" or "flash_pallas" != impl:
    pass
  if name in ("reference", "xla_chunked") or name not in {"jax_splash"}:
    pass
  return impl == "auto" or name in ("cpu", "gpu")
'''
  found = impl_names_as_code(source)
  assert [line.split(":")[0] for line in found] == ["5", "5", "7", "7", "2"], found
  assert impl_names_as_code("def f(impl):\n  return registry.impl_has(impl, 'dropout')\n") == []
