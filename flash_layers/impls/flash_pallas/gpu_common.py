"""What the GPU (Triton) kernels share: the call's description, masked tile loads and stores, the
walk over a program's visible blocks, and the per-tile logits step (scale * q.k + ALiBi -> score_mod ->
softcap -> mask, `tile_logits`) and online-softmax step that the forward (`gpu_fwd.py`), backward
(`gpu_bwd.py`) and decode (`gpu_decode.py`) kernels all run. The algorithm is described in `gpu.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Request
from flash_layers.impls.flash_pallas import decode, kernel_mods, scalar_table
from flash_layers.impls.tiling import MIN_GPU_TILE, GpuBlockSizes, round_up

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def pow2_tile(n: int) -> int:
  """A tile dimension for `n`: the next power of two, at least MIN_GPU_TILE (what `tl.dot` wants)."""
  return max(MIN_GPU_TILE, pl.next_power_of_2(n))


# ----------------------------------------------------------------------------
# Static description of one call (hashable: it is a custom_vjp nondiff argument)
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuCall(kernel_mods.ModOperands):
  """One call as the kernels see it: the request and what is derived from it."""

  KERNEL = "a GPU (Triton) kernel"  # in the mod operands' errors (kernel_mods.ModOperands)

  request: Request
  cfg: GpuBlockSizes  # gpu_config.config(request): the tiles and launch parameters actually used
  interpret: bool
  # mask_mod / score_mod operands (kernel_mods.flatten), read whole by every program.
  operands: tuple[kernel_mods.Meta, ...] = ()

  @property
  def has_segments(self) -> bool:
    return self.request.has_segment_ids

  @property
  def arithmetic(self) -> bool:
    """Whether each block's visible blocks are one range computed from the offsets (causal,
    windows, neither) rather than listed by `block_info.block_map` (segment ids; global tokens, whose
    visible set is the band plus the first rows and columns: not one interval; a mask_mod, whose
    tiles come from `block_info.tile_flags`)."""
    return (not self.has_segments and not self.request.spec.global_tokens
            and self.request.mask_mod is None)

  @property
  def map_rows(self) -> bool:
    """Whether the block map has a row per batch row (segment ids, a mask_mod)."""
    return self.has_segments or self.request.mask_mod is not None

  @property
  def grad_slots(self) -> int:
    """Length of a dQ program's operand-gradient accumulator (a power of two, as `tl.arange` wants)."""
    return pow2_tile(self.grad_layout.total)

  @property
  def group(self) -> int:
    return self.request.num_heads // self.request.num_kv_heads

  @property
  def d_pad(self) -> int:  # tile width: `tl.dot` and `tl.arange` want powers of two
    return pow2_tile(self.request.head_dim)

  @property
  def dv_pad(self) -> int:
    return pow2_tile(self.request.head_dim_v)


# ----------------------------------------------------------------------------
# Masked tile loads and stores: q/k/v/dO stay unpadded in HBM
# ----------------------------------------------------------------------------

def _tile_mask(ref, start, length: int | None, width: int | None):
  """The load/store mask of `ref` (a [rows] or [rows, width_pad] view): rows at or past `length`
  (global index start + i) and columns at or past `width`; None where nothing is cut off."""
  mask = None
  if length is not None:
    rows = start + jnp.arange(ref.shape[0], dtype=jnp.int32) < length
    mask = rows if len(ref.shape) == 1 else rows[:, None]
  if width is not None and width != ref.shape[-1]:
    cols = (jnp.arange(ref.shape[-1], dtype=jnp.int32) < width)[None, :]
    mask = cols if mask is None else mask & cols
  return None if mask is None else jnp.broadcast_to(mask, ref.shape)


def load(ref, start=0, length: int | None = None, width: int | None = None, other=0.0):
  """A tile of `ref` with the rows past `length` and columns past `width` read as `other`.

  The BlockSpecs are powers of two (head_dim) and block multiples (lengths) wide, the arrays
  are not: Triton's masked loads never touch the memory past the array, and interpret mode
  pads the blocks itself. Pass length=None where every row of the tile is known to be real.
  """
  mask = _tile_mask(ref, start, length, width)
  if mask is None:
    return ref[...]
  if jnp.issubdtype(ref.dtype, jnp.integer):  # segment ids: a float `other` would promote them
    other = int(other)
  return plgpu.load(ref, mask=mask, other=other)


def store(ref, value, start=0, length: int | None = None, width: int | None = None):
  """Write `value`, leaving rows past `length` and columns past `width` of the array untouched."""
  mask = _tile_mask(ref, start, length, width)
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def ragged(length: int, block: int) -> int | None:
  """`length` when the last block holds positions past it (loads must mask rows), else None."""
  return length if length % block else None


class QProgram(NamedTuple):
  """A program over q block `program_id(0)` of (batch, head) `program_id(1)`: the forward and dQ grids."""

  q_block: jax.Array
  batch: jax.Array
  head: jax.Array
  q_start: jax.Array
  q_rows: int | None   # `ragged` of the q and kv lengths: where loads must mask rows
  kv_rows: int | None


def q_program(st: GpuCall, block_q: int, block_kv: int) -> QProgram:
  r = st.request
  q_block, bh = pl.program_id(0), pl.program_id(1)
  return QProgram(q_block, bh // r.num_heads, bh % r.num_heads, q_block * block_q,
                  ragged(r.q_len, block_q), ragged(r.kv_len, block_kv))


class KvTile(NamedTuple):
  """Kv block ``kv_block`` of a q-block program's walk: its slice, first key and the loaded keys."""

  slice: pl.Slice
  start: jax.Array
  rows: int | None  # rows to mask on load: None for an interior block (only real keys)
  kv_seg: jax.Array | None
  k: jax.Array


def kv_tile(st: GpuCall, segs, k_ref, kv_block, block_kv: int, kv_rows: int | None, masked) -> KvTile:
  """Load kv block ``kv_block``'s keys (and segment ids). Interior blocks hold only real keys:
  unmasked rows; edge blocks may be the ragged last one."""
  kv_slice = pl.ds(kv_block * block_kv, block_kv)
  start = kv_block * block_kv
  rows = None if masked is False else kv_rows
  kv_seg = load(segs[1].at[kv_slice], start, rows) if segs else None
  return KvTile(kv_slice, start, rows, kv_seg, load(k_ref.at[kv_slice, :], start, rows, st.request.head_dim))


def visit_ranges(ranges, visit, carry):
  """Run `visit(block, carry, masked)` over a range: the interior blocks in a loop with no element
  mask (and no `cond`), then the edges before and after it with the mask."""
  lo, full_lo, full_hi, hi = ranges
  carry = lax.fori_loop(full_lo, full_hi, lambda block, c: visit(block, c, False), carry)
  before = full_lo - lo

  def edge(i, c):
    return visit(jnp.where(i < before, lo + i, full_hi + (i - before)), c, True)

  return lax.fori_loop(0, before + hi - full_hi, edge, carry)


# ----------------------------------------------------------------------------
# The tile computation shared by every kernel (forward, dK/dV, dQ, decode)
# ----------------------------------------------------------------------------

class Tile(NamedTuple):
  """Positions of one [rows, block_kv] tile: global q [rows, 1] and kv [1, block_kv] (what ALiBi,
  dropout, the mods and the element mask read), and the keys' local positions [block_kv]."""

  q_pos: jax.Array
  kv_pos: jax.Array
  kv_local: jax.Array


def tile_positions(offsets_ref, q_block, kv_block, block_q: int, block_kv: int) -> Tile:
  """The `Tile` of (q block, kv block) of the forward and backward kernels."""
  q_local = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
  kv_local = kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
  offsets = scalar_table.offsets(offsets_ref)
  return Tile((offsets.q + q_local)[:, None], (offsets.kv + kv_local)[None, :], kv_local)


def mod_at(st: GpuCall, offsets_ref, batch, head, operands):
  """`tile_logits`' mod_at for local (batch row, query head): the row and head made global by the kernel
  table's origin (a shard's first row and head, traced on a mesh; 0 unsharded), with the operand views;
  None when the request has no mods."""
  if not st.request.has_mods:
    return None
  origin = scalar_table.origin(offsets_ref)
  return origin.batch + batch, origin.head + head, operands


def needs_mask(request: Request, block_kv: int) -> bool:
  """Whether any tile needs the element mask (else every loaded pair is visible)."""
  spec = request.spec
  return (spec.causal or spec.window is not None or request.has_segment_ids
          or request.mask_mod is not None or request.kv_len % block_kv != 0)


def alibi_term(st: GpuCall, offsets_ref, head, tile: Tile):
  """The ALiBi term of a tile (slope bits from the kernel table), or None."""
  if not st.request.has_alibi:
    return None
  return alibi(scalar_table.Table.of(st.request).slope(offsets_ref, head), tile.q_pos, tile.kv_pos)


def dropout_keep(st: GpuCall, offsets_ref, batch, head, tile: Tile):
  """The dropout multiplier of a tile (0 or 1 / (1 - rate)), or None."""
  r = st.request
  if not r.has_dropout:
    return None
  stream = scalar_table.Table.of(r).stream(offsets_ref, batch, head)
  kept = dropout.keep(stream, tile.q_pos, tile.kv_pos, r.dropout_rate)
  return jnp.where(kept, jnp.float32(dropout.keep_scale(r.dropout_rate)), jnp.float32(0.0))


def dot(st: GpuCall, a, b, contract):
  """a . b over the `contract` dims in float32 at the request's precision: Pallas Triton makes
  float32 operands at HIGHEST IEEE products, at DEFAULT or HIGH TF32 ones. bfloat16/float16
  operands multiply exactly whatever the precision; they keep DEFAULT, as before."""
  precision = st.request.precision if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def tile_logits(st: GpuCall | decode.DecodeCall, q, k, tile: Tile, masked, q_seg=None, kv_seg=None,
                alibi=None, mod_at=None, grad: bool = False, operand_grads: bool = False):
  """The logits step of every GPU kernel: base-2 logits of one [rows, block_kv] tile (``q @ k^T``, the
  rows' and keys' positions in `tile`), masked to -inf where invisible.

  masked: False for an interior tile (every pair visible: no element mask), True for an edge
  tile, or the block map's traced `full` flag (segment ids, mask_mod), decided per tile behind a
  `cond`. Keys past kv_len (zeros from the masked loads) are masked like invisible ones.
  q_seg [rows], kv_seg [block_kv]: segment ids, or None. alibi: an `alibi_term`, or None.
  mod_at: (global batch row, global query head, operand views) when the request has a mask_mod or
  score_mod (`mod_at`).
  Returns (s2, chain): s2 = cap(score_mod(logits)) * log2(e) in float32; chain (``grad``) takes the
  gradient of the capped logits to that of the raw ones (the softcap's 1 - tanh^2, then score_mod's
  derivative by `jax.vjp`), or None (identity); with ``operand_grads`` it returns (that gradient, the
  reads' cotangents: `kernel_mods.score_vjp`) for `kernel_mods.accumulate`.
  """
  r = st.request
  raw = dot(st, q, k, ((1,), (1,)))
  q_pos, kv_pos, kv_local = tile
  block_kv = kv_local.shape[0]
  idx = None
  if mod_at is not None:
    batch, head, operands = mod_at
    idx = mods.Indices(batch, head, q_pos, kv_pos)  # all global
  chain = None
  if r.softcap is None and r.score_mod is None:
    s2 = raw * (r.scale * LOG2E)
    if alibi is not None:
      s2 = s2 + alibi * LOG2E
  else:
    x = raw * r.scale
    if alibi is not None:
      x = x + alibi
    score_vjp = None
    if r.score_mod is not None:
      x, score_vjp = kernel_mods.score_mod_vjp(r.score_mod, x, idx, operands, grad, operand_grads)
    if r.softcap is None:
      s2 = x * LOG2E
      chain = score_vjp
    else:
      tanh_t = jnp.tanh(x * (1.0 / r.softcap))
      s2 = tanh_t * (r.softcap * LOG2E)
      if grad:
        def chain(ds):
          ds = ds * (1.0 - tanh_t * tanh_t)
          return ds if score_vjp is None else score_vjp(ds)
  if masked is False or not needs_mask(r, block_kv):
    return s2, chain

  def element_mask(s2):
    ok = mask_rules.visible(q_pos, kv_pos, r.spec,
                            None if q_seg is None else q_seg[:, None],
                       None if kv_seg is None else kv_seg[None, :])
    if r.mask_mod is not None:
      ok = ok & mods.mask(r.mask_mod, idx, operands)
    if r.kv_len % block_kv:
      ok = ok & (kv_local < r.kv_len)[None, :]
    return jnp.where(ok, s2, -jnp.inf)

  if masked is True:
    return element_mask(s2), chain
  return lax.cond(masked != 0, element_mask, lambda s2: s2, s2), chain


def grad_logits(st: GpuCall, p, dp, delta, chain, grads=None):
  """dS for one tile: P * (dP - D), through the softcap's tanh and score_mod when there are some.
  ``grads``: a dQ program's operand-gradient accumulator, or None; with one, (dS, the accumulator
  plus this tile's reads' cotangents)."""
  ds = p * (dp - delta[:, None])
  if grads is None:
    return ds if chain is None else chain(ds)
  ds, reads = chain(ds)
  slots = jnp.arange(grads.shape[0], dtype=jnp.int32)
  return ds, kernel_mods.accumulate(grads, slots, st.grad_layout, reads, _tile_sum)


def _tile_sum(x):
  """A tile's sum as a scalar: one axis at a time, as Triton reduces."""
  return jnp.sum(jnp.sum(x, axis=1), axis=0)


def softmax_update(m, s2):
  """One online-softmax step (forward and decode kernels): (m_new, p, rescale) for the base-2 logits
  s2 [rows, block_kv] of a tile against the running row max m [rows]. A row that has seen only masked
  keys keeps m = -inf; subtracting 0 instead keeps exp2 at exp2(-inf) = 0 rather than exp2(nan)."""
  m_new = jnp.maximum(m, s2.max(axis=-1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  rescale = jnp.exp2(m - m_safe)
  p = jnp.exp2(s2 - m_safe[:, None])
  return m_new, p, rescale


def walk(st: GpuCall, offsets_ref, table, own_block, own_size, own_len, other_size, other_len,
         by_q: bool, visit, carry, map_row=0):
  """Run `visit(other_block, carry, masked)` over the blocks the own block sees.

  by_q: the own block is a q block walking kv blocks (forward, dQ); else a kv block walking q
  blocks (dK/dV). Without segment ids the range is arithmetic (`block_info.visible_block_range`); with
  them the block map's list (`table`: index, count, full refs) drives one loop and its `full` flag.
  """
  if st.arithmetic:
    q_off, kv_off = scalar_table.offsets(offsets_ref)
    own_offset, other_offset = (q_off, kv_off) if by_q else (kv_off, q_off)
    first = own_offset + own_block * own_size
    last = own_offset + jnp.minimum(own_block * own_size + own_size, own_len) - 1
    band = mask_rules.band(st.request.spec, transpose=not by_q)
    ranges = block_info.visible_block_range(first, last, band, other_offset, other_len, other_size)
    return visit_ranges(ranges, visit, carry)
  index_ref, count_ref, full_ref = table

  def step(i, c):
    masked = 1 - full_ref[map_row, own_block, i]
    return visit(index_ref[map_row, own_block, i], c, masked)

  return lax.fori_loop(0, count_ref[map_row, own_block], step, carry)


def split_refs(st: GpuCall, refs):
  """(offsets, block map table or None, (q_seg, kv_seg) or None, the rest) of a kernel's refs."""
  offsets_ref, refs = refs[0], refs[1:]
  table = None
  if not st.arithmetic:
    table, refs = refs[:3], refs[3:]
  segs = None
  if st.has_segments:
    segs, refs = refs[:2], refs[2:]
  n = len(st.operands)
  return offsets_ref, table, segs, (st.mod_views(refs[:n]), *refs[n:])


def visible_pairs(st: GpuCall, batch: int) -> int:
  """(query, key) pairs the mask leaves visible, over batch and heads, for the cost estimates.

  Causal and window are counted exactly (at offset 0; the offsets may be traced),
  segment ids not at all: an upper bound.
  """
  r = st.request
  return batch * r.num_heads * mask_rules.count_visible(r.q_len, r.kv_len, r.spec)


def mask_inputs(st: GpuCall, offsets, q_seg, kv_seg, ops, *, by_q: bool, block_q: int, block_kv: int,
                heads: int):
  """Inputs and BlockSpecs shared by the three kernels: offsets, block lists, segment ids.

  Without segment ids (or global tokens) only the offsets: the kernels compute their ranges.
  Otherwise the block map's lists, for tiles (block_q, block_kv): by_q: programs own a q block
  and walk its kv blocks (forward, dQ); else they own a kv block and walk its q blocks (dK/dV).
  Each list comes with the `full` flag of every listed block, in list order. The lists and
  offsets are small and read as scalars (Triton has no scalar prefetch), so they are passed whole.
  """
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731
  arrays = [offsets]
  r = st.request
  ops, prebuilt = ops  # flat operands; a block_mask's tile flags or None
  if not st.arithmetic:
    tiles = None
    if r.mask_mod is not None:  # the tiles it leaves empty leave the lists; full ones skip the mask
      nq, nk = -(-r.q_len // block_q), -(-r.kv_len // block_kv)
      if prebuilt is not None and (block_q, block_kv) == r.block_mask_tiles:  # built once, every layer
        shows, fills = prebuilt
      else:
        shows, fills = kernel_mods.request_tile_flags(
            r, kernel_mods.unflatten(ops, st.operands), scalar_table.offsets(offsets),
            scalar_table.origin(offsets), block_q, block_kv)  # the table's global rows and heads
      tiles = tuple(jnp.broadcast_to(x, (r.batch, nq, nk)) for x in (shows, fills))  # a map row per row
    bmap = block_info.block_map(r.q_len, r.kv_len, block_q, block_kv, r.spec, q_seg, kv_seg,
                                *scalar_table.offsets(offsets), tiles=tiles)
    if by_q:
      index, count, full = bmap.kv_index, bmap.kv_count, bmap.full
    else:
      index, count, full = bmap.q_index, bmap.q_count, jnp.swapaxes(bmap.full, 1, 2)
    full = jnp.take_along_axis(full, index, axis=-1)
    # Full blocks first, then the others, each in ascending order: the order `visit_ranges` walks an
    # arithmetic range in (interior, then edges), so a mask_mod equal to a built-in rule sums the online
    # softmax in the same order and gives the same bits.
    listed = jnp.arange(index.shape[-1]) < count[..., None]
    order = jnp.argsort(jnp.where(listed, jnp.where(full, 0, 1), 2), axis=-1, stable=True)
    index, full = (jnp.take_along_axis(x, order, axis=-1) for x in (index, full))
    arrays += [index, count, full.astype(jnp.int32)]
  specs = [whole(x) for x in arrays]
  if st.has_segments:
    arrays += [q_seg, kv_seg]
    q_ext, kv_ext = round_up(st.request.q_len, block_q), round_up(st.request.kv_len, block_kv)
    if by_q:  # program (q block, b * heads): its q ids, the whole kv row
      specs += [pl.BlockSpec((None, block_q), lambda i, j: (j // heads, i)),
                pl.BlockSpec((None, kv_ext), lambda i, j: (j // heads, 0))]
    else:  # program (kv block, b * kv heads): the whole q row, its kv ids
      specs += [pl.BlockSpec((None, q_ext), lambda i, j: (j // heads, 0)),
                pl.BlockSpec((None, block_kv), lambda i, j: (j // heads, i))]
  # Mod operands, flat and whole (a power of two long, as Triton's blocks must be).
  padded = [jnp.pad(x, (0, pl.next_power_of_2(x.size) - x.size)) for x in ops]
  return arrays + padded, specs + [whole(x) for x in padded]
