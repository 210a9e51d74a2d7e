"""flash_pallas's mods see global batch rows and query heads (the ``sharded_mods`` capability).

A shard of a mesh calls an impl on its slice of the batch and heads with `Args.batch_offset` and
`Args.head_offset` (traced: `jax.lax.axis_index`), and the mods' operands at their global shape. Here
one process makes such a call directly: rows 2..3 and query heads 2..3 (kv head 1) of a GQA 4:2 problem,
the offsets passed as jit arguments (traced like an axis index), with a mask_mod that reads a per-row
prefix and hides keys by head, and a score_mod that reads a trainable T5-style table by head. Both kernel
families (interpreted) must give the reference impl's output and gradients (q, k, v, the table) for the
same Args, and the output must be the slice of the unsharded call's. The mask is chosen so that tile flags
or an element mask evaluated on *local* rows or heads would call the tile fully visible and skip the
mask: a kernel that ignored either offset fails.

The same traced offsets compile for a TPU (Mosaic, ahead of time) and lower to Triton for CUDA.
(tests/test_context_parallel.py runs the kernels on real 8-device meshes.)
"""

from __future__ import annotations

import dataclasses
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import flash_layers as fl  # noqa: E402
from flash_layers import dispatch, validate  # noqa: E402

B, T, H, KVH, D, BUCKETS = 4, 128, 4, 2, 16, 16
ROWS, HEADS = slice(2, 4), slice(2, 4)  # the shard: global rows 2..3, query heads 2..3 (kv head 1)
# 128 tokens: one whole TPU tile (a ragged one always takes the element mask, whatever its flags say).
# Global rows 0 and 1 see every key; rows 2 and 3 see a prefix of 0 and 5 keys, then causally.
PREFIX = np.array([T, T, 0, 5], np.int32)
TPU_KERNELS = ("flash_layers_fwd", "flash_layers_bwd_delta", "flash_layers_bwd_dkv", "flash_layers_bwd_dq")
GPU_KERNELS = ("flash_pallas_gpu_forward", "flash_pallas_gpu_backward_dkv", "flash_pallas_gpu_backward_dq")


def prefix_causal_or_low_head(b, h, q_idx, kv_idx, prefix, table):
  """Heads 0 and 1 see every key; heads 2 and 3 the row's prefix and the keys up to the query."""
  return (kv_idx < prefix[b]) | (q_idx >= kv_idx) | (h < 2)


def t5_bias(score, b, h, q_idx, kv_idx, prefix, table):
  bucket = jnp.clip(q_idx - kv_idx, -(BUCKETS // 2), BUCKETS // 2 - 1) + BUCKETS // 2
  return score + table[h, bucket]


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((B, T, H, D), (B, T, KVH, D), (B, T, KVH, D), (B, T, H, D)))
  table = jnp.asarray(rng.standard_normal((H, BUCKETS)), jnp.float32)
  return q, k, v, dout, table


def _shard(q, k, v, dout):
  """The shard's slice: rows 2..3, query heads 2..3 and the kv head they share."""
  return q[ROWS, :, HEADS], k[ROWS, :, 1:], v[ROWS, :, 1:], dout[ROWS, :, HEADS]


def _attend(impl: str, q, k, v):
  """(q, k, v, table, batch_offset, head_offset) -> out [b, t, h, d]: one call with the given Args."""
  request, args = validate.prepare(q, k, v, mask_mod=prefix_causal_or_low_head, score_mod=t5_bias,
                                   mod_operands=(jnp.asarray(PREFIX), jnp.zeros((H, BUCKETS), jnp.float32)))

  def run(q, k, v, table, batch_offset, head_offset):
    local = dataclasses.replace(args, batch_offset=batch_offset, head_offset=head_offset,
                                mod_operands=(jnp.asarray(PREFIX), table))
    return dispatch.attend(q, k, v, impl=impl, request=request, args=local)[0]
  return run


def _value_and_grads(impl: str, q, k, v, dout, table, batch_offset, head_offset):
  run = _attend(impl, q, k, v)

  def f(q, k, v, table, batch_offset, head_offset):
    out, vjp = jax.vjp(lambda *x: run(*x, batch_offset, head_offset), q, k, v, table)
    return out, *vjp(dout)
  return jax.jit(f)(q, k, v, table, jnp.int32(batch_offset), jnp.int32(head_offset))


def _rel(actual, expected) -> float:
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_a_shards_mods_see_global_rows_and_heads(family):
  q, k, v, dout, table = _problem()
  shard = _shard(q, k, v, dout)
  expected = _value_and_grads("reference", *shard, table, 2, 2)
  with fl.interpret_as(family):
    got = _value_and_grads("flash_pallas", *shard, table, 2, 2)
  names = ("out", "dq", "dk", "dv", "dtable")
  errors = {n: _rel(a, e) for n, a, e in zip(names, got, expected, strict=True)}
  assert max(errors.values()) <= 2e-5, errors
  # The table's gradient reaches only the shard's global heads; the output is the unsharded call's slice.
  assert np.abs(np.asarray(got[4])[:2]).max() == 0 and np.abs(np.asarray(got[4])[2:]).max() > 0
  whole = _attend("reference", q, k, v)(q, k, v, table, 0, 0)
  assert _rel(got[0], whole[ROWS, :, HEADS]) <= 2e-5
  # The offsets matter: at offset 0 the same slice gives another output (guards the test itself).
  local = _attend("reference", *shard[:3])(*shard[:3], table, 0, 0)
  assert _rel(local, got[0]) > 1e-2


def _loss(q, k, v, table, batch_offset, head_offset):
  run = _attend("flash_pallas", q, k, v)
  return run(q, k, v, table, batch_offset, head_offset).astype(jnp.float32).sum()


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_traced_offsets_compile_for_a_tpu(generation):
  """jax.grad in q, k, v and the table, offsets traced: Mosaic compiles our four kernels."""
  topologies = pytest.importorskip("jax.experimental.topologies")
  pytest.importorskip("libtpu")
  name = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}[generation]
  placed = jax.sharding.SingleDeviceSharding(
      topologies.get_topology_desc(platform="tpu", topology_name=name).devices[0])
  q = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16, sharding=placed)
  kv = jax.ShapeDtypeStruct((2, 512, 1, 128), jnp.bfloat16, sharding=placed)
  table = jax.ShapeDtypeStruct((H, BUCKETS), jnp.float32, sharding=placed)
  offset = jax.ShapeDtypeStruct((), jnp.int32, sharding=placed)
  compiled = jax.jit(jax.grad(_loss, (0, 1, 2, 3))).lower(q, kv, kv, table, offset, offset).compile()
  calls = re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", compiled.as_text())
  assert sorted(re.sub(r"\.\d+$", "", n) for n in calls) == sorted(TPU_KERNELS)


def test_traced_offsets_lower_to_triton():
  """The same gradient lowered for CUDA on this host: our three Triton kernels."""
  lib = pytest.importorskip("jax._src.lib")
  if lib.version > (0, 10, 2) and not lib.triton.has_compilation_handler("cuda"):
    pytest.skip("this jaxlib lowers Triton for CUDA only with its CUDA plugin")
  q = jax.ShapeDtypeStruct((2, 512, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 512, 1, 64), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((H, BUCKETS), jnp.float32)
  offset = jax.ShapeDtypeStruct((), jnp.int32)
  traced = jax.jit(jax.grad(_loss, (0, 1, 2, 3))).trace(q, kv, kv, table, offset, offset)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert sorted(re.findall(r'name = "(flash_pallas_gpu_[a-z_]+)"', text)) == sorted(GPU_KERNELS)
