"""The layers package's shape (flash_layers/layers/) and the flax drop-in's parameter tree.

* Haiku imports no flax: flash_layers/layers/haiku.py and every flash_layers module it imports, read
  from the source (ast, imports inside functions too), import no flax module.
* The linen and NNX layers do not import each other.
* `fl.MultiHeadDotProductAttention` creates flax's parameter tree exactly (paths, shapes, dtypes, values,
  plain arrays); `logical_axis_names=True`, and `fl.MultiHeadAttention`'s default, box them.
"""

from __future__ import annotations

import ast
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _path(module: str) -> pathlib.Path | None:
  base = ROOT.joinpath(*module.split("."))
  for path in (base.with_suffix(".py"), base / "__init__.py"):
    if path.exists():
      return path
  return None


def _imports(module: str) -> set[str]:
  """The modules `module` imports anywhere in its body (`from pkg import name` counts as pkg.name and pkg)."""
  path = _path(module)
  package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      source = node.module or ""
      if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      found.add(source)
      found |= {f"{source}.{alias.name}" for alias in node.names}
  return found


def _closure(start: str) -> dict[str, set[str]]:
  """module -> its imports, for `start` and every flash_layers module it reaches, with the packages that
  importing them runs (flash_layers.layers/__init__, ...). Not flash_layers/__init__: the top-level
  namespace imports every layer (fl.MultiHeadAttention), so it is where the frameworks meet by design."""
  seen: dict[str, set[str]] = {}
  todo = [start]
  while todo:
    module = todo.pop()
    if module in seen or _path(module) is None:
      continue
    seen[module] = _imports(module)
    parts = module.split(".")
    todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # the packages above it, not flash_layers
    todo += [m for m in seen[module] if m.startswith("flash_layers.")]
  return seen


def test_haiku_layer_imports_no_flax():
  closure = _closure("flash_layers.layers.haiku")
  assert {"flash_layers.layers.core", "flash_layers.dispatch", "flash_layers.api"} <= set(closure)
  flax = {module: sorted(m for m in imports if m == "flax" or m.startswith("flax."))
          for module, imports in closure.items()}
  assert {module: found for module, found in flax.items() if found} == {}


def test_the_walk_sees_flax():
  """The check itself: the linen layer's closure does import flax."""
  closure = _closure("flash_layers.layers.linen")
  assert "flax.linen" in closure["flash_layers.layers.linen"]


@pytest.mark.parametrize("module, other", [("flash_layers.layers.linen", "flash_layers.layers.nnx"),
                                           ("flash_layers.layers.nnx", "flash_layers.layers.linen")])
def test_linen_and_nnx_do_not_import_each_other(module, other):
  assert other not in _closure(module)


# ----------------------------------------------------------------------------
# fl.MultiHeadDotProductAttention: flax's parameter tree
# ----------------------------------------------------------------------------

CASES = {
    "self": (dict(num_heads=4), ((2, 6, 16),)),
    "qkv_features": (dict(num_heads=2, qkv_features=8, out_features=12), ((2, 6, 16),)),
    "cross": (dict(num_heads=4), ((2, 6, 16), (2, 5, 24))),
    "no_bias_normalize_qk": (dict(num_heads=4, use_bias=False, normalize_qk=True), ((2, 6, 16),)),
    "batch_dims": (dict(num_heads=2, param_dtype=jnp.bfloat16), ((3, 2, 6, 8),)),
}


def _leaves(params) -> dict[str, object]:
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=nn.meta.is_axis_metadata)[0]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_drop_in_creates_flax_parameter_tree(case):
  fields, shapes = CASES[case]
  inputs = [jnp.ones(shape, jnp.float32) for shape in shapes]
  key = jax.random.key(0)
  want = _leaves(nn.MultiHeadDotProductAttention(**fields).init(key, *inputs))
  got = _leaves(fl.MultiHeadDotProductAttention(**fields).init(key, *inputs))
  assert sorted(got) == sorted(want)
  for path, leaf in got.items():
    assert type(leaf) is type(want[path]), path  # plain arrays, no nn.LogicallyPartitioned
    assert leaf.shape == want[path].shape and leaf.dtype == want[path].dtype, path
    np.testing.assert_array_equal(leaf, want[path], err_msg=path)  # the same initial values too


def test_logical_axis_names_box_the_parameters():
  x = jnp.ones((2, 6, 16))
  key = jax.random.key(0)
  plain = fl.MultiHeadDotProductAttention(num_heads=4).init(key, x)["params"]
  for layer in (fl.MultiHeadDotProductAttention(num_heads=4, logical_axis_names=True),
                fl.MultiHeadAttention(num_heads=4)):  # the boxed default of our sharded models
    params = layer.init(key, x)["params"]
    assert isinstance(params["query"]["kernel"], nn.LogicallyPartitioned)
    specs = nn.get_partition_spec(params)
    assert tuple(specs["query"]["kernel"]) == fl.layers.QUERY_KERNEL_AXES
    assert tuple(specs["out"]["bias"]) == fl.layers.OUT_BIAS_AXES
    jax.tree_util.tree_map(np.testing.assert_array_equal, nn.meta.unbox(params), plain)
  unboxed = fl.MultiHeadAttention(num_heads=4, logical_axis_names=False).init(key, x)["params"]
  assert not isinstance(unboxed["query"]["kernel"], nn.LogicallyPartitioned)


def test_our_encoders_keep_boxed_parameters():
  """The models shard their attention by logical axis names: they use the boxed layer."""
  from flash_layers.models import bert, modernbert

  assert bert.MultiHeadAttention is fl.MultiHeadAttention
  assert modernbert.MultiHeadAttention is fl.MultiHeadAttention
  assert fl.MultiHeadAttention.logical_axis_names is True


def test_self_attention_is_flax_self_attention():
  x = jax.random.normal(jax.random.key(1), (2, 6, 16))
  mask = nn.make_causal_mask(jnp.ones((2, 6)))
  theirs = nn.SelfAttention(num_heads=4)
  variables = theirs.init(jax.random.key(0), x)
  ours = fl.SelfAttention(num_heads=4, impl="reference")
  assert sorted(_leaves(ours.init(jax.random.key(0), x))) == sorted(_leaves(variables))
  np.testing.assert_allclose(ours.apply(variables, x, mask), theirs.apply(variables, x, mask),
                             rtol=1e-5, atol=1e-5)


# (framework, field) -> why its default is the framework's own, not the core's.
_OWN_DEFAULTS = {
    ("nnx", "deterministic"): "the NNX layer keeps the mode on the module, True (no dropout) until "
                              "`nnx.view` or a call turns it off (flax's nnx layer defaults to None)",
}


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_every_framework_has_the_core_fields_defaults(framework):
  """Each framework declares the attention fields again (its own signature); `AttentionFields` takes
  a missing one's default, so every declared default must equal the core's, or the layers drift."""
  import dataclasses
  import inspect

  from flash_layers.layers.core import AttentionFields
  core = {f.name: f.default for f in dataclasses.fields(AttentionFields)
          if f.default is not dataclasses.MISSING}
  if framework == "linen":
    declared = {f.name: f.default for f in dataclasses.fields(fl.MultiHeadAttention)
                if f.default is not dataclasses.MISSING}
  else:
    module = __import__(f"flash_layers.layers.{framework}", fromlist=["MultiHeadAttention"])
    parameters = inspect.signature(module.MultiHeadAttention.__init__).parameters
    declared = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
  shared = sorted(set(core) & set(declared) - {n for fw, n in _OWN_DEFAULTS if fw == framework})
  assert len(shared) >= 15, shared  # most of the fields are each framework's too
  assert {n: declared[n] for n in shared} == {n: core[n] for n in shared}
