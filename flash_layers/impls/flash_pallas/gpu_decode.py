"""flash_pallas's split-KV decode kernel for the GPU (Triton); the scheme is in `decode.py`.

Grid ``(splits, batch * kv_heads)``: one program per split of one (batch row, kv head). A decoding step
on one sequence has few (batch, kv head) pairs (8 on a GQA model) where an H100 or H200 has 132 SMs, so
the splits multiply the programs to about two per SM (`TARGET_PROGRAMS`); each program loops
(`lax.fori_loop`, an ``scf.for``) over its share of the row's run of kv blocks, bounds read from the plan.

Tiles: the q tile is the GQA group's rows, padded in HBM to a power of two of at least 16 rows (what
``tl.dot`` wants) and head_dim to a power of two (small: q_len <= 16), kept in registers for the whole
loop. K/V stay as the cache holds them, ``[b, len, kv_heads, d]``, read in ``(block_kv, d_pad)`` tiles
with masked loads (keys past the length and columns past head_dim read as 0), as the forward kernel
reads them. The softmax runs in base 2, in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.contract import mask_rules
from flash_layers.impls.base import Request
from flash_layers.impls.flash_pallas import decode, scalar_table
from flash_layers.impls.flash_pallas.gpu_common import (
  LOG2E,
  Tile,
  dot,
  load,
  pow2_tile,
  ragged,
  softmax_update,
  store,
  tile_logits,
)
from flash_layers.impls.tiling import GpuBlockSizes, round_up

# Keys per loop step: 64 keys of up to 128 dims keep K, V and a [rows, 64] logits tile in registers for
# 4 warps at 128 rows; wider heads take 32 (FlashAttention-2's decode tiles are of this size).
BLOCK_KV = 64
# Programs to aim for: about two per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 264
NUM_WARPS = 4
NUM_STAGES = 2


def tiles(request: Request) -> tuple[int, int]:
  """(block_kv, splits) of the decode kernel for `request`."""
  sizes = request.block_sizes
  if isinstance(sizes, GpuBlockSizes):
    block_kv = sizes.block_kv
  else:
    block_kv = BLOCK_KV if max(request.head_dim, request.head_dim_v) <= 128 else BLOCK_KV // 2
  return decode.with_splits(request, block_kv, TARGET_PROGRAMS)


def _kernel(plan_ref, offsets_ref, q_ref, k_ref, v_ref, *refs, call: decode.DecodeCall, rows_pad: int):
  if call.request.has_segment_ids:
    q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  r = call.request
  split, bk = pl.program_id(0), pl.program_id(1)
  b = bk // r.num_kv_heads
  first, count, per_split = decode.run(plan_ref, b)
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, count)
  block_kv = call.block_kv
  kv_rows = ragged(r.kv_len, block_kv)
  q = q_ref[...]  # [rows_pad, d_pad], padded in HBM
  offsets = scalar_table.offsets(offsets_ref)
  # Row r is query r % q_len of the step (`decode.pack_queries`): its position, whatever its head.
  q_pos = offsets.q + (jnp.arange(rows_pad, dtype=jnp.int32) % r.q_len)[:, None]
  q_seg = q_seg_ref[...] if r.has_segment_ids else None

  def step(i, carry):
    acc, m, denom = carry
    start = (first + i) * block_kv
    kv_slice = pl.ds(start, block_kv)
    k = load(k_ref.at[kv_slice, :], start, kv_rows, r.head_dim)
    kv_local = start + jnp.arange(block_kv, dtype=jnp.int32)
    kv_seg = load(kv_seg_ref.at[kv_slice], start, kv_rows, other=-1) if r.has_segment_ids else None
    # The family's logits step (every tile masked: the row's run starts and ends anywhere).
    s, _ = tile_logits(call, q, k, Tile(q_pos, (offsets.kv + kv_local)[None, :], kv_local), True,
                       q_seg, kv_seg)  # [rows_pad, block_kv], at the request's precision
    m_new, p, rescale = softmax_update(m, s)
    v = load(v_ref.at[kv_slice, :], start, kv_rows, r.head_dim_v)
    acc = acc * rescale[:, None] + dot(call, p.astype(v.dtype), v, ((1,), (0,)))
    return acc, m_new, denom * rescale + p.sum(axis=-1)

  dv_pad = o_ref.shape[-1]
  init = (jnp.zeros((rows_pad, dv_pad), jnp.float32), jnp.full((rows_pad,), -jnp.inf, jnp.float32),
          jnp.zeros((rows_pad,), jnp.float32))
  acc, m, denom = lax.fori_loop(lo, hi, step, init)
  seen = denom > 0  # a split that saw no key: zeros and lse -inf (merge gives it weight 0)
  denom = jnp.where(seen, denom, 1.0)
  store(o_ref, acc / denom[:, None])
  store(lse_ref, jnp.where(seen, (m + jnp.log2(denom)) / LOG2E, -jnp.inf))


def split_kv(call: decode.DecodeCall, q, k, v, q_seg, kv_seg, offsets, table):
  """(out_parts [b, kv_heads, splits, rows_pad, dv_pad] float32, lse_parts [b, kv_heads, splits,
  rows_pad]); the caller slices rows, `merge` and the unpacking drop the padding."""
  r = call.request
  b, kvh = q.shape[0], r.num_kv_heads
  rows_pad, d_pad, dv_pad = pow2_tile(call.rows), pow2_tile(r.head_dim), pow2_tile(r.head_dim_v)
  kv_ext = round_up(r.kv_len, call.block_kv)
  q_rows = jnp.pad(decode.pack_queries(call, q),
                   ((0, 0), (0, 0), (0, rows_pad - call.rows), (0, d_pad - r.head_dim)))
  # The plan and offsets are read as scalars (Triton has no scalar prefetch): whole, power-of-two long.
  plan = table.reshape(-1)
  plan = jnp.pad(plan, (0, pl.next_power_of_2(plan.size) - plan.size))
  whole = lambda x: pl.BlockSpec(x.shape, lambda s, j: (0,) * x.ndim)  # noqa: E731
  arrays = [plan, offsets, q_rows, k, v]
  specs = [whole(plan), whole(offsets),
           pl.BlockSpec((None, None, rows_pad, d_pad), lambda s, j: (j // kvh, j % kvh, 0, 0)),
           pl.BlockSpec((None, kv_ext, None, d_pad), lambda s, j: (j // kvh, 0, j % kvh, 0)),
           pl.BlockSpec((None, kv_ext, None, dv_pad), lambda s, j: (j // kvh, 0, j % kvh, 0))]
  if r.has_segment_ids:
    arrays += [jnp.pad(decode.row_segments(call, q_seg), ((0, 0), (0, rows_pad - call.rows))), kv_seg]
    specs += [pl.BlockSpec((None, rows_pad), lambda s, j: (j // kvh, 0)),
              pl.BlockSpec((None, kv_ext), lambda s, j: (j // kvh, 0))]
  out_shape = [jax.ShapeDtypeStruct((b, kvh, call.splits, rows_pad, dv_pad), jnp.float32),
               jax.ShapeDtypeStruct((b, kvh, call.splits, rows_pad), jnp.float32)]
  q_off, kv_off = call.static_offsets or (0, 0)
  pairs = b * r.num_heads * mask_rules.count_visible(r.q_len, r.kv_len, r.spec, q_off, kv_off)
  cost = pl.CostEstimate(
      flops=int(2 * pairs * (r.head_dim + r.head_dim_v)),
      transcendentals=int(pairs * (1 + (r.softcap is not None))),
      bytes_accessed=int(sum(x.size * x.dtype.itemsize for x in (q, k, v))
                         + 4 * sum(math.prod(s.shape) for s in out_shape)))
  out, lse = pl.pallas_call(
      functools.partial(_kernel, call=call, rows_pad=rows_pad), grid=(call.splits, b * kvh),
      in_specs=specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows_pad, dv_pad), lambda s, j: (j // kvh, j % kvh, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows_pad), lambda s, j: (j // kvh, j % kvh, s, 0))],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      cost_estimate=cost, interpret=call.interpret, name="flash_pallas_gpu_decode",
  )(*arrays)
  return out[..., :r.head_dim_v], lse
