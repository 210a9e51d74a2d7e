"""The GPU forward kernel: one program per (q block, batch * head), looping over its visible kv blocks
with the online softmax in registers (the algorithm: `gpu.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.impls.flash_pallas.gpu_common import (
  LN2,
  GpuCall,
  alibi_term,
  dot,
  dropout_keep,
  kv_tile,
  load,
  mask_inputs,
  mod_at,
  q_program,
  softmax_update,
  split_refs,
  store,
  tile_logits,
  tile_positions,
  visible_pairs,
  walk,
)
from flash_layers.impls.tiling import round_up


def _forward_kernel(st: GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  offsets_ref, table, segs, (operands, q_ref, k_ref, v_ref, o_ref, lse_ref) = split_refs(st, refs)
  r = st.request
  block_q, block_kv = st.cfg.block_q, st.cfg.block_kv
  q_block, batch, head, q_start, q_rows, kv_rows = q_program(st, block_q, block_kv)

  q = load(q_ref, q_start, q_rows, r.head_dim)
  q_seg = load(segs[0], q_start, q_rows) if segs else None

  def visit(kv_block, carry, masked):
    acc, m, denom = carry
    kv_slice, start, rows, kv_seg, k = kv_tile(st, segs, k_ref, kv_block, block_kv, kv_rows, masked)
    tile = tile_positions(offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, _ = tile_logits(st, q, k, tile, masked, q_seg, kv_seg, alibi_term(st, offsets_ref, head, tile),
                        mod_at(st, offsets_ref, batch, head, operands))
    m_new, p, rescale = softmax_update(m, s2)
    denom = denom * rescale + p.sum(axis=-1)  # the normaliser (and lse) is taken before dropout
    keep = dropout_keep(st, offsets_ref, batch, head, tile)
    if keep is not None:
      p = p * keep
    v = load(v_ref.at[kv_slice, :], start, rows, r.head_dim_v)
    pv = dot(st, p.astype(v.dtype), v, ((1,), (0,)))
    return acc * rescale[:, None] + pv, m_new, denom

  init = (jnp.zeros((block_q, st.dv_pad), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, m, denom = walk(st, offsets_ref, table, q_block, block_q, r.q_len, block_kv, r.kv_len,
                       True, visit, init, map_row=batch if st.map_rows else 0)

  seen = denom > 0  # False for a row that sees no key: zeros out, lse = -inf
  denom = jnp.where(seen, denom, 1.0)
  store(o_ref, (acc / denom[:, None]).astype(o_ref.dtype), q_start, q_rows, r.head_dim_v)
  store(lse_ref, jnp.where(seen, (m + jnp.log2(denom)) * LN2, -jnp.inf), q_start, q_rows)


def forward_call(st: GpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  r = st.request
  batch = q.shape[0]
  h, g = r.num_heads, st.group
  cfg = st.cfg
  num_q_blocks = -(-r.q_len // cfg.block_q)
  kv_ext = round_up(r.kv_len, cfg.block_kv)  # the whole-row K/V block: a block multiple
  arrays, specs = mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=True, block_q=cfg.block_q,
                              block_kv=cfg.block_kv, heads=h)
  specs += [
      pl.BlockSpec((None, cfg.block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, kv_ext, None, st.d_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, kv_ext, None, st.dv_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, cfg.block_q, None, st.dv_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, None, cfg.block_q), lambda i, j: (j // h, j % h, i)),
  ]
  out_shape = [jax.ShapeDtypeStruct((batch, r.q_len, h, r.head_dim_v), q.dtype),
               jax.ShapeDtypeStruct((batch, h, r.q_len), jnp.float32)]
  pairs = visible_pairs(st, batch)
  cost = pl.CostEstimate(
      flops=2 * pairs * (r.head_dim + r.head_dim_v),  # QK^T, PV
      transcendentals=int(pairs * (2 if r.softcap else 1)),
      bytes_accessed=int(sum(x.size * x.dtype.itemsize for x in (q, k, v)) * 2))
  return pl.pallas_call(
      functools.partial(_forward_kernel, st), grid=(num_q_blocks, batch * h),
      in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      cost_estimate=cost, interpret=st.interpret, name="flash_pallas_gpu_forward",
  )(*arrays, q, k, v)
