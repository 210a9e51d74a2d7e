"""What one benchmark cell computes: the mask kinds, the inputs, and the analytic work.

A cell is (impl, seq_len, mask kind, dtype, pass). The work it does is counted
analytically from the mask alone, so every impl is charged the same FLOPs for the
same cell whatever it actually computes: a dense impl that evaluates masked-out
pairs does not get credit for them.

Visibility is read through `flash_layers.masks.visible` (the one mask predicate);
nothing here re-derives which pairs a mask keeps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.contract import mask_rules

MASK_KINDS = ("full", "causal", "packed", "window")

# A bidirectional local window (Longformer-style): each query sees 256 keys on each side.
WINDOW = 256
# Packed documents: seeded lengths drawn uniformly from this range, packed back to back.
DOC_LENGTHS = (128, 1024)

PASSES = ("fwd", "fwd+bwd")
# FlashAttention's convention: the backward pass does 5 matmuls of the forward's 2 (2.5x).
BACKWARD_FLOPS_FACTOR = 2.5


@dataclasses.dataclass(frozen=True)
class Shape:
  """Everything of a cell's inputs except the length."""

  batch: int = 1
  heads: int = 4
  head_dim: int = 64


def doc_segment_ids(batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
  """int32 [batch, seq_len]: documents of seeded random lengths, ids 1, 2, ... (no padding)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    ids, doc = [], 1
    while len(ids) < seq_len:
      ids += [doc] * int(rng.integers(DOC_LENGTHS[0], DOC_LENGTHS[1] + 1))
      doc += 1
    rows.append(ids[:seq_len])
  return np.asarray(rows, dtype=np.int32)


def mask_kwargs(kind: str, batch: int, seq_len: int) -> dict[str, Any]:
  """The `fl.attention` keyword arguments of a mask kind (segment ids as a NumPy array)."""
  if kind == "full":
    return {}
  if kind == "causal":
    return {"causal": True}
  if kind == "packed":
    return {"segment_ids": doc_segment_ids(batch, seq_len)}
  if kind == "window":
    return {"window": WINDOW}
  raise ValueError(f"mask kind must be one of {MASK_KINDS}; got {kind!r}")


def mask_spec(kwargs: dict[str, Any]) -> mask_rules.MaskSpec:
  return mask_rules.MaskSpec(causal=kwargs.get("causal", False),
                        window=mask_rules.normalize_window(kwargs.get("window")))


def inputs(shape: Shape, seq_len: int, dtype: str, seed: int = 0):
  """q, k, v [batch, seq_len, heads, head_dim] and a cotangent for the backward pass."""
  keys = jax.random.split(jax.random.key(seed), 4)
  dims = (shape.batch, seq_len, shape.heads, shape.head_dim)
  return tuple(jax.random.normal(k, dims, dtype=dtype) for k in keys)


@functools.partial(jax.jit, static_argnames=("seq_len", "spec", "block_q", "block_kv"))
def _count(segment_ids, *, seq_len: int, spec: mask_rules.MaskSpec, block_q: int, block_kv: int):
  """(visible pairs, tiles of block_q x block_kv holding >= 1 visible pair), summed over batch."""
  num_q_blocks, num_kv_blocks = seq_len // block_q, seq_len // block_kv
  kv_pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :]

  def one_q_block(i):
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]
    q_seg = kv_seg = None
    if segment_ids is not None:
      q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, i * block_q, block_q, axis=1)[:, :, None]
      kv_seg = segment_ids[:, None, :]
    vis = mask_rules.visible(q_pos, kv_pos, spec, q_seg, kv_seg)
    vis = jnp.broadcast_to(vis, (vis.shape[0] if vis.ndim == 3 else 1, block_q, seq_len))
    tiles = vis.reshape(vis.shape[0], block_q, num_kv_blocks, block_kv).any(axis=(1, 3))
    # Per q block the count fits int32 (block_q * seq_len * batch); the total may not,
    # so blocks are summed on the host in int64.
    return vis.sum(dtype=jnp.int32), tiles.sum(dtype=jnp.int32)

  return jax.lax.map(one_q_block, jnp.arange(num_q_blocks))


def visible_work(kwargs: dict[str, Any], batch: int, seq_len: int,
                 block: tuple[int, int] | None = None) -> tuple[int, int | None]:
  """(visible pairs over the batch, tiles with a visible pair at `block` or None).

  Without segment ids the mask is the same for every batch row and is counted once.
  """
  block_q, block_kv = block if block is not None else (min(512, seq_len), seq_len)
  if seq_len % block_q or seq_len % block_kv:
    raise ValueError(f"seq_len {seq_len} must be a multiple of the block shape {block}")
  seg = kwargs.get("segment_ids")
  pairs, tiles = _count(None if seg is None else jnp.asarray(seg), seq_len=seq_len,
                        spec=mask_spec(kwargs), block_q=block_q, block_kv=block_kv)
  rows = 1 if seg is not None else batch
  pairs = int(np.asarray(pairs, dtype=np.int64).sum()) * rows
  tiles = int(np.asarray(tiles, dtype=np.int64).sum()) * rows
  return pairs, (tiles if block is not None else None)


def attention_flops(pairs: int, shape: Shape, pass_: str) -> float:
  """Matmul FLOPs of the visible pairs: QK^T and PV, 2 * head_dim each per pair and head."""
  forward = 4.0 * pairs * shape.heads * shape.head_dim
  if pass_ == "fwd":
    return forward
  if pass_ == "fwd+bwd":
    return forward * (1 + BACKWARD_FLOPS_FACTOR)
  raise ValueError(f"pass must be one of {PASSES}; got {pass_!r}")
