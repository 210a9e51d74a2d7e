"""XLA:CPU runs attention one (batch row, kv head) at a time: the logits then stay in cache.

An accelerator wants every batch row and head in flight at once. A CPU core wants the opposite:
its caches hold ~1 MiB (L2) to a few tens of MiB (L3), and attention's [q, kv] float32 logits
for all rows and heads of a batch do not fit (8 rows x 12 heads x 512 x 512 is 96 MiB). XLA:CPU
then streams them through main memory once per elementwise pass (mask, max, exp, sum) and the
passes, not the matmuls, set the time. `per_row_and_head` runs an impl's own computation inside
two `lax.map`s, over batch rows and over kv heads (a step holds the kv head's group of query
heads), so each step's logits are [g, q, kv] (or one chunk of them): 1 MiB at 512 x 512.

xla_chunked runs its forward and backward this way. xla_dense loops only a forward pass that is not
differentiated (evaluation, inference; its own `_dense_looped`, inside its custom VJP): under
differentiation its whole-call forward and backward were faster at batch > 1. Measured on a 2-core
AMD EPYC VM (XLA:CPU, float32, process CPU time; docs/benchmarks.md, "Attention on the CPU"): the
forward of [8, 512, 12, 64] with segment ids took 166 -> 113 ms (xla_dense) and 254 -> 129 ms
(xla_chunked); fwd+bwd of [4, 512, 12, 32] 348 -> 134 ms (xla_chunked). The loops are sequential;
each step's ops still use XLA's intra-op threads.

Why only on CPU: on TPU and GPU the loops would serialise work the chip runs in parallel, so the
impls choose this by the platform they are lowered for (`looped_on_cpu`,
`jax.lax.platform_dependent`).

Every step is an ordinary call of the impl with a [1, t, g, d] query and [1, s, 1, d] keys and
values, so the contract holds by construction: segment ids, masks and bias are sliced to the row
and head, ALiBi slopes to the head, and the dropout hash gets the global row and head through
`Args.batch_offset` / `head_offset` (as a sharded call's shards do). q, k, v and a per-row or
per-head bias travel as the maps' `xs`, so their gradients are stacked, not accumulated.

With GSPMD-sharded inputs (no `mesh`, no `shard_map`) the maps would gather the batch; a sharded
call passes `mesh=` and runs this on each device's local rows (parallel/sharded.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from flash_layers import lowering
from flash_layers.impls.base import Args, Request

# The loop keeps a step's logits in cache; when the whole call's (one tile of them, for a chunked
# impl) already fit in this many bytes, about one core's L2 (1 MiB on AMD EPYC Zen 4, 2 MiB on
# Intel Sapphire Rapids), the call runs whole: the loops would only add steps, and compile time.
CACHE_BYTES = 1 << 20
# A call of this many queries or fewer (decoding against a KV cache) runs whole: its logits are small
# at any kv_len, and its cost is reading K/V, which slicing per row and kv head would copy first
# (benchmarks/decode_cpu.py: looped, a decoding step at 8,192 cached tokens was much slower than flax's).
FEW_QUERIES = 16


def loop_bytes(request: Request) -> int:
  """The loop threshold of a call: its `CpuBlockSizes.loop_bytes` (tuned, flash_layers/tuning), else
  `CACHE_BYTES`."""
  tuned = getattr(request.block_sizes, "loop_bytes", None)
  return CACHE_BYTES if tuned is None else tuned


NEVER_LOOP = 1 << 62  # a loop_bytes no call reaches: a `CpuBlockSizes(loop_bytes=NEVER_LOOP)` never loops


def loops_on_shapes(request: Request, tile_q: int, tile_kv: int, cache_bytes: int) -> bool:
  """`worth_looping`'s size rule on a request's shapes alone (no arrays): what the autotuner uses to
  flip a call's loop decision, and to force the same decision on its small validation call."""
  return (request.batch * request.num_kv_heads > 1
          and 4 * request.batch * request.num_heads * tile_q * tile_kv > cache_bytes)


def flipped_loop_bytes(request: Request, tile_q: int, tile_kv: int) -> int:
  """The loop_bytes that flips the default loop decision for this tile (a tuning candidate)."""
  return NEVER_LOOP if loops_on_shapes(request, tile_q, tile_kv, CACHE_BYTES) else 0


def worth_looping(q, k, tile_q: int, tile_kv: int, cache_bytes: int = CACHE_BYTES) -> bool:
  """Whether a call's float32 logits tile over every row and head, [b, h, tile_q, tile_kv], exceeds
  `cache_bytes` (and there is more than one row or kv head to loop over)."""
  b, h, kvh = q.shape[0], q.shape[2], k.shape[2]
  if tile_q <= FEW_QUERIES:  # decoding: K/V traffic dominates, and slicing it per row and head costs more
    return False
  return b * kvh > 1 and 4 * b * h * tile_q * tile_kv > cache_bytes


def looped_on_cpu(fn: Callable, q, k, v, *, request: Request, args: Args, tile: tuple[int, int],
                  q_like: tuple = (), stats: tuple = ()):
  """`per_row_and_head` (fn, ...) when lowered for CPU; ``fn`` on the whole call on every other
  platform, and on CPU when `worth_looping` says no for the call's logits `tile` (q, kv lengths)."""
  def direct(q, k, v, *rest):
    return fn(q, k, v, *rest, request=request, args=args)

  def looped(q, k, v, *rest):
    n = len(q_like)
    return per_row_and_head(fn, q, k, v, request=request, args=args, q_like=rest[:n], stats=rest[n:])

  if not worth_looping(q, k, *tile, loop_bytes(request)):
    return direct(q, k, v, *q_like, *stats)
  return lowering.platform_dependent(q, k, v, *q_like, *stats, cpu=looped, default=direct)


def _split_heads(x, kvh: int):
  """[B', H', ...] (H' = 1 or h) -> [B', kvh, g, ...] when H' = h, else [B', 1, 1, ...]."""
  heads = x.shape[1]
  if heads == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kvh, heads // kvh, *x.shape[2:])


def per_row_and_head(fn: Callable, q, k, v, *, request: Request, args: Args,
                     q_like: tuple = (), stats: tuple = ()):
  """``fn(q, k, v, *q_like, *stats, request=, args=)`` for one batch row and kv head at a time.

  q ``[b, t, h, d]``, k/v ``[b, s, kvh, d|dv]``; `q_like` are more ``[b, t, h, x]`` arrays and
  `stats` ``[b, h, t]`` arrays (the backward's d_out, lse, delta). `fn` returns a tuple whose
  entries are shaped like q ``[1, t, g, x]``, like k/v ``[1, s, 1, x]`` or like a statistic
  ``[1, g, t]``; they are reassembled to the whole batch and every head.
  """
  b, t, h, _ = q.shape
  kvh = k.shape[2]
  g = h // kvh
  local = dataclasses.replace(request, batch=1, num_heads=g, num_kv_heads=1)

  def heads_major(x):  # [b, t|s, H, x] -> [b, kvh, t|s, H / kvh, x]
    return x.reshape(x.shape[0], x.shape[1], kvh, -1, x.shape[3]).transpose(0, 2, 1, 3, 4)

  # Every operand as [B', KVH', ...]: B' = b travels with the row map, KVH' = kvh with the head map,
  # size 1 is shared (closed over).
  ops = {"q": heads_major(q), "k": heads_major(k), "v": heads_major(v),
         "rows": jnp.arange(b, dtype=jnp.int32)[:, None], "heads": jnp.arange(kvh, dtype=jnp.int32)[None]}
  for i, x in enumerate(q_like):
    ops[f"q_like{i}"] = heads_major(x)
  for i, x in enumerate(stats):
    ops[f"stats{i}"] = x.reshape(b, kvh, g, t)
  if args.q_segment_ids is not None:
    ops["q_seg"] = args.q_segment_ids[:, None]
    ops["kv_seg"] = args.kv_segment_ids[:, None]
  for name in ("dense_mask", "bias"):
    x = getattr(args, name)
    if x is not None:
      ops[name] = _split_heads(x, kvh)
  if args.alibi_slopes is not None:
    ops["alibi_slopes"] = args.alibi_slopes.reshape(1, kvh, g)
  if args.mod_tiles is not None:  # [b|1, nq, nk] each: sliced by row, shared by heads
    ops["mod_any"], ops["mod_all"] = (x[:, None] for x in args.mod_tiles)

  def head(x):
    batched = {n: x[n][None] if n in x else None for n in ("q_seg", "kv_seg", "dense_mask", "bias")}
    mod_tiles = None if args.mod_tiles is None else (x["mod_any"][None], x["mod_all"][None])
    step_args = dataclasses.replace(
        args, mod_tiles=mod_tiles, q_segment_ids=batched["q_seg"], kv_segment_ids=batched["kv_seg"],
        dense_mask=batched["dense_mask"], bias=batched["bias"], alibi_slopes=x.get("alibi_slopes"),
        batch_offset=args.batch_offset + x["rows"], head_offset=args.head_offset + x["heads"] * g)
    extra = [x[f"q_like{i}"][None] for i in range(len(q_like))]
    extra += [x[f"stats{i}"][None] for i in range(len(stats))]
    return fn(x["q"][None], x["k"][None], x["v"][None], *extra, request=local, args=step_args)

  out = map_rows_and_heads(head, ops, b, kvh)
  # Each result [b, kvh, 1, ...]: reassemble by its shape.
  return tuple(_assemble(y[:, :, 0], b, h) for y in out)


def map_rows_and_heads(step: Callable, operands: dict, b: int, kvh: int):
  """``step(operands of one batch row and kv head)`` under two `lax.map`s, results stacked [b, kvh, ...].

  Every operand is [B', KVH', ...] with B' in (1, b) and KVH' in (1, kvh): an axis of the full size
  travels with its map (`xs`, so gradients are stacked), a size-1 one is shared (closed over)."""
  by_row = {n: x for n, x in operands.items() if x.shape[0] == b and b > 1}
  shared_rows = {n: x[0] for n, x in operands.items() if n not in by_row}

  def row(row_xs):
    here = {**shared_rows, **row_xs}  # every operand now [KVH', ...]
    by_head = {n: x for n, x in here.items() if x.shape[0] == kvh and kvh > 1}
    shared_heads = {n: x[0] for n, x in here.items() if n not in by_head}
    one = lambda head_xs: step({**shared_heads, **head_xs})  # noqa: E731
    if not by_head:
      return jax.tree.map(lambda y: y[None], one({}))
    return jax.lax.map(one, by_head)

  if not by_row:
    return jax.tree.map(lambda y: y[None], row({}))
  return jax.lax.map(row, by_row)


def _assemble(y, b: int, h: int):
  """One result stacked over rows and kv heads -> the call's layout: [b, kvh, t|s, g|1, x] ->
  [b, t|s, h|kvh, x]; [b, kvh, g, t] -> [b, h, t]."""
  if y.ndim == 5:
    return y.transpose(0, 2, 1, 3, 4).reshape(b, y.shape[2], -1, y.shape[4])
  return y.reshape(b, h, y.shape[3])
