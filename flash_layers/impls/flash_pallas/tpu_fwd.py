"""The TPU forward kernel: one q block (and its tile's query heads) against its visible kv blocks,
with the online softmax in VMEM scratch; its grid is `tpu_grid.Grid` (q-major).

GQA: with token-major operands, one forward program and one dQ program serve up to 8 query heads of
a group: the q tile (and dO, dQ) is the (block, heads * head_dim) window of their columns, lse and D
rows are (heads, 1, block), each K/V tile is fetched once for all of them (v5e, [1, 8192, 8, 128]
bf16 q on 2 kv heads, estimated HBM reads: forward 544 -> 160 MiB, dQ 560.5 -> 176.5 MiB), a loop
runs the heads over per-head scratch, and if the group's tiles would not fit VMEM the forward halves
block_q, the dQ kernel (whose block_q_bwd the dK/dV kernel shares) takes fewer heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers.impls.flash_pallas.tpu_common import (
  NN,
  TpuCall,
  alibi_term,
  column,
  cost_estimate,
  dims,
  dot,
  dropout_keep,
  folded,
  nbytes,
  softmax_result,
  softmax_update,
  tile_logits,
  tile_mask,
  when_visited,
)
from flash_layers.impls.flash_pallas.tpu_grid import Grid, call_kernel, kernel_grid, segment_rows
from flash_layers.impls.tiling import LANES


def _forward_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: TpuCall, grid: Grid):
  """One forward grid step: a q tile's query heads against one kv tile, online softmax.

  Per query head j of the tile (grid.tile_heads of one GQA group; 1 for head-major operands):
  m_scr[j] [bq, 128]: running row max of the base-2 logits seen so far (lane-replicated).
  l_scr[j] [bq, 128]: running sum of exp2(logit - m) over those logits (lane-replicated).
  acc_scr[j] [bq, dv]: running sum of exp2(logit - m) * v, rescaled whenever m grows.
  q_scr[j] [bq, d]: head j's q tile times `fold` (scale and log2 e), made once per q block:
    the q block is constant along the steps, so one multiply of bq * d elements replaces one of
    bq * bk logits per step, and the steps read it from VMEM as they would read q_ref.
  q_seg_scr [bq, 128]: this q block's segment ids as a column (made once per q block).
  """
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, q_scr,
     q_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, q_scr = refs
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)
  heads, d, dv = grid.tile_heads, cfg.request.head_dim, cfg.request.head_dim_v

  @pl.when(step.first)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    for j in range(heads):  # lane-aligned column windows (d % 128 == 0 when heads > 1)
      q_scr[j] = folded(cfg, q_ref[:, j * d:(j + 1) * d])
    if cfg.has_segments:
      q_seg_scr[...] = column(q_seg_ref[...])

  def update(masked: bool):
    tile, mod, visible = tile_mask(  # one element mask for every head of the tile
        cfg, offsets_ref, operands, step, (grid.block_q, grid.block_kv), 0, masked,
        lambda: (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None))

    # The heads run in a loop, not unrolled: the body is compiled once whatever the group (an
    # unrolled body grew Mosaic's compile by ~4 s per head), and its refs are indexed only along
    # their leading, untiled axis. K and V are read from their VMEM tiles inside the body, as the
    # matmuls would read them anyway, rather than held live across the loop.
    def head_update(j, carry):
      head = step.head + j
      s, _ = tile_logits(cfg, q_scr[j], k_ref[...], alibi=alibi_term(cfg, offsets_ref, head, tile),
                         mod=mod, visible=visible)
      m_next, p, rescale = softmax_update(m_scr[j], s)
      l_scr[j] = rescale * l_scr[j] + jnp.sum(p, axis=1, keepdims=True)  # lse: before dropout
      keep = dropout_keep(cfg, offsets_ref, step.batch, head, tile)
      if keep is not None:
        p = p * keep
      v = v_ref[...]
      acc_scr[j] = acc_scr[j] * rescale[:, :1] + dot(cfg, p.astype(v.dtype), v, NN)
      m_scr[j] = m_next
      return carry

    if heads == 1:
      head_update(0, None)
    else:
      jax.lax.fori_loop(0, heads, head_update, None)

  when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    for j in range(heads):
      inverse, lse = softmax_result(m_scr[j], l_scr[j])  # rows that saw no key: output 0, lse -inf
      o_ref[:, j * dv:(j + 1) * dv] = (acc_scr[j] * inverse[:, :1]).astype(o_ref.dtype)
      row = jnp.transpose(lse)[:1, :]  # [bq, 128] column -> [1, bq] row
      if heads > 1:
        lse_ref[j] = row
      else:
        lse_ref[...] = row


def _operand_shape(cfg: TpuCall, b: int, h: int, length: int, d: int) -> tuple[int, ...]:
  return (b, length, h * d) if cfg.token_major else (b, h, length, d)


def forward(cfg: TpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  b, h, q_pad, kv_pad, d, dv = dims(cfg, q, k)
  grid, steps, tables = kernel_grid(cfg, cfg.fwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=False,
                                    tile_heads=cfg.fwd_heads)
  block_q, heads = grid.block_q, grid.tile_heads
  inputs, in_specs = [q, k, v], [grid.q_tile(d), grid.kv_tile(d), grid.kv_tile(dv)]
  scratch = [pltpu.VMEM((heads, block_q, LANES), jnp.float32),
             pltpu.VMEM((heads, block_q, LANES), jnp.float32),
             pltpu.VMEM((heads, block_q, dv), jnp.float32),
             pltpu.VMEM((heads, block_q, d), q.dtype)]
  if cfg.has_segments:
    inputs += [segment_rows(q_seg, q_pad), segment_rows(kv_seg, kv_pad)]
    in_specs += grid.segment_rows()
    scratch.append(pltpu.VMEM((block_q, LANES), jnp.int32))
  out_shape = [jax.ShapeDtypeStruct(_operand_shape(cfg, b, h, q_pad, dv), q.dtype),
               jax.ShapeDtypeStruct((b, h, 1, q_pad), jnp.float32)]
  # K/V are streamed once per q block for every q tile's heads: group / tile_heads times per
  # kv head.
  kv_reads = grid.num_outer * grid.group // heads
  cost = cost_estimate(cfg, b, h, 2 * cfg.request.head_dim + 2 * cfg.request.head_dim_v,
                       nbytes(q, *out_shape) + nbytes(k, v) * kv_reads)
  return call_kernel(_forward_kernel, "flash_layers_fwd", cfg, grid, steps, (offsets, *tables), inputs,
                     in_specs, out_shape, [grid.q_tile(dv), grid.q_row()], scratch, cost)
