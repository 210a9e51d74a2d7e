"""Memory-efficient blockwise attention in pure JAX (after Rabe & Staats 2021, arXiv 2112.05682).

The sequence is cut into q chunks and kv chunks. For each q chunk the forward
pass visits kv chunks one at a time, keeping a running max ``m``, normaliser
``l`` and output accumulator in float32 (the "online softmax"), so no
``[q_len, kv_len]`` array ever exists. A custom VJP saves only q, k, v, the
output and the logsumexp ``lse``; the backward pass recomputes each chunk's
probabilities as ``exp(logits - lse)`` and accumulates dq, dk and dv chunk by
chunk. Forward and backward therefore use O(len * chunk) memory.

Chunks the mask makes wholly invisible are never visited: each q chunk loops
over the ``kv_count`` visible kv chunks listed in ``masks.block_map``'s
``kv_index``; inside a visited chunk, ``masks.visible`` masks element-wise.

Layout inside: q ``[b, nq, kvh, g, bq, d]`` (g = query heads per kv head, so
GQA/MQA read each kv head once, never repeated), k/v ``[b, nk, kvh, bk, d]``.
The per-row work is written for one batch row and vmapped over the batch,
because with segment ids each row has its own list of visible chunks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flash_layers import masks
from flash_layers.impls.base import Args, Request
from flash_layers.impls.tiling import pad_to

# Default chunk sizes: big enough that the chunk matmuls are efficient, small
# enough that a [bq, bk] float32 tile per head is ~1 MiB.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


def chunk_size(length: int, target: int) -> int:
  """A chunk length near ``target`` that wastes little padding: ``length`` itself
  when it fits, else ``length`` split evenly into ceil(length / target) chunks,
  rounded up to a multiple of 8."""
  if length <= target:
    return length
  num_chunks = -(-length // target)
  per_chunk = -(-length // num_chunks)
  return -(-per_chunk // 8) * 8


@dataclasses.dataclass(frozen=True)
class _ChunkedCall:
  """Everything the traced computation needs that is not an array."""

  spec: masks.MaskSpec
  scale: float
  softcap: float | None
  q_len: int  # unpadded lengths: positions at or beyond them are masked
  kv_len: int
  block_q: int
  block_kv: int
  num_kv_heads: int
  group: int  # query heads per kv head
  heads_in_mask: bool  # the dense mask has a head axis (else it broadcasts over heads)


def _dot(a, b, spec):
  """Matmul with float32 results; float32 operands at full precision (TPU defaults to bf16 passes)."""
  precision = jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
  if a.dtype != b.dtype:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


class _Row:
  """One batch row's chunked attention: the element mask and the logits of a (q chunk, kv chunk) tile."""

  def __init__(self, st: _ChunkedCall, q_seg, kv_seg, q_offset, kv_offset, dense):
    self.st, self.q_seg, self.kv_seg, self.dense = st, q_seg, kv_seg, dense
    self.q_offset, self.kv_offset = q_offset, kv_offset

  def mask(self, qb, kb):
    """bool [kvh|1, g|1, bq, bk]: may query (chunk qb, row i) attend key (chunk kb, column j)?"""
    st = self.st
    q_idx = qb * st.block_q + jnp.arange(st.block_q, dtype=jnp.int32)
    kv_idx = kb * st.block_kv + jnp.arange(st.block_kv, dtype=jnp.int32)
    q_seg = kv_seg = None
    if self.q_seg is not None:
      q_seg = self.q_seg[qb][:, None]
      kv_seg = self.kv_seg[kb][None, :]
    ok = masks.visible(self.q_offset + q_idx[:, None], self.kv_offset + kv_idx[None, :], st.spec,
                       q_seg, kv_seg)
    # Padding added to reach whole chunks is never visible (padded query rows see nothing).
    ok = ok & (q_idx < st.q_len)[:, None] & (kv_idx < st.kv_len)[None, :]
    ok = ok[None, None]
    if self.dense is not None:
      # Every start index int32: a literal 0 would be int64 under jax_enable_x64, and
      # dynamic_slice wants one index type.
      starts = (jnp.int32(0), jnp.int32(qb * st.block_q), jnp.int32(kb * st.block_kv))
      tile = jax.lax.dynamic_slice(
          self.dense, starts,
          (self.dense.shape[0], st.block_q, st.block_kv))  # [h|1, bq, bk]
      if st.heads_in_mask:
        tile = tile.reshape(st.num_kv_heads, st.group, st.block_q, st.block_kv)
      ok = ok & tile
    return ok

  def logits(self, q_blk, k_blk):
    """float32 [kvh, g, bq, bk]: scale * q.k, soft-capped. Also returns tanh for the softcap's derivative."""
    s = _dot(q_blk, k_blk, "kgtd,ksd->kgts") * self.st.scale
    if self.st.softcap is None:
      return s, None
    t = jnp.tanh(s / self.st.softcap)
    return self.st.softcap * t, t


def _forward_row(st: _ChunkedCall, q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, q_offset, kv_offset):
  """One batch row. q [nq, kvh, g, bq, d], k/v [nk, kvh, bk, d|dv] -> out f32 [nq, kvh, g, bq, dv], lse."""
  row = _Row(st, q_seg, kv_seg, q_offset, kv_offset, dense)
  kvh, g, bq, dv = q.shape[1], q.shape[2], q.shape[3], v.shape[-1]

  def q_chunk(args):
    qb, q_blk = args

    def visit(i, carry):
      m, denom, acc = carry
      kb = kv_index[qb, i]
      s, _ = row.logits(q_blk, k[kb])
      s = jnp.where(row.mask(qb, kb), s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      # A row with nothing visible yet keeps m = -inf; shifting by 0 then keeps
      # every exp() at exp(-inf) = 0 instead of NaN.
      shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - shift[..., None])
      correction = jnp.exp(m - shift)
      denom = correction * denom + p.sum(-1)
      acc = correction[..., None] * acc + _dot(p, v[kb], "kgts,ksv->kgtv")
      return m_new, denom, acc

    init = (jnp.full((kvh, g, bq), -jnp.inf, jnp.float32), jnp.zeros((kvh, g, bq), jnp.float32),
            jnp.zeros((kvh, g, bq, dv), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, kv_count[qb], visit, init)
    has_key = denom > 0
    safe_denom = jnp.where(has_key, denom, 1.0)
    out = acc / safe_denom[..., None]
    lse = jnp.where(has_key, m + jnp.log(safe_denom), -jnp.inf)
    return out, lse

  return jax.lax.map(q_chunk, (jnp.arange(q.shape[0], dtype=jnp.int32), q))


def _backward_row(st: _ChunkedCall, q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, q_offset, kv_offset,
                  lse, delta, dout):
  """One batch row's dq, dk, dv (float32), recomputing each visited tile's probabilities from lse.

  With s the (capped) logits and p = exp(s - lse):
    dv += p^T dO;  dp = dO v^T;  ds = p * (dp - delta)   where delta = rowsum(dO * O) - dlse
    (through the softcap: ds *= 1 - tanh^2);  dq += scale * ds k;  dk += scale * ds^T q.
  """
  row = _Row(st, q_seg, kv_seg, q_offset, kv_offset, dense)
  # A row that sees no key has lse = -inf and p = 0 everywhere; shift it by 0 to keep exp() finite.
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)

  def q_chunk(carry, args):
    dk, dv = carry
    qb, q_blk, lse_blk, delta_blk, do_blk = args

    def visit(i, inner):
      dq, dk, dv = inner
      kb = kv_index[qb, i]
      k_blk, v_blk = k[kb], v[kb]
      s, tanh = row.logits(q_blk, k_blk)
      p = jnp.where(row.mask(qb, kb), jnp.exp(s - lse_blk[..., None]), 0.0)
      dv_blk = _dot(p, do_blk, "kgts,kgtv->ksv")
      ds = p * (_dot(do_blk, v_blk, "kgtv,ksv->kgts") - delta_blk[..., None])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
      ds = ds * st.scale
      dq = dq + _dot(ds, k_blk, "kgts,ksd->kgtd")
      dk_blk = _dot(ds, q_blk, "kgts,kgtd->ksd")
      dk = jax.lax.dynamic_update_index_in_dim(dk, dk[kb] + dk_blk, kb, 0)
      dv = jax.lax.dynamic_update_index_in_dim(dv, dv[kb] + dv_blk, kb, 0)
      return dq, dk, dv

    dq = jnp.zeros(q_blk.shape, jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(0, kv_count[qb], visit, (dq, dk, dv))
    return (dk, dv), dq

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  xs = (jnp.arange(q.shape[0], dtype=jnp.int32), q, lse, delta, dout)
  (dk, dv), dq = jax.lax.scan(q_chunk, init, xs)
  return dq, dk, dv


def _batch_axes(q_seg, kv_index, dense):
  """vmap in_axes for (q_seg, kv_seg, kv_index, kv_count, dense): per row, or shared by all rows."""
  seg_axis = None if q_seg is None else 0
  map_axis = 0 if kv_index.shape[0] > 1 else None
  dense_axis = None if dense is None or dense.shape[0] == 1 else 0
  return seg_axis, seg_axis, map_axis, map_axis, dense_axis


def _squeeze_shared(kv_index, kv_count, dense):
  """Drop the size-1 batch axis of arrays shared by every row (vmap with in_axes None)."""
  if kv_index.shape[0] == 1:
    kv_index, kv_count = kv_index[0], kv_count[0]
  if dense is not None and dense.shape[0] == 1:
    dense = dense[0]
  return kv_index, kv_count, dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, offsets):
  return _chunked_fwd(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, offsets)[0]


def _chunked_fwd(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, offsets):
  axes = _batch_axes(q_seg, kv_index, dense)
  kv_index_, kv_count_, dense_ = _squeeze_shared(kv_index, kv_count, dense)
  fwd = jax.vmap(_forward_row, in_axes=(None, 0, 0, 0, *axes, None, None))
  out, lse = fwd(st, q, k, v, q_seg, kv_seg, kv_index_, kv_count_, dense_, offsets[0], offsets[1])
  residuals = (q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, offsets, out, lse)
  return (out, lse), residuals


def _chunked_bwd(st, residuals, cotangents):
  q, k, v, q_seg, kv_seg, kv_index, kv_count, dense, offsets, out, lse = residuals
  dout, dlse = cotangents
  dout = dout.astype(jnp.float32)
  # d lse_i / d s_ij = p_ij, so an lse cotangent enters exactly like -delta.
  delta = jnp.sum(dout * out, axis=-1) - dlse.astype(jnp.float32)
  axes = _batch_axes(q_seg, kv_index, dense)
  kv_index_, kv_count_, dense_ = _squeeze_shared(kv_index, kv_count, dense)
  bwd = jax.vmap(_backward_row, in_axes=(None, 0, 0, 0, *axes, None, None, 0, 0, 0))
  dq, dk, dv = bwd(st, q, k, v, q_seg, kv_seg, kv_index_, kv_count_, dense_, offsets[0], offsets[1],
                   lse, delta, dout)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None, None, None, None, None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


class XlaChunked:
  """Chunked attention with chunk sizes ``block_q`` x ``block_kv`` (clamped to the lengths)."""

  name = "xla_chunked"

  def __init__(self, block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV):
    self.block_q, self.block_kv = block_q, block_kv

  def unsupported(self, request: Request, platform: str) -> str | None:
    return None

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def chunk_shape(self, request: Request) -> tuple[int, int]:
    return chunk_size(request.q_len, self.block_q), chunk_size(request.kv_len, self.block_kv)

  def block_stats(self, request: Request, args: Args, platform: str) -> tuple[int, int] | None:
    """(chunk pairs visited, total) over batch and heads; None when segment ids are traced."""
    return masks.block_stats(request.batch, request.num_heads, request.q_len, request.kv_len,
                             *self.chunk_shape(request), request.spec, args.q_segment_ids,
                             args.kv_segment_ids, args.q_offset, args.kv_offset)

  def attend(self, q, k, v, *, request: Request, args: Args):
    b, t, h, d = q.shape
    s, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // kvh
    bq, bk = self.chunk_shape(request)
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    st = _ChunkedCall(request.spec, request.scale, request.softcap, t, s, bq, bk, kvh, g,
                 heads_in_mask=args.dense_mask is not None and args.dense_mask.shape[1] != 1)

    # [b, t, h, d] -> [b, nq, kvh, g, bq, d]; [b, s, kvh, d] -> [b, nk, kvh, bk, d].
    qc = pad_to(q, 1, tp).reshape(b, nq, bq, kvh, g, d).transpose(0, 1, 3, 4, 2, 5)
    kc = pad_to(k, 1, sp).reshape(b, nk, bk, kvh, d).transpose(0, 1, 3, 2, 4)
    vc = pad_to(v, 1, sp).reshape(b, nk, bk, kvh, dv).transpose(0, 1, 3, 2, 4)
    q_seg = kv_seg = None
    if args.q_segment_ids is not None:
      q_seg = pad_to(args.q_segment_ids, 1, tp).reshape(b, nq, bq)
      kv_seg = pad_to(args.kv_segment_ids, 1, sp).reshape(b, nk, bk)
    dense = None
    if args.dense_mask is not None:
      dm = args.dense_mask
      dm = jnp.broadcast_to(dm, (dm.shape[0], dm.shape[1], t, s))
      dense = pad_to(pad_to(dm, 2, tp, False), 3, sp, False)  # [b|1, h|1, tp, sp]
    bm = masks.block_map(t, s, bq, bk, request.spec, args.q_segment_ids, args.kv_segment_ids,
                         args.q_offset, args.kv_offset)
    offsets = (jnp.asarray(args.q_offset, jnp.int32), jnp.asarray(args.kv_offset, jnp.int32))

    out, lse = _chunked(st, qc, kc, vc, q_seg, kv_seg, bm.kv_index, bm.kv_count, dense, offsets)
    # [b, nq, kvh, g, bq, dv] -> [b, t, h, dv]; lse [b, nq, kvh, g, bq] -> [b, h, t].
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(b, tp, h, dv)[:, :t].astype(q.dtype)
    lse = lse.transpose(0, 2, 3, 1, 4).reshape(b, h, tp)[:, :, :t]
    return out, lse

