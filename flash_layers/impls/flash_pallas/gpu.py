"""flash_pallas on the GPU: our own Pallas flash-attention kernels, lowered through Triton.

The algorithm (FlashAttention-2, Dao 2023, arXiv 2307.08691), shaped for a GPU:

* Forward: one program per (q block, batch * head). The program keeps its q tile
  in registers and loops (`lax.fori_loop`, an `scf.for` in Triton) over the kv
  blocks that the mask makes visible to it, taken from `masks.block_map`: blocks
  no query of the tile can see are never loaded. Softmax is online, in float32
  and in base 2 (`exp2` is one instruction): a running row max `m`, a running
  denominator and an unnormalised accumulator, rescaled whenever the max
  grows. It writes the output and the row logsumexp (natural log, `-inf` for a
  row that sees no key; its output is zeros).
* Backward (custom VJP, from the saved logsumexp, nothing of size q x kv kept):
  P is recomputed tile by tile as exp(s - lse). With D_i = rowsum(dO * O)_i -
  dlse_i (the cotangent of lse enters here, so ring attention can differentiate
  through it), dS = P * (dP - D) where dP = dO V^T. Two kernels, neither needs
  atomics:
    - dK/dV: one program per (kv block, batch * kv head). It loops over the
      query heads of its GQA group and, per head, over the q blocks that see the
      kv block (`q_index`/`q_count` of the block map), accumulating dV += P^T dO
      and dK += dS^T Q in float32. A group's heads sum inside the program, so K/V
      are never repeated and no reduction over heads follows.
    - dQ: one program per (q block, batch * head), looping over visible kv
      blocks like the forward: dQ += dS K.
* GQA: program (.., b * h) reads kv head h // (num_heads // num_kv_heads).
* Any length: q and kv are padded inside to a block multiple; padded keys are
  masked; padded query rows are computed and dropped.
* head_dim 16..256: padded to a power of two (what `tl.dot` wants); the zero
  columns change neither logits nor outputs.
* Dropout and ALiBi: each tile hashes its keep mask (`dropout.keep`, the function every
  impl uses) and its ALiBi term from global positions, in the forward and again in
  both backward kernels. Slopes and per-(batch, head) dropout streams come in the
  small int32 offsets table (`dropout.kernel_table`).
* Masks: positions are global (`q_offset`/`kv_offset`, possibly traced, come in
  as a tiny int32 array), and the element predicate inside a tile is
  `masks.visible` itself, the one definition every impl uses. Tiles the block
  map marks `full` (every pair visible: most tiles of a long causal or packed
  sequence) skip the element mask behind an `scf.if`.

Tile sizes, warps and pipeline stages come from one table (`CONFIG_TABLE`) by
GPU generation and head_dim, and can be overridden per call with
`fl.attention(..., block_sizes=fl.GpuBlockSizes(...))`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers import dropout, masks
from flash_layers.impls.base import Args, Request
from flash_layers.impls.tiling import MIN_GPU_TILE, BlockSizes, GpuBlockSizes, pad_to, round_up

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256
# CUDA limits grid dimensions y and z to 65535; batch * heads runs on y.
MAX_GRID_Y = 65535


# ----------------------------------------------------------------------------
# Configuration: one table for every GPU generation we tune for
# ----------------------------------------------------------------------------

# (generation, largest head_dim of the bucket) -> defaults. Starting points from
# the usual FlashAttention-2 Triton settings, sized to each generation's shared
# memory (Hopper: 227 KiB per block, A100: 163 KiB, consumer Ampere/Ada: 99 KiB,
# hence the smaller "ampere" stages). Not yet tuned on hardware: see docs/kernels.md.
#
#   gen     head_dim  fwd q x kv  warps stages | bwd q x kv  warps stages
#   hopper    <=64     128 x 64     4     3    |   64 x 64     4     2
#   hopper   <=128     128 x 64     8     3    |   64 x 64     8     2
#   hopper   <=256      64 x 32     8     2    |   32 x 32     8     1
#   ampere    <=64     128 x 64     4     3    |   64 x 64     4     2
#   ampere   <=128     128 x 32     8     2    |   64 x 32     8     1
#   ampere   <=256      64 x 32     8     1    |   32 x 32     4     1
CONFIG_TABLE: dict[tuple[str, int], GpuBlockSizes] = {
    ("hopper", 64): GpuBlockSizes(128, 64, 64, 64, 4, 3, 4, 2),
    ("hopper", 128): GpuBlockSizes(128, 64, 64, 64, 8, 3, 8, 2),
    ("hopper", 256): GpuBlockSizes(64, 32, 32, 32, 8, 2, 8, 1),
    ("ampere", 64): GpuBlockSizes(128, 64, 64, 64, 4, 3, 4, 2),
    ("ampere", 128): GpuBlockSizes(128, 32, 64, 32, 8, 2, 8, 1),
    ("ampere", 256): GpuBlockSizes(64, 32, 32, 32, 8, 1, 4, 1),
}


@functools.cache
def gpu_generation() -> str:
  """'hopper' (sm_90+) or 'ampere' (sm_8x) from the local GPU; 'hopper' when there is none."""
  try:
    device = jax.local_devices(backend="gpu")[0]
  except (RuntimeError, ValueError):  # no GPU backend in this process
    return "hopper"
  capability = str(getattr(device, "compute_capability", "9.0"))
  try:
    major = int(capability.split(".")[0])
  except ValueError:
    return "hopper"
  return "ampere" if major < 9 else "hopper"


def _override(base: GpuBlockSizes, block_sizes: Any) -> GpuBlockSizes:
  """Apply `request.block_sizes`.

  `jax.lax.platform_dependent` traces both kernel families with the same request,
  so each family takes its own sizes and uses its defaults for the other's: a
  `GpuBlockSizes` replaces the table entry, the TPU family's `BlockSizes` is not
  for us.
  """
  if block_sizes is None or isinstance(block_sizes, BlockSizes):
    return base
  if isinstance(block_sizes, GpuBlockSizes):
    return block_sizes
  raise TypeError("block_sizes for the flash_pallas GPU kernels must be a flash_layers.GpuBlockSizes "
                  f"(or the TPU family's flash_layers.BlockSizes, ignored on GPU); got {block_sizes!r}")


def _fit(block: int, length: int) -> int:
  """Shrink a tile for short sequences (a 7-token call needs no 128-row tile)."""
  return max(MIN_GPU_TILE, min(block, pl.next_power_of_2(length)))


def config(request: Request) -> GpuBlockSizes:
  """The table entry for this GPU and head_dim, overridden by request.block_sizes, fit to the lengths."""
  head_dim = max(request.head_dim, request.head_dim_v)
  bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
  cfg = _override(CONFIG_TABLE[(gpu_generation(), bucket)], request.block_sizes)
  return dataclasses.replace(
      cfg, block_q=_fit(cfg.block_q, request.q_len), block_kv=_fit(cfg.block_kv, request.kv_len),
      block_q_bwd=_fit(cfg.block_q_bwd, request.q_len),
      block_kv_bwd=_fit(cfg.block_kv_bwd, request.kv_len))


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
  cfg = config(request)
  return cfg.block_q, cfg.block_kv


# ----------------------------------------------------------------------------
# Static description of one call (hashable: it is a custom_vjp nondiff argument)
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _GpuCall:
  request: Request
  cfg: GpuBlockSizes  # config(request): the tiles actually used
  interpret: bool

  @property
  def has_segments(self) -> bool:
    return self.request.has_segment_ids

  @property
  def group(self) -> int:
    return self.request.num_heads // self.request.num_kv_heads

  @property
  def q_pad(self) -> int:  # padded q length: a multiple of every q tile
    return round_up(self.request.q_len, max(self.cfg.block_q, self.cfg.block_q_bwd))

  @property
  def kv_pad(self) -> int:
    return round_up(self.request.kv_len, max(self.cfg.block_kv, self.cfg.block_kv_bwd))

  @property
  def d_pad(self) -> int:
    return max(MIN_GPU_TILE, pl.next_power_of_2(self.request.head_dim))

  @property
  def dv_pad(self) -> int:
    return max(MIN_GPU_TILE, pl.next_power_of_2(self.request.head_dim_v))

  @property
  def needs_mask(self) -> bool:
    """Whether tiles need the element mask at all (else every loaded pair is visible)."""
    return (self.request.spec.causal or self.request.spec.window is not None or self.has_segments
            or self.request.kv_len != self.kv_pad)


# ----------------------------------------------------------------------------
# The tile computation shared by all three kernels
# ----------------------------------------------------------------------------

def _positions(st: _GpuCall, offsets_ref, q_block, kv_block, block_q, block_kv):
  """Global positions of a tile: q [block_q, 1], kv [1, block_kv] (None when unused)."""
  if not (st.request.has_alibi or st.request.has_dropout):
    return None
  q_pos = offsets_ref[0] + q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
  kv_pos = offsets_ref[1] + kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
  return q_pos[:, None], kv_pos[None, :]


def _alibi(st: _GpuCall, offsets_ref, head, positions):
  """The ALiBi term of a tile (slope bits from the offsets table), or None."""
  if not st.request.has_alibi:
    return None
  return dropout.alibi(lax.bitcast_convert_type(offsets_ref[2 + head], jnp.float32), *positions)


def _keep(st: _GpuCall, offsets_ref, batch, head, positions):
  """The dropout multiplier of a tile (0 or 1 / (1 - rate)), or None."""
  r = st.request
  if not r.has_dropout:
    return None
  start = 2 + (r.num_heads if r.has_alibi else 0)
  stream = offsets_ref[start + batch * r.num_heads + head]
  kept = dropout.keep(stream, *positions, r.dropout_rate)
  return jnp.where(kept, jnp.float32(dropout.keep_scale(r.dropout_rate)), jnp.float32(0.0))


def _dot(st: _GpuCall, a, b, contract):
  """a . b over the `contract` dims in float32 at the request's precision: Pallas Triton makes
  float32 operands at HIGHEST IEEE products, at DEFAULT or HIGH TF32 ones. bfloat16/float16
  operands multiply exactly whatever the precision; they keep DEFAULT, as before."""
  precision = st.request.precision if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _tile_logits(st: _GpuCall, q, k, q_block, kv_block, block_q, block_kv, full, offsets_ref,
                 q_seg, kv_seg, alibi=None):
  """Base-2 logits of one [block_q, block_kv] tile, masked to -inf where invisible.

  `full` (from the block map) says every pair of the tile is visible: the element
  mask is then skipped (most tiles of a long causal or packed sequence are full).
  Returns (s2, tanh_t): s2 = logits * log2(e) in float32; tanh_t is tanh(x / softcap)
  (needed by the backward's chain rule) or None without softcap.
  """
  raw = _dot(st, q, k, ((1,), (1,)))
  tanh_t = None
  if st.request.softcap is None:
    s2 = raw * (st.request.scale * LOG2E)
    if alibi is not None:
      s2 = s2 + alibi * LOG2E
  else:
    x = raw * st.request.scale
    if alibi is not None:
      x = x + alibi
    tanh_t = jnp.tanh(x * (1.0 / st.request.softcap))
    s2 = tanh_t * (st.request.softcap * LOG2E)
  if not st.needs_mask:
    return s2, tanh_t

  def element_mask(s2):
    q_local = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
    kv_local = kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    q_pos = (offsets_ref[0] + q_local)[:, None]
    kv_pos = (offsets_ref[1] + kv_local)[None, :]
    ok = masks.visible(q_pos, kv_pos, st.request.spec,
                       None if q_seg is None else q_seg[:, None],
                       None if kv_seg is None else kv_seg[None, :])
    if st.request.kv_len != st.kv_pad:
      ok = ok & (kv_local < st.request.kv_len)[None, :]
    return jnp.where(ok, s2, -jnp.inf)

  return lax.cond(full != 0, lambda s2: s2, element_mask, s2), tanh_t


def _grad_logits(st: _GpuCall, p, dp, delta, tanh_t):
  """dS for one tile: P * (dP - D), through the softcap's tanh when there is one."""
  ds = p * (dp - delta[:, None])
  if tanh_t is not None:
    ds = ds * (1.0 - tanh_t * tanh_t)
  return ds


# ----------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------

def _forward_kernel(st: _GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  (offsets_ref, kv_index_ref, kv_count_ref, kv_full_ref), refs = refs[:4], refs[4:]
  if st.has_segments:
    (q_seg_ref, kv_seg_ref), refs = refs[:2], refs[2:]
  q_ref, k_ref, v_ref, o_ref, lse_ref = refs
  block_q, block_kv = st.cfg.block_q, st.cfg.block_kv
  q_block, bh = pl.program_id(0), pl.program_id(1)
  batch, head = bh // st.request.num_heads, bh % st.request.num_heads
  map_row = batch if st.has_segments else 0  # block map batch row

  q = q_ref[...]
  q_seg = q_seg_ref[...] if st.has_segments else None

  def visit(step, carry):
    acc, m, denom = carry
    kv_block = kv_index_ref[map_row, q_block, step]
    kv_slice = pl.ds(kv_block * block_kv, block_kv)
    kv_seg = kv_seg_ref[kv_slice] if st.has_segments else None
    positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, _ = _tile_logits(st, q, k_ref[kv_slice, :], q_block, kv_block, block_q, block_kv,
                         kv_full_ref[map_row, q_block, step], offsets_ref, q_seg, kv_seg,
                         _alibi(st, offsets_ref, head, positions))
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
    v = v_ref[kv_slice, :]
    pv = _dot(st, p.astype(v.dtype), v, ((1,), (0,)))
    return acc * rescale[:, None] + pv, m_new, denom

  init = (jnp.zeros((block_q, st.dv_pad), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, m, denom = lax.fori_loop(0, kv_count_ref[map_row, q_block], visit, init)

  seen = denom > 0  # False for a row that sees no key: zeros out, lse = -inf
  denom = jnp.where(seen, denom, 1.0)
  o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(denom)) * LN2, -jnp.inf)


# ----------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------

def _dkv_kernel(st: _GpuCall, *refs):
  """One program: kv block `program_id(0)` of (batch, kv head) `program_id(1)`."""
  (offsets_ref, q_index_ref, q_count_ref, q_full_ref), refs = refs[:4], refs[4:]
  if st.has_segments:
    (q_seg_ref, kv_seg_ref), refs = refs[:2], refs[2:]
  q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref = refs
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  kv_block, bkv = pl.program_id(0), pl.program_id(1)
  batch = bkv // st.request.num_kv_heads
  first_head = (bkv % st.request.num_kv_heads) * st.group  # the group's first query head
  map_row = batch if st.has_segments else 0

  k, v = k_ref[...], v_ref[...]
  kv_seg = kv_seg_ref[...] if st.has_segments else None
  num_q_blocks = q_count_ref[map_row, kv_block]

  def per_head(head, carry):  # head: index within this kv head's query group
    def visit(step, carry):
      dk, dv = carry
      q_block = q_index_ref[map_row, kv_block, step]
      q_slice = pl.ds(q_block * block_q, block_q)
      q = q_ref[q_slice, head, :]
      q_seg = q_seg_ref[q_slice] if st.has_segments else None
      positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
      s2, tanh_t = _tile_logits(st, q, k, q_block, kv_block, block_q, block_kv,
                                q_full_ref[map_row, kv_block, step], offsets_ref, q_seg, kv_seg,
                                _alibi(st, offsets_ref, first_head + head, positions))
      # lse2 is +inf for rows that see no key, so their p is exactly 0.
      p = jnp.exp2(s2 - lse2_ref[head, q_slice][:, None])
      do = do_ref[q_slice, head, :]
      dp = _dot(st, do, v, ((1,), (1,)))
      # Dropout: dV sums the kept, rescaled p; dP flows only through kept entries; D is unchanged.
      keep = _keep(st, offsets_ref, batch, first_head + head, positions)
      pk = p if keep is None else p * keep
      if keep is not None:
        dp = dp * keep
      dv = dv + _dot(st, pk.astype(do.dtype), do, ((0,), (0,)))
      ds = _grad_logits(st, p, dp, delta_ref[head, q_slice], tanh_t)
      dk = dk + _dot(st, ds.astype(q.dtype), q, ((0,), (0,)))
      return dk, dv

    return lax.fori_loop(0, num_q_blocks, visit, carry)

  init = (jnp.zeros((block_kv, st.d_pad), jnp.float32), jnp.zeros((block_kv, st.dv_pad), jnp.float32))
  dk, dv = lax.fori_loop(0, st.group, per_head, init)
  dk_ref[...] = (dk * st.request.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(st: _GpuCall, *refs):
  """One program: q block `program_id(0)` of (batch, head) `program_id(1)`."""
  (offsets_ref, kv_index_ref, kv_count_ref, kv_full_ref), refs = refs[:4], refs[4:]
  if st.has_segments:
    (q_seg_ref, kv_seg_ref), refs = refs[:2], refs[2:]
  q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref = refs
  block_q, block_kv = st.cfg.block_q_bwd, st.cfg.block_kv_bwd
  q_block, bh = pl.program_id(0), pl.program_id(1)
  batch, head = bh // st.request.num_heads, bh % st.request.num_heads
  map_row = batch if st.has_segments else 0

  q, do = q_ref[...], do_ref[...]
  lse2, delta = lse2_ref[...], delta_ref[...]
  q_seg = q_seg_ref[...] if st.has_segments else None

  def visit(step, dq):
    kv_block = kv_index_ref[map_row, q_block, step]
    kv_slice = pl.ds(kv_block * block_kv, block_kv)
    kv_seg = kv_seg_ref[kv_slice] if st.has_segments else None
    k = k_ref[kv_slice, :]
    positions = _positions(st, offsets_ref, q_block, kv_block, block_q, block_kv)
    s2, tanh_t = _tile_logits(st, q, k, q_block, kv_block, block_q, block_kv,
                              kv_full_ref[map_row, q_block, step], offsets_ref, q_seg, kv_seg,
                              _alibi(st, offsets_ref, head, positions))
    p = jnp.exp2(s2 - lse2[:, None])
    dp = _dot(st, do, v_ref[kv_slice, :], ((1,), (1,)))
    keep = _keep(st, offsets_ref, batch, head, positions)
    if keep is not None:
      dp = dp * keep
    ds = _grad_logits(st, p, dp, delta, tanh_t)
    return dq + _dot(st, ds.astype(k.dtype), k, ((1,), (0,)))

  dq = lax.fori_loop(0, kv_count_ref[map_row, q_block], visit,
                     jnp.zeros((block_q, st.d_pad), jnp.float32))
  dq_ref[...] = (dq * st.request.scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------
# pallas_call wrappers (arrays already padded)
# ----------------------------------------------------------------------------

def _visible_pairs(st: _GpuCall, batch: int) -> int:
  """(query, key) pairs the mask leaves visible, over batch and heads, for the cost estimates.

  Causal and window are counted exactly (at offset 0; the offsets may be traced),
  segment ids not at all: an upper bound.
  """
  r = st.request
  return batch * r.num_heads * masks.count_visible(r.q_len, r.kv_len, r.spec)


def _mask_inputs(st: _GpuCall, bmap: masks.BlockMap, offsets, q_seg, kv_seg, *, by_q: bool,
                 block_q: int, block_kv: int, heads: int):
  """Inputs and BlockSpecs shared by the three kernels: offsets, block lists, segment ids.

  by_q: programs own a q block and walk its kv blocks (forward, dQ); else they own
  a kv block and walk its q blocks (dK/dV). Each list comes with the `full` flag
  of every listed block, in list order. The lists and offsets are small and read
  as scalars (Triton has no scalar prefetch), so they are passed whole.
  """
  if by_q:
    index, count, full = bmap.kv_index, bmap.kv_count, bmap.full
  else:
    index, count, full = bmap.q_index, bmap.q_count, jnp.swapaxes(bmap.full, 1, 2)
  full = jnp.take_along_axis(full, index, axis=-1).astype(jnp.int32)
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731
  arrays = [offsets, index, count, full]
  specs = [whole(x) for x in arrays]
  if st.has_segments:
    arrays += [q_seg, kv_seg]
    if by_q:  # program (q block, b * heads): its q ids, the whole kv row
      specs += [pl.BlockSpec((None, block_q), lambda i, j: (j // heads, i)),
                pl.BlockSpec((None, st.kv_pad), lambda i, j: (j // heads, 0))]
    else:  # program (kv block, b * kv heads): the whole q row, its kv ids
      specs += [pl.BlockSpec((None, st.q_pad), lambda i, j: (j // heads, 0)),
                pl.BlockSpec((None, block_kv), lambda i, j: (j // heads, i))]
  return arrays, specs


def _forward_call(st: _GpuCall, bmap: masks.BlockMap, q, k, v, q_seg, kv_seg, offsets):
  batch = q.shape[0]
  h, g = st.request.num_heads, st.group
  cfg = st.cfg
  num_q_blocks = -(-st.request.q_len // cfg.block_q)
  arrays, specs = _mask_inputs(st, bmap, offsets, q_seg, kv_seg, by_q=True,
                               block_q=cfg.block_q, block_kv=cfg.block_kv, heads=h)
  specs += [
      pl.BlockSpec((None, cfg.block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, st.kv_pad, None, st.d_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, st.kv_pad, None, st.dv_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, cfg.block_q, None, st.dv_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, None, cfg.block_q), lambda i, j: (j // h, j % h, i)),
  ]
  out_shape = [jax.ShapeDtypeStruct((batch, st.q_pad, h, st.dv_pad), q.dtype),
               jax.ShapeDtypeStruct((batch, h, st.q_pad), jnp.float32)]
  pairs = _visible_pairs(st, batch)
  cost = pl.CostEstimate(
      flops=2 * pairs * (st.request.head_dim + st.request.head_dim_v),  # QK^T, PV
      transcendentals=int(pairs * (2 if st.request.softcap else 1)),
      bytes_accessed=int(sum(x.size * x.dtype.itemsize for x in (q, k, v)) * 2))
  return pl.pallas_call(
      functools.partial(_forward_kernel, st), grid=(num_q_blocks, batch * h),
      in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      cost_estimate=cost, interpret=st.interpret, name="flash_pallas_gpu_forward",
  )(*arrays, q, k, v)


def _backward_calls(st: _GpuCall, bmap: masks.BlockMap, q, k, v, q_seg, kv_seg, offsets, do, lse2,
                    delta):
  batch = q.shape[0]
  h, kvh, g = st.request.num_heads, st.request.num_kv_heads, st.group
  cfg = st.cfg
  block_q, block_kv = cfg.block_q_bwd, cfg.block_kv_bwd
  num_q_blocks = -(-st.request.q_len // block_q)
  num_kv_blocks = -(-st.request.kv_len // block_kv)
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  pairs = _visible_pairs(st, batch)
  io_bytes = int(sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) * 2)

  # dK/dV: program (kv block, b * kv head); Q, dO, lse, D of the group's heads stay whole.
  arrays, specs = _mask_inputs(st, bmap, offsets, q_seg, kv_seg, by_q=False,
                               block_q=block_q, block_kv=block_kv, heads=kvh)
  specs += [
      pl.BlockSpec((None, st.q_pad, g, st.d_pad), lambda i, j: (j // kvh, 0, j % kvh, 0)),
      pl.BlockSpec((None, block_kv, None, st.d_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
      pl.BlockSpec((None, block_kv, None, st.dv_pad), lambda i, j: (j // kvh, i, j % kvh, 0)),
      pl.BlockSpec((None, st.q_pad, g, st.dv_pad), lambda i, j: (j // kvh, 0, j % kvh, 0)),
      pl.BlockSpec((None, g, st.q_pad), lambda i, j: (j // kvh, j % kvh, 0)),
      pl.BlockSpec((None, g, st.q_pad), lambda i, j: (j // kvh, j % kvh, 0)),
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
          flops=4 * pairs * (st.request.head_dim + st.request.head_dim_v),  # QK^T, P^T dO, dO V^T, dS^T Q
          transcendentals=int(pairs), bytes_accessed=io_bytes),
  )(*arrays, q, k, v, do, lse2, delta)

  # dQ: program (q block, b * head), looping over visible kv blocks like the forward.
  arrays, specs = _mask_inputs(st, bmap, offsets, q_seg, kv_seg, by_q=True,
                               block_q=block_q, block_kv=block_kv, heads=h)
  specs += [
      pl.BlockSpec((None, block_q, None, st.d_pad), lambda i, j: (j // h, i, j % h, 0)),
      pl.BlockSpec((None, st.kv_pad, None, st.d_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
      pl.BlockSpec((None, st.kv_pad, None, st.dv_pad), lambda i, j: (j // h, 0, (j % h) // g, 0)),
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
          flops=2 * pairs * (2 * st.request.head_dim + st.request.head_dim_v),  # QK^T, dO V^T, dS K
          transcendentals=int(pairs), bytes_accessed=io_bytes),
  )(*arrays, q, k, v, do, lse2, delta)
  return dq, dk, dv


# ----------------------------------------------------------------------------
# Padding and the custom VJP
# ----------------------------------------------------------------------------

def _pad_inputs(st: _GpuCall, q, k, v, q_seg, kv_seg):
  q = pad_to(pad_to(q, 1, st.q_pad), 3, st.d_pad)
  k = pad_to(pad_to(k, 1, st.kv_pad), 3, st.d_pad)
  v = pad_to(pad_to(v, 1, st.kv_pad), 3, st.dv_pad)
  if st.has_segments:  # padded keys are masked by position; the ids there do not matter
    q_seg, kv_seg = pad_to(q_seg, 1, st.q_pad), pad_to(kv_seg, 1, st.kv_pad)
  return q, k, v, q_seg, kv_seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _GpuCall, q, k, v, q_seg, kv_seg, offsets):
  return _flash_forward(st, q, k, v, q_seg, kv_seg, offsets)[0]


def _block_map(st: _GpuCall, block_q: int, block_kv: int, q_seg, kv_seg, offsets) -> masks.BlockMap:
  """The shared block map for these tiles (on the unpadded segment ids)."""
  r = st.request
  return masks.block_map(r.q_len, r.kv_len, block_q, block_kv, r.spec, q_seg, kv_seg, offsets[0], offsets[1])


def _flash_forward(st, q, k, v, q_seg, kv_seg, offsets):
  bmap = _block_map(st, st.cfg.block_q, st.cfg.block_kv, q_seg, kv_seg, offsets)
  out, lse = _forward_call(st, bmap, *_pad_inputs(st, q, k, v, q_seg, kv_seg), offsets)
  r = st.request
  out, lse = out[:, :r.q_len, :, :r.head_dim_v], lse[:, :, :r.q_len]
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, out, lse)


def _flash_backward(st, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, out, lse = residuals
  d_out, d_lse = cotangents
  # D_i = rowsum(dO * O)_i - dlse_i: lse's own cotangent enters dS = P * (dP - D) here.
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32),
                     precision=st.request.precision)
  delta = delta - d_lse
  return (*_backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, lse, delta, d_out),
          None, None, None)


def _backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, lse, delta, d_out):
  """dq, dk, dv from the rows' lse and delta [b, h, q] (unpadded [b, len, h, d] arrays)."""
  # Base-2 lse for the kernels; +inf for rows that see no key (and padded rows), so P = 0 there.
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
  qp, kp, vp, q_seg_p, kv_seg_p = _pad_inputs(st, q, k, v, q_seg, kv_seg)
  do = pad_to(pad_to(d_out.astype(q.dtype), 1, st.q_pad), 3, st.dv_pad)
  lse2 = pad_to(lse2, 2, st.q_pad, jnp.inf)
  delta = pad_to(delta, 2, st.q_pad)
  bmap = _block_map(st, st.cfg.block_q_bwd, st.cfg.block_kv_bwd, q_seg, kv_seg, offsets)
  dq, dk, dv = _backward_calls(st, bmap, qp, kp, vp, q_seg_p, kv_seg_p, offsets, do, lse2, delta)
  r = st.request
  dq = dq[:, :r.q_len, :, :r.head_dim]
  dk, dv = dk[:, :r.kv_len, :, :r.head_dim], dv[:, :r.kv_len, :, :r.head_dim_v]
  return dq, dk, dv


_flash.defvjp(_flash_forward, _flash_backward)


def _prepare(request: Request, args: Args, interpret: bool, batch: int):
  st = _GpuCall(request, config(request), bool(interpret))
  offsets = jnp.concatenate([  # [q_offset, kv_offset, alibi slopes, dropout streams]
      jnp.stack([jnp.asarray(args.q_offset, jnp.int32), jnp.asarray(args.kv_offset, jnp.int32)]),
      dropout.kernel_table(request, args, batch, request.num_heads)])
  return st, offsets


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv] in q.dtype, lse [b, h, q] float32); differentiable in q, k, v and through lse."""
  st, offsets = _prepare(request, args, interpret, q.shape[0])
  return _flash(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets)


def attention_backward(q, k, v, lse, delta, d_out, *, request: Request, args: Args,
                       interpret: bool):
  """(dq, dk, dv) from given row statistics lse, delta [b, h, q]: the backward kernels only
  (see the TPU family's `attention_backward`)."""
  st, offsets = _prepare(request, args, interpret, q.shape[0])
  return _backward_from_stats(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets,
                              lse.astype(jnp.float32), delta.astype(jnp.float32), d_out)
