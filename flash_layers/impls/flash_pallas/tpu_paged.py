"""flash_pallas's paged-attention kernel for the TPU (Mosaic): a ragged batch against a paged KV pool.

The contract is `contract/paged.py`; `impls/paged/kernels.py` calls this module (``LAYOUT``,
`unsupported`, `paged_attention`, `grid_points`).

Tiles. The queries are cut into q tiles of one sequence each (`paged_plan.q_tiles`): at most
``block_q`` consecutive new tokens of one sequence, and, for kv head h, the rows of h's GQA group
(``group * block_q`` rows, query head i of the group at token t in row ``i * block_q + t``), so each
page is read once for the whole group and a decoding token of an 8:1 model still fills 8 rows. The
rows are padded to the sublane tile (8 for float32, 16 for bfloat16). `paged_plan.gather_q` builds
them in XLA before the kernel and `paged_plan.scatter_out` puts the results back in q's rows.

Grid ``(kv_heads, steps)``: kv heads are "parallel" (Mosaic may give them to a megacore's two
TensorCores), the steps "arbitrary": they walk the (q tile, chunk of pages) pairs of the batch in
order, a chunk being up to ``pages_per_step`` consecutive pages of the tile's sequence, and only the
pages holding a key some query of the tile can see (`paged.kv_range`: causal stops at the tile's last
position, a sliding window starts at its first position minus the left width). A tile's steps are
consecutive, so its output block stays in VMEM while the online softmax (running max, sum and
accumulator in VMEM scratch) runs over its chunks, and is written once when the tile changes.

The plan is scalar-prefetched to SMEM: the page table itself (flat), per step (tile, first page of
the chunk within the sequence, pages in the chunk), per tile (sequence, position of its first token,
tokens, kv_len). It is built in jnp inside the jitted call, so a serving loop's changing batch never
retraces. Its static size is an upper bound (`max_steps`: every tile taking the most chunks a tile can
take); the grid's second axis is the *dynamic* count of steps in use, a traced grid bound as the
forward kernel's with segment ids, so no padding step runs at all (an empty batch runs one step on an
empty tile; its output is never read). `grid_points` counts them from concrete arrays.

DMA. The pages are not contiguous in the pool, so K/V stay in HBM (``pl.ANY``) and the kernel copies
each step's pages itself: page i of the chunk goes to rows ``[i * page_size, (i + 1) * page_size)``
of a ``[2, pages_per_step * page_size, d]`` VMEM buffer, so the step's keys are one contiguous tile
for the dots. Double-buffered by hand: step t starts the copies of step t + 1 into the other slot
before it waits for its own (step 0 of each kv head starts its own first), one DMA semaphore per
stream and slot; a chunk shorter than ``pages_per_step`` copies only its pages. A step's page ids are
read from the prefetched page table (``page_table[seq, first + i]``), never gathered in HBM.

Quantized pages (int8, per token-head float32 scales): the scales of a page, one ``[1, page_size]``
row of ``[kv_heads, num_pages, page_size]``, are copied beside it into a ``[2, pages_per_step,
page_size]`` buffer, read back as a ``[1, keys]`` row; the logits of the int8 keys (exact in bf16 or
f32) are multiplied by the k scales before the softcap, and p by the v scales before ``p @ v``: the
pages are never dequantized in memory, and the result matches a call on the dequantized pages to float32
rounding (bfloat16: the one rounding of p for the MXU, as on float pages).

The logits are base 2 (``scale * log2 e`` or ``scale / softcap`` multiplied into the [rows, keys] tile
after the dot, `tpu_common.fold`); the online softmax is tpu_common's (`softmax_update`,
`softmax_result`), lse natural at the interface. Keys past kv_len in a sequence's last page, and the
rows of a chunk's unused page slots, are masked and their V rows zeroed, so a pool holding NaN or inf
in unused slots cannot leak into the output.

Layouts. The kernel reads the pool and the scales row-major, as pallas_call's operands are. XLA's default
TPU layout of an array whose minor dimension is under 128 lanes puts a longer dimension minor: pages of
head_dim 64, or the scales of pages of fewer than 128 tokens, then reach the kernel through a relayout
copy each call (tests/test_paged_tpu.py measures the scales' on v5p); a caller keeps them row-major with
jax's layout API, or uses head_dim 128 and 128-token pages of int8.

Limits of the design: each step serves one q tile, so a decoding batch takes a step per sequence and kv
head however few pages it holds (no packing of several short sequences into a step), and with one kv head
(MQA) the "parallel" axis has one index, so a megacore runs it on one TensorCore.

Not served (`unsupported`): a mask_mod, float8 pages (GPU only in this project), float16 pages, a
page_size that is not a multiple of the page dtype's sublane tile (8 float32, 16 bfloat16, 32 int8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.impls.flash_pallas import paged_plan
from flash_layers.impls.flash_pallas.tpu_common import (
  LOG2E,
  NN,
  NT,
  compiler_params,
  dot,
  fold,
  interpret_arg,
  softmax_result,
  softmax_update,
)
from flash_layers.impls.tiling import LANES, cdiv, round_up

LAYOUT = "heads_first"

# Keys per step: 256 keys of head_dim 128 in bfloat16 are 64 KiB per K or V buffer slot, 256 KiB for
# both double-buffered; long enough that the ~0.35 us of a grid step is small against its copies.
KEYS_PER_STEP = 256
# Each page of a step is one DMA descriptor (and one wait), unrolled in the kernel: their page ids
# and addresses live in scalar registers, which more than 16 per stream would spill.
MAX_PAGES_PER_STEP = 16
# Tokens per q tile at most, and rows (tokens x group) at most: a prefill chunk's tile of 32 tokens
# reads each of its pages once for 32 queries.
BLOCK_Q = 32
MAX_ROWS = 256
# The sublane tile of each page dtype: a page (page_size rows) must be whole tiles of VMEM.
_SUBLANES = {"float32": 8, "bfloat16": 16, "int8": 32}


class _Rules(NamedTuple):
  """What tpu_common's `dot` and `fold` read of a call's ``request``."""

  scale: float
  softcap: float | None
  precision: jax.lax.Precision
  score_mod: None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCall:
  """One paged call as the kernel sees it (static)."""

  spec: PagedSpec
  interpret: bool
  block_q: int          # tokens per q tile
  pages_per_step: int   # pages copied per grid step
  compute_dtype: str    # of the dots: bfloat16 for bfloat16 q on bfloat16 or int8 pages, else float32

  @property
  def request(self) -> _Rules:
    return _Rules(self.spec.scale, self.spec.softcap, self.spec.precision)

  @property
  def rows(self) -> int:  # q rows of a tile: the group's heads x block_q tokens
    return self.spec.group * self.block_q

  @property
  def rows_pad(self) -> int:
    return round_up(self.rows, 16 if self.compute_dtype == "bfloat16" else 8)

  @property
  def keys(self) -> int:  # keys per step
    return self.pages_per_step * self.spec.page_size


def unsupported(spec: PagedSpec) -> str | None:
  """The first feature of `spec` this kernel cannot serve, named; None when it serves it."""
  if spec.mask_mod is not None:
    return "mask_mod (the TPU paged kernel applies causal, window and softcap only; use xla_chunked)"
  if spec.kv_dtype == "float8_e4m3fn":
    return "float8_e4m3fn pages (fp8 pages are GPU-only in this project; int8 pages serve the TPU)"
  if spec.kv_dtype not in _SUBLANES:
    return f"{spec.kv_dtype} pages (the TPU paged kernel reads float32, bfloat16 or int8 pages)"
  sublanes = _SUBLANES[spec.kv_dtype]
  if spec.page_size % sublanes:
    return (f"page_size {spec.page_size} (the TPU paged kernel needs a multiple of {sublanes}, the "
            f"{spec.kv_dtype} sublane tile: a page is copied as whole VMEM tiles)")
  return None


def _compute_dtype(spec: PagedSpec) -> str:
  return "bfloat16" if spec.dtype == "bfloat16" and spec.kv_dtype in ("bfloat16", "int8") else "float32"


def _pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def _tile_pages(spec: PagedSpec, block_q: int) -> int:
  """The most pages one q tile can see: all of a sequence's, or with a window the pages its
  ``block_q + left (+ right, not causal)`` keys can straddle."""
  pages = spec.pages_per_seq
  if spec.window is not None:
    left, right = spec.window
    span = block_q + left + (0 if spec.causal else right)
    pages = min(pages, cdiv(span, spec.page_size) + 1)
  return max(pages, 1)


def make_call(spec: PagedSpec, interpret: bool) -> PagedCall:
  """The call's tiles. block_q: the batch's mean tokens per sequence as a power of two (a decoding batch
  wastes no rows on tiles of one token), at least one sublane tile of rows, at most BLOCK_Q tokens and
  MAX_ROWS rows. pages_per_step: KEYS_PER_STEP keys, at most MAX_PAGES_PER_STEP and a tile's pages."""
  compute = _compute_dtype(spec)
  least = cdiv(16 if compute == "bfloat16" else 8, spec.group)
  mean = cdiv(spec.num_tokens, max(spec.max_seqs, 1))
  block_q = min(max(least, _pow2(mean)), BLOCK_Q, max(1, MAX_ROWS // spec.group), _pow2(spec.num_tokens))
  pages = min(MAX_PAGES_PER_STEP, max(1, KEYS_PER_STEP // spec.page_size), _tile_pages(spec, block_q))
  return PagedCall(spec=spec, interpret=interpret, block_q=block_q, pages_per_step=pages,
                   compute_dtype=compute)


def max_steps(call: PagedCall) -> int:
  """The static bound of the steps: every tile taking the most chunks a tile can (the SMEM table's
  size; the grid runs only the steps in use)."""
  per_tile = cdiv(_tile_pages(call.spec, call.block_q), call.pages_per_step)
  return paged_plan.num_tiles(call.spec, call.block_q) * per_tile


# ----------------------------------------------------------------------------
# The plan: steps of (q tile, chunk of pages), in SMEM
# ----------------------------------------------------------------------------

STEP_WORDS = 3  # per step: tile, first page of the chunk (within the sequence), pages in the chunk
TILE_WORDS = 4  # per tile: sequence, position of its first token, tokens, the sequence's kv_len


class Plan(NamedTuple):
  steps: jax.Array  # int32 [max_steps * STEP_WORDS], flat (SMEM pads a 2-D array's rows)
  tiles: jax.Array  # int32 [num_tiles * TILE_WORDS]
  count: jax.Array  # int32 scalar: the steps in use, at least 1 (the grid's dynamic bound)


def plan(call: PagedCall, cu_q_lens, kv_lens, num_seqs) -> tuple[paged_plan.QTiles, Plan]:
  """The q tiles and the steps of the batch (jnp; concrete inputs give concrete tables)."""
  spec, per = call.spec, call.pages_per_step
  tiles = paged_plan.q_tiles(spec, cu_q_lens, kv_lens, jnp.asarray(num_seqs, jnp.int32), call.block_q)
  used = tiles.count > 0
  first_page = tiles.kv_start // spec.page_size
  pages = jnp.where(used, jnp.maximum((tiles.kv_stop - 1) // spec.page_size - first_page + 1, 1), 0)
  chunks = -(-pages // per)  # a tile in use sees at least its own position: one chunk or more
  ends = jnp.cumsum(chunks)
  total = ends[-1]
  t = jnp.arange(max_steps(call), dtype=jnp.int32)
  tile = jnp.clip(jnp.searchsorted(ends, t, side="right").astype(jnp.int32), 0, len(chunks) - 1)
  start = first_page[tile] + (t - (ends[tile] - chunks[tile])) * per
  count = jnp.clip(first_page[tile] + pages[tile] - start, 0, per)
  live = t < total
  steps = jnp.stack([jnp.where(live, tile, 0), jnp.where(live, start, 0), jnp.where(live, count, 0)], -1)
  lens = kv_lens.astype(jnp.int32)[tiles.seq]
  tile_table = jnp.stack([tiles.seq, tiles.first_pos, tiles.count, jnp.where(used, lens, 0)], -1)
  return tiles, Plan(steps.reshape(-1).astype(jnp.int32), tile_table.reshape(-1).astype(jnp.int32),
                     jnp.maximum(total, 1).astype(jnp.int32))


def grid_points(spec: PagedSpec, page_table, kv_lens, cu_q_lens, num_seqs) -> int:
  """The grid points the kernel runs for these concrete arrays: kv_heads x the steps in use."""
  call = make_call(spec, interpret=True)
  _, p = plan(call, jnp.asarray(cu_q_lens), jnp.asarray(kv_lens), num_seqs)
  return spec.num_kv_heads * int(p.count)


# ----------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------

class _Step(NamedTuple):
  """Grid step t as the kernel reads it from SMEM."""

  tile: jax.Array
  start: jax.Array      # first page of the chunk, within the sequence
  pages: jax.Array      # pages in the chunk (0 only for the one step of an empty batch)
  seq: jax.Array
  first_pos: jax.Array  # position of the tile's first token in its sequence
  tokens: jax.Array     # tokens of the tile
  kv_len: jax.Array


def _step_at(steps_ref, tiles_ref, t) -> _Step:
  tile = steps_ref[STEP_WORDS * t]
  at = TILE_WORDS * tile
  return _Step(tile, steps_ref[STEP_WORDS * t + 1], steps_ref[STEP_WORDS * t + 2], tiles_ref[at],
               tiles_ref[at + 1], tiles_ref[at + 2], tiles_ref[at + 3])


class _Stream(NamedTuple):
  """One array copied page by page: its HBM ref [kv_heads, pages, page_size(, d)], its VMEM buffer
  [2, keys, d] (pages) or [2, pages_per_step, page_size] (scales), and its two semaphores."""

  hbm: object
  buf: object
  sems: object  # semaphore array [streams, 2]: this stream's row
  row: int
  scales: bool


def _copy(call: PagedCall, table_ref, stream: _Stream, head, step: _Step, slot, i: int):
  """The descriptor of page i of `step` in `stream`, into buffer slot `slot`."""
  spec = call.spec
  index = jnp.minimum(step.start + i, spec.pages_per_seq - 1)
  page = table_ref[step.seq * spec.pages_per_seq + index]
  sem = stream.sems.at[stream.row, slot]
  if stream.scales:
    return pltpu.make_async_copy(stream.hbm.at[head, pl.ds(page, 1)], stream.buf.at[slot, pl.ds(i, 1)], sem)
  rows = pl.ds(i * spec.page_size, spec.page_size)
  return pltpu.make_async_copy(stream.hbm.at[head, page], stream.buf.at[slot, rows], sem)


def _dma(call: PagedCall, table_ref, streams, head, step: _Step, slot, *, wait: bool):
  """Start (wait=False) or wait for (wait=True) the copies of a step's pages into `slot`."""
  for i in range(call.pages_per_step):
    @pl.when(i < step.pages)
    def _():
      for stream in streams:
        copy = _copy(call, table_ref, stream, head, step, slot, i)
        copy.wait() if wait else copy.start()


def _start(call: PagedCall, table_ref, streams, head, step: _Step, slot):
  _dma(call, table_ref, streams, head, step, slot, wait=False)


def _wait(call: PagedCall, table_ref, streams, head, step: _Step, slot):
  _dma(call, table_ref, streams, head, step, slot, wait=True)


def _logits(call: PagedCall, q, k, k_scales):
  """Base-2 logits [rows, keys] float32 (before the mask): q.k, times the k scales of int8 pages, then
  scale (and the softcap) in tpu_common's units (`fold`)."""
  s = dot(call, q, k, NT)
  if k_scales is not None:
    s = s * k_scales
  s = s * fold(call)
  if call.spec.softcap is not None:
    s = (call.spec.softcap * LOG2E) * jnp.tanh(s)
  return s


def _masks(call: PagedCall, step: _Step):
  """(visible [rows, keys], key_ok row [1, keys], key_ok column [keys, 1]) of the step: the contract's
  rules (`paged.visible`) on the tile's real rows, and the keys that exist (in a copied page, < kv_len)."""
  spec = call.spec
  row = jax.lax.broadcasted_iota(jnp.int32, (call.rows_pad, 1), 0)
  token = row % call.block_q
  row_ok = (row < call.rows) & (token < step.tokens)

  def key_ok(shape, axis):
    j = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (j < step.pages * spec.page_size) & (step.start * spec.page_size + j < step.kv_len)

  kv_pos = step.start * spec.page_size + jax.lax.broadcasted_iota(jnp.int32, (1, call.keys), 1)
  ok_row = key_ok((1, call.keys), 1)
  visible = paged.visible(spec, step.first_pos + token, kv_pos, step.kv_len) & row_ok & ok_row
  return visible, ok_row, key_ok((call.keys, 1), 0)


def _kernel(table_ref, steps_ref, tiles_ref, q_ref, *refs, call: PagedCall):
  quantized = call.spec.quantized
  n_streams = 4 if quantized else 2
  hbm, refs = refs[:n_streams], refs[n_streams:]
  o_ref, lse_ref, *bufs, sems, m_scr, l_scr, acc_scr = refs
  # m_scr [rows, 128]: running row max of the base-2 logits (lane-replicated); l_scr [rows, 128]: the
  # running sum of exp2(logit - m); acc_scr [rows, dv]: the running sum of exp2(logit - m) * v.
  streams = [_Stream(hbm[j], bufs[j], sems, j, j >= 2) for j in range(n_streams)]
  head, t, num = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
  step = _step_at(steps_ref, tiles_ref, t)
  slot = t % 2

  @pl.when(t == 0)
  def _prologue():
    _start(call, table_ref, streams, head, step, slot)

  @pl.when(t + 1 < num)
  def _prefetch():  # the next step's pages, into the other slot, while this step computes
    _start(call, table_ref, streams, head, _step_at(steps_ref, tiles_ref, t + 1), 1 - slot)

  _wait(call, table_ref, streams, head, step, slot)
  prev_tile = steps_ref[STEP_WORDS * jnp.maximum(t - 1, 0)]
  next_tile = steps_ref[STEP_WORDS * jnp.minimum(t + 1, num - 1)]

  @pl.when((t == 0) | (prev_tile != step.tile))
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  compute = jnp.dtype(call.compute_dtype)
  visible, ok_row, ok_column = _masks(call, step)
  k_scales = bufs[2][slot].reshape(1, call.keys) if quantized else None
  s = jnp.where(visible, _logits(call, q_ref[...], bufs[0][slot].astype(compute), k_scales), -jnp.inf)
  m_next, p, rescale = softmax_update(m_scr[...], s)
  l_scr[...] = rescale * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
  if quantized:  # p times the v scales; a slot's stale scales (maybe NaN) are zeroed first
    p = p * jnp.where(ok_row, bufs[3][slot].reshape(1, call.keys), 0.0)
  v = jnp.where(ok_column, bufs[1][slot].astype(compute), jnp.zeros((), compute))
  acc_scr[...] = acc_scr[...] * rescale[:, :1] + dot(call, p.astype(compute), v, NN)
  m_scr[...] = m_next

  @pl.when((t == num - 1) | (next_tile != step.tile))
  def _finish():
    # A row that saw no key (a padding row): output 0, lse -inf.
    inverse, lse = softmax_result(m_scr[...], l_scr[...])
    o_ref[...] = (acc_scr[...] * inverse[:, :1]).astype(o_ref.dtype)
    lse_ref[...] = jnp.transpose(lse)[:1, :]  # [rows, 128] column -> [1, rows] row


def _cost(call: PagedCall, q_tiles, out_shape) -> pl.CostEstimate:
  """An upper bound (the batch's lengths are traced): every token against a sequence's longest reach,
  every step copying a full chunk."""
  spec = call.spec
  reach = spec.max_kv_len
  if spec.window is not None:
    reach = min(reach, spec.window[0] + 1 + (0 if spec.causal else spec.window[1]))
  pairs = spec.num_tokens * spec.num_heads * reach
  page_bytes = jnp.dtype(spec.kv_dtype).itemsize * spec.page_size * (spec.head_dim + spec.head_dim_v)
  if spec.quantized:
    page_bytes += 2 * 4 * spec.page_size
  kv_bytes = max_steps(call) * call.pages_per_step * spec.num_kv_heads * page_bytes
  out_bytes = sum(s.size * jnp.dtype(s.dtype).itemsize for s in out_shape)
  return pl.CostEstimate(flops=int(2 * pairs * (spec.head_dim + spec.head_dim_v)),
                         transcendentals=int(pairs * (1 + (spec.softcap is not None))),
                         bytes_accessed=int(q_tiles.size * q_tiles.dtype.itemsize + out_bytes + kv_bytes))


def _pallas(call: PagedCall, p: Plan, table, q_tiles, pages):
  """(out tiles [num_tiles, kv_heads, rows_pad, dv], lse tiles [num_tiles, kv_heads, 1, rows_pad])."""
  spec = call.spec
  num_tiles, kvh, rows_pad, d = q_tiles.shape
  dv, keys = spec.head_dim_v, call.keys
  kv_dtype = jnp.dtype(spec.kv_dtype)
  block = lambda h, t, table, steps, tiles: (steps[STEP_WORDS * t], h, 0, 0)  # noqa: E731
  out_shape = [jax.ShapeDtypeStruct((num_tiles, kvh, rows_pad, dv), q_tiles.dtype),
               jax.ShapeDtypeStruct((num_tiles, kvh, 1, rows_pad), jnp.float32)]
  buffers = [pltpu.VMEM((2, keys, d), kv_dtype), pltpu.VMEM((2, keys, dv), kv_dtype)]
  if spec.quantized:
    buffers += [pltpu.VMEM((2, call.pages_per_step, spec.page_size), jnp.float32)] * 2
  return pl.pallas_call(
      functools.partial(_kernel, call=call),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(kvh, p.count),
          in_specs=[pl.BlockSpec((None, None, rows_pad, d), block)]
          + [pl.BlockSpec(memory_space=pl.ANY)] * len(pages),
          out_specs=[pl.BlockSpec((None, None, rows_pad, dv), block),
                     pl.BlockSpec((None, None, 1, rows_pad), block)],
          scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((len(pages), 2)),
                          *[pltpu.VMEM((rows_pad, LANES), jnp.float32)] * 2,  # running max and sum
                          pltpu.VMEM((rows_pad, dv), jnp.float32)]),
      out_shape=out_shape, compiler_params=compiler_params(("parallel", "arbitrary")),
      cost_estimate=_cost(call, q_tiles, out_shape), interpret=interpret_arg(call.interpret),
      name="flash_layers_paged",
  )(table, p.steps, p.tiles, q_tiles, *pages)


def paged_attention(q, k_pages, v_pages, k_scales, v_scales, page_table, kv_lens, cu_q_lens, num_seqs, *,
                    spec: PagedSpec, interpret: bool):
  """(out [tokens, heads, dv] in q's dtype, lse [tokens, heads] float32) of a paged call; pages
  [kv_heads, num_pages, page_size, d] and scales [kv_heads, num_pages, page_size] (heads_first)."""
  call = make_call(spec, interpret)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  tiles, p = plan(call, cu_q_lens, kv_lens, num_seqs)
  q_tiles = paged_plan.gather_q(spec, q.astype(call.compute_dtype), tiles, call.block_q)
  q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, call.rows_pad - call.rows), (0, 0)))
  pages = [k_pages, v_pages] + ([k_scales, v_scales] if spec.quantized else [])
  out, lse = _pallas(call, p, page_table.astype(jnp.int32).reshape(-1), q_tiles, pages)
  return paged_plan.scatter_out(spec, out[:, :, : call.rows], lse[:, :, 0, : call.rows], cu_q_lens, num_seqs,
                                call.block_q, q.dtype)
