"""All-gather context parallelism over the sequence axis (runs inside `shard_map`).

Each of the n devices of `config.axis` gathers the whole K and V (and kv segment ids) with one tiled
`lax.all_gather`, so they arrive in natural global order, and attends only the queries it holds
against them: one ordinary `dispatch.attend` call per query chunk, with the chunk's *global* start as
q_offset (traced: it depends on `axis_index`) and kv_offset = 0. Causal masks, windows, segment ids,
dropout, ALiBi and mods therefore mean what they mean in the unsharded call; nothing is merged,
because every query row sees all its keys in one call.

Load balance: with a causal mask the contiguous layout gives the last device n times the work of the
first. For causal calls (no window) whose q_len splits into 2n chunks the queries move to the
"zig-zag" layout of the ring (`ring.to_zigzag`: device i holds chunks i and 2n-1-i, two ppermutes),
one inner call per chunk, and the output and lse move back (`ring.from_zigzag`). Impls that skip
invisible key blocks (xla_chunked, flash_pallas) then do the same work on every device. Windows
(already local) and everything else keep the contiguous layout.

Backward: plain autodiff. all_gather's transpose is a reduce-scatter (`psum_scatter`): each device's
dK/dV of the whole sequence are summed over the axis and each device keeps its own shard. XLA's CPU
backend keeps it a `reduce-scatter` in the compiled HLO, not an all-reduce + dynamic-slice
(tests/test_cp_all_gather.py checks the compiled programs: two all-gathers of the whole K and V in
the forward, two reduce-scatters to the local dK and dV shards in the gradient, no all-reduce).

Cost per device and layer (for parallel/cost.py), with K+V the bytes of the *global* keys and values
of this device's batch rows and heads (plus kv segment ids, int32 [b, S], when packed):
* memory: O(S) -- the gathered K and V (S tokens) live through the inner call and are saved as
  residuals for the backward (the impl's own VJP keeps its k, v inputs), and the backward holds
  full-length dK and dV before the reduce-scatter. Queries, output and lse stay O(T / n).
* bytes moved: forward (n-1)/n of K+V received by the all-gather; backward the same (n-1)/n of
  dK+dV (K+V's dtype) in the reduce-scatter. Zig-zag adds, per device, its q shard (and q segment
  ids) forward and its out + lse back -- and d out, d lse, dq in the backward -- each sent once by
  ppermute (6 collective-permutes forward, 6 more backward).
"""

from __future__ import annotations

import dataclasses

import jax

from flash_layers import dispatch
from flash_layers.impls import Args, Request
from flash_layers.parallel import ring
from flash_layers.parallel.context import CPConfig


def _chunks(request: Request, size: int) -> int:
  """Query chunks per device: 2 (zig-zag) for causal calls without a window that split into 2n
  chunks, else 1 (contiguous). `request` has the global q_len."""
  causal = request.spec.causal and request.spec.window is None
  return 2 if causal and request.q_len % (2 * size) == 0 else 1


def refusal(request: Request, size: int, group: int) -> str | None:
  """Why all_gather cannot serve `request` (global lengths) on `size` devices, or None."""
  del group  # ulysses_ring's; the all-gather has no groups
  for name, value in (("q_len", request.q_len), ("kv_len", request.kv_len)):
    if value % size:
      return f"{name}={value} is not divisible by the sequence axis size ({size})"
  # Dense masks and biases are [.., q, kv]: the strategy is given no slice of them (CPConfig's Args
  # carry none), so they cannot reach the inner calls.
  if request.has_dense_mask:
    return "a dense mask (the all-gather strategy takes causal/window/segment ids or a mask_mod)"
  if request.has_bias:
    return "a dense bias (the all-gather strategy takes alibi_slopes or a score_mod)"
  return None


def local_request(request: Request, size: int, group: int) -> Request:
  """What each inner `dispatch.attend` call sees: one query chunk (T / n or T / 2n queries) against
  the whole gathered K/V (kv_len stays global)."""
  del group
  return dataclasses.replace(request, q_len=request.q_len // (size * _chunks(request, size)))


def _gather(x, axis: str):
  """The whole sequence in global order: device i's shard lands at tokens i*S/n ... (tiled)."""
  return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def attention(q, k, v, q_seg, kv_seg, config: CPConfig, args: Args):
  """Local contiguous shards in -> this device's (out [b, T/n, h, dv], lse [b, h, T/n]) out."""
  axis, size = config.axis, config.size
  chunks = _chunks(config.request, size)
  local = local_request(config.request, size, config.group)
  k_all, v_all, kv_seg_all = (_gather(x, axis) for x in (k, v, kv_seg))
  me = jax.lax.axis_index(axis)
  if chunks == 2:
    q_parts, seg_parts = ring.to_zigzag(q, axis, size), ring.to_zigzag(q_seg, axis, size)
    starts = [me * local.q_len, (2 * size - 1 - me) * local.q_len]
  else:
    q_parts, seg_parts, starts = [q], [q_seg], [me * local.q_len]
  outs, lses = [], []
  for q_part, seg_part, start in zip(q_parts, seg_parts, starts, strict=True):
    # Mods, dropout and ALiBi see global indices: the caller's batch/head offsets, seed, slopes and
    # operands go through unchanged; the positions are this chunk's. mod_tiles (tile flags of the
    # caller's shapes) do not: the impl builds its own for the chunk.
    inner = Args(q_segment_ids=seg_part, kv_segment_ids=kv_seg_all, q_offset=start, kv_offset=0,
                 dropout_seed=args.dropout_seed, batch_offset=args.batch_offset,
                 head_offset=args.head_offset, alibi_slopes=args.alibi_slopes,
                 mod_operands=args.mod_operands)
    out, lse = dispatch.attend(q_part, k_all, v_all, impl=config.impl, request=local, args=inner)
    outs.append(out)
    lses.append(lse)
  if chunks == 1:
    return outs[0], lses[0]
  return ring.from_zigzag(outs, axis, size, seq_dim=1), ring.from_zigzag(lses, axis, size, seq_dim=2)
