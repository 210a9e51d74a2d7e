"""Block and tile information: which tiles of the (query, key) grid hold a visible pair.

The rules themselves (which query sees which key) are in `mask_rules`; a user's `mask_mod` is called
through `mods`. This module turns both into what block-sparse impls and kernels read: the block map of
the built-in rules (`block_map`, `block_visibility`, `block_segments`, `tile_visibility` for kernels that
decide per grid step on scalars, `visible_block_range` for kernels that compute ranges arithmetically),
a mask_mod's tile flags (`tile_flags`), and `BlockMask`, those flags built once for many layers.

The answer is conservative (it may say "visible" for a block with no visible pair, never the
reverse), and exact for causal, windows and contiguous packed documents, padded with id 0 or not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract.mask_rules import MaskSpec
from flash_layers.contract.mods import Indices, mask


class BlockMap(NamedTuple):
  """Which (q block, kv block) tiles hold at least one visible pair.

  Shapes use ``b = batch`` when segment ids are given, else ``b = 1``.

  visible:   bool  [b, num_q_blocks, num_kv_blocks]
  full:      bool  [b, num_q_blocks, num_kv_blocks]  every pair visible: no element mask needed
  kv_index:  int32 [b, num_q_blocks, num_kv_blocks]  per q block, the visible kv blocks first (in
             order), then the last visible one repeated, so a kernel that clamps its index_map
             to it re-uses the tile already in VMEM and issues no new DMA for skipped steps
  kv_count:  int32 [b, num_q_blocks]                 how many kv blocks the q block visits
  q_index / q_count: the same, transposed (per kv block, the q blocks that see it); the
             dK/dV backward kernels iterate these.
  """

  visible: jax.Array
  full: jax.Array
  kv_index: jax.Array
  kv_count: jax.Array
  q_index: jax.Array
  q_count: jax.Array

  @property
  def blocks_visited(self):
    return jnp.sum(self.visible)

  @property
  def blocks_total(self) -> int:
    return int(self.visible.size)


def _block_ranges(seg, length: int, block: int):
  """Per block: (min, max) of the segment ids of the real (unpadded) positions."""
  num_blocks = -(-length // block)
  pad = num_blocks * block - length
  big = jnp.iinfo(jnp.int32).max
  small = jnp.iinfo(jnp.int32).min
  seg = seg.astype(jnp.int32)
  lo = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=big).reshape(seg.shape[0], num_blocks, block)
  hi = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=small).reshape(seg.shape[0], num_blocks, block)
  return lo.min(-1), hi.max(-1)


class BlockSegments(NamedTuple):
  """What the tile test needs to know of one side's segment ids, per block ``[b, num_blocks]``.

  lo, hi: the range of the (decoded) nonzero segment ids of its real positions (lo > hi when
    there are none).
  zero: bit 0 set when some position has id 0, bit 1 when all have. Id 0 is an ordinary id in
    the contract, but it is what callers pad with, after the documents: folded into one range,
    a block holding the last document and padding would span every id and look visible to
    every block.
  is_global: bit 0 set when some position is a global token (the flag of `encode_global`), bit
    1 when all are; 0 without global tokens.
  Four int32 words per block: the TPU kernels read them from SMEM.
  """

  lo: jax.Array
  hi: jax.Array
  zero: jax.Array
  is_global: jax.Array


def _any_all(flag, length: int, block: int):
  """Bit 0: some real position of the block has the 0/1 flag set; bit 1: all do."""
  lo, hi = _block_ranges(flag, length, block)
  return hi + 2 * lo


def block_segments(segment_ids, length: int, block: int, spec: MaskSpec) -> BlockSegments:
  """`BlockSegments` of ``segment_ids [b, length]`` cut into blocks (O(length) work and memory)."""
  seg = segment_ids.astype(jnp.int32)
  if spec.global_tokens and spec.window is not None:
    flag, seg = seg & 1, seg >> 1
    is_global = _any_all(flag, length, block)
  else:
    is_global = jnp.zeros((seg.shape[0], -(-length // block)), jnp.int32)
  is_zero = seg == 0
  big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
  lo = _block_ranges(jnp.where(is_zero, big, seg), length, block)[0]
  hi = _block_ranges(jnp.where(is_zero, small, seg), length, block)[1]
  return BlockSegments(lo, hi, _any_all(is_zero.astype(jnp.int32), length, block), is_global)


def tile_visibility(q_first, q_last, kv_first, kv_last, spec: MaskSpec,
                    q_info: BlockSegments | None = None, kv_info: BlockSegments | None = None):
  """(visible, full) of the tile holding queries at global positions ``[q_first, q_last]`` and keys
  at ``[kv_first, kv_last]``: may any pair see each other, do all pairs?

  The arguments may be NumPy or JAX arrays that broadcast together, or scalars: `block_map` calls
  it on whole [q blocks, kv blocks] grids, the TPU kernels on the SMEM scalars of one grid step.
  Only operators are used (no jnp functions), so it runs in either world. Conservative: "visible"
  may hold for a tile with no visible pair (non-contiguous segment ids), never the reverse.
  """
  qs, qe, ks, ke = q_first, q_last, kv_first, kv_last
  vis = full = True
  if spec.causal:
    vis = vis & (ks <= qe)
    full = full & (ke <= qs)
  if spec.window is not None:
    left, right = spec.window
    in_band = (ks <= qe + right) & (ke >= qs - left)
    band_full = (ks >= qe - left) & (ke <= qs + right)
    g = spec.global_tokens
    if g and q_info is None:  # global by position
      in_band = in_band | (qs < g) | (ks < g)
      band_full = band_full | (qe < g) | (ke < g)
    elif g:  # global by document position: the flags of the encoded segment ids
      in_band = in_band | ((q_info.is_global & 1) > 0) | ((kv_info.is_global & 1) > 0)
      band_full = band_full | ((q_info.is_global & 2) > 0) | ((kv_info.is_global & 2) > 0)
    vis = vis & in_band
    full = full & band_full
  if q_info is not None:
    ids_overlap = (q_info.lo <= kv_info.hi) & (kv_info.lo <= q_info.hi)  # false when a side has none
    vis = vis & (ids_overlap | (((q_info.zero & kv_info.zero) & 1) > 0))
    one_id = ((q_info.lo == q_info.hi) & (kv_info.lo == kv_info.hi) & (q_info.lo == kv_info.lo)
              & (q_info.zero == 0) & (kv_info.zero == 0))
    full = full & (one_id | (((q_info.zero & kv_info.zero) & 2) > 0))
  return vis, full


def _compact(vis):
  """Per row of ``vis [b, n, m]``: indices of True entries first (in order), then the last one repeated."""
  m = vis.shape[-1]
  idx = jnp.arange(m, dtype=jnp.int32)
  # Stable sort key: visible blocks keep their order and come before invisible ones.
  key = jnp.where(vis, idx, m + idx)
  order = jnp.argsort(key, axis=-1).astype(jnp.int32)
  count = vis.sum(-1).astype(jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  pos = jnp.arange(m, dtype=jnp.int32)
  order = jnp.where(pos < count[..., None], order, last)
  return order, count


def block_bounds(length: int, block: int, offset=0, xp=jnp):
  """Global (first, last) position of the real positions of each block."""
  index = xp.arange(-(-length // block), dtype=xp.int32)
  return offset + index * block, offset + xp.minimum((index + 1) * block, length) - 1


def block_visibility(q_len: int, kv_len: int, block_q: int, block_kv: int, spec: MaskSpec,
                     q_segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0, xp=jnp):
  """(visible, full) bool ``[b, q blocks, kv blocks]`` (b = batch with segment ids, else 1).

  ``xp=numpy`` computes it while tracing (no segment ids, static offsets), so a caller can size a
  grid from it.
  """
  qs, qe = block_bounds(q_len, block_q, q_offset, xp)
  ks, ke = block_bounds(kv_len, block_kv, kv_offset, xp)
  q_info = kv_info = None
  if q_segment_ids is not None:
    q_info = BlockSegments(*(x[:, :, None] for x in block_segments(q_segment_ids, q_len, block_q, spec)))
    kv_info = BlockSegments(*(x[:, None, :] for x in block_segments(kv_segment_ids, kv_len, block_kv, spec)))
  vis, full = tile_visibility(qs[:, None], qe[:, None], ks[None, :], ke[None, :], spec, q_info, kv_info)
  shape = (1 if q_info is None else q_segment_ids.shape[0], qs.shape[0], ks.shape[0])
  vis = xp.broadcast_to(vis, shape)
  # A block holding padded tail positions needs the element mask for the tail.
  tail = ((q_len % block_q != 0) & (xp.arange(shape[1]) == shape[1] - 1))[:, None] | (
      (kv_len % block_kv != 0) & (xp.arange(shape[2]) == shape[2] - 1))[None, :]
  full = xp.broadcast_to(full, shape) & vis & ~tail[None]
  return vis, full


def block_map(q_len: int, kv_len: int, block_q: int, block_kv: int, spec: MaskSpec,
              q_segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0,
              tiles=None) -> BlockMap:
  """The shared block-sparsity map (see module docstring). Works on traced inputs. `tiles`: a
  mask_mod's (any, all) tile flags [b|1, nq, nk] (`block_info.tile_flags`), intersected with the rules'."""
  vis, full = block_visibility(q_len, kv_len, block_q, block_kv, spec, q_segment_ids,
                               kv_segment_ids, q_offset, kv_offset)
  if tiles is not None:
    vis, full = vis & tiles[0], full & tiles[1]
  kv_index, kv_count = _compact(vis)
  q_index, q_count = _compact(jnp.swapaxes(vis, 1, 2))
  return BlockMap(vis, full, kv_index, kv_count, q_index, q_count)


def block_stats(batch: int, num_heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int,
                spec: MaskSpec, q_segment_ids=None, kv_segment_ids=None, q_offset=0,
                kv_offset=0, tiles=None) -> tuple[int, int] | None:
  """(blocks visited, blocks total) summed over batch and heads, for `explain()`.

  None when segment ids or offsets are traced or abstract (`jax.ShapeDtypeStruct`: the count is
  then not known before running). `tiles`: a callable returning a mask_mod's tile flags
  (`block_map`), called only when everything else is concrete.
  """
  unknown = (jax.core.Tracer, jax.ShapeDtypeStruct)
  if any(isinstance(x, unknown) for x in (q_segment_ids, kv_segment_ids, q_offset, kv_offset)):
    return None
  bm = block_map(q_len, kv_len, block_q, block_kv, spec, q_segment_ids, kv_segment_ids,
                 q_offset, kv_offset, tiles=None if tiles is None else tiles())
  # Without segment ids the map has batch 1 and holds for every batch row.
  per_row = batch if bm.visible.shape[0] == 1 else 1
  visited = int(bm.blocks_visited) * per_row * num_heads
  return visited, batch * num_heads * bm.visible.shape[1] * bm.visible.shape[2]


def visible_block_range(first, last, band: tuple[int | None, int | None], offset, length: int,
                        block: int, xp=jnp):
  """The other side's blocks seen by a block whose real positions are [first, last] (global).

  The other side has `length` positions from global position `offset`, in `block`-sized
  blocks; a pair is visible when (other - own position) lies in `band`. Returns (lo, full_lo,
  full_hi, hi): blocks [lo, hi) hold a visible pair (exactly the tiles `block_map` marks
  visible); [full_lo, full_hi) within it are the interior blocks, whose every position is real
  and seen by every own position, so they need no element mask. The rest are the edges.
  Element-wise: scalars in the GPU kernels (without segment ids or global tokens: then the
  visible set is one interval), arrays of blocks with xp=numpy in the tests.
  """
  dmin, dmax = band
  # Local index intervals of the other side, clamped to [0, length - 1] (empty when end < start).
  seen_start = 0 if dmin is None else xp.clip(first + dmin - offset, 0, length)
  seen_end = length - 1 if dmax is None else xp.clip(last + dmax - offset, -1, length - 1)
  all_start = 0 if dmin is None else xp.clip(last + dmin - offset, 0, length)
  all_end = length - 1 if dmax is None else xp.clip(first + dmax - offset, -1, length - 1)
  # 0 blocks when nothing is seen. (A multiply: Pallas Triton lowers a scalar `where` with a
  # literal branch to an i1 value.)
  seen = (seen_start <= seen_end) * 1
  lo = seen * (seen_start // block)
  hi = seen * (seen_end // block + 1)
  # Interior: whole blocks inside [all_start, all_end]; all_end <= length - 1 leaves out a ragged
  # last block, whose positions past the length must be masked.
  full_lo = xp.clip((all_start + block - 1) // block, lo, hi)
  full_hi = xp.clip((all_end + 1) // block, full_lo, hi)
  return tuple(xp.asarray(x, xp.int32) for x in (lo, full_lo, full_hi, hi))


def tile_flags(mask_mod: Callable, operands: tuple, *, batch: int, heads, batch_offset, q_offset,
               kv_offset, q_len: int, kv_len: int, block_q: int, block_kv: int, num_q_blocks: int,
               num_kv_blocks: int) -> tuple[jax.Array, jax.Array]:
  """(any, all): bool [b|1, nq, nk] (1: the mask does not read the row). Does the tile hold a pair
  mask_mod shows (for some head in ``heads``)? Are all its pairs shown (for every head, none of them
  padding)?

  Evaluated one q block at a time (`lax.map`), so the memory is one block's [b, h, block_q, kv]
  verdicts, never [q_len, kv_len]. Positions past q_len/kv_len are padding: never shown.
  """
  rows = batch_offset + jnp.arange(batch, dtype=jnp.int32)
  kv_local = jnp.arange(num_kv_blocks * block_kv, dtype=jnp.int32)
  heads = jnp.asarray(heads, jnp.int32)

  def one(qb):
    q_local = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
    idx = Indices(rows.reshape(-1, 1, 1, 1), heads.reshape(1, -1, 1, 1),
                  (q_offset + q_local)[:, None], (kv_offset + kv_local)[None, :])
    shown = mask(mask_mod, idx, operands)  # [b|1, h|1, bq|1, kv|1]: reduced as it comes, not broadcast
    shown = shown & (q_local < q_len)[:, None] & (kv_local < kv_len)[None, :]
    rows_, heads_ = shown.shape[0], shown.shape[1]
    shown = shown.reshape(rows_, heads_, block_q, num_kv_blocks, block_kv)
    return shown.any((1, 2, 4)), shown.all((1, 2, 4))  # [b|1, nk]

  any_, all_ = jax.lax.map(one, jnp.arange(num_q_blocks, dtype=jnp.int32))  # [nq, b|1, nk]
  return jnp.swapaxes(any_, 0, 1), jnp.swapaxes(all_, 0, 1)  # [b|1, nq, nk]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """A mask_mod evaluated on a tile grid once, for every layer of a model to reuse (`block_mask`).

  ``any`` / ``all``: bool [b|1, nq, nk], the tiles holding a pair the mask shows / holding only such
  pairs (over the heads it was built for). Memory: 2 * nq * nk bytes per row (1 row when the mask
  does not read the row): 32 KiB for a 32k x 32k grid of 512 x 512 tiles.
  """

  any: jax.Array
  all: jax.Array
  mask_mod: Any = dataclasses.field(metadata={"static": True})
  q_len: int = dataclasses.field(metadata={"static": True})
  kv_len: int = dataclasses.field(metadata={"static": True})
  block_q: int = dataclasses.field(metadata={"static": True})
  block_kv: int = dataclasses.field(metadata={"static": True})

  @property
  def tiles_visited(self) -> jax.Array:
    return self.any.sum()
