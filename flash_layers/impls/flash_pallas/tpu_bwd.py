"""The TPU backward kernels: dK/dV (kv-major grid) and dQ (q-major), and rowsum(dO * O).

Backward (custom VJP, from the saved logsumexp L):
  P = exp(S - L),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = dS K,  dK = dS^T Q
with ``D_i = rowsum(dO * O)_i - dlse_i`` (the second term carries a cotangent on lse, which ring
attention produces; rowsum(dO * O) is one small kernel). `attention_backward` runs the two
backward kernels from given L and D: ring attention passes the global ones and never re-runs
the forward. One kernel accumulates dK and dV for a kv block over the q blocks that see it
(and over the query heads sharing the kv head: GQA never repeats K/V in HBM); a second kernel
accumulates dQ for a q block (and its tile's query heads) over its kv blocks. Both skip blocks
like the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers.impls.flash_pallas import kernel_mods
from flash_layers.impls.flash_pallas.tpu_common import (
  LOG2E,
  NN,
  NT,
  TpuCall,
  alibi_term,
  column,
  compiler_params,
  cost_estimate,
  dims,
  dot,
  dropout_keep,
  folded,
  interpret_arg,
  nbytes,
  tile_logits,
  tile_mask,
  when_visited,
)
from flash_layers.impls.flash_pallas.tpu_grid import Grid, call_kernel, kernel_grid, segment_rows
from flash_layers.impls.tiling import LANES, round_up


def _dkv_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: TpuCall, grid: Grid):
  """One dK/dV grid step: a kv tile's gradients summed over one q tile of one query head.

  dk_scr [bk, d], dv_scr [bk, dv]: float32 sums over every (query head of the group, q block)
  that sees this kv block. kv_seg_scr [bk, 128]: this kv block's segment ids as a column.
  Tiles are transposed ([kv, q]) so the per-query rows lse and D broadcast along sublanes; lse
  arrives in base 2 (`backward_from_stats`).
  q changes every step here, and it is q that is scaled (`folded`), per step: bq * d multiplies
  instead of bk * bq. Folding the scale into the resident k tile once would be cheaper still,
  but for bfloat16 it rounds differently from the forward's scaled q, and P recomputed from other
  roundings than the ones lse was summed from no longer sums to one (measured: dV's error
  against float64 3x larger, over the conformance limit).
  """
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dk_ref, dv_ref,
     dk_scr, dv_scr, kv_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr = refs
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)

  @pl.when(step.first)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)
    if cfg.has_segments:
      kv_seg_scr[...] = column(kv_seg_ref[...])

  def update(masked: bool):
    q, do = q_ref[...], do_ref[...]
    tile, mod, visible = tile_mask(  # laid out as the transposed tile s_t: [bk, bq]
        cfg, offsets_ref, operands, step, (grid.block_kv, grid.block_q), 1, masked,
        lambda: (q_seg_ref[...], kv_seg_scr[:, :1]) if cfg.has_segments else (None, None))
    s_t, chain = tile_logits(cfg, k_ref[...], folded(cfg, q), mod=mod, visible=visible, grad=True,
                             alibi=alibi_term(cfg, offsets_ref, step.head, tile))
    # lse is +inf for rows that see no key (set by the wrapper): their p is exactly 0.
    p_t = jnp.exp2(s_t - lse_ref[...])
    dp_t = dot(cfg, v_ref[...], do, NT)
    keep = dropout_keep(cfg, offsets_ref, step.batch, step.head, tile)
    # Dropout: dV sums the kept, rescaled probabilities; dP passes only through kept entries.
    # delta = rowsum(dO * O) is unchanged (sum_j p_j keep_j dO.v_j = dO.O).
    pk_t = p_t if keep is None else p_t * keep
    if keep is not None:
      dp_t = dp_t * keep
    dv_scr[...] += dot(cfg, pk_t.astype(do.dtype), do, NN)
    ds_t = p_t * (dp_t - delta_ref[...])
    if chain is not None:  # softcap: d(c tanh(x / c)) / dx = 1 - tanh^2; score_mod: its derivative
      ds_t = chain(ds_t)
    dk_scr[...] += dot(cfg, ds_t.astype(q.dtype), q, NN)

  when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.request.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: TpuCall, grid: Grid):
  """One dQ grid step: a q tile's query heads' dQ summed over one kv tile.

  Per query head j of the tile (grid.tile_heads of one GQA group, as in the forward; 1 for
  head-major operands), all made once per q block:
  dq_scr[j] [bq, d]: float32 sum over the visible kv blocks.
  lse_scr[j] (base 2), delta_scr[j] [bq, 128]: head j's lse and D rows as columns.
  q_scr[j] [bq, d]: head j's q tile times `fold`; do_scr[j] [bq, dv]: its dO tile. The loop
    over the heads indexes refs along their leading axis only (a head's columns of q_ref and
    do_ref are static lane windows, copied out here).
  q_seg_scr [bq, 128]: this q block's segment ids as a column.
  dQ may be aliased into dO's buffer (`_backward`): a program copies its dO window to do_scr
  at its first step and writes dQ into the same window after its last; no other program
  touches that window.
  With operand gradients (`cfg.operand_grads`) a second output, grads_ref [R, 128] float32, holds
  this program's (batch, head, row) partial sums of the float operands' gradients, resident over
  the row's steps (its block index does not change along them).
  """
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  grads_ref, refs = _grads_output(cfg, refs)
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref,
     dq_scr, lse_scr, delta_scr, q_scr, do_scr, q_seg_scr) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, lse_scr, delta_scr,
     q_scr, do_scr) = refs
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)
  heads, d, dv = grid.tile_heads, cfg.request.head_dim, cfg.request.head_dim_v

  def row(ref, j):  # head j's [1, bq] row of lse or D
    return ref[j] if heads > 1 else ref[...]

  if grads_ref is not None:
    @pl.when(pl.program_id(3) == 0)  # the row's first step: its partial starts at zero
    def _zero():
      grads_ref[...] = jnp.zeros(grads_ref.shape, jnp.float32)

  @pl.when(step.first)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
    for j in range(heads):  # lane-aligned column windows (d % 128 == 0 when heads > 1)
      q_scr[j] = folded(cfg, q_ref[:, j * d:(j + 1) * d])
      do_scr[j] = do_ref[:, j * dv:(j + 1) * dv]
      lse_scr[j] = column(row(lse_ref, j))
      delta_scr[j] = column(row(delta_ref, j))
    if cfg.has_segments:
      q_seg_scr[...] = column(q_seg_ref[...])

  def update(masked: bool):
    tile, mod, visible = tile_mask(  # one element mask for every head of the tile
        cfg, offsets_ref, operands, step, (grid.block_q, grid.block_kv), 0, masked,
        lambda: (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None))

    # A loop, as in the forward (`_forward_kernel`): one compiled body, K and V read from their
    # VMEM tiles inside it.
    def head_update(j, carry):
      head = step.head + j
      k = k_ref[...]
      s, chain = tile_logits(cfg, q_scr[j], k, alibi=alibi_term(cfg, offsets_ref, head, tile), mod=mod,
                             visible=visible, grad=True, operand_grads=grads_ref is not None)  # s: [bq, bk]
      p = jnp.exp2(s - lse_scr[j][:, :1])
      dp = dot(cfg, do_scr[j], v_ref[...], NT)
      keep = dropout_keep(cfg, offsets_ref, step.batch, head, tile)
      if keep is not None:
        dp = dp * keep
      ds = _chained(cfg, chain, p * (dp - delta_scr[j][:, :1]), grads_ref)
      dq_scr[j] += dot(cfg, ds.astype(k.dtype), k, NN)
      return carry

    if heads == 1:
      head_update(0, None)
    else:
      jax.lax.fori_loop(0, heads, head_update, None)

  when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    for j in range(heads):
      dq_ref[:, j * d:(j + 1) * d] = (dq_scr[j] * cfg.request.scale).astype(dq_ref.dtype)


def _grads_output(cfg: TpuCall, refs):
  """(the operand-gradient output ref or None, the other refs): it follows dQ, the dQ kernel's first
  output, when `cfg.operand_grads`."""
  if not cfg.operand_grads:
    return None, refs
  dq_at = 8 if cfg.has_segments else 6  # after q, k, v, dO, lse, D [, q_seg, kv_seg] and dQ
  return refs[dq_at + 1], (*refs[:dq_at + 1], *refs[dq_at + 2:])


def _chained(cfg: TpuCall, chain, ds, grads_ref):
  """dS through the softcap and score_mod (`tile_logits`' chain); with operand gradients, the reads'
  cotangents are summed into this program's partial."""
  if chain is None:
    return ds
  if grads_ref is None:
    return chain(ds)
  ds, reads = chain(ds)
  rows = grads_ref.shape
  slots = (jax.lax.broadcasted_iota(jnp.int32, rows, 0) * LANES
           + jax.lax.broadcasted_iota(jnp.int32, rows, 1))
  grads_ref[...] = kernel_mods.accumulate(grads_ref[...], slots, cfg.grad_layout, reads, _tile_sum)
  return ds


def _tile_sum(x):
  """Sum of a [rows, lanes] tile as [1, 1]: lane then sublane reductions, both native to Mosaic."""
  return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def grad_rows(cfg: TpuCall) -> int:
  """Sublanes of a program's operand-gradient partial [rows, 128] (whole (8, 128) tiles)."""
  return round_up(-(-cfg.grad_layout.total // LANES), 8)


def _backward(cfg: TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, do, reuse_do: bool):
  """dq, dk, dv and the flat operands' gradients (float32, None for those without one).
  ``reuse_do``: dO is dead after this call (a VJP's cotangent), so the dQ kernel,
  which runs last and reads each dO tile only while it owns that q block, writes dQ into dO's
  buffer (input_output_aliases): one q-sized buffer less (at 8k tokens on v5e, the only HBM
  temporary left). Token-major operands only: with head-major copies the alias made XLA keep
  another q-sized float32 buffer (v5p, 262,144 tokens, 2 heads of 64: temporaries 772 -> 900
  MiB), and saved nothing at 8k or 32k."""
  b, h, q_pad, kv_pad, d, dv = dims(cfg, q, k)
  seg_inputs = []
  if cfg.has_segments:
    seg_inputs = [segment_rows(q_seg, q_pad), segment_rows(kv_seg, kv_pad)]
  vmem = functools.partial(pltpu.VMEM, dtype=jnp.float32)

  def specs(grid: Grid):  # q, k, v, dO, lse, D, [segment ids]
    return [grid.q_tile(d), grid.kv_tile(d), grid.kv_tile(dv), grid.q_tile(dv), grid.q_row(),
            grid.q_row(), *(grid.segment_rows() if cfg.has_segments else [])]

  inputs = [q, k, v, do, lse, delta, *seg_inputs]
  grid, steps, tables = kernel_grid(cfg, cfg.bwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=True)
  block_q, block_kv = grid.block_q, grid.block_kv
  dk_dv_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dk, dv_ = call_kernel(
      _dkv_kernel, "flash_layers_bwd_dkv", cfg, grid, steps, (offsets, *tables), inputs, specs(grid),
      dk_dv_shape, [grid.kv_tile(d), grid.kv_tile(dv)],
      [vmem((block_kv, d)), vmem((block_kv, dv)),
       *([pltpu.VMEM((block_kv, LANES), jnp.int32)] if cfg.has_segments else [])],
      cost_estimate(cfg, b, h, 4 * cfg.request.head_dim + 4 * cfg.request.head_dim_v,
                    nbytes(k, v, *dk_dv_shape) + nbytes(q, do, lse, delta) * grid.num_outer))

  grid, steps, tables = kernel_grid(cfg, cfg.bwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=False,
                                    tile_heads=cfg.dq_heads)
  block_q, heads = grid.block_q, grid.tile_heads
  dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  out_shape, out_specs = dq_shape, grid.q_tile(d)
  if cfg.operand_grads:  # one partial per (batch, head, row) program, summed below
    partials = (b, h // heads, grid.rows, grad_rows(cfg), LANES)
    out_shape = [dq_shape, jax.ShapeDtypeStruct(partials, jnp.float32)]
    out_specs = [out_specs, pl.BlockSpec((None, None, None, *partials[3:]),
                                         lambda b, h, r, *_: (b, h, r, 0, 0))]
  # K/V are streamed once per q block for every q tile's heads: group / tile_heads times per
  # kv head.
  kv_reads = grid.num_outer * grid.group // heads
  dq = call_kernel(
      _dq_kernel, "flash_layers_bwd_dq", cfg, grid, steps, (offsets, *tables), inputs, specs(grid),
      out_shape, out_specs,
      [vmem((heads, block_q, d)), vmem((heads, block_q, LANES)), vmem((heads, block_q, LANES)),
       pltpu.VMEM((heads, block_q, d), q.dtype), pltpu.VMEM((heads, block_q, dv), do.dtype),
       *([pltpu.VMEM((block_q, LANES), jnp.int32)] if cfg.has_segments else [])],
      cost_estimate(cfg, b, h, 4 * cfg.request.head_dim + 2 * cfg.request.head_dim_v,
                    nbytes(q, do, lse, delta, dq_shape) + nbytes(k, v) * kv_reads),
      aliases={3: 0} if (reuse_do and cfg.token_major and do.shape == q.shape
                         and do.dtype == q.dtype) else None)
  if not cfg.operand_grads:
    return dq, dk, dv_, tuple(None for _ in cfg.operands)
  dq, partials = dq
  return dq, dk, dv_, cfg.grad_layout.split(partials.sum((0, 1, 2)).reshape(-1))


def _delta_kernel(o_ref, do_ref, delta_ref):
  rows = jnp.sum(o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32), axis=1,
                 keepdims=True)  # [bq, 1]
  delta_ref[...] = jnp.transpose(jnp.broadcast_to(rows, (rows.shape[0], LANES)))[:1, :]


def row_delta(cfg: TpuCall, out, d_out):
  """rowsum(dO * O) [b, h, 1, q_pad] float32, tile by tile in the kernels' layout.

  In XLA this product would be a [b, len, h, dv] float32 temporary plus, for token-major
  operands, a relayout copy of it (the reduction axis is a lane slice of the fused h * dv axis);
  here it is one read of O and dO.
  """
  b, h, q_pad, _, _, dv = dims(cfg, out, out)
  block_q = cfg.bwd[0]
  if cfg.token_major:
    tile = pl.BlockSpec((None, block_q, dv), lambda b, h, i: (b, i, h))
  else:
    tile = pl.BlockSpec((None, None, block_q, dv), lambda b, h, i: (b, h, i, 0))
  return pl.pallas_call(
      _delta_kernel, grid=(b, h, q_pad // block_q), in_specs=[tile, tile],
      out_specs=pl.BlockSpec((None, None, 1, block_q), lambda b, h, i: (b, h, 0, i)),
      out_shape=jax.ShapeDtypeStruct((b, h, 1, q_pad), jnp.float32),
      compiler_params=compiler_params(("parallel",) * 3),
      cost_estimate=pl.CostEstimate(flops=2 * b * h * q_pad * dv, transcendentals=0,
                                    bytes_accessed=nbytes(out, d_out)),
      interpret=interpret_arg(cfg.interpret), name="flash_layers_bwd_delta",
  )(out, d_out)


def backward_from_stats(cfg: TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out,
                        reuse_do: bool = False):
  """(dq, dk, dv, the flat operands' gradients or None each) by the backward kernels on padded
  kernel-layout arrays; lse, delta [b, h, 1, q_pad].

  The kernels recompute P = exp2(S2 - L2) from base-2 logits (`tile_logits`), so lse is handed to them
  in base 2, L2 = L * log2 e: one multiply per row here, fused with the masking below.
  """
  real = (jnp.arange(lse.shape[-1]) < cfg.request.q_len)[None, None, None, :]
  delta = jnp.where(real, delta, 0.0)
  lse = jnp.where(real & (lse > -jnp.inf), lse * LOG2E, jnp.inf)
  return _backward(cfg, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out, reuse_do)
