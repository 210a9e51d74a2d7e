"""The GPU backward kernels: dK/dV (one program per kv block and kv head, over the group's query heads)
and dQ (one program per q block and head), from the saved logsumexp (the algorithm: `gpu.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.impls.flash_pallas.gpu_common import (
  LOG2E,
  GpuCall,
  alibi_term,
  dot,
  dropout_keep,
  grad_logits,
  kv_tile,
  load,
  mask_inputs,
  mod_at,
  q_program,
  ragged,
  split_refs,
  store,
  tile_logits,
  tile_positions,
  visible_pairs,
  walk,
)
from flash_layers.impls.tiling import round_up


def _dkv_kernel(st: GpuCall, *refs):
  """One program: kv block `program_id(0)` of (batch, kv head) `program_id(1)`."""
  offsets_ref, table, segs, refs = split_refs(st, refs)
  operands, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref = refs
  r = st.request
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  kv_block, bkv = pl.program_id(0), pl.program_id(1)
  batch = bkv // r.num_kv_heads
  first_head = (bkv % r.num_kv_heads) * st.group  # the group's first query head
  kv_start = kv_block * block_kv
  kv_rows = ragged(r.kv_len, block_kv)
  q_rows = ragged(r.q_len, block_q)

  k = load(k_ref, kv_start, kv_rows, r.head_dim)
  v = load(v_ref, kv_start, kv_rows, r.head_dim_v)
  kv_seg = load(segs[1], kv_start, kv_rows) if segs else None

  def per_head(head, carry):  # head: index within this kv head's query group
    def visit(q_block, carry, masked):
      dk, dv = carry
      q_slice = pl.ds(q_block * block_q, block_q)
      start = q_block * block_q
      # Interior q blocks are whole; rows past q_len (edges only) read q = dO = 0 and lse2 = +inf,
      # so their P and dS are exactly 0.
      rows = None if masked is False else q_rows
      q = load(q_ref.at[q_slice, head, :], start, rows, r.head_dim)
      q_seg = load(segs[0].at[q_slice], start, rows) if segs else None
      tile = tile_positions(offsets_ref, q_block, kv_block, block_q, block_kv)
      s2, chain = tile_logits(st, q, k, tile, masked, q_seg, kv_seg,
                              alibi_term(st, offsets_ref, first_head + head, tile),
                              mod_at(st, offsets_ref, batch, first_head + head, operands), grad=True)
      # lse2 is +inf for rows that see no key, so their p is exactly 0.
      p = jnp.exp2(s2 - load(lse2_ref.at[head, q_slice], start, rows, other=jnp.inf)[:, None])
      do = load(do_ref.at[q_slice, head, :], start, rows, r.head_dim_v)
      dp = dot(st, do, v, ((1,), (1,)))
      # Dropout: dV sums the kept, rescaled p; dP flows only through kept entries; D is unchanged.
      keep = dropout_keep(st, offsets_ref, batch, first_head + head, tile)
      pk = p if keep is None else p * keep
      if keep is not None:
        dp = dp * keep
      dv = dv + dot(st, pk.astype(do.dtype), do, ((0,), (0,)))
      ds = grad_logits(st, p, dp, load(delta_ref.at[head, q_slice], start, rows), chain)
      dk = dk + dot(st, ds.astype(q.dtype), q, ((0,), (0,)))
      return dk, dv

    # Rows past kv_len of this block may hold junk in interior tiles (their keys are zeros, not
    # masked): each key's dK/dV row depends on its own column only, and those rows are not stored.
    return walk(st, offsets_ref, table, kv_block, block_kv, r.kv_len, block_q, r.q_len, False,
                visit, carry, map_row=batch if st.map_rows else 0)

  init = (jnp.zeros((block_kv, st.d_pad), jnp.float32), jnp.zeros((block_kv, st.dv_pad), jnp.float32))
  dk, dv = lax.fori_loop(0, st.group, per_head, init)
  store(dk_ref, (dk * r.scale).astype(dk_ref.dtype), kv_start, kv_rows, r.head_dim)
  store(dv_ref, dv.astype(dv_ref.dtype), kv_start, kv_rows, r.head_dim_v)


def _dq_kernel(st: GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  offsets_ref, table, segs, refs = split_refs(st, refs)
  operands, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref, *grads_ref = refs
  r = st.request
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  q_block, batch, head, q_start, q_rows, kv_rows = q_program(st, block_q, block_kv)

  q = load(q_ref, q_start, q_rows, r.head_dim)
  do = load(do_ref, q_start, q_rows, r.head_dim_v)
  lse2 = load(lse2_ref, q_start, q_rows, other=jnp.inf)
  delta = load(delta_ref, q_start, q_rows)
  q_seg = load(segs[0], q_start, q_rows) if segs else None

  # With operand gradients the carry holds (dQ, this program's float32 partial of the float operands'
  # gradients, in registers), stored once after the walk.
  def visit(kv_block, carry, masked):
    dq, grads = carry if st.operand_grads else (carry, None)
    kv_slice, start, rows, kv_seg, k = kv_tile(st, segs, k_ref, kv_block, block_kv, kv_rows, masked)
    tile = tile_positions(offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, chain = tile_logits(st, q, k, tile, masked, q_seg, kv_seg, alibi_term(st, offsets_ref, head, tile),
                            mod_at(st, offsets_ref, batch, head, operands), grad=True,
                            operand_grads=st.operand_grads)
    p = jnp.exp2(s2 - lse2[:, None])
    dp = dot(st, do, load(v_ref.at[kv_slice, :], start, rows, r.head_dim_v), ((1,), (1,)))
    keep = dropout_keep(st, offsets_ref, batch, head, tile)
    if keep is not None:
      dp = dp * keep
    ds = grad_logits(st, p, dp, delta, chain, grads)
    if grads is not None:
      ds, grads = ds
    dq = dq + dot(st, ds.astype(k.dtype), k, ((1,), (0,)))
    return dq if grads is None else (dq, grads)

  init = jnp.zeros((block_q, st.d_pad), jnp.float32)
  if st.operand_grads:
    init = (init, jnp.zeros((st.grad_slots,), jnp.float32))
  dq = walk(st, offsets_ref, table, q_block, block_q, r.q_len, block_kv, r.kv_len, True, visit,
            init, map_row=batch if st.map_rows else 0)
  if st.operand_grads:
    dq, grads_ref[0][...] = dq
  store(dq_ref, (dq * r.scale).astype(dq_ref.dtype), q_start, q_rows, r.head_dim)


def backward_calls(st: GpuCall, q, k, v, q_seg, kv_seg, offsets, ops, do, lse2, delta):
  r = st.request
  batch = q.shape[0]
  h, kvh, g = r.num_heads, r.num_kv_heads, st.group
  cfg = st.cfg
  block_q, block_kv = cfg.block_q_bwd, cfg.block_kv_bwd
  num_q_blocks = -(-r.q_len // block_q)
  num_kv_blocks = -(-r.kv_len // block_kv)
  q_ext, kv_ext = round_up(r.q_len, block_q), round_up(r.kv_len, block_kv)
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  pairs = visible_pairs(st, batch)
  io_bytes = int(sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) * 2)

  # dK/dV: program (kv block, b * kv head); Q, dO, lse, D of the group's heads stay whole.
  arrays, specs = mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=False, block_q=block_q,
                              block_kv=block_kv, heads=kvh)
  specs += [
      pl.BlockSpec((None, q_ext, g, st.d_pad), lambda i, j: (j // kvh, 0, j % kvh, 0)),
      pl.BlockSpec((None, block_kv, None, st.d_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
      pl.BlockSpec((None, block_kv, None, st.dv_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
      pl.BlockSpec((None, q_ext, g, st.dv_pad), lambda i, j: (j // kvh, 0, j % kvh, 0)),
      pl.BlockSpec((None, g, q_ext), lambda i, j: (j // kvh, j % kvh, 0)),
      pl.BlockSpec((None, g, q_ext), lambda i, j: (j // kvh, j % kvh, 0)),
  ]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st), grid=(num_kv_blocks, batch * kvh),
      in_specs=specs,
      out_specs=[
          pl.BlockSpec((None, block_kv, None, st.d_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
          pl.BlockSpec((None, block_kv, None, st.dv_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=st.interpret, name="flash_pallas_gpu_backward_dkv",
      cost_estimate=pl.CostEstimate(
          flops=4 * pairs * (r.head_dim + r.head_dim_v),  # QK^T, P^T dO, dO V^T, dS^T Q
          transcendentals=int(pairs), bytes_accessed=io_bytes),
  )(*arrays, q, k, v, do, lse2, delta)

  # dQ: program (q block, b * head), looping over visible kv blocks like the forward.
  arrays, specs = mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=True, block_q=block_q,
                              block_kv=block_kv, heads=h)
  specs += [
      pl.BlockSpec((None, block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, kv_ext, None, st.d_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, kv_ext, None, st.dv_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, block_q, None, st.dv_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, None, block_q), lambda i, j: (j // h, j % h, i)),
      pl.BlockSpec((None, None, block_q), lambda i, j: (j // h, j % h, i)),
  ]
  out_specs = [pl.BlockSpec((None, block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0))]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if st.operand_grads:  # one partial per program, summed below
    out_specs.append(pl.BlockSpec((None, None, st.grad_slots), lambda i, j: (i, j, 0)))
    out_shape.append(jax.ShapeDtypeStruct((num_q_blocks, batch * h, st.grad_slots), jnp.float32))
  dq, *partials = pl.pallas_call(
      functools.partial(_dq_kernel, st), grid=(num_q_blocks, batch * h),
      in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=st.interpret, name="flash_pallas_gpu_backward_dq",
      cost_estimate=pl.CostEstimate(
          flops=2 * pairs * (2 * r.head_dim + r.head_dim_v),  # QK^T, dO V^T, dS K
          transcendentals=int(pairs), bytes_accessed=io_bytes),
  )(*arrays, q, k, v, do, lse2, delta)
  if not partials:
    return dq, dk, dv, tuple(None for _ in st.operands)
  return dq, dk, dv, st.grad_layout.split(partials[0].sum((0, 1)))


def backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out):
  """dq, dk, dv and the flat operands' gradients (float32; None for those without one) from the rows'
  lse and delta [b, h, q] (unpadded [b, len, h, d] arrays)."""
  # Base-2 lse for the kernels; +inf for rows that see no key, so P = 0 there.
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
  return backward_calls(st, q, k, v, q_seg, kv_seg, offsets, ops, d_out.astype(q.dtype), lse2, delta)
