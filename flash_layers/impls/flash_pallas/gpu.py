"""flash_pallas on the GPU: our own Pallas flash-attention kernels, lowered through Triton.

The algorithm (FlashAttention-2, Dao 2023, arXiv 2307.08691), shaped for a GPU:

* Forward: one program per (q block, batch * head). The program keeps its q tile
  in registers and loops (`lax.fori_loop`, an `scf.for` in Triton) over the kv
  blocks that the mask makes visible to it: blocks no query of the tile can see
  are never loaded. Softmax is online, in float32 and in base 2 (`exp2` is one
  instruction): a running row max `m`, a running denominator and an unnormalised
  accumulator, rescaled whenever the max grows. It writes the output and the row
  logsumexp (natural log, `-inf` for a row that sees no key; its output is zeros).
* Backward (custom VJP, from the saved logsumexp, nothing of size q x kv kept):
  P is recomputed tile by tile as exp(s - lse). With D_i = rowsum(dO * O)_i -
  dlse_i (the cotangent of lse enters here, so ring attention can differentiate
  through it), dS = P * (dP - D) where dP = dO V^T. Two kernels, neither needs
  atomics:
    - dK/dV: one program per (kv block, batch * kv head). It loops over the
      query heads of its GQA group and, per head, over the q blocks that see the
      kv block, accumulating dV += P^T dO and dK += dS^T Q in float32. A group's
      heads sum inside the program, so K/V are never repeated and no reduction
      over heads follows.
    - dQ: one program per (q block, batch * head), looping over visible kv
      blocks like the forward: dQ += dS K.
* Which blocks a program visits. Causal and windows make the keys a query sees
  one interval of positions, so without segment ids each program computes its
  range from the global offsets (`q_offset`/`kv_offset`, possibly traced, in a
  tiny int32 array) and the tile sizes (`block_info.visible_block_range`): the interior blocks,
  where every pair is visible and every position real, run in a loop with no
  element mask and no `cond`; the edge blocks (the diagonal, window edges, the
  ragged last block) run in a second loop with the mask. With segment ids
  (packed documents) or global tokens the visible set is not one interval: the
  kernels walk the lists of `block_info.block_map` and its per-tile `full` flag skips
  the mask behind an `scf.if`. The element mask is `mask_rules.visible` itself.
* Any length and head_dim 16..256 without copies: q/k/v/dO stay as given in HBM.
  BlockSpecs are block multiples long and powers of two wide (what `tl.dot`
  wants); tiles are read with masked loads (rows past the length and columns
  past head_dim read as 0, lse as +inf) and written with masked stores. Keys past
  kv_len are masked to -inf in edge tiles; query rows past q_len compute
  harmless values that are never stored (in dK/dV their lse is +inf: P = 0).
* GQA: program (.., b * h) reads kv head h // (num_heads // num_kv_heads).
* Dropout and ALiBi: each tile hashes its keep mask (`dropout.keep`, the function every
  impl uses) and its ALiBi term from global positions, in the forward and again in
  both backward kernels. Slopes and per-(batch, head) dropout streams come in the
  small int32 scalar table (`scalar_table`).

Tile sizes, warps and pipeline stages come from one table (`gpu_config.TILE_TABLE`)
by GPU generation and head_dim, each row citing its yardstick and sized to the
generation's shared memory (`gpu_config.shared_memory_bytes`), and can be overridden per call
with `fl.attention(..., block_sizes=fl.GpuBlockSizes(...))`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas import gpu_config, kernel_mods, scalar_table
from flash_layers.impls.tiling import MIN_GPU_TILE, GpuBlockSizes, round_up

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256
# CUDA limits grid dimensions y and z to 65535; batch * heads runs on y.
MAX_GRID_Y = 65535


# ----------------------------------------------------------------------------
# The family interface (see flash_pallas/__init__.py)
# ----------------------------------------------------------------------------

def unsupported(request: Request) -> str | None:
  """The first feature of `request` these kernels cannot serve, or None."""
  if request.has_dense_mask:
    return "dense mask"
  if request.has_bias:
    return "dense bias"
  if request.dtype not in SUPPORTED_DTYPES:
    return f"dtype {request.dtype} (GPU kernels take {', '.join(SUPPORTED_DTYPES)})"
  if max(request.head_dim, request.head_dim_v) > MAX_HEAD_DIM:
    return f"head_dim > {MAX_HEAD_DIM}"
  if request.batch * request.num_heads > MAX_GRID_Y:
    return f"batch * num_heads > {MAX_GRID_Y}"
  return None


def block_shape(request: Request, platform: str) -> tuple[int, int]:
  """(block_q, block_kv) of the forward kernel, for explain()'s block counts."""
  del platform  # One table; the generation comes from the local GPU (Hopper without one).
  cfg = gpu_config.config(request)
  return cfg.block_q, cfg.block_kv


def grid_steps(request: Request, args: Args) -> int | None:
  """None: each program loops over its kv blocks inside the kernel, so the grid (q blocks x
  batch * heads) says nothing about the tiles visited; `block_shape` gives explain() the counts."""
  del request, args
  return None


def pow2_tile(n: int) -> int:
  """A tile dimension for `n`: the next power of two, at least MIN_GPU_TILE (what `tl.dot` wants)."""
  return max(MIN_GPU_TILE, pl.next_power_of_2(n))


# ----------------------------------------------------------------------------
# Static description of one call (hashable: it is a custom_vjp nondiff argument)
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _GpuCall:
  """One call as the kernels see it: the request and what is derived from it."""

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

  def mod_views(self, refs) -> tuple:
    """The operands as a mod sees them inside a kernel (`kernel_mods.Operand`)."""
    return kernel_mods.views(refs, self.operands, self.interpret, "a GPU (Triton) kernel")

  @property
  def group(self) -> int:
    return self.request.num_heads // self.request.num_kv_heads

  @property
  def d_pad(self) -> int:  # tile width: `tl.dot` and `tl.arange` want powers of two
    return pow2_tile(self.request.head_dim)

  @property
  def dv_pad(self) -> int:
    return pow2_tile(self.request.head_dim_v)

  def needs_mask(self, block_kv: int) -> bool:
    """Whether any tile needs the element mask (else every loaded pair is visible)."""
    spec = self.request.spec
    return (spec.causal or spec.window is not None or self.has_segments
            or self.request.mask_mod is not None or self.request.kv_len % block_kv != 0)


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


def _load(ref, start=0, length: int | None = None, width: int | None = None, other=0.0):
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


def _store(ref, value, start=0, length: int | None = None, width: int | None = None):
  """Write `value`, leaving rows past `length` and columns past `width` of the array untouched."""
  mask = _tile_mask(ref, start, length, width)
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def _ragged(length: int, block: int) -> int | None:
  """`length` when the last block holds positions past it (loads must mask rows), else None."""
  return length if length % block else None


def _visit_ranges(ranges, visit, carry):
  """Run `visit(block, carry, masked)` over a range: the interior blocks in a loop with no element
  mask (and no `cond`), then the edges before and after it with the mask."""
  lo, full_lo, full_hi, hi = ranges
  carry = lax.fori_loop(full_lo, full_hi, lambda block, c: visit(block, c, False), carry)
  before = full_lo - lo

  def edge(i, c):
    return visit(jnp.where(i < before, lo + i, full_hi + (i - before)), c, True)

  return lax.fori_loop(0, before + hi - full_hi, edge, carry)


# ----------------------------------------------------------------------------
# The tile computation shared by all three kernels
# ----------------------------------------------------------------------------

def _positions(st: _GpuCall, offsets_ref, q_block, kv_block, block_q, block_kv):
  """Global positions of a tile: q [block_q, 1], kv [1, block_kv] (None when unused)."""
  if not (st.request.has_alibi or st.request.has_dropout):
    return None
  q_pos = offsets_ref[scalar_table.Q_OFFSET] + q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
  kv_pos = offsets_ref[scalar_table.KV_OFFSET] + kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
  return q_pos[:, None], kv_pos[None, :]


def _alibi(st: _GpuCall, offsets_ref, head, positions):
  """The ALiBi term of a tile (slope bits from the kernel table), or None."""
  if not st.request.has_alibi:
    return None
  return alibi(scalar_table.Table.of(st.request).slope(offsets_ref, head), *positions)


def _keep(st: _GpuCall, offsets_ref, batch, head, positions):
  """The dropout multiplier of a tile (0 or 1 / (1 - rate)), or None."""
  r = st.request
  if not r.has_dropout:
    return None
  stream = scalar_table.Table.of(r).stream(offsets_ref, batch, head)
  kept = dropout.keep(stream, *positions, r.dropout_rate)
  return jnp.where(kept, jnp.float32(dropout.keep_scale(r.dropout_rate)), jnp.float32(0.0))


def _dot(st: _GpuCall, a, b, contract):
  """a . b over the `contract` dims in float32 at the request's precision: Pallas Triton makes
  float32 operands at HIGHEST IEEE products, at DEFAULT or HIGH TF32 ones. bfloat16/float16
  operands multiply exactly whatever the precision; they keep DEFAULT, as before."""
  precision = st.request.precision if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _tile_logits(st: _GpuCall, q, k, q_block, kv_block, block_q, block_kv, masked, offsets_ref,
                 q_seg, kv_seg, alibi=None, mod_at=None, grad: bool = False):
  """Base-2 logits of one [block_q, block_kv] tile, masked to -inf where invisible.

  masked: False for an interior tile (every pair visible: no element mask), True for an edge
  tile, or the block map's traced `full` flag (segment ids, mask_mod), decided per tile behind a
  `cond`. Keys past kv_len (zeros from the masked loads) are masked like invisible ones.
  mod_at: (batch row, query head, operand views) when the request has a mask_mod or score_mod.
  Returns (s2, chain): s2 = cap(score_mod(logits)) * log2(e) in float32; chain (``grad``) takes the
  gradient of the capped logits to that of the raw ones (the softcap's 1 - tanh^2, then score_mod's
  derivative by `jax.vjp`), or None (identity).
  """
  r = st.request
  raw = _dot(st, q, k, ((1,), (1,)))
  # The tile's positions, local and global (the mods and the element mask read them).
  q_local = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
  kv_local = kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
  q_pos = (offsets_ref[scalar_table.Q_OFFSET] + q_local)[:, None]
  kv_pos = (offsets_ref[scalar_table.KV_OFFSET] + kv_local)[None, :]
  idx = None
  if mod_at is not None:
    batch, head, operands = mod_at
    idx = mods.Indices(batch, head, q_pos, kv_pos)  # mods are refused on a mesh: local = global
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
      def rewrite(x):
        return mods.score(r.score_mod, x, idx, operands)
      x, score_vjp = jax.vjp(rewrite, x) if grad else (rewrite(x), None)
    if r.softcap is None:
      s2 = x * LOG2E
      if grad:
        chain = lambda ds: score_vjp(ds)[0]  # noqa: E731
    else:
      tanh_t = jnp.tanh(x * (1.0 / r.softcap))
      s2 = tanh_t * (r.softcap * LOG2E)
      if grad:
        def chain(ds):
          ds = ds * (1.0 - tanh_t * tanh_t)
          return ds if score_vjp is None else score_vjp(ds)[0]
  if masked is False or not st.needs_mask(block_kv):
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


def _grad_logits(st: _GpuCall, p, dp, delta, chain):
  """dS for one tile: P * (dP - D), through the softcap's tanh and score_mod when there are some."""
  ds = p * (dp - delta[:, None])
  return ds if chain is None else chain(ds)


def _walk(st: _GpuCall, offsets_ref, table, own_block, own_size, own_len, other_size, other_len,
          by_q: bool, visit, carry, map_row=0):
  """Run `visit(other_block, carry, masked)` over the blocks the own block sees.

  by_q: the own block is a q block walking kv blocks (forward, dQ); else a kv block walking q
  blocks (dK/dV). Without segment ids the range is arithmetic (`block_info.visible_block_range`); with
  them the block map's list (`table`: index, count, full refs) drives one loop and its `full` flag.
  """
  if st.arithmetic:
    q_off, kv_off = offsets_ref[scalar_table.Q_OFFSET], offsets_ref[scalar_table.KV_OFFSET]
    own_offset, other_offset = (q_off, kv_off) if by_q else (kv_off, q_off)
    first = own_offset + own_block * own_size
    last = own_offset + jnp.minimum(own_block * own_size + own_size, own_len) - 1
    band = mask_rules.band(st.request.spec, transpose=not by_q)
    ranges = block_info.visible_block_range(first, last, band, other_offset, other_len, other_size)
    return _visit_ranges(ranges, visit, carry)
  index_ref, count_ref, full_ref = table

  def step(i, c):
    masked = 1 - full_ref[map_row, own_block, i]
    return visit(index_ref[map_row, own_block, i], c, masked)

  return lax.fori_loop(0, count_ref[map_row, own_block], step, carry)


# ----------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------

def _split_refs(st: _GpuCall, refs):
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


def _forward_kernel(st: _GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  offsets_ref, table, segs, (operands, q_ref, k_ref, v_ref, o_ref, lse_ref) = _split_refs(st, refs)
  r = st.request
  block_q, block_kv = st.cfg.block_q, st.cfg.block_kv
  q_block, bh = pl.program_id(0), pl.program_id(1)
  batch, head = bh // r.num_heads, bh % r.num_heads
  q_start = q_block * block_q
  q_rows = _ragged(r.q_len, block_q)
  kv_rows = _ragged(r.kv_len, block_kv)

  q = _load(q_ref, q_start, q_rows, r.head_dim)
  q_seg = _load(segs[0], q_start, q_rows) if segs else None

  def visit(kv_block, carry, masked):
    acc, m, denom = carry
    kv_slice = pl.ds(kv_block * block_kv, block_kv)
    start = kv_block * block_kv
    # Interior blocks hold only real keys: unmasked rows. Edge blocks may be the ragged last one.
    rows = None if masked is False else kv_rows
    kv_seg = _load(segs[1].at[kv_slice], start, rows) if segs else None
    k = _load(k_ref.at[kv_slice, :], start, rows, r.head_dim)
    positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, _ = _tile_logits(st, q, k, q_block, kv_block, block_q, block_kv, masked, offsets_ref,
                         q_seg, kv_seg, _alibi(st, offsets_ref, head, positions),
                         (batch, head, operands) if r.has_mods else None)
    m_new = jnp.maximum(m, s2.max(axis=-1))
    # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead
    # keeps exp2 at exp2(-inf) = 0 rather than exp2(nan).
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    rescale = jnp.exp2(m - m_safe)
    p = jnp.exp2(s2 - m_safe[:, None])
    denom = denom * rescale + p.sum(axis=-1)  # the normaliser (and lse) is taken before dropout
    keep = _keep(st, offsets_ref, batch, head, positions)
    if keep is not None:
      p = p * keep
    v = _load(v_ref.at[kv_slice, :], start, rows, r.head_dim_v)
    pv = _dot(st, p.astype(v.dtype), v, ((1,), (0,)))
    return acc * rescale[:, None] + pv, m_new, denom

  init = (jnp.zeros((block_q, st.dv_pad), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, m, denom = _walk(st, offsets_ref, table, q_block, block_q, r.q_len, block_kv, r.kv_len,
                        True, visit, init, map_row=batch if st.map_rows else 0)

  seen = denom > 0  # False for a row that sees no key: zeros out, lse = -inf
  denom = jnp.where(seen, denom, 1.0)
  _store(o_ref, (acc / denom[:, None]).astype(o_ref.dtype), q_start, q_rows, r.head_dim_v)
  _store(lse_ref, jnp.where(seen, (m + jnp.log2(denom)) * LN2, -jnp.inf), q_start, q_rows)


# ----------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------

def _dkv_kernel(st: _GpuCall, *refs):
  """One program: kv block `program_id(0)` of (batch, kv head) `program_id(1)`."""
  offsets_ref, table, segs, refs = _split_refs(st, refs)
  operands, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref = refs
  r = st.request
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  kv_block, bkv = pl.program_id(0), pl.program_id(1)
  batch = bkv // r.num_kv_heads
  first_head = (bkv % r.num_kv_heads) * st.group  # the group's first query head
  kv_start = kv_block * block_kv
  kv_rows = _ragged(r.kv_len, block_kv)
  q_rows = _ragged(r.q_len, block_q)

  k = _load(k_ref, kv_start, kv_rows, r.head_dim)
  v = _load(v_ref, kv_start, kv_rows, r.head_dim_v)
  kv_seg = _load(segs[1], kv_start, kv_rows) if segs else None

  def per_head(head, carry):  # head: index within this kv head's query group
    def visit(q_block, carry, masked):
      dk, dv = carry
      q_slice = pl.ds(q_block * block_q, block_q)
      start = q_block * block_q
      # Interior q blocks are whole; rows past q_len (edges only) read q = dO = 0 and lse2 = +inf,
      # so their P and dS are exactly 0.
      rows = None if masked is False else q_rows
      q = _load(q_ref.at[q_slice, head, :], start, rows, r.head_dim)
      q_seg = _load(segs[0].at[q_slice], start, rows) if segs else None
      positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
      s2, chain = _tile_logits(st, q, k, q_block, kv_block, block_q, block_kv, masked, offsets_ref,
                               q_seg, kv_seg, _alibi(st, offsets_ref, first_head + head, positions),
                               (batch, first_head + head, operands) if r.has_mods else None, grad=True)
      # lse2 is +inf for rows that see no key, so their p is exactly 0.
      p = jnp.exp2(s2 - _load(lse2_ref.at[head, q_slice], start, rows, other=jnp.inf)[:, None])
      do = _load(do_ref.at[q_slice, head, :], start, rows, r.head_dim_v)
      dp = _dot(st, do, v, ((1,), (1,)))
      # Dropout: dV sums the kept, rescaled p; dP flows only through kept entries; D is unchanged.
      keep = _keep(st, offsets_ref, batch, first_head + head, positions)
      pk = p if keep is None else p * keep
      if keep is not None:
        dp = dp * keep
      dv = dv + _dot(st, pk.astype(do.dtype), do, ((0,), (0,)))
      ds = _grad_logits(st, p, dp, _load(delta_ref.at[head, q_slice], start, rows), chain)
      dk = dk + _dot(st, ds.astype(q.dtype), q, ((0,), (0,)))
      return dk, dv

    # Rows past kv_len of this block may hold junk in interior tiles (their keys are zeros, not
    # masked): each key's dK/dV row depends on its own column only, and those rows are not stored.
    return _walk(st, offsets_ref, table, kv_block, block_kv, r.kv_len, block_q, r.q_len, False,
                 visit, carry, map_row=batch if st.map_rows else 0)

  init = (jnp.zeros((block_kv, st.d_pad), jnp.float32), jnp.zeros((block_kv, st.dv_pad), jnp.float32))
  dk, dv = lax.fori_loop(0, st.group, per_head, init)
  _store(dk_ref, (dk * r.scale).astype(dk_ref.dtype), kv_start, kv_rows, r.head_dim)
  _store(dv_ref, dv.astype(dv_ref.dtype), kv_start, kv_rows, r.head_dim_v)


def _dq_kernel(st: _GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  offsets_ref, table, segs, refs = _split_refs(st, refs)
  operands, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref = refs
  r = st.request
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  q_block, bh = pl.program_id(0), pl.program_id(1)
  batch, head = bh // r.num_heads, bh % r.num_heads
  q_start = q_block * block_q
  q_rows = _ragged(r.q_len, block_q)
  kv_rows = _ragged(r.kv_len, block_kv)

  q = _load(q_ref, q_start, q_rows, r.head_dim)
  do = _load(do_ref, q_start, q_rows, r.head_dim_v)
  lse2 = _load(lse2_ref, q_start, q_rows, other=jnp.inf)
  delta = _load(delta_ref, q_start, q_rows)
  q_seg = _load(segs[0], q_start, q_rows) if segs else None

  def visit(kv_block, dq, masked):
    kv_slice = pl.ds(kv_block * block_kv, block_kv)
    start = kv_block * block_kv
    rows = None if masked is False else kv_rows
    kv_seg = _load(segs[1].at[kv_slice], start, rows) if segs else None
    k = _load(k_ref.at[kv_slice, :], start, rows, r.head_dim)
    positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, chain = _tile_logits(st, q, k, q_block, kv_block, block_q, block_kv, masked, offsets_ref,
                             q_seg, kv_seg, _alibi(st, offsets_ref, head, positions),
                             (batch, head, operands) if r.has_mods else None, grad=True)
    p = jnp.exp2(s2 - lse2[:, None])
    dp = _dot(st, do, _load(v_ref.at[kv_slice, :], start, rows, r.head_dim_v), ((1,), (1,)))
    keep = _keep(st, offsets_ref, batch, head, positions)
    if keep is not None:
      dp = dp * keep
    ds = _grad_logits(st, p, dp, delta, chain)
    return dq + _dot(st, ds.astype(k.dtype), k, ((1,), (0,)))

  dq = _walk(st, offsets_ref, table, q_block, block_q, r.q_len, block_kv, r.kv_len, True, visit,
             jnp.zeros((block_q, st.d_pad), jnp.float32), map_row=batch if st.map_rows else 0)
  _store(dq_ref, (dq * r.scale).astype(dq_ref.dtype), q_start, q_rows, r.head_dim)


# ----------------------------------------------------------------------------
# pallas_call wrappers (unpadded arrays; blocks are block multiples / powers of two)
# ----------------------------------------------------------------------------

def _visible_pairs(st: _GpuCall, batch: int) -> int:
  """(query, key) pairs the mask leaves visible, over batch and heads, for the cost estimates.

  Causal and window are counted exactly (at offset 0; the offsets may be traced),
  segment ids not at all: an upper bound.
  """
  r = st.request
  return batch * r.num_heads * mask_rules.count_visible(r.q_len, r.kv_len, r.spec)


def _mask_inputs(st: _GpuCall, offsets, q_seg, kv_seg, ops, *, by_q: bool, block_q: int, block_kv: int,
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
        shows, fills = kernel_mods.tile_flags(r, kernel_mods.unflatten(ops, st.operands),
                                              offsets[scalar_table.Q_OFFSET],
                                              offsets[scalar_table.KV_OFFSET], block_q, block_kv)
      tiles = tuple(jnp.broadcast_to(x, (r.batch, nq, nk)) for x in (shows, fills))  # a map row per row
    bmap = block_info.block_map(r.q_len, r.kv_len, block_q, block_kv, r.spec, q_seg, kv_seg,
                           offsets[scalar_table.Q_OFFSET], offsets[scalar_table.KV_OFFSET], tiles=tiles)
    if by_q:
      index, count, full = bmap.kv_index, bmap.kv_count, bmap.full
    else:
      index, count, full = bmap.q_index, bmap.q_count, jnp.swapaxes(bmap.full, 1, 2)
    full = jnp.take_along_axis(full, index, axis=-1)
    # Full blocks first, then the others, each in ascending order: the order `_visit_ranges` walks an
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


def _forward_call(st: _GpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  r = st.request
  batch = q.shape[0]
  h, g = r.num_heads, st.group
  cfg = st.cfg
  num_q_blocks = -(-r.q_len // cfg.block_q)
  kv_ext = round_up(r.kv_len, cfg.block_kv)  # the whole-row K/V block: a block multiple
  arrays, specs = _mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=True, block_q=cfg.block_q,
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
  pairs = _visible_pairs(st, batch)
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


def _backward_calls(st: _GpuCall, q, k, v, q_seg, kv_seg, offsets, ops, do, lse2, delta):
  r = st.request
  batch = q.shape[0]
  h, kvh, g = r.num_heads, r.num_kv_heads, st.group
  cfg = st.cfg
  block_q, block_kv = cfg.block_q_bwd, cfg.block_kv_bwd
  num_q_blocks = -(-r.q_len // block_q)
  num_kv_blocks = -(-r.kv_len // block_kv)
  q_ext, kv_ext = round_up(r.q_len, block_q), round_up(r.kv_len, block_kv)
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  pairs = _visible_pairs(st, batch)
  io_bytes = int(sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) * 2)

  # dK/dV: program (kv block, b * kv head); Q, dO, lse, D of the group's heads stay whole.
  arrays, specs = _mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=False, block_q=block_q,
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
  arrays, specs = _mask_inputs(st, offsets, q_seg, kv_seg, ops, by_q=True, block_q=block_q,
                               block_kv=block_kv, heads=h)
  specs += [
      pl.BlockSpec((None, block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, kv_ext, None, st.d_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, kv_ext, None, st.dv_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, block_q, None, st.dv_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, None, block_q), lambda i, j: (j // h, j % h, i)),
      pl.BlockSpec((None, None, block_q), lambda i, j: (j // h, j % h, i)),
  ]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st), grid=(num_q_blocks, batch * h),
      in_specs=specs,
      out_specs=pl.BlockSpec((None, block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=st.interpret, name="flash_pallas_gpu_backward_dq",
      cost_estimate=pl.CostEstimate(
          flops=2 * pairs * (2 * r.head_dim + r.head_dim_v),  # QK^T, dO V^T, dS K
          transcendentals=int(pairs), bytes_accessed=io_bytes),
  )(*arrays, q, k, v, do, lse2, delta)
  return dq, dk, dv


# ----------------------------------------------------------------------------
# The custom VJP
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _GpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  return _flash_forward(st, q, k, v, q_seg, kv_seg, offsets, ops)[0]


def _flash_forward(st, q, k, v, q_seg, kv_seg, offsets, ops):
  out, lse = _forward_call(st, q, k, v, q_seg, kv_seg, offsets, ops)
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, ops, out, lse)


def _flash_backward(st, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, ops, out, lse = residuals
  d_out, d_lse = cotangents
  # D_i = rowsum(dO * O)_i - dlse_i: lse's own cotangent enters dS = P * (dP - D) here.
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32),
                     precision=st.request.precision)
  delta = delta - d_lse
  # The operands: a mask_mod's have no gradient; a score_mod with floating ones never gets here
  # (FlashPallas.unsupported: "score_mod operand gradients"). The tile flags are booleans.
  flat, prebuilt = ops
  return (*_backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out),
          None, None, None, (tuple(None for _ in flat), None if prebuilt is None else (None, None)))


def _backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out):
  """dq, dk, dv from the rows' lse and delta [b, h, q] (unpadded [b, len, h, d] arrays)."""
  # Base-2 lse for the kernels; +inf for rows that see no key, so P = 0 there.
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
  return _backward_calls(st, q, k, v, q_seg, kv_seg, offsets, ops, d_out.astype(q.dtype), lse2, delta)


_flash.defvjp(_flash_forward, _flash_backward)


def _prepare(request: Request, args: Args, interpret: bool, batch: int):
  ops, metas = kernel_mods.flatten(args.mod_operands)
  st = _GpuCall(request=request, cfg=gpu_config.config(request), interpret=bool(interpret), operands=metas)
  prebuilt = None  # a block_mask's tile flags, used where the kernel's tiles are the block mask's
  if request.block_mask_tiles is not None and args.mod_tiles is not None:
    prebuilt = tuple(args.mod_tiles)
  # offsets, slopes, streams (scalar_table); the mods' inputs
  return st, scalar_table.build(request, args, batch), (ops, prebuilt)


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv] in q.dtype, lse [b, h, q] float32); differentiable in q, k, v and through lse."""
  st, offsets, ops = _prepare(request, args, interpret, q.shape[0])
  return _flash(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets, ops)


def attention_backward(q, k, v, lse, delta, d_out, *, request: Request, args: Args,
                       interpret: bool):
  """(dq, dk, dv) from given row statistics lse, delta [b, h, q]: the backward kernels only
  (see the TPU family's `attention_backward`)."""
  st, offsets, ops = _prepare(request, args, interpret, q.shape[0])
  return _backward_from_stats(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets, ops,
                              lse.astype(jnp.float32), delta.astype(jnp.float32), d_out)
