"""flash_pallas's paged-attention kernel for the GPU (Triton): a ragged batch against a shared KV pool.

The contract (the pool, the page table, the ragged queries, quantized pages) is `contract/paged.py`;
`impls/paged/kernels.py` calls `paged_attention` with the pool in our `LAYOUT`.

Grid ``(num_tiles, kv_heads)``: one program per q tile of `paged_plan` (consecutive tokens of one
sequence, at most `block_q` of them) and kv head. Its rows are the tile's tokens for each query head of
the kv head's GQA group (row ``i * block_q + t``: group head i, token t), so each key and value is
read once for the whole group, and a decoding token of an 8:1 model still fills 8 rows. The q tile,
padded in HBM to a power of two of at least 16 rows and head_dim columns (what ``tl.dot`` wants), stays
in registers while the program loops (`lax.fori_loop`, an ``scf.for``) over the keys its tile can see:
``[kv_start, kv_stop)`` of `paged.kv_range` (causal stops at the tile's last position, a window starts
at its first position's left edge), in blocks of `block_kv` keys, with the online softmax in float32
registers, in base 2.

The pool. Pages are passed whole (the pointer to the pool; Triton has no scalar prefetch, so the page
table and the tile plan are whole int32 arrays read as scalars and small vectors). Key block b of a
program covers sequence positions ``[b * block_kv, (b + 1) * block_kv)``; key j of it lives in page
``page_table[seq, j // page_size]`` at row ``j % page_size``, so the block is one gathered load: the
page ids of its keys (a [block_kv] load from the table row, cached: most are the same page), then the
``[block_kv, head_dim]`` rows ``k_pages[page, row, kv_head, :]``. Nothing ties the block to the page:
a page larger than the block is read in several steps, pages smaller than it several to a step, and
any page_size works. In the "flax" layout a key's head_dim is contiguous, and that is all a Triton
pointer load vectorizes over (per row, 16 bytes at a time); "heads_first" would make a page of one head
one contiguous block, which pointer loads gain nothing from, so the kernel reads "flax" and no pool is
transposed for it.

Blocks wholly inside every row's visible range (below the tile's first position when causal, right of
its last position's window edge, all keys real) run without the element mask; the edge blocks, and
every block under a mask_mod, apply `paged.visible` (the length, causal, the window, the mask_mod).
Keys past the sequence's length are never loaded (masked loads), neither their page table entries,
which the contract allows to be anything.

Quantized pages (int8, float8_e4m3fn) carry a float32 scale per token and kv head. The scales factor
out of both products, so the kernel dequantizes in the logits and probabilities instead of the
elements: ``q . (k * ks) = (q . k) * ks`` per key column, and ``sum_j p_j (v_j * vs_j) = (p * vs) . v``.
The integer and e4m3 values are exact in bfloat16 and float32, so the key dot multiplies them exactly
(in bfloat16 for a bfloat16 q, `_dot_dtype`), the value dot rounds only p * vs (as it rounds p for
float pages), and only [rows, block_kv] tiles are scaled, never a [block_kv, head_dim] one. Triton
converts e4m3 on sm_89 and later.

The tiles' results go back to q's rows with `paged_plan.scatter_out` (padding rows: zeros, lse -inf);
sinks are merged by the caller from the lse. Forward only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.impls.flash_pallas import paged_plan
from flash_layers.impls.flash_pallas.gpu_common import (
  LN2,
  LOG2E,
  load,
  pow2_tile,
  softmax_update,
  store,
  visit_ranges,
)
from flash_layers.impls.tiling import MIN_GPU_TILE

LAYOUT = "flax"
# Rows per tile to aim for (the GQA group's heads times block_q tokens): 64 rows of up to 128 dims keep
# the q tile, the float32 accumulator and a [64, 64] logits tile in 4 warps' registers.
TARGET_ROWS = 64
# Keys per loop step, for head dims up to 128; wider heads take 32 (as the decode kernel).
BLOCK_KV = 64
NUM_STAGES = 2
# Warps by what a program keeps in registers for its whole loop, the q tile and the float32 accumulator:
# up to 48 KiB (64 rows of 128 dims, bfloat16 q) 4 warps, beyond that (float32 q, 256 dims) 8. An
# estimate, not tuned on hardware.
WARP_BYTES = 48 * 1024
# What the kernel takes: dtypes Triton loads and multiplies, the widest head a program's registers hold.
Q_DTYPES = ("float32", "bfloat16", "float16")
PAGE_DTYPES = ("float32", "bfloat16", "float16", *paged.QUANTIZED_DTYPES)
MAX_HEAD_DIM = 256
MAX_GROUP = 128
# Rows of the plan table, one column per tile (`paged_plan.QTiles` and the tile's sequence length).
_PLAN = ("seq", "count", "first_pos", "kv_start", "kv_stop", "kv_len")


def unsupported(spec: PagedSpec) -> str | None:
  """The first feature of `spec` the kernel cannot serve, or None. Any page_size and head_dim up to
  `MAX_HEAD_DIM` (padded to a power of two in registers, masked in memory); float8_e4m3fn pages need
  sm_89 or later (Triton's e4m3 conversion), which only the device can tell."""
  if spec.dtype not in Q_DTYPES:
    return f"q dtype {spec.dtype} (the Triton kernel takes {', '.join(Q_DTYPES)})"
  if spec.kv_dtype not in PAGE_DTYPES:
    return f"page dtype {spec.kv_dtype} (the Triton kernel takes {', '.join(PAGE_DTYPES)})"
  if max(spec.head_dim, spec.head_dim_v) > MAX_HEAD_DIM:
    return (f"head_dim {max(spec.head_dim, spec.head_dim_v)} > {MAX_HEAD_DIM} (the widest q tile and "
            "accumulator a program's registers hold)")
  if spec.group > MAX_GROUP:
    return f"{spec.group} query heads per kv head > {MAX_GROUP} (a tile holds a whole GQA group)"
  return None


def tiles(spec: PagedSpec) -> tuple[int, int]:
  """(block_q, block_kv): tokens per q tile and keys per loop step.

  block_q fills about `TARGET_ROWS` rows with the GQA group (at least one token; never more than
  the call's tokens). A batch of at most one token per sequence (num_tokens <= max_seqs: decoding)
  aims at 16 rows instead, the least ``tl.dot`` takes: its tiles hold one token each, and a
  64-row tile would be mostly padding. block_kv is `BLOCK_KV` (half for heads wider than 128),
  never more than a sequence holds, at least 16.
  """
  rows = TARGET_ROWS if spec.num_tokens > spec.max_seqs else MIN_GPU_TILE
  block_q = max(1, min(rows // spec.group, pl.next_power_of_2(spec.num_tokens)))
  block_kv = BLOCK_KV if max(spec.head_dim, spec.head_dim_v) <= 128 else BLOCK_KV // 2
  return block_q, pow2_tile(min(block_kv, spec.max_kv_len))


def num_warps(spec: PagedSpec, rows_pad: int) -> int:
  """Warps of a program: 4, or 8 when its q tile and accumulator exceed `WARP_BYTES`."""
  held = rows_pad * (pow2_tile(spec.head_dim) * _dot_dtype(spec).itemsize + pow2_tile(spec.head_dim_v) * 4)
  return 4 if held <= WARP_BYTES else 8


def _dot_dtype(spec: PagedSpec):
  """The operands' dtype in both dots. bfloat16 q multiplies bfloat16 pages, or quantized ones (their
  values are exact in bfloat16; the probabilities, scaled by the value scales, keep its 8-bit
  exponent), in bfloat16; float16 q float16 pages in float16 (a quantized page's scaled
  probabilities could fall below float16's normal range: float32); anything else in float32."""
  if spec.dtype == "bfloat16" and spec.kv_dtype in ("bfloat16", *paged.QUANTIZED_DTYPES):
    return jnp.dtype(jnp.bfloat16)
  if spec.dtype == spec.kv_dtype == "float16":
    return jnp.dtype(jnp.float16)
  return jnp.dtype(jnp.float32)


def _dot(spec: PagedSpec, a, b, contract):
  """a . b in float32: float32 operands at the call's precision (`PagedSpec.precision`: HIGHEST, IEEE
  products, unless q is bfloat16), 16-bit ones exact."""
  precision = spec.precision if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _interior(spec: PagedSpec, first, last, kv_len, lo, hi, block_kv: int):
  """[full_lo, full_hi) within the blocks [lo, hi): the blocks every row of the tile (positions
  [first, last]) sees whole and whose keys are all real, which need no element mask. Empty under a
  mask_mod (it may hide any key)."""
  if spec.mask_mod is not None:
    return lo, lo
  all_start = 0  # keys at or after it are seen by every row (left side)...
  all_end = kv_len - 1  # ...and those at or before it (right side)
  if spec.window is not None:
    left, right = spec.window
    all_start = last - left
    if not spec.causal:
      all_end = jnp.minimum(all_end, first + right)
  if spec.causal:
    all_end = jnp.minimum(all_end, first)
  full_lo = jnp.clip((all_start + block_kv - 1) // block_kv, lo, hi)
  return full_lo, jnp.clip((all_end + 1) // block_kv, full_lo, hi)


def _logits(spec: PagedSpec, s):
  """Base-2 logits of the raw products s: scale, then the softcap, times log2(e)."""
  if spec.softcap is None:
    return s * (spec.scale * LOG2E)
  return jnp.tanh(s * (spec.scale / spec.softcap)) * (spec.softcap * LOG2E)


class _Keys(NamedTuple):
  """Where a block's keys lie in the pool: per key its page and row in the page ([block_kv] each), the
  kv head, and the masked-load bounds (the block's first position; the sequence's length, or None
  where every key is real)."""

  page: jax.Array
  slot: jax.Array
  kv_head: jax.Array
  start: jax.Array
  length: jax.Array | None

  def load(self, ref, width: int | None = None):
    """The block's rows of `ref`: [block_kv, width_pad] of pages (columns past `width` read as 0), or
    [block_kv] of scales. Every index is an array (a gather of rows; interpret mode takes no mix of
    index arrays and slices)."""
    if width is None:
      return load(ref.at[self.page, self.slot, self.kv_head], self.start, self.length)
    cols = jnp.arange(ref.shape[-1], dtype=jnp.int32)[None, :]
    view = ref.at[self.page[:, None], self.slot[:, None], self.kv_head, cols]
    return load(view, self.start, self.length, width)


def _kernel(plan_ref, table_ref, q_ref, k_ref, v_ref, *refs, spec: PagedSpec, block_q: int, block_kv: int):
  """One program: q tile `program_id(0)` of the plan, kv head `program_id(1)`."""
  if spec.quantized:
    ks_ref, vs_ref, o_ref, lse_ref = refs
  else:
    (o_ref, lse_ref), ks_ref, vs_ref = refs, None, None
  tile, kv_head = pl.program_id(0), pl.program_id(1)
  seq, count, first, kv_start, kv_stop, kv_len = (plan_ref[i, tile] for i in range(len(_PLAN)))
  dtype = _dot_dtype(spec)
  rows_pad = q_ref.shape[0]
  row = jnp.arange(rows_pad, dtype=jnp.int32)
  # Row i * block_q + t: head i of the group, token t (rows past the tile's tokens repeat its last one,
  # as `gather_q` fills them; padding rows past the group are zeros, cut off when stored).
  q_pos = (first + jnp.minimum(row % block_q, jnp.maximum(count, 1) - 1))[:, None]
  head = (kv_head * spec.group + jnp.minimum(row // block_q, spec.group - 1))[:, None]
  q = q_ref[...].astype(dtype)

  def visit(block, carry, masked: bool):
    acc, m, denom = carry
    start = block * block_kv
    kv_pos = start + jnp.arange(block_kv, dtype=jnp.int32)
    length = kv_len if masked else None  # interior blocks hold only real keys: no row mask
    # The page and row of each key: one gathered [block_kv] read of the table row, then of the pool.
    page = load(table_ref.at[seq, kv_pos // spec.page_size], start, length)
    key = _Keys(page, kv_pos % spec.page_size, kv_head, start, length)
    k = key.load(k_ref, spec.head_dim)
    s = _dot(spec, q, k.astype(dtype), ((1,), (1,)))  # [rows_pad, block_kv]
    if ks_ref is not None:  # q . (k * ks) = (q . k) * ks, per key
      s = s * key.load(ks_ref)[None, :]
    s2 = _logits(spec, s)
    if masked:
      s2 = jnp.where(paged.visible(spec, q_pos, kv_pos[None, :], kv_len, seq, head), s2, -jnp.inf)
    m_new, p, rescale = softmax_update(m, s2)
    v = key.load(v_ref, spec.head_dim_v)
    pv = p if vs_ref is None else p * key.load(vs_ref)[None, :]
    acc = acc * rescale[:, None] + _dot(spec, pv.astype(dtype), v.astype(dtype), ((1,), (0,)))
    return acc, m_new, denom * rescale + p.sum(axis=-1)

  # The blocks of [kv_start, kv_stop) (`paged.kv_range`; an empty tile has none), interior first.
  lo, hi = kv_start // block_kv, (kv_stop + block_kv - 1) // block_kv
  full_lo, full_hi = _interior(spec, first, first + count - 1, kv_len, lo, hi, block_kv)
  init = (jnp.zeros((rows_pad, o_ref.shape[-1]), jnp.float32), jnp.full((rows_pad,), -jnp.inf, jnp.float32),
          jnp.zeros((rows_pad,), jnp.float32))
  acc, m, denom = visit_ranges((lo, full_lo, full_hi, hi), visit, init)
  seen = denom > 0  # False for a row that sees no key (a mask_mod, an empty tile): zeros, lse -inf
  denom = jnp.where(seen, denom, 1.0)
  rows = spec.group * block_q
  length = rows if rows < rows_pad else None
  store(o_ref, (acc / denom[:, None]).astype(o_ref.dtype), 0, length, spec.head_dim_v)
  store(lse_ref, jnp.where(seen, (m + jnp.log2(denom)) * LN2, -jnp.inf), 0, length)


def _cost(spec: PagedSpec, num_tiles: int, block_q: int, arrays) -> pl.CostEstimate:
  """An upper bound (the lengths are traced): every token sees at most the window's keys or a full
  table, and a program reads at most its tile's keys (the span plus its tokens), never more than the
  pool."""
  span = spec.max_kv_len
  if spec.window is not None:
    span = min(span, spec.window[0] + 1 + (0 if spec.causal else spec.window[1]))
  pairs = spec.num_tokens * spec.num_heads * span
  keys = min(spec.num_pages * spec.page_size, num_tiles * min(span + block_q - 1, spec.max_kv_len))
  item = jnp.dtype(spec.kv_dtype).itemsize
  per_key = spec.num_kv_heads * (item * (spec.head_dim + spec.head_dim_v) + 8 * spec.quantized)
  out_bytes = spec.num_tokens * spec.num_heads * (spec.head_dim_v * jnp.dtype(spec.dtype).itemsize + 4)
  small = sum(x.size * x.dtype.itemsize for x in arrays)  # the plan, the table and the q tiles
  return pl.CostEstimate(flops=int(2 * pairs * (spec.head_dim + spec.head_dim_v)),
                         transcendentals=int(pairs * (1 + (spec.softcap is not None))),
                         bytes_accessed=int(small + keys * per_key + out_bytes))


def paged_attention(q, k_pages, v_pages, k_scales, v_scales, page_table, kv_lens, cu_q_lens, num_seqs, *,
                    spec: PagedSpec, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(out [tokens, heads, head_dim_v] in q's dtype, lse [tokens, heads] float32) of a paged call, pages
  and scales in the "flax" layout; padding rows get zeros and -inf."""
  if spec.num_tokens == 0:  # no tile, no program (Triton takes no empty grid)
    return (jnp.zeros((0, spec.num_heads, spec.head_dim_v), q.dtype),
            jnp.zeros((0, spec.num_heads), jnp.float32))
  block_q, block_kv = tiles(spec)
  plan = paged_plan.q_tiles(spec, cu_q_lens, kv_lens, num_seqs, block_q)
  rows = spec.group * block_q
  rows_pad, d_pad, dv_pad = pow2_tile(rows), pow2_tile(spec.head_dim), pow2_tile(spec.head_dim_v)
  q_tiles = jnp.pad(paged_plan.gather_q(spec, q, plan, block_q),
                    ((0, 0), (0, 0), (0, rows_pad - rows), (0, d_pad - spec.head_dim)))
  num_tiles = q_tiles.shape[0]
  table = jnp.stack([plan.seq, plan.count, plan.first_pos, plan.kv_start, plan.kv_stop,
                     kv_lens.astype(jnp.int32)[plan.seq]])  # `_PLAN`'s rows
  # Read whole: the plan and page table as scalars and vectors, the pool (and its scales) by pointer,
  # its head_dim padded to the tile's power of two (masked loads: no copy).
  whole = lambda x, last=None: pl.BlockSpec((*x.shape[:-1], last or x.shape[-1]),  # noqa: E731
                                            lambda t, h: (0,) * x.ndim)
  arrays = [table, page_table.astype(jnp.int32), q_tiles, k_pages, v_pages]
  specs = [whole(table), whole(page_table), pl.BlockSpec((None, None, rows_pad, d_pad),
                                                         lambda t, h: (t, h, 0, 0)),
           whole(k_pages, d_pad), whole(v_pages, dv_pad)]
  if spec.quantized:
    arrays += [k_scales, v_scales]
    specs += [whole(k_scales), whole(v_scales)]
  kvh = spec.num_kv_heads
  out, lse = pl.pallas_call(
      functools.partial(_kernel, spec=spec, block_q=block_q, block_kv=block_kv), grid=(num_tiles, kvh),
      in_specs=specs,
      out_specs=[pl.BlockSpec((None, None, rows_pad, dv_pad), lambda t, h: (t, h, 0, 0)),
                 pl.BlockSpec((None, None, rows_pad), lambda t, h: (t, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((num_tiles, kvh, rows, spec.head_dim_v), q.dtype),
                 jax.ShapeDtypeStruct((num_tiles, kvh, rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps(spec, rows_pad), num_stages=NUM_STAGES),
      cost_estimate=_cost(spec, num_tiles, block_q, arrays[:3]), interpret=interpret,
      name="flash_pallas_gpu_paged",
  )(*arrays)
  return paged_plan.scatter_out(spec, out, lse, cu_q_lens, num_seqs, block_q, q.dtype)


def grid_points(spec: PagedSpec, page_table, kv_lens, cu_q_lens, num_seqs) -> int:
  """The programs that do work: (q tile, kv head) pairs of the tiles holding tokens (the grid's other
  tiles are the plan's static padding and exit at once; a program's pages are its own loop)."""
  if spec.num_tokens == 0:
    return 0
  block_q, _ = tiles(spec)
  plan = paged_plan.q_tiles(spec, jnp.asarray(cu_q_lens), jnp.asarray(kv_lens), jnp.asarray(num_seqs),
                            block_q)
  return int(np.count_nonzero(np.asarray(plan.count))) * spec.num_kv_heads
