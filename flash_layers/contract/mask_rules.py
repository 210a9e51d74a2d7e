"""The built-in mask rules, in one place.

Every impl, both Pallas kernel families, `explain()` and the ring schedule read
the mask through this module (and `block_info`, its block-level form), so there is
exactly one definition of "query i may attend key j":

* ``causal``           -> kv_pos <= q_pos
* ``window=(l, r)``    -> q_pos - l <= kv_pos <= q_pos + r
* segment ids          -> q_segment_ids[i] == kv_segment_ids[j]
* ``global_tokens=g``  -> with a window, the window is waived when doc_pos(i) < g or
                          doc_pos(j) < g (Longformer's global attention); causal and segment
                          ids still apply. doc_pos is the position within the document: it
                          restarts at 0 where the segment id changes (the global position
                          without segment ids).

With global tokens and segment ids the impls receive *encoded* segment ids,
``2 * id + (doc_pos < g)`` (`encode_global`, done once in `validate.prepare` on the
whole sequence), so the flag travels wherever segment ids already go: kernel
tiles, xla_chunked's chunks, the ring's rotating kv shards. `visible` and
`block_info.block_map` decode it; no impl needs an extra operand.

Positions are *global*: ``q_pos = q_offset + i`` and ``kv_pos = kv_offset + j``.
Offsets are 0 for an ordinary call; ring attention passes the offsets of the
shards a device holds (they may be traced values).

Which tiles hold a visible pair is `block_info`'s question (the same rules, per block).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def normalize_window(window: int | tuple[int, int] | None) -> tuple[int, int] | None:
  """``w`` -> ``(w, w)``; validates; ``None`` stays ``None``."""
  if window is None:
    return None
  if isinstance(window, bool):
    raise TypeError(f"window must be an int or a (left, right) pair of ints; got {window!r}")
  if isinstance(window, (int, np.integer)):
    window = (window, window)
  try:
    left, right = window
  except (TypeError, ValueError):
    raise TypeError(
        f"window must be an int or a (left, right) pair of ints; got {window!r}") from None
  for name, v in (("left", left), ("right", right)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"window {name} must be a non-negative int; got {v!r} in window={window!r}")
    if v < 0:
      raise ValueError(f"window {name} must be >= 0; got {v} in window={window!r}")
  return (int(left), int(right))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a mask (segment ids and offsets are arrays, passed beside it)."""

  causal: bool = False
  window: tuple[int, int] | None = None
  global_tokens: int = 0  # > 0 only with a window; segment ids are then encoded (encode_global)

  def describe(self, has_segments: bool) -> str:
    parts = []
    if self.causal:
      parts.append("causal")
    if self.window is not None:
      parts.append(f"window={self.window}")
    if self.global_tokens:
      parts.append(f"global_tokens={self.global_tokens}")
    if has_segments:
      parts.append("segments")
    return "+".join(parts) or "full"


def visible(q_pos, kv_pos, spec: MaskSpec, q_seg=None, kv_seg=None):
  """Element-wise visibility; broadcasts its arguments (q on axis -2, kv on axis -1 by the caller).

  This is the single predicate: the reference, xla_chunked and the kernels call
  it (the kernels on iota-built positions of one tile).
  """
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos)), dtype=bool)
  if spec.causal:
    ok = ok & (kv_pos <= q_pos)
  if spec.global_tokens and q_seg is not None:
    q_global, kv_global = (q_seg & 1) == 1, (kv_seg & 1) == 1
    q_seg, kv_seg = q_seg >> 1, kv_seg >> 1
  elif spec.global_tokens:
    q_global, kv_global = q_pos < spec.global_tokens, kv_pos < spec.global_tokens
  if spec.window is not None:
    left, right = spec.window
    in_window = (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)
    if spec.global_tokens:
      in_window = in_window | q_global | kv_global
    ok = ok & in_window
  if q_seg is not None:
    ok = ok & (q_seg == kv_seg)
  return ok


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """[batch, len] position of each token in its document: 0 where the segment id changes."""
  length = segment_ids.shape[-1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def encode_global(segment_ids: jax.Array, global_tokens: int) -> jax.Array:
  """Segment ids with the global flag in the lowest bit: 2 * id + (doc_pos < global_tokens)."""
  flag = (document_positions(segment_ids) < global_tokens).astype(jnp.int32)
  return segment_ids.astype(jnp.int32) * 2 + flag


def dense_mask(q_len: int, kv_len: int, spec: MaskSpec, q_segment_ids=None,
               kv_segment_ids=None, q_offset=0, kv_offset=0) -> jax.Array:
  """Boolean mask ``[batch or 1, q_len, kv_len]``."""
  q_pos = q_offset + jnp.arange(q_len, dtype=jnp.int32)[:, None]
  kv_pos = kv_offset + jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  q_seg = kv_seg = None
  if q_segment_ids is not None:
    q_seg = q_segment_ids[:, :, None]
    kv_seg = kv_segment_ids[:, None, :]
  ok = visible(q_pos, kv_pos, spec, q_seg, kv_seg)
  return ok if ok.ndim == 3 else ok[None]


def band(spec: MaskSpec, transpose: bool = False) -> tuple[int | None, int | None]:
  """(lo, hi): causal and windows make key position - query position of a visible pair lie in
  [lo, hi] (`visible`; segment ids and global tokens not counted); None is unbounded.
  transpose: the band of query position - key position instead (kv blocks walking q blocks)."""
  lo = hi = None
  if spec.window is not None:
    lo, hi = -spec.window[0], spec.window[1]
  if spec.causal:
    hi = 0 if hi is None else min(hi, 0)
  if transpose:
    lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
  return lo, hi


def count_visible(q_len: int, kv_len: int, spec: MaskSpec, q_offset: int = 0, kv_offset: int = 0) -> int:
  """How many (query, key) pairs causal/window leave visible (static; segment ids not counted;
  with global tokens an upper bound).

  The closed form of summing `visible` over a [q_len, kv_len] grid, in O(q_len) NumPy, for cost
  estimates: each query sees the keys of one interval of positions.
  """
  q_pos = q_offset + np.arange(q_len, dtype=np.int64)
  lo = np.full(q_len, kv_offset, dtype=np.int64)
  hi = np.full(q_len, kv_offset + kv_len - 1, dtype=np.int64)
  dmin, dmax = band(spec)
  if dmin is not None:
    lo = np.maximum(lo, q_pos + dmin)
  if dmax is not None:
    hi = np.minimum(hi, q_pos + dmax)
  count = int(np.maximum(hi - lo + 1, 0).sum())
  if spec.global_tokens and spec.window is not None:  # an upper bound: g full rows and columns more
    g = spec.global_tokens
    count = min(count + min(g, q_len) * kv_len + q_len * min(g, kv_len), q_len * kv_len)
  return count
