"""flash_pallas on TPU: our own Mosaic flash-attention kernels, forward and backward, and their
grid plans. The tile sizes (per generation, with their reasons), VMEM budgets, the GQA tile rule
and the autotuning candidates are data and heuristics in `tpu_config.py`.

Tiles. ``len`` is padded to a multiple of the forward and backward block sizes; padded keys and
queries are masked by position. Tiles are ``(block, head_dim)`` with blocks multiples of 128,
so they respect the TPU's (8 sublanes, 128 lanes) tiling. A tile spans the whole head_dim, so
any head_dim is legal; one that is not a multiple of 128 (BERT's 32 and 64) is padded to 128
lanes inside VMEM and the vregs by Mosaic, not in HBM: no zero columns are stored, copied or
re-read with every K/V block. (Compiled for v4, v5e, v5p and v6e with head_dim 17, 32, 64, 80,
128, 200 and 256.)

Grid: only the tiles that matter. Each q block sees a contiguous *range* of kv blocks under
causal masks, windows and packed documents; the forward kernel's grid is ``(batch, heads, rows,
steps)`` (heads: per q tile, see Inner loops) where row r holds q block r and then q block
n - 1 - r, so a causal triangle folds into a rectangle of exactly the visible tiles (n/2 rows
of n + 1 steps). ``steps`` is the widest row:
a Python int when the mask is static, a dynamic grid bound computed from the segment ids
otherwise (16 packed documents of 2,048 tokens at 32k: 256 steps for 256 visible tiles, where a
full grid would run 4,096). The first three axes are "parallel" (Mosaic may split them across
TensorCores); the last carries the online softmax ("arbitrary"), its statistics in VMEM scratch.

The plan is linear in the length: per (batch row if segment ids, outer block) its range
(first block, count), int32, scalar-prefetched to SMEM; the BlockSpec index maps read it, so a
step past a row's end re-names the previous tile (no DMA) and ``pl.when`` skips its compute.
Whether a tile is visible, and fully visible (no element mask), is decided per step by
`block_info.tile_visibility` on SMEM scalars: the offsets and, with segment ids, each block's segment
range and global-token flags. 262,144 tokens compile on one v5p chip; 1,048,576 over a v5p:2x2x2
ring.

Layout: with head_dim (and head_dim_v) a multiple of 128, q, k, v, the output, dO and the
gradients stay token-major ``[b, len, heads * dim]`` (the caller's layout reshaped) and a tile is
the ``(block, dim)`` window at column ``head * dim``; otherwise head-major copies
``[b, heads, len, dim]`` are made, a layout Mosaic can tile for any dim.

Inner loops: the q tile is multiplied once per q block, when its first step copies it to a VMEM
scratch, by scale * log2 e (with a softcap by scale / softcap, the tanh's natural units; the cap
then multiplies by softcap * log2 e), so the logits leave the dot in base 2 and no [bq, bkv]
tile is scaled; ALiBi's slope takes the same unit. The online softmax and the backward's P use
exp2; lse stays natural at the interface (the backward converts it once per row). bfloat16 q is
rounded to bfloat16 again after scaling, as in JAX's splash kernels. With token-major operands and
GQA, one forward program and one dQ program serve up to 8 query heads of a group: the q tile (and
dO, dQ) is the (block, heads * head_dim) window of their columns, lse and D rows are (heads, 1,
block), each K/V tile is fetched once for all of them (v5e, [1, 8192, 8, 128] bf16 q on 2 kv
heads, estimated HBM reads: forward 544 -> 160 MiB, dQ 560.5 -> 176.5 MiB), a loop runs the heads
over per-head scratch, and if the group's tiles would not fit VMEM the forward halves block_q,
the dQ kernel (whose block_q_bwd the dK/dV kernel shares) takes fewer heads.

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

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers import lowering
from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas import kernel_mods, scalar_table, tpu_config
from flash_layers.impls.tiling import LANES, round_up

# ----------------------------------------------------------------------------
# The family interface (see flash_pallas/__init__.py)
# ----------------------------------------------------------------------------

def unsupported(request: Request) -> str | None:
  if request.has_dense_mask:  # blocks are skipped by the mask spec; an arbitrary array has none
    return "dense mask"
  if request.has_bias:
    return "dense bias"
  words = max(tpu_config.plan_words(request, tiles) for tiles in tpu_config.blocks(request))
  if request.mask_mod is not None:  # the plan's full-tile runs: two more words per outer block
    words *= 2
  if request.has_mods and words + request.mod_operand_words > tpu_config.MAX_PLAN_WORDS:
    return (f"mod_operands of {request.mod_operand_words} elements, with a block plan of {words} words "
            f"(SMEM holds {tpu_config.MAX_PLAN_WORDS} int32 words for both)")
  if words > tpu_config.MAX_PLAN_WORDS:
    return (f"a block plan of {words} int32 words (SMEM holds {tpu_config.MAX_PLAN_WORDS}; use "
            "larger block_sizes, fewer rows or ring attention)")
  return None


def block_shape(request: Request, platform: str) -> tuple[int, int]:
  return tpu_config.blocks(request)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TpuCall:
  """One call as the kernels see it: the request and what is derived from it while tracing
  (hashable: a custom_vjp static argument)."""

  request: Request
  interpret: bool
  fwd: tuple[int, int]  # forward (block_q, block_kv), after `tpu_config.forward_tiles`
  bwd: tuple[int, int]  # backward (block_q, block_kv)
  static_offsets: tuple[int, int] | None  # for the cost estimate; None when traced
  # Token-major operands: q, k, v, out, dO and the gradients stay [b, len, heads * dim] (the
  # caller's layout, reshaped for free) and a tile is the (block, dim) window at column
  # head * dim; legal for Mosaic when dim is a multiple of 128 lanes. Otherwise head-major
  # copies [b, heads, len, dim] are made (a transpose each way).
  token_major: bool
  # Query heads per forward / dQ q tile: a GQA group's heads (token-major only) share one K/V
  # stream.
  fwd_heads: int = 1
  dq_heads: int = 1
  # mask_mod / score_mod operands (kernel_mods.flatten), scalar-prefetched after the plan tables.
  operands: tuple[kernel_mods.Meta, ...] = ()

  @property
  def has_segments(self) -> bool:
    return self.request.has_segment_ids

  @property
  def needs_positions(self) -> bool:  # every visited tile, full or not, hashes, biases or mods positions
    return self.request.has_alibi or self.request.has_dropout or self.request.score_mod is not None

  def mod_views(self, refs) -> tuple:
    """The operands as a mod sees them inside a kernel (`kernel_mods.Operand`)."""
    return kernel_mods.views(refs, self.operands, self.interpret, "a TPU (Mosaic) kernel")


def _config(request: Request, args: Args, interpret: bool) -> _TpuCall:
  fwd, bwd = tpu_config.blocks(request)
  offsets_static = None  # python ints are known while tracing; traced offsets only at run time
  if all(isinstance(o, (int, np.integer)) for o in (args.q_offset, args.kv_offset)):
    offsets_static = (int(args.q_offset), int(args.kv_offset))
  token_major = request.head_dim % LANES == 0 and request.head_dim_v % LANES == 0
  fwd, fwd_heads = tpu_config.forward_tiles(request, fwd, token_major)
  dq_heads = tpu_config.dq_tile_heads(request, bwd, token_major)
  if request.has_mods:  # a mod may read the head: one query head per tile, its own element mask
    fwd_heads = dq_heads = 1
  return _TpuCall(request=request, interpret=interpret, fwd=fwd, bwd=bwd,
                  static_offsets=offsets_static, token_major=token_major, fwd_heads=fwd_heads,
                  dq_heads=dq_heads, operands=kernel_mods.flatten(args.mod_operands)[1])


def grid_steps(request: Request, args: Args) -> int | None:
  """Grid steps the forward kernel runs, over batch and heads (None when segment ids or
  offsets are traced: the grid is then sized at run time)."""
  if any(isinstance(x, jax.core.Tracer) for x in (args.q_segment_ids, args.kv_segment_ids,
                                                  args.q_offset, args.kv_offset, *args.mod_operands)):
    return None
  cfg = _config(request, args, interpret=True)
  offsets = jnp.asarray([args.q_offset, args.kv_offset], jnp.int32)
  row_steps, _, _ = _plan(cfg, cfg.fwd, args.q_segment_ids, args.kv_segment_ids, offsets,
                          kv_major=False, operands=args.mod_operands)
  row_steps = np.asarray(row_steps)
  programs = request.batch * request.num_heads // cfg.fwd_heads  # one per (row, q tile's heads)
  return programs * row_steps.shape[-1] * int(row_steps.max())


def _to_kernel(cfg: _TpuCall, x, length):
  """[b, len, h, d] -> the kernels' layout, padded to `length` tokens: [b, len_pad, h * d]
  (token-major, a free reshape when no padding is needed) or [b, h, len_pad, d]."""
  b, t, h, d = x.shape
  if cfg.token_major:
    return jnp.pad(x.reshape(b, t, h * d), ((0, 0), (0, length - t), (0, 0)))
  return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, length - t), (0, 0)))


def _from_kernel(cfg: _TpuCall, x, length: int, heads: int):
  """The kernels' layout -> [b, length, heads, d] (the padding sliced off)."""
  if cfg.token_major:
    return x[:, :length].reshape(x.shape[0], length, heads, -1)
  return jnp.swapaxes(x[:, :, :length], 1, 2)


def _prepare(request: Request, args: Args, interpret: bool, batch: int):
  """(config, padded q length, padded kv length, SMEM offsets table) of one call."""
  cfg = _config(request, args, interpret)
  q_pad = round_up(request.q_len, math.lcm(cfg.fwd[0], cfg.bwd[0]))
  kv_pad = round_up(request.kv_len, math.lcm(cfg.fwd[1], cfg.bwd[1]))
  # Offsets, ALiBi slopes and dropout streams (scalar_table), in SMEM.
  return cfg, q_pad, kv_pad, scalar_table.build(request, args, batch)


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv], lse [b, h, q] float32) by the Mosaic kernels."""
  if q.dtype not in (jnp.float32, jnp.bfloat16):
    # float16 (or float64): the kernels run in float32, the output returns to the input dtype.
    out, lse = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               request=request, args=args, interpret=interpret)
    return out.astype(q.dtype), lse
  cfg, q_pad, kv_pad, offsets = _prepare(request, args, interpret, q.shape[0])
  out, lse = _flash(cfg, _to_kernel(cfg, q, q_pad), _to_kernel(cfg, k, kv_pad),
                    _to_kernel(cfg, v, kv_pad), args.q_segment_ids, args.kv_segment_ids, offsets,
                    kernel_mods.flatten(args.mod_operands)[0], _prebuilt(request, args))
  return _from_kernel(cfg, out, request.q_len, request.num_heads), lse[:, :, 0, :request.q_len]


def attention_backward(q, k, v, lse, delta, d_out, *, request: Request, args: Args,
                       interpret: bool):
  """(dq, dk, dv) from given row statistics: the two backward kernels, no forward.

  ``lse [b, h, q]`` is the normaliser of the whole softmax the rows belong to and
  ``delta [b, h, q]`` = rowsum(dO * O) - dlse of its whole output (ring attention passes the
  global ones, so each (q shard, kv shard) pair's gradients are its exact share).
  """
  if q.dtype not in (jnp.float32, jnp.bfloat16):
    grads = attention_backward(*(x.astype(jnp.float32) for x in (q, k, v)), lse, delta, d_out,
                               request=request, args=args, interpret=interpret)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
  cfg, q_pad, kv_pad, offsets = _prepare(request, args, interpret, q.shape[0])
  dq, dk, dv = _backward_from_stats(
      cfg, _to_kernel(cfg, q, q_pad), _to_kernel(cfg, k, kv_pad), _to_kernel(cfg, v, kv_pad),
      args.q_segment_ids, args.kv_segment_ids, offsets,
      (kernel_mods.flatten(args.mod_operands)[0], _prebuilt(request, args)),
      _row_stat(lse, q_pad), _row_stat(delta, q_pad), _to_kernel(cfg, d_out.astype(q.dtype), q_pad))
  return (_from_kernel(cfg, dq, request.q_len, request.num_heads),
          _from_kernel(cfg, dk, request.kv_len, request.num_kv_heads),
          _from_kernel(cfg, dv, request.kv_len, request.num_kv_heads))


def _prebuilt(request: Request, args: Args):
  """A block_mask's (any, all) tile flags when the call was given one (`tpu_config.blocks` then takes its
  tiles), else None: `_plan` builds them."""
  if request.block_mask_tiles is None or args.mod_tiles is None:
    return None
  return tuple(args.mod_tiles)


def _row_stat(x, length):  # [b, h, q] -> [b, h, 1, q_pad] float32
  x = x.astype(jnp.float32)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])))[:, :, None, :]


# ----------------------------------------------------------------------------
# Pallas plumbing shared by the three kernels
# ----------------------------------------------------------------------------

def _interpret_arg(interpret: bool):
  """What to pass as pallas_call(interpret=...).

  Under `fl.interpret_as("tpu")`: the TPU-semantics interpreter (`pltpu.InterpretParams`:
  uninitialized memory reads as NaN, out-of-bounds reads raise), with the settings given to
  `interpret_as(..., params=)` when there are some (the strict test tier). Otherwise an interpreted kernel
  is the CPU branch of the dispatcher's `platform_dependent`, next to the compiled TPU branch;
  InterpretParams' io callbacks carry an ordered effect that the TPU branch lacks, and JAX then
  fails to lower the TPU branch alone. The plain interpreter (`True`) has no effects.

  Inside a `shard_map` over several devices the plain interpreter is used too: InterpretParams
  holds every device at a barrier when a kernel starts, while its callbacks copy their arguments
  through CPU device 0, whose stream may be the one held at the barrier -- a deadlock on a
  multi-device CPU host (seen with GQA under an 8-device data mesh).
  """
  if not interpret:
    return False
  params = getattr(pltpu, "InterpretParams", None)  # jax 0.10.2 and 0.11
  if params is None or lowering.interpreting() != "tpu" or lowering.manual_device_count() > 1:
    return True
  return lowering.interpret_params() or params()


def _compiler_params(semantics: tuple[str, ...], vmem_bytes: int | None = None):
  params = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
  return params(dimension_semantics=semantics, vmem_limit_bytes=vmem_bytes)


class _Step(NamedTuple):
  batch: jax.Array    # local batch row and query head of this grid point
  head: jax.Array
  q_block: jax.Array
  kv_block: jax.Array
  full: jax.Array     # every pair of the tile is visible: no element mask (may be a Python bool)
  visited: jax.Array  # a step of the row's range whose tile holds a visible pair (else skipped)
  first: jax.Array    # first step of an accumulation (initialize the scratch)
  last: jax.Array     # last step (write the output block)


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
class _Grid:
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

  def _tile_visibility(self, cfg: _TpuCall, offsets_ref, plan_ref, tiles_ref, w: _Where):
    """(visible, full) of this step's tile, from SMEM scalars (`block_info.tile_visibility`)."""
    bq, bk = self.block_q, self.block_kv
    q_first = offsets_ref[scalar_table.Q_OFFSET] + w.q_block * bq
    q_last = offsets_ref[scalar_table.Q_OFFSET] + jnp.minimum(w.q_block * bq + bq, cfg.request.q_len) - 1
    kv_first = offsets_ref[scalar_table.KV_OFFSET] + w.kv_block * bk
    kv_last = offsets_ref[scalar_table.KV_OFFSET] + jnp.minimum(w.kv_block * bk + bk, cfg.request.kv_len) - 1
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

  def step(self, cfg: _TpuCall, offsets_ref, plan_ref, tiles_ref) -> _Step:
    """Inside a kernel: where this grid step is and what it does."""
    ids = [pl.program_id(axis) for axis in range(self.ndim)]
    w = self.locate(ids, plan_ref)
    visible, full = self._tile_visibility(cfg, offsets_ref, plan_ref, tiles_ref, w)
    first = w.first
    last = w.switch | (ids[3] == pl.num_programs(3) - 1)
    if self.kv_major:  # the group's heads are the innermost axis
      first = first & (ids[4] == 0)
      last = last & (ids[4] == self.group - 1)
    return _Step(w.batch, w.q_head, w.q_block, w.kv_block, full, w.in_range & visible, first, last)


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


def _plan(cfg: _TpuCall, blocks, q_seg, kv_seg, offsets, *, kv_major: bool, operands=(), prebuilt=None):
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
    xp, seg, offs = jnp, (q_seg, kv_seg), (offsets[scalar_table.Q_OFFSET], offsets[scalar_table.KV_OFFSET])
  visible, full = block_info.block_visibility(r.q_len, r.kv_len, block_q, block_kv, r.spec, *seg, *offs,
                                         xp=xp)
  if r.mask_mod is not None:
    if prebuilt is not None:  # a block_mask's flags, built once for every layer
      shows, fills = prebuilt
    else:
      shows, fills = kernel_mods.tile_flags(r, operands, offs[0], offs[1], block_q, block_kv)
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


def _grid(cfg: _TpuCall, blocks, q, k, q_seg, kv_seg, offsets, mod_inputs=((), None), *,
          kv_major: bool, tile_heads: int = 1):
  """The grid of one kernel, its number of steps per row and its SMEM tables (plan, tiles, then the
  flat mod operands). `mod_inputs`: (flat operands, a block_mask's tile flags or None)."""
  block_q, block_kv = blocks
  ops, prebuilt = mod_inputs
  if prebuilt is not None and blocks != cfg.request.block_mask_tiles:
    prebuilt = None  # tiles of their own (block_sizes given): the flags are built for them
  row_steps, plan, per_row = _plan(cfg, blocks, q_seg, kv_seg, offsets, kv_major=kv_major,
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
  grid = _Grid(kv_major, cfg.has_segments, cfg.token_major, q.shape[0], r.num_heads,
               r.num_heads // r.num_kv_heads, -(-r.q_len // block_q), -(-r.kv_len // block_kv),
               block_q, block_kv, tile_heads, per_row=bool(per_row),
               plan_words=4 if r.mask_mod is not None else 2)
  return grid, steps, (jnp.asarray(plan), tiles.astype(jnp.int32), *ops)


def _call(kernel, name: str, cfg: _TpuCall, grid: _Grid, steps, tables, inputs, in_specs,
          out_shape, out_specs, scratch, cost, aliases=None):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, grid=grid),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(tables), grid=grid.shape(steps), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, compiler_params=_compiler_params(
          ("parallel",) * 3 + ("arbitrary",) * (grid.ndim - 3),
          tpu_config.vmem_limit(cfg.request.head_dim, cfg.request.head_dim_v, grid.block_q,
                                grid.block_kv, jnp.dtype(inputs[0].dtype).itemsize,
                                grid.tile_heads)),
      cost_estimate=cost, interpret=_interpret_arg(cfg.interpret), name=name,
      input_output_aliases={len(tables) + i: o for i, o in (aliases or {}).items()},
  )(*tables, *inputs)


def _segment_rows(seg, padded_len):
  """Segment ids [b, len] -> [b, 1, len_pad] rows (tiles of (1, block) in VMEM)."""
  return jnp.pad(seg, ((0, 0), (0, padded_len - seg.shape[1])))[:, None, :]


def _column(row):
  """A [1, n] row as an [n, LANES] lane-replicated column, via a supported 2-D transpose."""
  return jnp.transpose(jnp.broadcast_to(row, (LANES, row.shape[1])))


class _Tile(NamedTuple):
  """Positions of one tile (q along ``q_axis``: 0, or 1 when transposed), local and global."""

  q_local: jax.Array
  kv_local: jax.Array
  q_pos: jax.Array
  kv_pos: jax.Array


def _tile(offsets_ref, step: _Step, shape, q_axis) -> _Tile:
  block_q, block_kv = shape[q_axis], shape[1 - q_axis]
  q_local = step.q_block * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
  kv_local = step.kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  return _Tile(q_local, kv_local, offsets_ref[scalar_table.Q_OFFSET] + q_local,
               offsets_ref[scalar_table.KV_OFFSET] + kv_local)


class _Mod(NamedTuple):
  """What a mod reads in one tile: its indices (the program's batch row and query head, the tile's
  global positions; mods are refused on a mesh, so local = global) and the operands' views."""

  idx: mods.Indices
  operands: tuple


def _mod(cfg: _TpuCall, operands: tuple, batch, head, tile: _Tile | None) -> _Mod | None:
  if not cfg.request.has_mods or tile is None:
    return None
  return _Mod(mods.Indices(batch, head, tile.q_pos, tile.kv_pos), operands)


def _tile_visible(cfg: _TpuCall, tile: _Tile, q_seg, kv_seg, mod: _Mod | None = None):
  """The element mask of one tile: the built-in rules, AND the mask_mod's verdict."""
  ok = mask_rules.visible(tile.q_pos, tile.kv_pos, cfg.request.spec, q_seg, kv_seg)
  if cfg.request.mask_mod is not None:
    ok = ok & mods.mask(cfg.request.mask_mod, mod.idx, mod.operands)
  # Padded tail positions see nothing and are seen by nothing (q_len % block_q etc. may be != 0).
  return ok & (tile.q_local < cfg.request.q_len) & (tile.kv_local < cfg.request.kv_len)


def _alibi(cfg: _TpuCall, offsets_ref, head, tile: _Tile | None):
  """The ALiBi term of query head `head`'s tile (slope bits read from SMEM) in the units of the
  pre-scaled logits (`_unit`: the scalar slope takes the factor), or None."""
  if not cfg.request.has_alibi:
    return None
  slope = scalar_table.Table.of(cfg.request).slope(offsets_ref, head)
  return alibi(slope * _unit(cfg), tile.q_pos, tile.kv_pos)


def _dropout(cfg: _TpuCall, offsets_ref, batch, head, tile: _Tile | None):
  """The dropout multiplier of a tile (0 or 1 / (1 - rate)), or None: `dropout.keep` on global
  positions with this (batch row, head)'s stream from SMEM."""
  if cfg.request.dropout_rate == 0:
    return None
  stream = scalar_table.Table.of(cfg.request).stream(offsets_ref, batch, head)
  kept = dropout.keep(stream, tile.q_pos, tile.kv_pos, cfg.request.dropout_rate)
  return jnp.where(kept, jnp.float32(dropout.keep_scale(cfg.request.dropout_rate)), jnp.float32(0.0))


def _when_visited(step: _Step, update):
  """Skipping rule: compute only visible blocks; mask element-wise only the partial ones."""
  if isinstance(step.full, bool):  # decided while tracing (e.g. causal only: never full and...)
    pl.when(step.visited)(lambda: update(masked=not step.full))
    return
  pl.when(step.visited & step.full)(lambda: update(masked=False))
  pl.when(step.visited & ~step.full)(lambda: update(masked=True))


_NT = ((1,), (1,))  # dot_general contractions: a @ b^T and a @ b
_NN = ((1,), (0,))


def _dot(cfg: _TpuCall, a, b, contract):
  """a @ b (or a @ b^T) in float32 at the call's precision.

  Pallas lowers DEFAULT to a Mosaic matmul without a contraction precision (Mosaic's default) and
  HIGHEST to `contract_precision<fp32>`, and rejects HIGH, so HIGH is written out as what XLA runs for it
  on TPU (bf16_3x): a = a_hi + a_lo in bfloat16, a @ b ~ lo.hi + hi.lo + hi.hi. bfloat16
  operands multiply exactly in one pass and Mosaic refuses a contraction precision on them
  ("Bad lhs type"): they always get DEFAULT.
  """
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=(contract, ((), ())),
                          preferred_element_type=jnp.float32)
  if a.dtype != jnp.float32:
    return dot(a, b, precision=jax.lax.Precision.DEFAULT)
  if cfg.request.precision != jax.lax.Precision.HIGH:
    return dot(a, b, precision=cfg.request.precision)
  a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  a_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16)
  b_lo = (b - b_hi.astype(jnp.float32)).astype(jnp.bfloat16)
  return dot(a_lo, b_hi) + dot(a_hi, b_lo) + dot(a_hi, b_hi)


LOG2E = math.log2(math.e)


def _unit(cfg: _TpuCall) -> float:
  """What the logits (scale * q.k + alibi) are multiplied by before `_logits` returns or caps
  them: base 2 (log2 e; the softmax runs on exp2) without a softcap; with one, whose tanh needs
  natural units, 1 / softcap (`_logits` then multiplies the tanh by softcap * log2 e: one multiply
  where there were three). A score_mod reads the logits themselves: 1."""
  if cfg.request.score_mod is not None:
    return 1.0
  return LOG2E if cfg.request.softcap is None else 1.0 / cfg.request.softcap


def _fold(cfg: _TpuCall) -> float:
  """The factor folded into the q tile once per q block, so that the dot itself yields the
  logits in `_unit`s: scale * log2 e, or scale / softcap."""
  return cfg.request.scale * _unit(cfg)


def _folded(cfg: _TpuCall, x):
  """x * `_fold(cfg)`, multiplied in float32 and stored in x's dtype.

  For bfloat16 the scaled tile is rounded to bfloat16 again (as JAX's splash kernels do with
  their pre-scaled q): the logits then carry one more bfloat16 rounding of q (relative 2^-9),
  the size of the rounding the inputs already have. A float32 tile would make every logits dot
  a multi-pass float32 matmul. For float32 the product changes q by at most an ulp.
  """
  return (x.astype(jnp.float32) * _fold(cfg)).astype(x.dtype)


def _logits(cfg: _TpuCall, a, b, alibi=None, mod: _Mod | None = None, grad: bool = False):
  """(s2, chain): the base-2 logits log2(e) * cap(score_mod(scale * q.k + alibi)) of a tile, in float32,
  from `_folded` operands (``a @ b^T``) and an `_alibi` in the same units; and, for the backward
  (``grad``), the chain rule from the capped logits' gradient to the raw logits' (the softcap's
  1 - tanh^2, then score_mod's derivative by `jax.vjp` of the elementwise mod), or None (identity)."""
  s = _dot(cfg, a, b, _NT)
  if alibi is not None:
    s = s + alibi
  r = cfg.request
  if r.score_mod is None:
    if r.softcap is None:
      return s, None
    capped = jnp.tanh(s)
    return (r.softcap * LOG2E) * capped, lambda ds: ds * (1.0 - capped * capped)
  # `_unit` is 1 with a score_mod: s holds the natural logits it rewrites.
  def rewrite(x):
    return mods.score(r.score_mod, x, mod.idx, mod.operands)

  if grad:
    y, score_vjp = jax.vjp(rewrite, s)
  else:
    y, score_vjp = rewrite(s), None
  if r.softcap is None:
    return y * LOG2E, (lambda ds: score_vjp(ds)[0]) if grad else None
  capped = jnp.tanh(y * (1.0 / r.softcap))
  chain = (lambda ds: score_vjp(ds * (1.0 - capped * capped))[0]) if grad else None
  return (r.softcap * LOG2E) * capped, chain


def _cost(cfg: _TpuCall, b, h, per_pair_flops, nbytes):
  """A CostEstimate from the analytic count of visible pairs (ignoring segment ids, not known
  while tracing: an upper bound for packed sequences)."""
  q_off, kv_off = cfg.static_offsets or (0, 0)
  request = cfg.request
  pairs = mask_rules.count_visible(request.q_len, request.kv_len, request.spec, q_off, kv_off) * b * h
  return pl.CostEstimate(flops=int(pairs * per_pair_flops),
                         transcendentals=int(pairs * (1 + (cfg.request.softcap is not None))),
                         bytes_accessed=int(nbytes))


def _nbytes(*arrays):
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------

def _forward_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: _TpuCall, grid: _Grid):
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, q_scr,
     q_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, q_scr = refs
  # Per query head j of the tile (grid.tile_heads of one GQA group; 1 for head-major operands):
  # m_scr[j] [bq, 128]: running row max of the base-2 logits seen so far (lane-replicated).
  # l_scr[j] [bq, 128]: running sum of exp2(logit - m) over those logits (lane-replicated).
  # acc_scr[j] [bq, dv]: running sum of exp2(logit - m) * v, rescaled whenever m grows.
  # q_scr[j] [bq, d]: head j's q tile times `_fold` (scale and log2 e), made once per q block:
  #   the q block is constant along the steps, so one multiply of bq * d elements replaces one of
  #   bq * bk logits per step, and the steps read it from VMEM as they would read q_ref.
  # q_seg_scr [bq, 128]: this q block's segment ids as a column (made once per q block).
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)
  heads, d, dv = grid.tile_heads, cfg.request.head_dim, cfg.request.head_dim_v

  @pl.when(step.first)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    for j in range(heads):  # lane-aligned column windows (d % 128 == 0 when heads > 1)
      q_scr[j] = _folded(cfg, q_ref[:, j * d:(j + 1) * d])
    if cfg.has_segments:
      q_seg_scr[...] = _column(q_seg_ref[...])

  def update(masked: bool):
    shape = (grid.block_q, grid.block_kv)
    tile = _tile(offsets_ref, step, shape, 0) if masked or cfg.needs_positions else None
    mod = _mod(cfg, operands, step.batch, step.head, tile)  # mods: one head per tile
    if masked:  # one element mask for every head of the tile
      seg = (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None)
      visible = _tile_visible(cfg, tile, *seg, mod)

    # The heads run in a loop, not unrolled: the body is compiled once whatever the group (an
    # unrolled body grew Mosaic's compile by ~4 s per head), and its refs are indexed only along
    # their leading, untiled axis. K and V are read from their VMEM tiles inside the body, as the
    # matmuls would read them anyway, rather than held live across the loop.
    def head_update(j, carry):
      head = step.head + j
      s, _ = _logits(cfg, q_scr[j], k_ref[...], _alibi(cfg, offsets_ref, head, tile), mod)
      if masked:
        s = jnp.where(visible, s, -jnp.inf)
      # Online softmax: with the new row max m', rescale what was summed under the old max m by
      # exp2(m - m') and add this block's exp2(s - m'). A row with nothing visible yet keeps
      # m' = -inf; shifting it by 0 instead makes its p and its rescale factor exactly 0, not NaN.
      m_prev = m_scr[j]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
      p = jnp.exp2(s - shift[:, :1])
      rescale = jnp.exp2(m_prev - shift)
      l_scr[j] = rescale * l_scr[j] + jnp.sum(p, axis=1, keepdims=True)  # lse: before dropout
      keep = _dropout(cfg, offsets_ref, step.batch, head, tile)
      if keep is not None:
        p = p * keep
      v = v_ref[...]
      acc_scr[j] = acc_scr[j] * rescale[:, :1] + _dot(cfg, p.astype(v.dtype), v, _NN)
      m_scr[j] = m_next
      return carry

    if heads == 1:
      head_update(0, None)
    else:
      jax.lax.fori_loop(0, heads, head_update, None)

  _when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    for j in range(heads):
      total = l_scr[j]
      seen = total > 0  # rows that saw no key: output 0, lse -inf
      o_ref[:, j * dv:(j + 1) * dv] = (
          acc_scr[j] * jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)[:, :1]
      ).astype(o_ref.dtype)
      # m is in base 2: lse = ln 2 * m + ln(sum exp2(s - m)), natural at the interface.
      lse = jnp.where(seen, m_scr[j] * math.log(2.0) + jnp.log(jnp.where(seen, total, 1.0)),
                      -jnp.inf)
      row = jnp.transpose(lse)[:1, :]  # [bq, 128] column -> [1, bq] row
      if heads > 1:
        lse_ref[j] = row
      else:
        lse_ref[...] = row


def _dims(cfg: _TpuCall, q, k):
  """(batch, heads, q_pad, kv_pad, head_dim, head_dim_v) of kernel-layout operands."""
  length_axis = 1 if cfg.token_major else 2
  return (q.shape[0], cfg.request.num_heads, q.shape[length_axis], k.shape[length_axis], cfg.request.head_dim,
          cfg.request.head_dim_v)


def _operand_shape(cfg: _TpuCall, b: int, h: int, length: int, d: int) -> tuple[int, ...]:
  return (b, length, h * d) if cfg.token_major else (b, h, length, d)


def _forward(cfg: _TpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  b, h, q_pad, kv_pad, d, dv = _dims(cfg, q, k)
  grid, steps, tables = _grid(cfg, cfg.fwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=False,
                              tile_heads=cfg.fwd_heads)
  block_q, heads = grid.block_q, grid.tile_heads
  inputs, in_specs = [q, k, v], [grid.q_tile(d), grid.kv_tile(d), grid.kv_tile(dv)]
  scratch = [pltpu.VMEM((heads, block_q, LANES), jnp.float32),
             pltpu.VMEM((heads, block_q, LANES), jnp.float32),
             pltpu.VMEM((heads, block_q, dv), jnp.float32),
             pltpu.VMEM((heads, block_q, d), q.dtype)]
  if cfg.has_segments:
    inputs += [_segment_rows(q_seg, q_pad), _segment_rows(kv_seg, kv_pad)]
    in_specs += grid.segment_rows()
    scratch.append(pltpu.VMEM((block_q, LANES), jnp.int32))
  out_shape = [jax.ShapeDtypeStruct(_operand_shape(cfg, b, h, q_pad, dv), q.dtype),
               jax.ShapeDtypeStruct((b, h, 1, q_pad), jnp.float32)]
  # K/V are streamed once per q block for every q tile's heads: group / tile_heads times per
  # kv head.
  kv_reads = grid.num_outer * grid.group // heads
  cost = _cost(cfg, b, h, 2 * cfg.request.head_dim + 2 * cfg.request.head_dim_v,
               _nbytes(q, *out_shape) + _nbytes(k, v) * kv_reads)
  return _call(_forward_kernel, "flash_layers_fwd", cfg, grid, steps, (offsets, *tables), inputs,
               in_specs, out_shape, [grid.q_tile(dv), grid.q_row()], scratch, cost)


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------

def _dkv_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: _TpuCall, grid: _Grid):
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dk_ref, dv_ref,
     dk_scr, dv_scr, kv_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr = refs
  # dk_scr [bk, d], dv_scr [bk, dv]: float32 sums over every (query head of the group, q block)
  # that sees this kv block. kv_seg_scr [bk, 128]: this kv block's segment ids as a column.
  # Tiles are transposed ([kv, q]) so the per-query rows lse and D broadcast along sublanes; lse
  # arrives in base 2 (`_backward_from_stats`).
  # q changes every step here, and it is q that is scaled (`_folded`), per step: bq * d multiplies
  # instead of bk * bq. Folding the scale into the resident k tile once would be cheaper still,
  # but for bfloat16 it rounds differently from the forward's scaled q, and P recomputed from other
  # roundings than the ones lse was summed from no longer sums to one (measured: dV's error
  # against float64 3x larger, over the conformance limit).
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)

  @pl.when(step.first)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)
    if cfg.has_segments:
      kv_seg_scr[...] = _column(kv_seg_ref[...])

  def update(masked: bool):
    q, do = q_ref[...], do_ref[...]
    shape = (grid.block_kv, grid.block_q)
    tile = _tile(offsets_ref, step, shape, 1) if masked or cfg.needs_positions else None
    mod = _mod(cfg, operands, step.batch, step.head, tile)  # indices laid out as the [bk, bq] tile
    s_t, chain = _logits(cfg, k_ref[...], _folded(cfg, q), _alibi(cfg, offsets_ref, step.head, tile),
                         mod, grad=True)
    if masked:  # s_t: [bk, bq]
      seg = (q_seg_ref[...], kv_seg_scr[:, :1]) if cfg.has_segments else (None, None)
      s_t = jnp.where(_tile_visible(cfg, tile, *seg, mod), s_t, -jnp.inf)
    # lse is +inf for rows that see no key (set by the wrapper): their p is exactly 0.
    p_t = jnp.exp2(s_t - lse_ref[...])
    dp_t = _dot(cfg, v_ref[...], do, _NT)
    keep = _dropout(cfg, offsets_ref, step.batch, step.head, tile)
    # Dropout: dV sums the kept, rescaled probabilities; dP passes only through kept entries.
    # delta = rowsum(dO * O) is unchanged (sum_j p_j keep_j dO.v_j = dO.O).
    pk_t = p_t if keep is None else p_t * keep
    if keep is not None:
      dp_t = dp_t * keep
    dv_scr[...] += _dot(cfg, pk_t.astype(do.dtype), do, _NN)
    ds_t = p_t * (dp_t - delta_ref[...])
    if chain is not None:  # softcap: d(c tanh(x / c)) / dx = 1 - tanh^2; score_mod: its derivative
      ds_t = chain(ds_t)
    dk_scr[...] += _dot(cfg, ds_t.astype(q.dtype), q, _NN)

  _when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.request.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(offsets_ref, plan_ref, tiles_ref, *refs, cfg: _TpuCall, grid: _Grid):
  operands, refs = cfg.mod_views(refs[:len(cfg.operands)]), refs[len(cfg.operands):]
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref,
     dq_scr, lse_scr, delta_scr, q_scr, do_scr, q_seg_scr) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, lse_scr, delta_scr,
     q_scr, do_scr) = refs
  # Per query head j of the tile (grid.tile_heads of one GQA group, as in the forward; 1 for
  # head-major operands), all made once per q block:
  # dq_scr[j] [bq, d]: float32 sum over the visible kv blocks.
  # lse_scr[j] (base 2), delta_scr[j] [bq, 128]: head j's lse and D rows as columns.
  # q_scr[j] [bq, d]: head j's q tile times `_fold`; do_scr[j] [bq, dv]: its dO tile. The loop
  #   over the heads indexes refs along their leading axis only (a head's columns of q_ref and
  #   do_ref are static lane windows, copied out here).
  # q_seg_scr [bq, 128]: this q block's segment ids as a column.
  # dQ may be aliased into dO's buffer (`_backward`): a program copies its dO window to do_scr
  # at its first step and writes dQ into the same window after its last; no other program
  # touches that window.
  step = grid.step(cfg, offsets_ref, plan_ref, tiles_ref)
  heads, d, dv = grid.tile_heads, cfg.request.head_dim, cfg.request.head_dim_v

  def row(ref, j):  # head j's [1, bq] row of lse or D
    return ref[j] if heads > 1 else ref[...]

  @pl.when(step.first)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
    for j in range(heads):  # lane-aligned column windows (d % 128 == 0 when heads > 1)
      q_scr[j] = _folded(cfg, q_ref[:, j * d:(j + 1) * d])
      do_scr[j] = do_ref[:, j * dv:(j + 1) * dv]
      lse_scr[j] = _column(row(lse_ref, j))
      delta_scr[j] = _column(row(delta_ref, j))
    if cfg.has_segments:
      q_seg_scr[...] = _column(q_seg_ref[...])

  def update(masked: bool):
    shape = (grid.block_q, grid.block_kv)
    tile = _tile(offsets_ref, step, shape, 0) if masked or cfg.needs_positions else None
    mod = _mod(cfg, operands, step.batch, step.head, tile)  # mods: one head per tile
    if masked:  # one element mask for every head of the tile
      seg = (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None)
      visible = _tile_visible(cfg, tile, *seg, mod)

    # A loop, as in the forward (`_forward_kernel`): one compiled body, K and V read from their
    # VMEM tiles inside it.
    def head_update(j, carry):
      head = step.head + j
      k = k_ref[...]
      s, chain = _logits(cfg, q_scr[j], k, _alibi(cfg, offsets_ref, head, tile), mod, grad=True)
      if masked:  # s: [bq, bk]
        s = jnp.where(visible, s, -jnp.inf)
      p = jnp.exp2(s - lse_scr[j][:, :1])
      dp = _dot(cfg, do_scr[j], v_ref[...], _NT)
      keep = _dropout(cfg, offsets_ref, step.batch, head, tile)
      if keep is not None:
        dp = dp * keep
      ds = p * (dp - delta_scr[j][:, :1])
      if chain is not None:
        ds = chain(ds)
      dq_scr[j] += _dot(cfg, ds.astype(k.dtype), k, _NN)
      return carry

    if heads == 1:
      head_update(0, None)
    else:
      jax.lax.fori_loop(0, heads, head_update, None)

  _when_visited(step, update)

  @pl.when(step.last)
  def _finish():
    for j in range(heads):
      dq_ref[:, j * d:(j + 1) * d] = (dq_scr[j] * cfg.request.scale).astype(dq_ref.dtype)


def _backward(cfg: _TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, do, reuse_do: bool):
  """dq, dk, dv. ``reuse_do``: dO is dead after this call (a VJP's cotangent), so the dQ kernel,
  which runs last and reads each dO tile only while it owns that q block, writes dQ into dO's
  buffer (input_output_aliases): one q-sized buffer less (at 8k tokens on v5e, the only HBM
  temporary left). Token-major operands only: with head-major copies the alias made XLA keep
  another q-sized float32 buffer (v5p, 262,144 tokens, 2 heads of 64: temporaries 772 -> 900
  MiB), and saved nothing at 8k or 32k."""
  b, h, q_pad, kv_pad, d, dv = _dims(cfg, q, k)
  seg_inputs = []
  if cfg.has_segments:
    seg_inputs = [_segment_rows(q_seg, q_pad), _segment_rows(kv_seg, kv_pad)]
  vmem = functools.partial(pltpu.VMEM, dtype=jnp.float32)

  def specs(grid: _Grid):  # q, k, v, dO, lse, D, [segment ids]
    return [grid.q_tile(d), grid.kv_tile(d), grid.kv_tile(dv), grid.q_tile(dv), grid.q_row(),
            grid.q_row(), *(grid.segment_rows() if cfg.has_segments else [])]

  inputs = [q, k, v, do, lse, delta, *seg_inputs]
  grid, steps, tables = _grid(cfg, cfg.bwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=True)
  block_q, block_kv = grid.block_q, grid.block_kv
  dk_dv_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dk, dv_ = _call(
      _dkv_kernel, "flash_layers_bwd_dkv", cfg, grid, steps, (offsets, *tables), inputs, specs(grid),
      dk_dv_shape, [grid.kv_tile(d), grid.kv_tile(dv)],
      [vmem((block_kv, d)), vmem((block_kv, dv)),
       *([pltpu.VMEM((block_kv, LANES), jnp.int32)] if cfg.has_segments else [])],
      _cost(cfg, b, h, 4 * cfg.request.head_dim + 4 * cfg.request.head_dim_v,
            _nbytes(k, v, *dk_dv_shape) + _nbytes(q, do, lse, delta) * grid.num_outer))

  grid, steps, tables = _grid(cfg, cfg.bwd, q, k, q_seg, kv_seg, offsets, ops, kv_major=False,
                              tile_heads=cfg.dq_heads)
  block_q, heads = grid.block_q, grid.tile_heads
  dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  # K/V are streamed once per q block for every q tile's heads: group / tile_heads times per
  # kv head.
  kv_reads = grid.num_outer * grid.group // heads
  dq = _call(
      _dq_kernel, "flash_layers_bwd_dq", cfg, grid, steps, (offsets, *tables), inputs, specs(grid),
      dq_shape, grid.q_tile(d),
      [vmem((heads, block_q, d)), vmem((heads, block_q, LANES)), vmem((heads, block_q, LANES)),
       pltpu.VMEM((heads, block_q, d), q.dtype), pltpu.VMEM((heads, block_q, dv), do.dtype),
       *([pltpu.VMEM((block_q, LANES), jnp.int32)] if cfg.has_segments else [])],
      _cost(cfg, b, h, 4 * cfg.request.head_dim + 2 * cfg.request.head_dim_v,
            _nbytes(q, do, lse, delta, dq_shape) + _nbytes(k, v) * kv_reads),
      aliases={3: 0} if (reuse_do and cfg.token_major and do.shape == q.shape
                         and do.dtype == q.dtype) else None)
  return dq, dk, dv_


# ----------------------------------------------------------------------------
# The custom VJP (on padded arrays in the kernels' layout: token-major [b, len_pad, heads * dim]
# when both head dims are multiples of 128, else head-major [b, heads, len_pad, dim]; `_to_kernel`)
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, prebuilt):
  return _forward(cfg, q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt))


def _flash_fwd(cfg: _TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, prebuilt):
  out, lse = _forward(cfg, q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt))
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt), out, lse)


def _flash_bwd(cfg: _TpuCall, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, ops, out, lse = residuals
  d_out, d_lse = cotangents
  # Rows past q_len get a zero cotangent (the wrapper slices them off), but they may lie in a
  # backward block beyond the forward grid (block sizes differ), where out and lse were never
  # written: give them lse = +inf and D = 0, so p = 0 there, never NaN. Rows that see no key get
  # lse = +inf too (p = exp(s - inf) = 0, never exp(+inf)).
  delta = _row_delta(cfg, out, d_out) - d_lse
  dq, dk, dv = _backward_from_stats(cfg, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out,
                                    reuse_do=True)
  # The operands: a mask_mod's have no gradient; a score_mod with floating ones never gets here
  # (FlashPallas.unsupported: "score_mod operand gradients"). The tile flags are booleans.
  flat, prebuilt = ops
  return (dq, dk, dv, None, None, None, tuple(None for _ in flat),
          None if prebuilt is None else tuple(None for _ in prebuilt))


def _delta_kernel(o_ref, do_ref, delta_ref):
  rows = jnp.sum(o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32), axis=1,
                 keepdims=True)  # [bq, 1]
  delta_ref[...] = jnp.transpose(jnp.broadcast_to(rows, (rows.shape[0], LANES)))[:1, :]


def _row_delta(cfg: _TpuCall, out, d_out):
  """rowsum(dO * O) [b, h, 1, q_pad] float32, tile by tile in the kernels' layout.

  In XLA this product would be a [b, len, h, dv] float32 temporary plus, for token-major
  operands, a relayout copy of it (the reduction axis is a lane slice of the fused h * dv axis);
  here it is one read of O and dO.
  """
  b, h, q_pad, _, _, dv = _dims(cfg, out, out)
  block_q = cfg.bwd[0]
  if cfg.token_major:
    tile = pl.BlockSpec((None, block_q, dv), lambda b, h, i: (b, i, h))
  else:
    tile = pl.BlockSpec((None, None, block_q, dv), lambda b, h, i: (b, h, i, 0))
  return pl.pallas_call(
      _delta_kernel, grid=(b, h, q_pad // block_q), in_specs=[tile, tile],
      out_specs=pl.BlockSpec((None, None, 1, block_q), lambda b, h, i: (b, h, 0, i)),
      out_shape=jax.ShapeDtypeStruct((b, h, 1, q_pad), jnp.float32),
      compiler_params=_compiler_params(("parallel",) * 3),
      cost_estimate=pl.CostEstimate(flops=2 * b * h * q_pad * dv, transcendentals=0,
                                    bytes_accessed=_nbytes(out, d_out)),
      interpret=_interpret_arg(cfg.interpret), name="flash_layers_bwd_delta",
  )(out, d_out)


def _backward_from_stats(cfg: _TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out,
                         reuse_do: bool = False):
  """The backward kernels on padded kernel-layout arrays; lse, delta [b, h, 1, q_pad].

  The kernels recompute P = exp2(S2 - L2) from base-2 logits (`_logits`), so lse is handed to them
  in base 2, L2 = L * log2 e: one multiply per row here, fused with the masking below.
  """
  real = (jnp.arange(lse.shape[-1]) < cfg.request.q_len)[None, None, None, :]
  delta = jnp.where(real, delta, 0.0)
  lse = jnp.where(real & (lse > -jnp.inf), lse * LOG2E, jnp.inf)
  return _backward(cfg, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out, reuse_do)


_flash.defvjp(_flash_fwd, _flash_bwd)
