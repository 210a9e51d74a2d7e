"""The int32 scalar table both kernel families read: offsets, ALiBi slopes, dropout streams.

The TPU kernel keeps it in SMEM (scalar prefetch), the GPU kernel reads it as a small array. Its
layout, the last two parts present only when the request uses them:

    [Q_OFFSET]                     global position of query 0 (traced under a ring)
    [KV_OFFSET]                    global position of key 0
    [BATCH_OFFSET]                 global index of local batch row 0 (traced on a mesh: axis_index)
    [HEAD_OFFSET]                  global index of local query head 0 (likewise; Ulysses adds its slice)
    [SLOPES + h]                   ALiBi slope of local query head h, as float32 bits
    [streams + b * heads + h]      dropout stream of local (batch row b, query head h)

The batch and head offsets are what a shard of a mesh adds to its local indices so that mask_mod and
score_mod see global rows and heads (`origin`, read by the kernels' mod evaluation and by the tile flags
of a mask_mod's block plan); dropout needs no read of them, its streams are hashed from global indices
here.

A kernel never indexes the table by hand: it reads the offsets through `offsets(ref)` and `origin(ref)`
and the rest through a `Table` made from its request, which owns the layout (`build` writes the same
layout; the decode kernels, which read only the offsets, get a table of the fixed part alone from
`offsets_table`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract import dropout

Q_OFFSET, KV_OFFSET, BATCH_OFFSET, HEAD_OFFSET, SLOPES = 0, 1, 2, 3, 4


class Offsets(NamedTuple):
  """The global positions of query 0 and key 0 (int32 scalars; traced under a ring)."""

  q: jax.Array
  kv: jax.Array


class Origin(NamedTuple):
  """The global batch row and query head of this call's local row 0 and head 0 (int32 scalars; 0
  unsharded, traced on a mesh): a mod's ``b`` and ``h`` are these plus the local ones."""

  batch: jax.Array
  head: jax.Array


def offsets(ref) -> Offsets:
  """The offsets of a table (a Pallas ref or an array), whatever else it holds."""
  return Offsets(ref[Q_OFFSET], ref[KV_OFFSET])


def origin(ref) -> Origin:
  """The batch and head offsets of a table (a Pallas ref or an array), whatever else it holds."""
  return Origin(ref[BATCH_OFFSET], ref[HEAD_OFFSET])


def offsets_table(q_offset, kv_offset, batch_offset=0, head_offset=0) -> jax.Array:
  """int32 [4]: a table of the offsets alone (the first part of every table `build` writes)."""
  return jnp.stack([jnp.asarray(x, jnp.int32) for x in (q_offset, kv_offset, batch_offset, head_offset)])


@dataclasses.dataclass(frozen=True)
class Table:
  """The layout of one call's table, and typed reads of it inside a kernel."""

  num_heads: int
  has_alibi: bool
  has_dropout: bool

  @classmethod
  def of(cls, request) -> Table:
    return cls(request.num_heads, request.has_alibi, request.has_dropout)

  @property
  def streams(self) -> int:
    """Index of the first dropout stream."""
    return SLOPES + (self.num_heads if self.has_alibi else 0)

  def slope_index(self, head):
    return SLOPES + head

  def stream_index(self, batch, head):
    return self.streams + batch * self.num_heads + head

  # Reads (`ref` is the kernel's table: a Pallas ref or an array); the offsets: `offsets(ref)`.
  def slope(self, ref, head):
    """float32 ALiBi slope of local query head `head`."""
    return jax.lax.bitcast_convert_type(ref[self.slope_index(head)], jnp.float32)

  def stream(self, ref, batch, head):
    """int32 dropout stream of local (batch row, query head)."""
    return ref[self.stream_index(batch, head)]


def build(request, args, batch: int) -> jax.Array:
  """int32 table of one call (module docstring) for `batch` local rows and the request's heads.

  The streams come from `dropout.stream` on global rows and heads (`args.batch_offset`,
  `args.head_offset`), so a kernel only hashes positions (`dropout.bits`), as the other impls do.
  """
  parts = [offsets_table(args.q_offset, args.kv_offset, args.batch_offset, args.head_offset)]
  if request.has_alibi:
    parts.append(jax.lax.bitcast_convert_type(args.alibi_slopes.astype(jnp.float32), jnp.int32))
  if request.has_dropout:
    if request.dropout_broadcast:
      b = h = jnp.zeros((batch, request.num_heads), jnp.int32)
    else:
      b = args.batch_offset + jnp.arange(batch, dtype=jnp.int32)[:, None]
      h = args.head_offset + jnp.arange(request.num_heads, dtype=jnp.int32)[None, :]
    parts.append(dropout.stream(args.dropout_seed, b, h).reshape(-1))
  return jnp.concatenate(parts)
