"""The TPU kernels' grids and block plans.

Grid: only the tiles that matter. Each q block sees a contiguous *range* of kv blocks under causal
masks, windows and packed documents; the forward kernel's grid is ``(batch, heads, rows, steps)``
(heads: per q tile, see `tpu_fwd.py`) where row r holds q block r and then q block n - 1 - r, so a
causal triangle folds into a rectangle of exactly the visible tiles (n/2 rows of n + 1 steps).
``steps`` is the widest row: a Python int when the mask is static, a dynamic grid bound computed
from the segment ids otherwise (16 packed documents of 2,048 tokens at 32k: 256 steps for 256
visible tiles, where a full grid would run 4,096). The first three axes are "parallel" (Mosaic may
split them across TensorCores); the last carries the online softmax ("arbitrary"), its statistics in
VMEM scratch.

The plan is linear in the length: per (batch row if segment ids, outer block) its range
(first block, count), int32, scalar-prefetched to SMEM; the BlockSpec index maps read it, so a
step past a row's end re-names the previous tile (no DMA) and ``pl.when`` skips its compute.
Whether a tile is visible, and fully visible (no element mask), is decided per step by
`block_info.tile_visibility` on SMEM scalars: the offsets and, with segment ids, each block's segment
range and global-token flags. 262,144 tokens compile on one v5p chip; 1,048,576 over a v5p:2x2x2
ring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers.contract import block_info
from flash_layers.impls.flash_pallas import kernel_mods, scalar_table, tpu_config
from flash_layers.impls.flash_pallas.tpu_common import Step, TpuCall, compiler_params, interpret_arg


class _Where(NamedTuple):
  """Where one grid step is (computed from the grid indices and the plan, in SMEM)."""

  batch: jax.Array
  q_head: jax.Array
  kv_head: jax.Array
  q_block: jax.Array
  kv_block: jax.Array
  in_range: jax.Array  # inside the visible range of its outer block (else a padding step)
  first: jax.Array     # first step of its outer block
  switch: jax.Array    # last step of the row's first outer block, when a second one follows


@dataclasses.dataclass(frozen=True)
class Grid:
  """One kernel's grid: only the tiles in each block's visible range, two blocks per row.

  q-major (forward, dQ): (batch, heads / tile_heads, rows, steps). The *outer* blocks are q
    blocks; each has a range of visible kv blocks, [lo, lo + count), from the mask
    (`block_info.block_visibility`). A q tile holds ``tile_heads`` consecutive query heads of one GQA
    group (forward and dQ with token-major operands; otherwise 1), which share each K/V tile.
  kv-major (dK/dV): (batch, kv heads, rows, steps, heads of the group): outer blocks are kv
    blocks, ranges of q blocks; every query head of the group is accumulated into the same
    resident dK/dV tile (K/V are never repeated for GQA).

  Row r holds outer block r and then outer block n - 1 - r, so a causal triangle becomes a
  rectangle: q block i sees i + 1 kv blocks and q block n - 1 - i sees n - i, n + 1 steps per
  row for every row, the grid is exactly the visible tiles. ``steps`` is the widest row (a
  Python int when the mask is known while tracing; otherwise a traced scalar: a dynamic grid
  bound, computed from the segment ids). Steps past a row's end, and tiles inside a range that
  hold no visible pair, repeat the previous block index (no DMA) and skip the compute.

  The plan is linear in the length: per (batch row if segment ids, outer block) the pair
  (lo, count), int32, flat in SMEM. Whether a tile is visible, and fully visible (no element
  mask), is decided in the kernel by `block_info.tile_visibility` on SMEM scalars: the offsets, and
  with segment ids each block's segment range and global-token flags (4 words per block).
  The first three grid axes are "parallel"; the rest accumulate in VMEM scratch, "arbitrary".
  """

  kv_major: bool
  has_segments: bool
  token_major: bool
  batch: int
  heads: int
  group: int
  num_q: int
  num_kv: int
  block_q: int
  block_kv: int
  tile_heads: int = 1
  per_row: bool = False  # a plan per batch row (segment ids, or a mask_mod that reads the row)
  plan_words: int = 2  # per outer block: (lo, count), and with a mask_mod its full run (lo, count)

  @property
  def num_outer(self) -> int:
    return self.num_kv if self.kv_major else self.num_q

  @property
  def rows(self) -> int:
    return -(-self.num_outer // 2)

  def shape(self, steps) -> tuple:
    if self.kv_major:
      return (self.batch, self.heads // self.group, self.rows, steps, self.group)
    return (self.batch, self.heads // self.tile_heads, self.rows, steps)

  @property
  def ndim(self) -> int:
    return 5 if self.kv_major else 4

  def locate(self, ids, plan_ref) -> _Where:
    """Where grid point `ids` is. Plain scalar arithmetic: it runs in the index maps too."""
    batch, outer_head, row, step = ids[0], ids[1], ids[2], ids[3]
    base = (batch if self.per_row else 0) * self.num_outer
    a, b = row, self.num_outer - 1 - row  # the row's two outer blocks (one for the middle row)
    has_b = b > a
    w = self.plan_words
    lo_a, count_a = plan_ref[w * (base + a)], plan_ref[w * (base + a) + 1]
    lo_b, count_b = plan_ref[w * (base + b)], plan_ref[w * (base + b) + 1]
    # Every outer block takes at least one step, even with nothing visible: its output (zeros,
    # lse -inf; or zero dK/dV) is written there.
    steps_a = jnp.maximum(count_a, 1)
    on_b = has_b & (step >= steps_a)
    outer = jnp.where(on_b, b, a)
    inner = jnp.where(on_b, lo_b + jnp.minimum(step - steps_a, jnp.maximum(count_b, 1) - 1),
                      lo_a + jnp.minimum(step, steps_a - 1))
    in_range = jnp.where(on_b, step - steps_a < count_b, step < count_a)
    first = (step == 0) | (on_b & (step == steps_a))
    switch = has_b & (step == steps_a - 1)
    if self.kv_major:
      q_head = outer_head * self.group + ids[4]
      return _Where(batch, q_head, outer_head, inner, outer, in_range, first, switch)
    q_head = outer_head * self.tile_heads  # the tile's first query head
    return _Where(batch, q_head, jax.lax.div(q_head, self.group), outer, inner, in_range, first,
                  switch)

  def _spec(self, block_shape, pick):
    def index_map(*args):  # the grid indices, then the scalar-prefetch refs (offsets, plan, tiles)
      w = self.locate(args[:self.ndim], args[self.ndim + 1])
      return pick(w.batch, w.q_head, w.kv_head, w.q_block, w.kv_block)
    return pl.BlockSpec(block_shape, index_map)

  def _tile_of(self, h):  # the q tile's index along the heads (h: its first query head)
    return h if self.tile_heads == 1 else jax.lax.div(h, self.tile_heads)

  def q_tile(self, width):  # q, dO, out, dQ: [b, q_pad, h * width] or [b, h, q_pad, width]
    if self.token_major:  # the (block_q, tile_heads * width) window of the tile's heads
      return self._spec((None, self.block_q, self.tile_heads * width),
                        lambda b, h, kh, qb, kb: (b, qb, self._tile_of(h)))
    return self._spec((None, None, self.block_q, width), lambda b, h, kh, qb, kb: (b, h, qb, 0))

  def q_row(self):  # lse, D: [b, h, 1, q_pad]; [tile_heads, 1, block_q] when a tile has several
    if self.tile_heads > 1:
      return self._spec((None, self.tile_heads, 1, self.block_q),
                        lambda b, h, kh, qb, kb: (b, self._tile_of(h), 0, qb))
    return self._spec((None, None, 1, self.block_q), lambda b, h, kh, qb, kb: (b, h, 0, qb))

  def kv_tile(self, width):  # k, v, dK, dV: [b, kv_pad, kv_heads * width] or [b, kv_heads, kv_pad, width]
    if self.token_major:
      return self._spec((None, self.block_kv, width), lambda b, h, kh, qb, kb: (b, kb, kh))
    return self._spec((None, None, self.block_kv, width), lambda b, h, kh, qb, kb: (b, kh, kb, 0))

  def segment_rows(self):  # q and kv segment ids: [b, 1, len_pad]
    return [self._spec((None, 1, self.block_q), lambda b, h, kh, qb, kb: (b, 0, qb)),
            self._spec((None, 1, self.block_kv), lambda b, h, kh, qb, kb: (b, 0, kb))]

  def _tile_visibility(self, cfg: TpuCall, offsets_ref, plan_ref, tiles_ref, w: _Where):
    """(visible, full) of this step's tile, from SMEM scalars (`block_info.tile_visibility`)."""
    bq, bk = self.block_q, self.block_kv
    offsets = scalar_table.offsets(offsets_ref)
    q_first = offsets.q + w.q_block * bq
    q_last = offsets.q + jnp.minimum(w.q_block * bq + bq, cfg.request.q_len) - 1
    kv_first = offsets.kv + w.kv_block * bk
    kv_last = offsets.kv + jnp.minimum(w.kv_block * bk + bk, cfg.request.kv_len) - 1
    q_info = kv_info = None
    if self.has_segments:  # 4 words per block: segment lo, hi, any global, all global
      at = (w.batch * self.num_q + w.q_block) * 4
      q_info = block_info.BlockSegments(*(tiles_ref[at + i] for i in range(4)))
      at = (self.batch * self.num_q + w.batch * self.num_kv + w.kv_block) * 4
      kv_info = block_info.BlockSegments(*(tiles_ref[at + i] for i in range(4)))
    visible, full = block_info.tile_visibility(q_first, q_last, kv_first, kv_last, cfg.request.spec, q_info,
                                               kv_info)
    if self.plan_words == 4:  # a mask_mod: full only inside the outer block's run of full tiles
      outer, inner = (w.kv_block, w.q_block) if self.kv_major else (w.q_block, w.kv_block)
      at = 4 * ((w.batch if self.per_row else 0) * self.num_outer + outer)
      run_lo, run_count = plan_ref[at + 2], plan_ref[at + 3]
      full = full & (inner >= run_lo) & (inner < run_lo + run_count)
    # A tile holding padded tail positions needs the element mask for the tail.
    if cfg.request.q_len % bq:
      full = full & (w.q_block != self.num_q - 1)
    if cfg.request.kv_len % bk:
      full = full & (w.kv_block != self.num_kv - 1)
    return visible, full

  def step(self, cfg: TpuCall, offsets_ref, plan_ref, tiles_ref) -> Step:
    """Inside a kernel: where this grid step is and what it does."""
    ids = [pl.program_id(axis) for axis in range(self.ndim)]
    w = self.locate(ids, plan_ref)
    visible, full = self._tile_visibility(cfg, offsets_ref, plan_ref, tiles_ref, w)
    first = w.first
    last = w.switch | (ids[3] == pl.num_programs(3) - 1)
    if self.kv_major:  # the group's heads are the innermost axis
      first = first & (ids[4] == 0)
      last = last & (ids[4] == self.group - 1)
    return Step(w.batch, w.q_head, w.q_block, w.kv_block, full, w.in_range & visible, first, last)


def _row_ranges(visible, xp):
  """Per outer block (the rows of ``visible [b, outer, inner]``): the first visible inner block
  and the length of the range up to the last visible one (0 when none is visible)."""
  n = visible.shape[-1]
  lo = xp.argmax(visible, axis=-1)
  hi = n - 1 - xp.argmax(visible[..., ::-1], axis=-1)
  count = xp.where(visible.any(axis=-1), hi - lo + 1, 0)
  return lo.astype(xp.int32), count.astype(xp.int32)


def _row_steps(count, xp):
  """Grid steps per row: outer blocks r and n - 1 - r paired (at least one step each)."""
  n = count.shape[-1]
  steps = xp.maximum(count, 1)
  rows = -(-n // 2)
  paired = xp.arange(rows) < n - 1 - xp.arange(rows)
  return steps[..., :rows] + xp.where(paired, steps[..., ::-1][..., :rows], 0)


def block_plan(cfg: TpuCall, blocks, q_seg, kv_seg, offsets, *, kv_major: bool, operands=(), prebuilt=None):
  """(steps per row, flat plan table, whether it has a row per batch row) for one kernel's tiles.

  With no segment ids, no mask_mod and offsets known while tracing, the plan is NumPy and the grid
  is static; otherwise plain JAX, and the number of steps a traced scalar. With a mask_mod
  (`operands`: its mod_operands) the tiles it leaves empty leave the ranges, and each outer block
  also records the run of tiles it fills (`_full_runs`): 4 words per outer block.
  """
  block_q, block_kv = blocks
  r = cfg.request
  if not cfg.has_segments and cfg.static_offsets is not None and r.mask_mod is None:
    xp, seg, offs = np, (None, None), cfg.static_offsets
  else:
    xp, seg, offs = jnp, (q_seg, kv_seg), tuple(scalar_table.offsets(offsets))
  visible, full = block_info.block_visibility(r.q_len, r.kv_len, block_q, block_kv, r.spec, *seg, *offs,
                                              xp=xp)
  if r.mask_mod is not None:
    if prebuilt is not None:  # a block_mask's flags, built once for every layer
      shows, fills = prebuilt
    else:
      # On the table's global offsets and origin (the static path above never has a mask_mod).
      shows, fills = kernel_mods.request_tile_flags(r, operands, scalar_table.offsets(offsets),
                                                    scalar_table.origin(offsets), block_q, block_kv)
    visible, full = visible & shows, full & fills
  if kv_major:
    visible, full = xp.swapaxes(visible, 1, 2), xp.swapaxes(full, 1, 2)
  lo, count = _row_ranges(visible, xp)
  words = [lo, count]
  if r.mask_mod is not None:
    words += list(_full_runs(full))
  plan = xp.stack(words, axis=-1).reshape(-1).astype(xp.int32)
  return _row_steps(count, xp), plan, visible.shape[0] > 1


def _full_runs(full):
  """Per outer block (rows of ``full [b, outer, inner]``): (first full inner block, length of the run of
  full blocks from it). The kernels skip the element mask inside that run only: exact for the masks whose
  full tiles per block are contiguous (causal, windows, prefix-LM, chunked causal), a subset otherwise."""
  n = full.shape[-1]
  first = jnp.argmax(full, axis=-1)
  after = jnp.arange(n) >= first[..., None]
  run = after & (jnp.cumsum(after & ~full, axis=-1) == 0)
  return first.astype(jnp.int32), jnp.where(full.any(axis=-1), run.sum(-1), 0).astype(jnp.int32)


def kernel_grid(cfg: TpuCall, blocks, q, k, q_seg, kv_seg, offsets, mod_inputs=((), None), *,
                kv_major: bool, tile_heads: int = 1):
  """The grid of one kernel, its number of steps per row and its SMEM tables (plan, tiles, then the
  flat mod operands). `mod_inputs`: (flat operands, a block_mask's tile flags or None)."""
  block_q, block_kv = blocks
  ops, prebuilt = mod_inputs
  if prebuilt is not None and blocks != cfg.request.block_mask_tiles:
    prebuilt = None  # tiles of their own (block_sizes given): the flags are built for them
  row_steps, plan, per_row = block_plan(cfg, blocks, q_seg, kv_seg, offsets, kv_major=kv_major,
                                        operands=kernel_mods.unflatten(ops, cfg.operands), prebuilt=prebuilt)
  steps = row_steps.max()
  steps = int(steps) if not isinstance(steps, jax.core.Tracer) else steps.astype(jnp.int32)
  r = cfg.request
  if cfg.has_segments:
    tiles = jnp.concatenate([
        jnp.stack(block_info.block_segments(q_seg, r.q_len, block_q, r.spec), -1).reshape(-1),
        jnp.stack(block_info.block_segments(kv_seg, r.kv_len, block_kv, r.spec), -1).reshape(-1)])
  else:
    tiles = jnp.zeros((1,), jnp.int32)
  grid = Grid(kv_major, cfg.has_segments, cfg.token_major, q.shape[0], r.num_heads,
              r.num_heads // r.num_kv_heads, -(-r.q_len // block_q), -(-r.kv_len // block_kv),
               block_q, block_kv, tile_heads, per_row=bool(per_row),
               plan_words=4 if r.mask_mod is not None else 2)
  return grid, steps, (jnp.asarray(plan), tiles.astype(jnp.int32), *ops)


def call_kernel(kernel, name: str, cfg: TpuCall, grid: Grid, steps, tables, inputs, in_specs,
                out_shape, out_specs, scratch, cost, aliases=None):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, grid=grid),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(tables), grid=grid.shape(steps), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, compiler_params=compiler_params(
          ("parallel",) * 3 + ("arbitrary",) * (grid.ndim - 3),
          tpu_config.vmem_limit(cfg.request.head_dim, cfg.request.head_dim_v, grid.block_q,
                                grid.block_kv, jnp.dtype(inputs[0].dtype).itemsize,
                                grid.tile_heads)),
      cost_estimate=cost, interpret=interpret_arg(cfg.interpret), name=name,
      input_output_aliases={len(tables) + i: o for i, o in (aliases or {}).items()},
  )(*tables, *inputs)


def segment_rows(seg, padded_len):
  """Segment ids [b, len] -> [b, 1, len_pad] rows (tiles of (1, block) in VMEM)."""
  return jnp.pad(seg, ((0, 0), (0, padded_len - seg.shape[1])))[:, None, :]
