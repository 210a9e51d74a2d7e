"""flash_pallas's decode path: split-KV attention (flash-decoding) for a few queries against a long cache.

A decoding step asks for 1 to `cpu_loop.FEW_QUERIES` new queries against a cache of thousands of keys.
The forward kernels tile the queries: with one q block per (batch row, head) there are only
batch * heads programs, each walking the whole cache alone, and most of each q tile is padding. The
decode kernels (`tpu_decode.py`, `gpu_decode.py`) turn that around (the flash-decoding scheme of Dao et
al., 2023, "Flash-Decoding for long-context inference"):

* Rows. The queries of a GQA group share one K/V stream, so one program takes all of them: its q tile is
  the group's ``heads_per_kv * q_len`` rows (row r: query head ``r // q_len`` of the group, query
  ``r % q_len``), every K/V tile is read once for the whole group, and the matmul has rows to fill.
* Splits. The cache is cut into `splits` contiguous runs of kv blocks, one program each, so a step
  runs ``batch * kv_heads * splits`` programs in parallel. Each writes its partial output, normalised
  over its own keys, and its logsumexp; `merge` combines the splits by their logsumexps
  (``lse = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse) out_s``), exactly the global softmax.
* Ragged rows. Per batch row, `plan` finds the run of kv blocks that hold a key some query of the row
  can see (segment ids mark each row's valid length: layers/kv_cache.py gives unwritten slots the id
  -1; causal masks and windows with the offsets bound it too), and the splits share *that* run: a row
  with 300 valid keys of an 8,192-slot cache reads one block, not sixteen, and rows of different
  lengths keep every split equally busy. Inside a tile, `mask_rules.visible` (the predicate every impl
  uses) masks the rest.

The backward is the family's own backward kernels from the merged logsumexp (`attention_backward`);
a decoding step is rarely differentiated, but the contract holds for it like for any call.

`unserved` says which requests take this path: short queries without the features the decode kernels
leave to the forward kernels (dropout, ALiBi, global tokens, mods; GQA groups whose rows exceed `MAX_ROWS`).
Those run the forward kernels, which serve everything; explain() names the kernel either way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.contract import mask_rules
from flash_layers.impls import cpu_loop
from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas import scalar_table

# Query rows of one program (GQA group * q_len): the q tile, the logits tile and the accumulator
# stay small enough for registers (GPU) and a few vregs per row block (TPU).
MAX_ROWS = 128

_MODULES = {"tpu": "flash_layers.impls.flash_pallas.tpu_decode",
            "gpu": "flash_layers.impls.flash_pallas.gpu_decode"}


def unserved(request: Request) -> str | None:
  """Why this request is not a decode-path request (it then runs the forward kernels), or None."""
  group = request.num_heads // request.num_kv_heads
  if request.q_len > cpu_loop.FEW_QUERIES:
    return f"q_len {request.q_len} > {cpu_loop.FEW_QUERIES}"
  if group * request.q_len > MAX_ROWS:
    return f"heads per kv head * q_len = {group * request.q_len} > {MAX_ROWS} rows"
  for feature, used in (("dropout", request.has_dropout), ("alibi", request.has_alibi),
                        ("global tokens", bool(request.spec.global_tokens)),
                        ("mask_mod / score_mod", request.has_mods)):
    if used:
      return feature
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeCall:
  """One decode call as the kernels see it (hashable: a custom_vjp static argument)."""

  request: Request
  family: str  # "tpu" or "gpu"
  interpret: bool
  block_kv: int
  splits: int
  rows: int  # group * q_len, before the family pads it
  static_offsets: tuple[int, int] | None  # (q_offset, kv_offset) when known while tracing

  @property
  def group(self) -> int:
    return self.request.num_heads // self.request.num_kv_heads

  @property
  def num_blocks(self) -> int:
    return -(-self.request.kv_len // self.block_kv)

  @property
  def steps(self) -> int:
    """Kv blocks per split at most (a row whose run is shorter skips the rest)."""
    return -(-self.num_blocks // self.splits)


def _module(family: str):
  return importlib.import_module(_MODULES[family])


def describe(request: Request, family: str) -> str:
  """The decode kernel's shape, for explain(): 'split-KV decode: S splits of B-key blocks'."""
  block_kv, splits = _module(family).tiles(request)
  return f"split-KV decode, {splits} split(s) x {block_kv}-key blocks"


def _call(request: Request, args: Args, family: str, interpret: bool) -> DecodeCall:
  block_kv, splits = _module(family).tiles(request)
  static = None
  if all(isinstance(o, (int, np.integer)) for o in (args.q_offset, args.kv_offset)):
    static = (int(args.q_offset), int(args.kv_offset))
  group = request.num_heads // request.num_kv_heads
  return DecodeCall(request=request, family=family, interpret=interpret, block_kv=block_kv,
                    splits=splits, rows=group * request.q_len, static_offsets=static)


class Run(NamedTuple):
  """One batch row's entry of the plan: its run of kv blocks and the blocks each split takes."""

  first: jax.Array      # first kv block holding a key some query of the row sees
  count: jax.Array      # blocks in the run (0 when the row sees nothing)
  per_split: jax.Array  # blocks per split


def run(plan_ref, b) -> Run:
  """Row b's `Run` in the flat plan a kernel reads (`plan(...).reshape(-1)`: a ref or an array)."""
  words = len(Run._fields)
  return Run(*(plan_ref[words * b + i] for i in range(words)))


def plan(call: DecodeCall, q_seg, kv_seg, offsets) -> jax.Array:
  """int32 [batch, 3]: per batch row its `Run` (first kv block, number of kv blocks, blocks per split) of the
  run of blocks holding a key that some query of the row sees. A row that sees nothing gets (0, 0, 0).

  The [batch, q_len, kv_len] visibility is small here (q_len <= FEW_QUERIES); it is the one predicate
  every impl evaluates, so the run can never drop a visible key.
  """
  r = call.request
  q_off, kv_off = scalar_table.offsets(offsets)
  q_pos = q_off + jnp.arange(r.q_len, dtype=jnp.int32)
  kv_pos = kv_off + jnp.arange(r.kv_len, dtype=jnp.int32)
  seen = mask_rules.visible(q_pos[:, None], kv_pos[None, :], r.spec,
                       None if q_seg is None else q_seg[:, :, None],
                       None if kv_seg is None else kv_seg[:, None, :])
  seen = jnp.broadcast_to(seen.reshape(-1, r.q_len, r.kv_len), (r.batch, r.q_len, r.kv_len))
  keys = jnp.pad(seen.any(axis=1), ((0, 0), (0, call.num_blocks * call.block_kv - r.kv_len)))
  blocks = keys.reshape(r.batch, call.num_blocks, call.block_kv).any(axis=-1)
  has = blocks.any(axis=-1)
  first = jnp.argmax(blocks, axis=-1)
  last = call.num_blocks - 1 - jnp.argmax(blocks[:, ::-1], axis=-1)
  count = jnp.where(has, last - first + 1, 0)
  per_split = (count + call.splits - 1) // call.splits
  return jnp.stack([jnp.where(has, first, 0), count, per_split], axis=-1).astype(jnp.int32)


def merge(out_parts, lse_parts):
  """Combine per-split results: out_parts [..., S, rows, dv] (each normalised over its split's keys),
  lse_parts [..., S, rows] (natural log; -inf for a split that saw no key) -> (out [..., rows, dv],
  lse [..., rows]); a row no split saw gets zeros and -inf."""
  top = lse_parts.max(axis=-2)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weight = jnp.exp(lse_parts - top[..., None, :])  # 0 for empty splits
  total = weight.sum(axis=-2)
  out = (weight[..., None] * out_parts).sum(axis=-3) / jnp.where(total > 0, total, 1.0)[..., None]
  lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  return out, lse


def pack_queries(call: DecodeCall, q):
  """[b, q_len, heads, d] -> [b, kv_heads, group * q_len, d]: row r is query head r // q_len of the
  group, query r % q_len (a small transpose: q_len <= FEW_QUERIES)."""
  b, t, _, d = q.shape
  kvh = call.request.num_kv_heads
  q = q.reshape(b, t, kvh, call.group, d).transpose(0, 2, 3, 1, 4)
  return q.reshape(b, kvh, call.group * t, d)


def unpack_rows(call: DecodeCall, x):
  """[b, kv_heads, rows(+pad), ...] -> [b, q_len, heads, ...] (the inverse of `pack_queries`)."""
  r = call.request
  b, kvh = x.shape[:2]
  x = x[:, :, :call.rows].reshape(b, kvh, call.group, r.q_len, *x.shape[3:])
  x = jnp.moveaxis(x, 3, 1)  # [b, t, kvh, group, ...]
  return x.reshape(b, r.q_len, r.num_heads, *x.shape[4:])


def row_segments(call: DecodeCall, q_seg):
  """[b, q_len] -> [b, rows]: each packed row's query segment id."""
  return jnp.tile(q_seg, (1, call.group))


def _forward(call: DecodeCall, q, k, v, q_seg, kv_seg, offsets):
  table = plan(call, q_seg, kv_seg, offsets)
  out_parts, lse_parts = _module(call.family).split_kv(call, q, k, v, q_seg, kv_seg, offsets, table)
  out, lse = merge(out_parts, lse_parts)  # [b, kvh, rows, dv], [b, kvh, rows]
  out = unpack_rows(call, out).astype(q.dtype)
  lse = jnp.moveaxis(unpack_rows(call, lse[..., None])[..., 0], 1, 2)  # [b, h, q_len]
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(call: DecodeCall, q, k, v, q_seg, kv_seg, offsets):
  return _forward(call, q, k, v, q_seg, kv_seg, offsets)


def _attend_fwd(call: DecodeCall, q, k, v, q_seg, kv_seg, offsets):
  out, lse = _forward(call, q, k, v, q_seg, kv_seg, offsets)
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, out, lse)


def _attend_bwd(call: DecodeCall, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, out, lse = residuals
  d_out, d_lse = cotangents
  # D_i = rowsum(dO * O)_i - dlse_i, then the family's backward kernels from the merged lse.
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST) - d_lse
  q_off, kv_off = call.static_offsets or scalar_table.offsets(offsets)
  args = Args(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=q_off, kv_offset=kv_off)
  family = importlib.import_module(f"flash_layers.impls.flash_pallas.{call.family}")
  dq, dk, dv = family.attention_backward(q, k, v, lse, delta, d_out, request=call.request, args=args,
                                         interpret=call.interpret)
  return dq, dk, dv, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def attention(q, k, v, *, request: Request, args: Args, family: str, interpret: bool):
  """(out [b, q, h, dv] in q.dtype, lse [b, h, q] float32) by the decode kernels of `family`;
  differentiable in q, k, v and through lse."""
  call = _call(request, args, family, interpret)
  offsets = scalar_table.offsets_table(args.q_offset, args.kv_offset)  # the decode kernels' table
  return _attend(call, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets)


def with_splits(request: Request, block_kv: int, target: int) -> tuple[int, int]:
  """(block_kv, splits): splits so that batch * kv heads * splits reaches `target` parallel programs,
  never more splits than kv blocks."""
  num_blocks = -(-request.kv_len // block_kv)
  programs = request.batch * request.num_kv_heads
  return block_kv, max(1, min(num_blocks, math.ceil(target / max(programs, 1))))


def _concrete_plan(request: Request, args: Args, family: str):
  """(call, plan as NumPy) when the segment ids and offsets are known while tracing, else (call, None):
  traced, or only shapes (`fl.explain` takes ShapeDtypeStructs)."""
  call = _call(request, args, family, interpret=True)
  known = (args.q_segment_ids, args.kv_segment_ids, args.q_offset, args.kv_offset)
  if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for x in known):
    return call, None
  offsets = scalar_table.offsets_table(args.q_offset, args.kv_offset)
  return call, np.asarray(plan(call, args.q_segment_ids, args.kv_segment_ids, offsets))


def block_stats(request: Request, args: Args, family: str) -> tuple[int, int] | None:
  """(kv tiles read, kv tiles in the cache) over batch and kv heads: a tile is one kv block for all the
  rows of a GQA group. None when the plan is known only at run time."""
  call, table = _concrete_plan(request, args, family)
  if table is None:
    return None
  kvh = request.num_kv_heads
  return int(table[:, Run._fields.index("count")].sum()) * kvh, request.batch * kvh * call.num_blocks


def grid_steps(request: Request, args: Args, family: str) -> int | None:
  """The TPU decode kernel's grid steps (batch x kv heads x splits x steps per split); None for the GPU
  family, whose programs loop inside the kernel."""
  if family != "tpu":
    return None
  call = _call(request, args, family, interpret=True)
  return request.batch * request.num_kv_heads * call.splits * call.steps
