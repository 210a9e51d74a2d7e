"""`precision=`: one matmul precision, validated once, carried by every impl and both kernel families.

The structural tests trace forward + backward and walk the jaxpr (into pallas_call kernel bodies,
custom_vjp, pjit, loops and branches) so that every `dot_general` is seen: with float32 inputs each
one must carry HIGHEST by default (full float32 products: Mosaic `contract_precision<fp32>`, Triton
IEEE) and DEFAULT under precision="default". Nothing runs on an accelerator here; on the CPU every
precision gives float32 products, so the numeric test only checks that both settings conform.
"""

from __future__ import annotations

import contextlib
import types

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import validate
from flash_layers.impls.flash_pallas import tpu_common
from flash_layers.testing import reference64

DEFAULT, HIGH, HIGHEST = jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST
F32_TOL = 1e-5  # the conformance suite's float32 tolerance (tests/test_conformance.py)


# ----------------------------------------------------------------------------
# Walking jaxprs
# ----------------------------------------------------------------------------

def _sub_jaxprs(value):
  if isinstance(value, jex.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def _dots(jaxpr, in_kernel=False):
  """(precision, operand dtypes, inside a pallas_call kernel?) of every dot_general, recursively."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      precision = eqn.params["precision"]
      if isinstance(precision, tuple):
        assert precision[0] == precision[1], precision
        precision = precision[0]
      dtypes = tuple(jnp.dtype(v.aval.dtype).name for v in eqn.invars)
      found.append((DEFAULT if precision is None else precision, dtypes, in_kernel))
    kernel = in_kernel or eqn.primitive.name == "pallas_call"
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        found += _dots(sub, kernel)
  return found


def _traced_dots(impl, dtype=jnp.float32, interpret=None, **kwargs):
  """Dots of forward + backward of `fl.attention` (causal, 128 tokens, GQA 2/1 heads, head_dim 32)."""
  q = jax.ShapeDtypeStruct((1, 128, 2, 32), dtype)
  kv = jax.ShapeDtypeStruct((1, 128, 1, 32), dtype)

  def loss(q, k, v):
    return fl.attention(q, k, v, impl=impl, causal=True, **kwargs).astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))
  if interpret is None:
    return _dots(jax.make_jaxpr(grad)(q, kv, kv).jaxpr)
  with fl.interpret_as(interpret):
    return _dots(jax.make_jaxpr(grad)(q, kv, kv).jaxpr)


CASES = [("flash_pallas", "tpu"), ("flash_pallas", "gpu"), ("xla_chunked", None), ("xla_dense", None),
         ("reference", None), ("xla_native", None)]


@pytest.mark.parametrize("precision, expected", [(None, HIGHEST), ("default", DEFAULT), ("highest", HIGHEST)])
@pytest.mark.parametrize("impl, interpret", CASES, ids=lambda x: str(x))
def test_every_float32_dot_carries_the_precision(impl, interpret, precision, expected):
  dots = _traced_dots(impl, interpret=interpret, **({} if precision is None else {"precision": precision}))
  f32 = [(p, where) for p, dtypes, where in dots if "float32" in dtypes]
  assert len(f32) >= 4, f"too few dots found ({dots}): the walk misses the computation"
  if impl == "flash_pallas":
    # fwd: q.k, p.v; dK/dV: k.q, v.do, p.do, ds.q; dQ: q.k, do.v, ds.k (each its own kernel).
    assert sum(where for _, where in f32) >= 9, f"the kernels' dots were not all found: {dots}"
  wrong = [p for p, _ in f32 if p != expected]
  assert not wrong, f"{impl}: float32 dots at {wrong} (expected {expected}) in {dots}"


@pytest.mark.parametrize("interpret", ["tpu", "gpu"])
def test_bfloat16_kernels_are_unchanged(interpret):
  """bfloat16 inputs default to DEFAULT, and the kernels' bf16 x bf16 dots keep DEFAULT even when
  "highest" is asked: their products are exact, and Mosaic rejects a contraction precision on them."""
  for precision in (None, "highest"):
    dots = _traced_dots("flash_pallas", jnp.bfloat16, interpret, precision=precision)
    kernel = [(p, dtypes) for p, dtypes, where in dots if where]
    assert len(kernel) >= 9 and all(p == DEFAULT and dtypes == ("bfloat16", "bfloat16")
                                    for p, dtypes in kernel), kernel


def test_high_per_kernel_family():
  """HIGH: Triton gets HIGH (TF32, as XLA on a GPU); Mosaic has no HIGH, so the TPU kernels write
  out bf16_3x (three bfloat16 dots for every float32 one)."""
  gpu = [(p, dtypes) for p, dtypes, where in _traced_dots("flash_pallas", interpret="gpu", precision="high")
         if where]
  # 9 dots (forward 2, dK/dV 4, dQ 3), each in two loop bodies: interior tiles and masked edges.
  assert len(gpu) == 18 and all(p == HIGH and dtypes == ("float32", "float32") for p, dtypes in gpu), gpu
  def tpu_kernel_dots(precision):
    return [(p, dtypes) for p, dtypes, where in _traced_dots("flash_pallas", interpret="tpu",
                                                             precision=precision) if where]

  tpu_dots = tpu_kernel_dots("high")
  assert len(tpu_dots) == 3 * len(tpu_kernel_dots("highest")), tpu_dots
  assert all(p == DEFAULT and dtypes == ("bfloat16", "bfloat16") for p, dtypes in tpu_dots), tpu_dots
  xla = _traced_dots("xla_chunked", precision="high")
  assert xla and all(p == HIGH for p, _, _ in xla)


def test_tpu_high_is_bf16x3():
  """The TPU kernels' HIGH dot: error of bf16_3x (~2^-16 of the summed magnitudes, far below one
  bfloat16 pass's ~2^-9, but not exact)."""
  rng = np.random.default_rng(0)
  a, b = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
  exact = a.astype(np.float64) @ b.astype(np.float64)
  magnitude = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)

  def error(precision):
    call = types.SimpleNamespace(request=types.SimpleNamespace(precision=precision))
    out = tpu_common.dot(call, jnp.asarray(a), jnp.asarray(b), tpu_common.NN)
    return float(np.max(np.abs(np.asarray(out, np.float64) - exact) / magnitude))

  high = error(HIGH)
  one_pass = float(np.max(np.abs(a.astype(jnp.bfloat16).astype(np.float64)
                                 @ b.astype(jnp.bfloat16).astype(np.float64) - exact) / magnitude))
  assert 1e-8 < high < 2e-5 < one_pass, (high, one_pass)
  assert error(HIGHEST) < 1e-6  # the CPU computes HIGHEST exactly in float32


# ----------------------------------------------------------------------------
# What Mosaic and Triton receive (lowered on this CPU host, no accelerator)
# ----------------------------------------------------------------------------

def _custom_call_bodies(lowered, target: str):
  """The `backend_config` (Mosaic) or `mhlo.backend_config` (Triton) of every `target` custom call."""

  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.name == "stablehlo.custom_call" and target in str(o.attributes["call_target_name"]):
            found.append(o.attributes["mhlo.backend_config" if target == "triton" else "backend_config"])
          walk(o)

  walk(lowered.compiler_ir().operation)
  return found


def _lower_grad(platform: str, precision):
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
  grad = jax.grad(lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", causal=True,
                                               precision=precision).sum(), argnums=(0, 1, 2))
  return jax.jit(grad).trace(q, q, q).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("precision, expected", [(None, "contract_precision<fp32>"), ("default", None)])
def test_mosaic_matmuls_carry_contract_precision(precision, expected):
  import base64
  import re

  try:
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu as tpu_dialect
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager
  except ImportError as e:  # private modules: their names may move between jax versions
    pytest.skip(f"cannot read Mosaic modules with this jax: {e}")
  kinds = []
  for config in _custom_call_bodies(_lower_grad("tpu", precision), "tpu_custom_call"):
    body = base64.b64decode(re.search(r'"body": "([^"]+)"', ir.StringAttr(config).value).group(1))
    ctx = mlir.make_ir_context()
    tpu_dialect.register_dialect(ctx)
    with ctx, ir.Location.unknown():
      ctx.allow_unregistered_dialects = True
      module = ir.Module.parse(body)
      PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
      for line in str(module).splitlines():
        if "tpu.matmul" in line:
          found = re.search(r"contract_precision<\w+>", line)
          kinds.append(found.group(0) if found else None)
  # 3 kernels, 9 dots, each tile update traced with and without the element mask.
  assert len(kinds) == 18 and set(kinds) == {expected}, kinds


@pytest.mark.parametrize("precision, expected", [(None, "ieee"), ("default", "tf32"), ("high", "tf32")])
def test_triton_dots_carry_input_precision(precision, expected):
  try:
    from jax._src.interpreters import mlir
    from jax._src.lib import triton
    from jax._src.lib import version as jaxlib_version
    from jaxlib.mlir import ir
  except ImportError as e:
    pytest.skip(f"cannot read Triton modules with this jax: {e}")
  if jaxlib_version > (0, 10, 2) and not triton.has_compilation_handler("cuda"):
    pytest.skip("this jaxlib lowers Triton for CUDA only with its CUDA plugin")
  names = {int(v): k.lower() for k, v in triton.dialect.InputPrecision.__members__.items()}
  kinds = []
  for config in _custom_call_bodies(_lower_grad("cuda", precision), "triton"):
    ctx = mlir.make_ir_context()
    triton.dialect.register_dialect(ctx)
    with ctx:
      module = ir.Module.parse(ir.StringAttr(ir.DictAttr(config)["ir"]).value_bytes)

      def walk(op):
        for region in op.regions:
          for block in region.blocks:
            for o in block.operations:
              if o.name == "tt.dot":
                kinds.append(names[ir.IntegerAttr(o.attributes["inputPrecision"]).value])
              walk(o)

      walk(module.operation)
  assert len(kinds) == 18 and set(kinds) == {expected}, kinds  # 9 dots, interior and edge loops


# ----------------------------------------------------------------------------
# The argument
# ----------------------------------------------------------------------------

def _request(dtype=jnp.float32, **kwargs):
  q = jax.ShapeDtypeStruct((1, 8, 2, 16), dtype)
  return validate.prepare(q, q, q, **kwargs)[0]


@pytest.mark.parametrize("given, expected", [
    ("default", DEFAULT), ("high", HIGH), ("highest", HIGHEST), ("bfloat16", DEFAULT),
    ("bfloat16_3x", HIGH), ("tensorfloat32", HIGH), ("float32", HIGHEST), (HIGH, HIGH),
    ((HIGHEST, HIGHEST), HIGHEST)])
def test_precision_values(given, expected):
  assert _request(precision=given).precision == expected
  assert jax.lax.Precision(given) == expected if isinstance(given, str) else True  # jax agrees


def test_precision_default_follows_the_dtype():
  assert _request(jnp.float32).precision == HIGHEST
  assert _request(jnp.float16).precision == HIGHEST  # the TPU kernels compute float16 in float32
  assert _request(jnp.bfloat16).precision == DEFAULT
  assert _request(jnp.bfloat16, precision="highest").precision == HIGHEST


@pytest.mark.parametrize("bad", ["fast", "HIGHEST", 3, (DEFAULT, HIGHEST),
                                 jax.lax.DotAlgorithmPreset.F32_F32_F32])
def test_bad_precision_is_a_value_error(bad):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=r"precision must be None, a jax.lax.Precision or one of .*'highest'"):
    fl.attention(q, q, q, precision=bad)
  with pytest.raises(ValueError, match="precision"):
    fl.explain(q, q, q, precision=bad)


def test_explain_and_auto_accept_precision():
  q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)
  assert fl.explain(q, q, q, precision="default").impl == fl.explain(q, q, q).impl


@pytest.mark.parametrize("impl, interpret", CASES, ids=lambda x: str(x))
def test_default_and_highest_both_conform(impl, interpret):
  """On the CPU every precision multiplies in float32: both settings meet the float32 tolerance of
  the conformance suite against the float64 oracle (forward and gradients)."""
  rng = np.random.default_rng(1)
  q, k, v, dout = (rng.standard_normal((1, 128, 1, 32)).astype(np.float32) for _ in range(4))
  visible = reference64.mask(1, 128, 128, causal=True)[:, None]
  expected = reference64.attention(q, k, v, visible, dout=dout)

  @jax.jit
  def fwd_bwd(q, k, v, dout):
    results = []
    for precision in ("default", "highest"):
      f = lambda q, k, v, p=precision: fl.attention(q, k, v, impl=impl, causal=True, precision=p)
      out, vjp = jax.vjp(f, q, k, v)
      results.append(dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(dout)), strict=True)))
    return results

  with fl.interpret_as(interpret) if interpret else contextlib.nullcontext():
    results = fwd_bwd(q, k, v, dout)
  for precision, got in zip(("default", "highest"), results, strict=True):
    for name, value in got.items():
      err = np.max(np.abs(np.asarray(value, np.float64) - expected[name])) / expected["magnitude"][name]
      assert err <= F32_TOL, f"{impl} {interpret} precision={precision}: {name} error {err:.2e}"


# ----------------------------------------------------------------------------
# Layers: one `precision` for the projections and the attention, as in flax
# ----------------------------------------------------------------------------

def _layer_dots(fn, *args):
  return {p for p, dtypes, _ in _dots(jax.make_jaxpr(fn)(*args).jaxpr) if "float32" in dtypes}


@pytest.mark.parametrize("precision, expected", [(None, {DEFAULT, HIGHEST}), ("high", {HIGH}),
                                                 ("default", {DEFAULT})])
def test_linen_layer_precision_reaches_the_attention(precision, expected):
  layer = fl.MultiHeadAttention(num_heads=2, impl="xla_chunked", precision=precision)
  x = jnp.ones((1, 8, 16))
  params = layer.init(jax.random.key(0), x)
  # None: the projections at jax's default, the attention at its own (HIGHEST for float32).
  assert _layer_dots(lambda x: layer.apply(params, x), x) == expected


def test_nnx_and_haiku_layers_pass_precision():
  from flax import nnx

  from flash_layers import nnx as fl_nnx

  x = jnp.ones((1, 8, 16))
  layer = fl_nnx.MultiHeadAttention(2, 16, impl="xla_dense", precision="high", rngs=nnx.Rngs(0))
  assert _layer_dots(lambda x: layer(x), x) == {HIGH}
  hk = pytest.importorskip("haiku")
  from flash_layers import haiku as fl_haiku

  f = hk.without_apply_rng(hk.transform(
      lambda x: fl_haiku.MultiHeadAttention(2, impl="xla_dense", precision="default")(x)))
  params = f.init(jax.random.key(0), x)
  assert _layer_dots(lambda x: f.apply(params, x), x) == {DEFAULT}


def test_layers_reject_a_bad_precision_when_built():
  from flax import nnx

  from flash_layers import nnx as fl_nnx

  with pytest.raises(ValueError, match="precision"):
    fl.MultiHeadAttention(num_heads=2, precision="fast")
  with pytest.raises(ValueError, match="precision"):
    fl_nnx.MultiHeadAttention(2, 16, precision="fast", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("precision", ["high", "default"])
def test_attention_fn_honours_flax_precision(precision):
  layer = nn.MultiHeadDotProductAttention(num_heads=2, precision=precision,
                                          attention_fn=fl.attention_fn(impl="xla_chunked"))
  x = jnp.ones((1, 8, 16))
  params = layer.init(jax.random.key(0), x)
  assert _layer_dots(lambda x: layer.apply(params, x), x) == {jax.lax.Precision(precision)}
