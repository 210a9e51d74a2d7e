"""Trainable score_mod operands inside flash_pallas's kernels (docs/kernels.md, "Operand gradients").

A T5 relative-position bias table [heads, buckets] (float32), read by a score_mod through a bucketed
relative position, takes its gradient from both kernel families (interpreted), checked against the
float64 oracle with q, k and v; `attention_backward`'s 4-tuple is checked against xla_dense's; the TPU
kernels compile ahead of time for v5e and v6e with the table, and the GPU backward lowers to Triton.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import flash_layers as fl  # noqa: E402
from flash_layers import dispatch, validate  # noqa: E402
from flash_layers.testing import reference64  # noqa: E402

BUCKETS, MAX_DISTANCE = 16, 64
TPU_KERNELS = ("flash_layers_fwd", "flash_layers_bwd_delta", "flash_layers_bwd_dkv", "flash_layers_bwd_dq")
GPU_KERNELS = ("flash_pallas_gpu_forward", "flash_pallas_gpu_backward_dkv", "flash_pallas_gpu_backward_dq")


def t5_bucket(rel, bidirectional: bool):
  """T5's bucket of the relative position rel = kv_idx - q_idx (int32): exact below half the buckets,
  then logarithmic up to MAX_DISTANCE; with `bidirectional`, keys after the query get their own half."""
  n = BUCKETS // 2 if bidirectional else BUCKETS
  ret = jnp.where(rel > 0, n, 0) if bidirectional else 0
  rel = jnp.abs(rel) if bidirectional else jnp.maximum(-rel, 0)
  exact = n // 2
  far = jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / exact) / np.log(MAX_DISTANCE / exact)
  far = jnp.minimum(exact + (far * (n - exact)).astype(jnp.int32), n - 1)
  return ret + jnp.where(rel < exact, rel, far)


def _bias(bidirectional: bool):
  def t5_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, t5_bucket(kv_idx - q_idx, bidirectional)]
  return t5_bias


# Defined once: a mod is part of the request, hashed by identity (one trace per function).
MODS = {True: _bias(True), False: _bias(False)}


def _problem(t=80, h=4, kvh=2, d=32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, dout = (rng.standard_normal(shape).astype(np.float32)
                   for shape in ((1, t, h, d), (1, t, kvh, d), (1, t, kvh, d), (1, t, h, d)))
  table = rng.standard_normal((h, BUCKETS)).astype(np.float32)
  return q, k, v, dout, table


def _oracle(q, k, v, dout, table, causal: bool, prefix: int | None):
  """The float64 oracle's out and gradients, the table's from its dL/d score (a bucket's sum)."""
  t = q.shape[1]
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  bucket = np.asarray(t5_bucket(jnp.asarray(j - i), not causal))  # [t, s]
  visible = reference64.mask(1, t, t, causal=causal)[:, None]
  if prefix is not None:
    visible = visible & ((j < prefix) | (i - j < 24))[None, None]
  bias = table.astype(np.float64)[:, bucket]  # [h, t, s]
  result = reference64.attention(q, k, v, visible, dout=dout,
                                 score_mod=lambda x: (x + bias[None], np.ones_like(x)))
  dtable = np.zeros(table.shape)
  for head in range(table.shape[0]):
    np.add.at(dtable[head], bucket, result["dscore"][:, head].sum(0))
  return result, dtable


def _mask_mod(prefix: int):
  def near_or_prefix(b, h, q_idx, kv_idx, *_):
    return (kv_idx < prefix) | (q_idx - kv_idx < 24)
  return near_or_prefix


MASK_MODS = {16: _mask_mod(16)}


def _flash(q, k, v, dout, table, causal: bool, prefix: int | None, platform: str):
  # Several q blocks with the mask_mod (TPU: 128-row tiles, the smallest; a grid row then holds two
  # q blocks, which share the row's partial), one or two without.
  sizes = fl.BlockSizes(128, 128) if platform == "tpu" and prefix is not None else None

  def f(q, k, v, table):
    return fl.attention(q, k, v, impl="flash_pallas", causal=causal, score_mod=MODS[not causal],
                        mask_mod=None if prefix is None else MASK_MODS[prefix], mod_operands=(table,),
                        block_sizes=sizes)

  with fl.interpret_as(platform):
    out, vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v, table)))
    return jax.jit(lambda: (out, *vjp(jnp.asarray(dout))))()


def _rel_error(actual, expected):
  actual = np.asarray(actual, np.float64)
  return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("causal,prefix", [(True, None), (False, None), (True, 16)],
                         ids=["causal", "bidirectional", "causal_mask_mod"])
def test_table_gradient_matches_the_float64_oracle(platform, causal, prefix):
  """GQA 4:2, float32: out, dq, dk, dv and d table within 2e-5 of the oracle (relative to the largest
  entry of each)."""
  q, k, v, dout, table = _problem(t=80 if prefix is None else 300)
  expected, dtable = _oracle(q, k, v, dout, table, causal, prefix)
  out, dq, dk, dv, dt = _flash(q, k, v, dout, table, causal, prefix, platform)
  assert dt.shape == table.shape and dt.dtype == jnp.float32
  errors = {name: _rel_error(a, e) for name, a, e in (
      ("out", out, expected["out"]), ("dq", dq, expected["dq"]), ("dk", dk, expected["dk"]),
      ("dv", dv, expected["dv"]), ("dtable", dt, dtable))}
  print(platform, causal, prefix, {n: f"{e:.1e}" for n, e in errors.items()})
  assert max(errors.values()) <= 2e-5, errors


def test_attention_backward_returns_the_operand_gradients_like_xla_dense():
  """attention_backward from given row statistics: (dq, dk, dv, (d table,)) on both families, as
  xla_dense's; integer operands get None; without float operands it stays a 3-tuple."""
  q, k, v, dout, table = (jnp.asarray(x) for x in _problem(t=48))
  prefix = jnp.asarray([20], jnp.int32)

  def bias_and_prefix(score, b, h, q_idx, kv_idx, table, prefix):
    return MODS[False](score, b, h, q_idx, kv_idx, table) * jnp.where(kv_idx < prefix[b], 1.0, 0.5)

  request, args = validate.prepare(q, k, v, score_mod=bias_and_prefix, mod_operands=(table, prefix))
  out, lse = dispatch.attend(q, k, v, impl="xla_dense", request=request, args=args)
  delta = jnp.einsum("bthd,bthd->bht", dout, out)

  def backward(impl):
    return dispatch.attend_backward(q, k, v, lse, delta, dout, impl=impl, request=request, args=args)

  expected = backward("xla_dense")
  assert len(expected) == 4 and expected[3][1] is None and expected[3][0].shape == table.shape
  for platform in ("tpu", "gpu", None):  # None: xla_chunked, on the CPU
    if platform is None:
      got = jax.jit(lambda: backward("xla_chunked"))()
    else:
      with fl.interpret_as(platform):
        got = jax.jit(lambda: backward("flash_pallas"))()
    assert len(got) == 4 and got[3][1] is None
    for a, e in zip((*got[:3], got[3][0]), (*expected[:3], expected[3][0]), strict=True):
      np.testing.assert_allclose(a, e, rtol=0, atol=2e-5 * float(np.abs(e).max()))
  plain, plain_args = validate.prepare(q, k, v, causal=True)
  assert len(dispatch.attend_backward(q, k, v, lse, delta, dout, impl="xla_dense", request=plain,
                                      args=plain_args)) == 3


def _tpu_device(generation: str):
  topologies = pytest.importorskip("jax.experimental.topologies")
  pytest.importorskip("libtpu")
  name = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}[generation]
  return topologies.get_topology_desc(platform="tpu", topology_name=name).devices[0]


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_forward_and_backward_with_the_table_compile_for_a_tpu(generation):
  """bfloat16 q, k, v [1, 512, 4, 128] and a float32 table [4, 16]: jax.grad in q, k, v and the table
  compiles through Mosaic to our four kernels (the gather unrolled into selects, the operand gradient
  accumulated in the dQ kernel); its temporaries stay within 64 KiB of the plain call's (the
  partials: one [8, 128] float32 block per (batch, head, row) program)."""
  placed = jax.sharding.SingleDeviceSharding(_tpu_device(generation))
  x = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16, sharding=placed)
  table = jax.ShapeDtypeStruct((4, BUCKETS), jnp.float32, sharding=placed)

  def loss(q, k, v, table, with_table=True):
    mods = dict(score_mod=MODS[False], mod_operands=(table,)) if with_table else {}
    return fl.attention(q, k, v, impl="flash_pallas", causal=True, **mods).astype(jnp.float32).sum()

  compiled = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(x, x, x, table).compile()
  plain = jax.jit(jax.grad(lambda *a: loss(*a, with_table=False), (0, 1, 2))).lower(x, x, x, table).compile()
  calls = re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", compiled.as_text())
  assert sorted(re.sub(r"\.\d+$", "", n) for n in calls) == sorted(TPU_KERNELS)
  temps = [c.memory_analysis().temp_size_in_bytes for c in (compiled, plain)]
  assert temps[0] <= temps[1] + 64 * 1024, temps


def test_the_gpu_backward_with_the_table_lowers_to_triton():
  """The same gradient lowered for CUDA on this host: our three Triton kernels, the dQ kernel with its
  partials output."""
  lib = pytest.importorskip("jax._src.lib")
  if lib.version > (0, 10, 2) and not lib.triton.has_compilation_handler("cuda"):
    pytest.skip("this jaxlib lowers Triton for CUDA only with its CUDA plugin")
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

  def loss(q, k, v, table):
    return fl.attention(q, k, v, impl="flash_pallas", causal=True, score_mod=MODS[True],
                        mod_operands=(table,)).astype(jnp.float32).sum()

  table = jax.ShapeDtypeStruct((4, BUCKETS), jnp.float32)
  traced = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(q, kv, kv, table)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert sorted(re.findall(r'name = "(flash_pallas_gpu_[a-z_]+)"', text)) == sorted(GPU_KERNELS)
