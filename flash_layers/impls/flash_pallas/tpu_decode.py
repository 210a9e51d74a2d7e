"""flash_pallas's split-KV decode kernel for the TPU (Mosaic); the scheme is in `decode.py`.

Grid ``(batch, kv_heads, splits, steps)``: the first three axes are "parallel" (Mosaic may spread them
over a megacore's TensorCores), the last walks the split's kv blocks carrying the online softmax in
VMEM scratch ("arbitrary"). The per-row plan (first block, block count, blocks per split) is
scalar-prefetched to SMEM, and the K/V BlockSpecs read it: split s of row b visits blocks
``first + s * per_split + t`` for ``t < per_split`` inside the row's run; a step past the end re-names
the split's last tile, so Mosaic issues no DMA for it, and `pl.when` skips its compute.

Tiles: the q tile is the GQA group's rows ``[rows_pad, d]`` (rows padded to the sublane tile: 8 for
float32, 16 for bfloat16), whole in VMEM for every step; K/V tiles are ``(block_kv, d)`` of a head-major
cache ``[b, kv_heads, len, d]``, a legal Mosaic block for any head_dim. The contract's
``[b, len, kv_heads, d]`` becomes head-major by a transpose: on a TPU, whose HBM tiles the last two
dimensions by (8, 128), neither that transpose nor a reshape to ``[b, len, kv_heads * d]`` is free, and
the transpose is the one XLA cancels against its inverse, so a cache kept head-major by the caller
(``fl.attention(q, k_cache.swapaxes(1, 2), ...)``) reaches the kernel without a copy (tests/test_tpu_aot.py
measures both).

Per-row query data (segment id, position within the step) come as lane-replicated ``[rows, 128]``
int32 columns, the layout the forward kernel's segment column has: a ``[rows, 1]`` slice of them
broadcasts against a ``[1, block_kv]`` row of key ids in `mask_rules.visible`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers.contract import mask_rules
from flash_layers.impls.base import Request
from flash_layers.impls.flash_pallas import decode, scalar_table
from flash_layers.impls.flash_pallas.tpu_common import (
  NN,
  Tile,
  compiler_params,
  dot,
  interpret_arg,
  softmax_result,
  softmax_update,
  tile_logits,
  tile_visible,
)
from flash_layers.impls.tiling import LANES, BlockSizes, round_up

# Keys per tile: 512 keys x 128 lanes x 2 bytes is 128 KiB per K or V buffer (double-buffered: 512 KiB
# for both), far inside every generation's scoped VMEM, and long enough that the ~0.35 us per grid step
# (JAX's Pallas TPU docs) stays small against the tile's DMA. Smaller caches take the largest of 512,
# 256, 128 that divides them, so the cache is never padded (a copy of it); 128 when none does.
BLOCK_KV = 512
# Parallel programs to aim for: two TensorCores (v4, v5p megacore), each with a few programs in flight.
TARGET_PROGRAMS = 8


def tiles(request: Request) -> tuple[int, int]:
  """(block_kv, splits) of the decode kernel for `request`."""
  sizes = request.block_sizes
  if isinstance(sizes, BlockSizes):
    block_kv = sizes.block_kv
  else:
    block_kv = next((b for b in (BLOCK_KV, 256, 128) if request.kv_len % b == 0), LANES)
    block_kv = min(block_kv, round_up(request.kv_len, LANES))
  return decode.with_splits(request, block_kv, TARGET_PROGRAMS)


def _cache_layout(x, kv_pad: int):
  """[b, len, kv_heads, d] -> head-major [b, kv_heads, kv_pad, d] (padded only when no block size
  divides the length)."""
  x = jnp.swapaxes(x, 1, 2)
  pad = kv_pad - x.shape[2]
  return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x


def _kernel(plan_ref, offsets_ref, q_ref, k_ref, v_ref, row_pos_ref, *refs, call: decode.DecodeCall):
  if call.request.has_segment_ids:
    q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  else:
    o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  # m_scr [rows, 128]: running row max of the base-2 logits (lane-replicated); l_scr [rows, 128]: the
  # running sum of exp2(logit - m); acc_scr [rows, dv]: the running sum of exp2(logit - m) * v.
  r = call.request
  b, split, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  first, count, per_split = decode.run(plan_ref, b)
  index = split * per_split + t  # this step's block within the row's run

  @pl.when(t == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when((t < per_split) & (index < count))
  def _update():
    # The family's logits step on the unscaled q rows (`tile_logits`); row i's position within the
    # decoding step comes from row_pos_ref, every row of the program shares the tile's keys.
    q_local = row_pos_ref[:, :1]
    kv_local = (first + index) * call.block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, call.block_kv), 1)
    offsets = scalar_table.offsets(offsets_ref)
    tile = Tile(q_local, kv_local, offsets.q + q_local, offsets.kv + kv_local)
    seg = (q_seg_ref[:, :1], kv_seg_ref[...]) if r.has_segment_ids else (None, None)
    s, _ = tile_logits(call, q_ref[...], k_ref[...], visible=tile_visible(call, tile, *seg),
                       prescaled=False)  # [rows, block_kv], float32
    m_next, p, rescale = softmax_update(m_scr[...], s)  # as in the forward kernel
    l_scr[...] = rescale * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_scr[...] = acc_scr[...] * rescale[:, :1] + dot(call, p.astype(v.dtype), v, NN)
    m_scr[...] = m_next

  @pl.when(t == call.steps - 1)
  def _finish():
    # A split that saw no key: output 0, lse -inf (merge gives it weight 0).
    inverse, lse = softmax_result(m_scr[...], l_scr[...])
    o_ref[...] = acc_scr[...] * inverse[:, :1]
    lse_ref[...] = lse


def split_kv(call: decode.DecodeCall, q, k, v, q_seg, kv_seg, offsets, table):
  """(out_parts [b, kv_heads, splits, rows_pad, dv] float32, lse_parts [b, kv_heads, splits, rows_pad])."""
  r = call.request
  if q.dtype not in (jnp.float32, jnp.bfloat16):  # float16: the kernel runs in float32
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  b, kvh, d, dv = q.shape[0], r.num_kv_heads, r.head_dim, r.head_dim_v
  rows_pad = round_up(call.rows, 16 if q.dtype == jnp.bfloat16 else 8)
  kv_pad = call.num_blocks * call.block_kv
  q_rows = jnp.pad(decode.pack_queries(call, q), ((0, 0), (0, 0), (0, rows_pad - call.rows), (0, 0)))
  row_pos = jnp.broadcast_to((jnp.arange(rows_pad, dtype=jnp.int32) % r.q_len)[:, None], (rows_pad, LANES))
  steps, splits = call.steps, call.splits

  def kv_block(b, split, t, plan):
    """The block of step t of `split` in row b: clamped into the split's run, so a step past it
    re-names the previous tile (no DMA)."""
    row = decode.run(plan, b)
    index = split * row.per_split + jnp.minimum(t, jnp.maximum(row.per_split - 1, 0))
    return row.first + jnp.minimum(index, jnp.maximum(row.count - 1, 0))

  def kv_spec(width):
    return pl.BlockSpec((None, None, call.block_kv, width),
                        lambda b, h, s, t, plan, off: (b, h, kv_block(b, s, t, plan), 0))

  inputs = [q_rows, _cache_layout(k, kv_pad), _cache_layout(v, kv_pad), row_pos]
  in_specs = [pl.BlockSpec((None, None, rows_pad, d), lambda b, h, s, t, plan, off: (b, h, 0, 0)),
              kv_spec(d), kv_spec(dv),
              pl.BlockSpec((rows_pad, LANES), lambda b, h, s, t, plan, off: (0, 0))]
  if r.has_segment_ids:
    seg_rows = jnp.pad(decode.row_segments(call, q_seg), ((0, 0), (0, rows_pad - call.rows)))
    inputs += [jnp.broadcast_to(seg_rows[:, :, None], (b, rows_pad, LANES)),
               jnp.pad(kv_seg, ((0, 0), (0, kv_pad - r.kv_len)), constant_values=-1)[:, None, :]]
    in_specs += [pl.BlockSpec((None, rows_pad, LANES), lambda b, h, s, t, plan, off: (b, 0, 0)),
                 pl.BlockSpec((None, 1, call.block_kv),
                              lambda b, h, s, t, plan, off: (b, 0, kv_block(b, s, t, plan)))]
  out_block = lambda b, h, s, t, plan, off: (b, h, s, 0, 0)  # noqa: E731
  out_shape = [jax.ShapeDtypeStruct((b, kvh, splits, rows_pad, dv), jnp.float32),
               jax.ShapeDtypeStruct((b, kvh, splits, rows_pad, LANES), jnp.float32)]
  q_off, kv_off = call.static_offsets or (0, 0)
  pairs = b * r.num_heads * mask_rules.count_visible(r.q_len, r.kv_len, r.spec, q_off, kv_off)
  itemsize = jnp.dtype(q.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(2 * pairs * (d + dv)), transcendentals=int(pairs * (1 + (r.softcap is not None))),
      bytes_accessed=int(itemsize * (b * r.kv_len * kvh * (d + dv) + q_rows.size)
                         + 4 * (out_shape[0].size + out_shape[1].size)))
  out, lse = pl.pallas_call(
      functools.partial(_kernel, call=call),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, kvh, splits, steps), in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, None, rows_pad, dv), out_block),
                     pl.BlockSpec((None, None, None, rows_pad, LANES), out_block)],
          scratch_shapes=[pltpu.VMEM((rows_pad, LANES), jnp.float32),
                          pltpu.VMEM((rows_pad, LANES), jnp.float32),
                          pltpu.VMEM((rows_pad, dv), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret_arg(call.interpret), name="flash_layers_decode",
  )(table.reshape(-1), offsets, *inputs)  # the plan flat: SMEM pads a 2-D array's rows
  return out, lse[..., 0]
