"""Memory-efficient blockwise attention in pure JAX (after Rabe & Staats 2021, arXiv 2112.05682).

The sequence is cut into q chunks and kv chunks. For each q chunk the forward
pass visits kv chunks one at a time, keeping a running max ``m``, normaliser
``l`` and output accumulator in float32 (the "online softmax"), so no
``[q_len, kv_len]`` array ever exists. A custom VJP saves only q, k, v, the
output and the logsumexp ``lse``; the backward pass recomputes each chunk's
probabilities as ``exp(logits - lse)`` and accumulates dq, dk and dv chunk by
chunk. Forward and backward therefore use O(len * chunk) memory.

Chunks the mask makes wholly invisible are never visited: each q chunk loops
over the ``kv_count`` visible kv chunks listed in ``block_info.block_map``'s
``kv_index``; inside a visited chunk, ``mask_rules.visible`` masks element-wise, except
in a chunk the block map marks full (every pair visible), which a one-row call
(each step of the CPU loop) runs without the element mask (a long document's rows
are mostly full chunks). Under vmap the branch would run both sides, so a call
of several rows always masks.

Dropout, ALiBi: each visited tile hashes its keep mask (`dropout.keep`) and its
ALiBi term from global indices, in the forward and again in the backward; no
[q_len, kv_len] array exists. A dense ``bias`` is sliced per tile, and its
gradient (dS before the logit scale) is written tile by tile.

Layout inside: q ``[b, nq, kvh, g, bq, d]`` (g = query heads per kv head, so
GQA/MQA read each kv head once, never repeated), k/v ``[b, nk, kvh, bk, d]``.
The per-row work is written for one batch row and vmapped over the batch,
because with segment ids each row has its own list of visible chunks. Lowered
for CPU, the whole call instead runs once per batch row and kv head
(`impls/cpu_loop.py`): each row then loops over its own chunk list only, and a
step's [g, bq, bk] tile stays in cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls import cpu_loop, dense_logits
from flash_layers.impls.base import Args, Request
from flash_layers.impls.tiling import CpuBlockSizes, pad_to

# Default chunk sizes: big enough that the chunk matmuls are efficient, small
# enough that a [bq, bk] float32 tile per head is ~1 MiB.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512
# The chunk lengths the autotuner combines (`XlaChunked.tuning_space`).
TUNING_CHUNKS = (256, 512, 1024)


def chunk_size(length: int, target: int) -> int:
  """A chunk length near ``target`` that wastes little padding: ``length`` itself
  when it fits, else ``length`` split evenly into ceil(length / target) chunks,
  rounded up to a multiple of 8."""
  if length <= target:
    return length
  num_chunks = -(-length // target)
  per_chunk = -(-length // num_chunks)
  return -(-per_chunk // 8) * 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ChunkedCall:
  """One call as the traced computation sees it: the request and what is derived from it (not
  arrays; hashable: a custom_vjp static argument)."""

  request: Request
  block_q: int   # chunk sizes (`XlaChunked.chunk_shape`)
  block_kv: int
  heads_in_mask: bool  # the dense mask has a head axis (else it broadcasts over heads)
  heads_in_bias: bool = False  # the bias has a head axis (else it broadcasts over heads)

  @property
  def group(self) -> int:  # query heads per kv head
    return self.request.num_heads // self.request.num_kv_heads


def _dot(st: _ChunkedCall, a, b, spec):
  """Matmul with float32 results at the request's precision; mixed operands (float32 probabilities
  against bfloat16 values) meet in float32."""
  if a.dtype != b.dtype:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(spec, a, b, precision=st.request.precision, preferred_element_type=jnp.float32)


class _Extras(NamedTuple):
  """Per-call operands beyond q, k, v, segment ids and the block lists (any may be None)."""

  dense: jax.Array | None   # bool [b|1, h|1, tp, sp]
  bias: jax.Array | None    # float [b|1, h|1, tp, sp]
  slopes: jax.Array | None  # float32 [kvh, g]
  ints: jax.Array           # int32 [q_offset, kv_offset, batch_offset, head_offset, seed0, seed1]
  ops: tuple = ()           # mod_operands (flash_layers/contract/mods.py), shared by every row


def _tile_starts(st: _ChunkedCall, qb, kb):
  """Start indices of the (qb, kb) tile of a [h|1, q_len, kv_len] operand, all int32.

  A literal 0 would be int64 under jax_enable_x64, and dynamic_slice wants one index type.
  """
  return jnp.int32(0), jnp.asarray(qb * st.block_q, jnp.int32), jnp.asarray(kb * st.block_kv, jnp.int32)


class _Row:
  """One batch row's chunked attention: the element mask and the logits of a (q chunk, kv chunk) tile."""

  def __init__(self, st: _ChunkedCall, q_seg, kv_seg, dense, bias, slopes, ints, batch_index, ops=()):
    self.st, self.q_seg, self.kv_seg, self.dense, self.bias = st, q_seg, kv_seg, dense, bias
    self.slopes, self.ops = slopes, ops
    self.q_offset, self.kv_offset = ints[0], ints[1]
    kvh, g = st.request.num_kv_heads, st.group
    # The mods' global row and heads, laid out as a tile's logits [kvh, g, bq, bk].
    self.mod_b = (ints[2] + batch_index).reshape(1, 1, 1, 1)
    self.mod_h = (ints[3] + jnp.arange(kvh * g, dtype=jnp.int32)).reshape(kvh, g, 1, 1)
    self.stream = None
    if st.request.dropout_rate > 0:
      if st.request.dropout_broadcast:
        self.stream = dropout.stream(ints[4:6], 0, 0)[None, None]  # [1, 1]
      else:
        heads = ints[3] + jnp.arange(st.request.num_kv_heads * st.group, dtype=jnp.int32)
        self.stream = dropout.stream(ints[4:6], ints[2] + batch_index,
                                     heads.reshape(st.request.num_kv_heads, st.group))  # [kvh, g]

  def positions(self, qb, kb):
    """Global positions (q [bq, 1], kv [1, bk]) of a tile."""
    q_pos = self.q_offset + qb * self.st.block_q + jnp.arange(self.st.block_q, dtype=jnp.int32)
    kv_pos = self.kv_offset + kb * self.st.block_kv + jnp.arange(self.st.block_kv, dtype=jnp.int32)
    return q_pos[:, None], kv_pos[None, :]

  def keep(self, qb, kb):
    """The dropout multiplier of a tile, float32 [kvh|1, g|1, bq, bk] (0 or 1 / (1 - rate)), or None."""
    if self.stream is None:
      return None
    q_pos, kv_pos = self.positions(qb, kb)
    kept = dropout.keep(self.stream[..., None, None], q_pos, kv_pos, self.st.request.dropout_rate)
    return jnp.where(kept, jnp.float32(dropout.keep_scale(self.st.request.dropout_rate)), 0.0)

  def bias_tile(self, qb, kb):
    """float32 [kvh|1, g|1, bq, bk] of the dense bias, or None."""
    st = self.st
    tile = jax.lax.dynamic_slice(self.bias, _tile_starts(st, qb, kb),
                                 (self.bias.shape[0], st.block_q, st.block_kv)).astype(jnp.float32)
    if st.heads_in_bias:
      return tile.reshape(st.request.num_kv_heads, st.group, st.block_q, st.block_kv)
    return tile[None]

  def mask(self, qb, kb):
    """bool [kvh|1, g|1, bq, bk]: may query (chunk qb, row i) attend key (chunk kb, column j)?"""
    st = self.st
    q_idx = qb * st.block_q + jnp.arange(st.block_q, dtype=jnp.int32)
    kv_idx = kb * st.block_kv + jnp.arange(st.block_kv, dtype=jnp.int32)
    q_seg = kv_seg = None
    if self.q_seg is not None:
      q_seg = self.q_seg[qb][:, None]
      kv_seg = self.kv_seg[kb][None, :]
    ok = mask_rules.visible(self.q_offset + q_idx[:, None], self.kv_offset + kv_idx[None, :], st.request.spec,
                       q_seg, kv_seg)
    # Padding added to reach whole chunks is never visible (padded query rows see nothing).
    ok = ok & (q_idx < st.request.q_len)[:, None] & (kv_idx < st.request.kv_len)[None, :]
    ok = ok[None, None]
    if st.request.mask_mod is not None:
      ok = ok & mods.mask(st.request.mask_mod, self.mod_indices(qb, kb), self.ops)
    if self.dense is not None:
      tile = jax.lax.dynamic_slice(
          self.dense, _tile_starts(st, qb, kb),
          (self.dense.shape[0], st.block_q, st.block_kv))  # [h|1, bq, bk]
      if st.heads_in_mask:
        tile = tile.reshape(st.request.num_kv_heads, st.group, st.block_q, st.block_kv)
      ok = ok & tile
    return ok

  def mod_indices(self, qb, kb) -> mods.Indices:
    """The mods' global indices of a tile, broadcastable to [kvh, g, bq, bk]."""
    return mods.Indices(self.mod_b, self.mod_h, *self.positions(qb, kb))

  def unmodded(self, q_blk, k_blk, qb, kb):
    """float32 [kvh, g, bq, bk]: scale * q.k + alibi + bias (what score_mod receives)."""
    s = _dot(self.st, q_blk, k_blk, "kgtd,ksd->kgts") * self.st.request.scale
    if self.slopes is not None:
      s = s + alibi(self.slopes[..., None, None], *self.positions(qb, kb))
    if self.bias is not None:
      s = s + self.bias_tile(qb, kb)
    return s

  def logits(self, q_blk, k_blk, qb, kb):
    """float32 [kvh, g, bq, bk]: `unmodded`, then score_mod, soft-capped (the dense impls' step,
    `dense_logits.logits`, on a tile). Also returns tanh for the softcap's derivative."""
    request = self.st.request
    indices = None if request.score_mod is None else self.mod_indices(qb, kb)
    return dense_logits.logits(self.unmodded(q_blk, k_blk, qb, kb), request, None, indices, self.ops)


def _forward_row(st: _ChunkedCall, q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, dense, bias, slopes,
                 ints, ops, batch_index, *, branch: bool = False):
  """One batch row. q [nq, kvh, g, bq, d], k/v [nk, kvh, bk, d|dv] -> out f32 [nq, kvh, g, bq, dv], lse.

  branch=True (only outside vmap, where a batched predicate would run both branches): a tile whose
  pairs are all visible (`kv_full`, from the block map) skips the element mask."""
  row = _Row(st, q_seg, kv_seg, dense, bias, slopes, ints, batch_index, ops)
  kvh, g, bq, dv = q.shape[1], q.shape[2], q.shape[3], v.shape[-1]

  def q_chunk(args):
    qb, q_blk = args

    def tile(i, carry, masked: bool):
      m, denom, acc = carry
      kb = kv_index[qb, i]
      s, _ = row.logits(q_blk, k[kb], qb, kb)
      if masked:
        s = jnp.where(row.mask(qb, kb), s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      # A row with nothing visible yet keeps m = -inf; shifting by 0 then keeps
      # every exp() at exp(-inf) = 0 instead of NaN.
      shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - shift[..., None])
      correction = jnp.exp(m - shift)
      denom = correction * denom + p.sum(-1)  # the normaliser (and lse) is taken before dropout
      keep = row.keep(qb, kb)
      if keep is not None:
        p = p * keep
      acc = correction[..., None] * acc + _dot(st, p, v[kb], "kgts,ksv->kgtv")
      return m_new, denom, acc

    def visit(i, carry):
      if not (branch and dense is None):
        return tile(i, carry, masked=True)
      return jax.lax.cond(kv_full[qb, i], functools.partial(tile, i, masked=False),
                          functools.partial(tile, i, masked=True), carry)

    init = (jnp.full((kvh, g, bq), -jnp.inf, jnp.float32), jnp.zeros((kvh, g, bq), jnp.float32),
            jnp.zeros((kvh, g, bq, dv), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, kv_count[qb], visit, init)
    has_key = denom > 0
    safe_denom = jnp.where(has_key, denom, 1.0)
    out = acc / safe_denom[..., None]
    lse = jnp.where(has_key, m + jnp.log(safe_denom), -jnp.inf)
    return out, lse

  return jax.lax.map(q_chunk, (jnp.arange(q.shape[0], dtype=jnp.int32), q))


def _backward_row(st: _ChunkedCall, q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, dense, bias, slopes,
                  ints, ops, batch_index, lse, delta, dout):
  """One batch row's dq, dk, dv (float32) and dbias, recomputing each visited tile's probabilities from lse.

  With s the (capped) logits, p = exp(s - lse) and m the dropout multiplier (1 without dropout):
    dv += (m p)^T dO;  dp = m * (dO v^T);  ds = p * (dp - delta)   where delta = rowsum(dO * O) - dlse
    (through the softcap: ds *= 1 - tanh^2; through score_mod: ds, d operands = its vjp at the
    logits it received);  dbias = ds;  dq += scale * ds k;  dk += scale * ds^T q.
  (sum_j p m dO.v_j = dO.O, so delta is unchanged by dropout.)
  """
  row = _Row(st, q_seg, kv_seg, dense, bias, slopes, ints, batch_index, ops)
  bias_heads = None if bias is None else bias.shape[0]
  # A row that sees no key has lse = -inf and p = 0 everywhere; shift it by 0 to keep exp() finite.
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)

  def q_chunk(carry, args):
    dk, dv, d_ops = carry
    qb, q_blk, lse_blk, delta_blk, do_blk = args

    def visit(i, inner):
      dq, dk, dv, dbias, d_ops = inner
      kb = kv_index[qb, i]
      k_blk, v_blk = k[kb], v[kb]
      s, tanh = row.logits(q_blk, k_blk, qb, kb)
      p = jnp.where(row.mask(qb, kb), jnp.exp(s - lse_blk[..., None]), 0.0)
      dp = _dot(st, do_blk, v_blk, "kgtv,ksv->kgts")
      keep = row.keep(qb, kb)
      pm = p if keep is None else p * keep
      if keep is not None:
        dp = dp * keep
      dv_blk = _dot(st, pm, do_blk, "kgts,kgtv->ksv")
      ds = p * (dp - delta_blk[..., None])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
      if st.request.score_mod is not None:
        ds, d_tile = mods.score_vjp(st.request.score_mod, row.unmodded(q_blk, k_blk, qb, kb),
                                    row.mod_indices(qb, kb), ops, ds)
        d_ops = mods.add_grads(d_ops, d_tile)
      if dbias is not None:  # [h|1, bq, sp]: this q chunk's rows, written at kv chunk kb
        tile = ds.reshape(-1, *ds.shape[2:]) if bias_heads > 1 else ds.sum((0, 1))[None]
        dbias = jax.lax.dynamic_update_slice_in_dim(dbias, tile, kb * st.block_kv, 2)
      ds = ds * st.request.scale
      dq = dq + _dot(st, ds, k_blk, "kgts,ksd->kgtd")
      dk_blk = _dot(st, ds, q_blk, "kgts,kgtd->ksd")
      dk = jax.lax.dynamic_update_index_in_dim(dk, dk[kb] + dk_blk, kb, 0)
      dv = jax.lax.dynamic_update_index_in_dim(dv, dv[kb] + dv_blk, kb, 0)
      return dq, dk, dv, dbias, d_ops

    dq = jnp.zeros(q_blk.shape, jnp.float32)
    dbias = None if bias is None else jnp.zeros((bias_heads, st.block_q, bias.shape[2]), jnp.float32)
    dq, dk, dv, dbias, d_ops = jax.lax.fori_loop(0, kv_count[qb], visit, (dq, dk, dv, dbias, d_ops))
    return (dk, dv, d_ops), (dq, dbias)

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), mods.zero_grads(ops))
  xs = (jnp.arange(q.shape[0], dtype=jnp.int32), q, lse, delta, dout)
  (dk, dv, d_ops), (dq, dbias) = jax.lax.scan(q_chunk, init, xs)
  if dbias is not None:  # [nq, h|1, bq, sp] -> [h|1, tp, sp]
    dbias = jnp.swapaxes(dbias, 0, 1).reshape(bias_heads, -1, bias.shape[2])
  return dq, dk, dv, dbias, d_ops


def _row_axis(x):
  """vmap in_axis of an array with a leading batch axis of size b or 1 (shared by every row)."""
  return None if x is None or x.shape[0] == 1 else 0


def _squeeze_shared(*arrays):
  """Drop the size-1 batch axis of arrays shared by every row (vmap with in_axes None)."""
  return tuple(x[0] if x is not None and x.shape[0] == 1 else x for x in arrays)


def _row_inputs(q_seg, kv_seg, kv_index, kv_count, kv_full, extras: _Extras):
  """(arrays, vmap in_axes) of the per-row inputs after q, k, v: segments, block lists, extras."""
  arrays = (q_seg, kv_seg, kv_index, kv_count, kv_full, extras.dense, extras.bias)
  axes = tuple(_row_axis(x) for x in arrays)
  return (*_squeeze_shared(*arrays), extras.slopes, extras.ints, extras.ops), (*axes, None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, extras):
  return _chunked_fwd(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, extras)[0]


def _chunked_fwd(st, q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, extras):
  arrays, axes = _row_inputs(q_seg, kv_seg, kv_index, kv_count, kv_full, extras)
  if q.shape[0] == 1:  # one row (each step of the CPU loop): no vmap, so full tiles can branch
    rows = [x if a is None else x[0] for x, a in zip(arrays, axes, strict=True)]
    out, lse = _forward_row(st, q[0], k[0], v[0], *rows, jnp.int32(0), branch=True)
    out, lse = out[None], lse[None]
  else:
    fwd = jax.vmap(_forward_row, in_axes=(None, 0, 0, 0, *axes, 0))
    out, lse = fwd(st, q, k, v, *arrays, jnp.arange(q.shape[0], dtype=jnp.int32))
  residuals = (q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, extras, out, lse)
  return (out, lse), residuals


def _chunked_bwd(st, residuals, cotangents):
  q, k, v, q_seg, kv_seg, kv_index, kv_count, kv_full, extras, out, lse = residuals
  dout, dlse = cotangents
  dout = dout.astype(jnp.float32)
  # d lse_i / d s_ij = p_ij, so an lse cotangent enters exactly like -delta.
  delta = jnp.sum(dout * out, axis=-1) - dlse.astype(jnp.float32)
  arrays, axes = _row_inputs(q_seg, kv_seg, kv_index, kv_count, kv_full, extras)
  bwd = jax.vmap(_backward_row, in_axes=(None, 0, 0, 0, *axes, 0, 0, 0, 0))
  dq, dk, dv, dbias, d_ops = bwd(st, q, k, v, *arrays, jnp.arange(q.shape[0], dtype=jnp.int32), lse, delta,
                                 dout)
  d_ops = mods.cast_grads(tuple(None if d is None else d.sum(0) for d in d_ops), extras.ops)  # over rows
  if dbias is not None:  # [b, h|1, tp, sp], summed over the rows when the bias is shared by them
    bias = extras.bias
    dbias = (dbias.sum(0, keepdims=True) if bias.shape[0] == 1 else dbias).astype(bias.dtype)
  slopes = None if extras.slopes is None else jnp.zeros_like(extras.slopes)
  d_extras = _Extras(None, dbias, slopes, None, d_ops)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None, d_extras)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _listed_full(bm: block_info.BlockMap) -> jax.Array:
  """bool [b|1, nq, nk]: is the i-th kv chunk in a q chunk's visit list (`kv_index`) fully visible?"""
  return jnp.take_along_axis(bm.full, bm.kv_index, axis=2)


class XlaChunked:
  """Chunked attention with chunk sizes ``block_q`` x ``block_kv`` (clamped to the lengths)."""

  name = "xla_chunked"
  capabilities = frozenset({"attention_backward", "block_stats", "traced_offsets", "mod_gathers", "dropout",
                            "sharded_mods", "tuning_space", "cpu_loop_tile"})
  block_size_types = (CpuBlockSizes,)

  def __init__(self, block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV):
    self.block_q, self.block_kv = block_q, block_kv

  def unsupported(self, request: Request, platform: str) -> str | None:
    return None

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def chunk_shape(self, request: Request) -> tuple[int, int]:
    """(q, kv) chunk lengths: a prebuilt block_mask's tiles, else the request's `CpuBlockSizes` (tuned,
    flash_layers/tuning) where set, else this impl's defaults."""
    if request.block_mask_tiles is not None:
      return request.block_mask_tiles
    sizes = request.block_sizes if isinstance(request.block_sizes, CpuBlockSizes) else CpuBlockSizes()
    return (chunk_size(request.q_len, sizes.block_q or self.block_q),
            chunk_size(request.kv_len, sizes.block_kv or self.block_kv))

  def cpu_loop_tile(self, request: Request) -> tuple[int, int]:
    """One chunk pair's logits: the CPU loop weighs a tile at a time."""
    return self.chunk_shape(request)

  def tuning_space(self, request: Request, platform: str) -> list[CpuBlockSizes | None]:
    """On CPU: the defaults, every distinct chunk pair from `TUNING_CHUNKS` (kv chunks at least as long
    as q chunks: fewer steps), and the CPU loop decision flipped for the default pair."""
    if platform != "cpu":
      return []
    default_tile = self.chunk_shape(dataclasses.replace(request, block_sizes=None, block_mask_tiles=None))
    space: list[CpuBlockSizes | None] = [None]
    seen = {default_tile}
    for block_q in TUNING_CHUNKS:
      for block_kv in (c for c in TUNING_CHUNKS if c >= block_q):
        tile = (chunk_size(request.q_len, block_q), chunk_size(request.kv_len, block_kv))
        if tile not in seen:
          seen.add(tile)
          space.append(CpuBlockSizes(block_q, block_kv))
    if request.batch * request.num_kv_heads > 1:
      space.append(CpuBlockSizes(loop_bytes=cpu_loop.flipped_loop_bytes(request, *default_tile)))
    return space

  def block_stats(self, request: Request, args: Args, platform: str) -> tuple[int, int] | None:
    """(chunk pairs visited, total) over batch and heads; None when segment ids or mod_operands are
    traced. With a mask_mod, a chunk pair counts when it shows a pair to some head."""
    tiles = None
    if request.mask_mod is not None:
      if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for x in args.mod_operands):
        return None
      tiles = lambda: self._with_mod_tiles(request, args).mod_tiles  # noqa: E731  (the flags attend uses)
    return block_info.block_stats(request.batch, request.num_heads, request.q_len, request.kv_len,
                             *self.chunk_shape(request), request.spec, args.q_segment_ids,
                             args.kv_segment_ids, args.q_offset, args.kv_offset, tiles=tiles)

  def attend(self, q, k, v, *, request: Request, args: Args):
    return cpu_loop.looped_on_cpu(self._attend, q, k, v, request=request,
                                  args=self._with_mod_tiles(request, args), tile=self.chunk_shape(request))

  def _with_mod_tiles(self, request: Request, args: Args) -> Args:
    """args with a mask_mod's tile flags built once for the whole call (every row and head), so the
    CPU loop's steps slice them instead of evaluating the mask again."""
    if request.mask_mod is None:
      return args
    bq, bk = self.chunk_shape(request)
    if args.mod_tiles is not None:  # a prebuilt block_mask (mods.block_mask): its grid must be ours
      grid = (-(-request.q_len // bq), -(-request.kv_len // bk))
      if tuple(args.mod_tiles[0].shape[1:]) != grid:
        raise ValueError(f"block_mask has a {tuple(args.mod_tiles[0].shape[1:])} tile grid; xla_chunked runs "
                         f"{grid} chunks of ({bq}, {bk}) here")
      return args
    return dataclasses.replace(args, mod_tiles=_mod_tiles(request, args, bq, bk))

  def _attend(self, q, k, v, *, request: Request, args: Args):
    b, t, h, d = q.shape
    dv = v.shape[3]
    st, (qc, kc, vc), q_seg, kv_seg, bm, extras = self._layout(q, k, v, request, args)
    out, lse = _chunked(st, qc, kc, vc, q_seg, kv_seg, bm.kv_index, bm.kv_count, _listed_full(bm), extras)
    # [b, nq, kvh, g, bq, dv] -> [b, t, h, dv]; lse [b, nq, kvh, g, bq] -> [b, h, t].
    tp = out.shape[1] * st.block_q
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(b, tp, h, dv)[:, :t].astype(q.dtype)
    lse = lse.transpose(0, 2, 3, 1, 4).reshape(b, h, tp)[:, :, :t]
    return out, lse

  def attention_backward(self, q, k, v, lse, delta, d_out, *, request: Request, args: Args):
    """(dq, dk, dv) from given row statistics ``lse, delta [b, h, q]``: the chunked backward
    alone (each visited chunk's probabilities from lse), no forward. With a score_mod's float
    operands, (dq, dk, dv, their gradients aligned with mod_operands, None for the others); that call
    runs whole (the CPU loop reassembles only per-row, per-head results)."""
    if request.has_float_score_operands:
      return self._backward(q, k, v, lse, delta, d_out, request=request,
                            args=self._with_mod_tiles(request, args))
    return cpu_loop.looped_on_cpu(
        lambda q, k, v, d_out, lse, delta, **kw: self._backward(q, k, v, lse, delta, d_out, **kw),
        q, k, v, request=request, args=self._with_mod_tiles(request, args), tile=self.chunk_shape(request),
        q_like=(d_out,), stats=(lse, delta))

  def _backward(self, q, k, v, lse, delta, d_out, *, request: Request, args: Args):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    st, (qc, kc, vc), q_seg, kv_seg, bm, extras = self._layout(q, k, v, request, args)
    nq, bq, g = qc.shape[1], st.block_q, h // kvh
    tp = nq * bq

    def rows(x, fill):  # [b, h, t] -> [b, nq, kvh, g, bq]
      x = pad_to(x.astype(jnp.float32), 2, tp, fill)
      return x.reshape(b, kvh, g, nq, bq).transpose(0, 3, 1, 2, 4)

    dout = pad_to(d_out.astype(jnp.float32), 1, tp)
    dout = dout.reshape(b, nq, bq, kvh, g, -1).transpose(0, 1, 3, 4, 2, 5)
    arrays, axes = _row_inputs(q_seg, kv_seg, bm.kv_index, bm.kv_count, _listed_full(bm), extras)
    bwd = jax.vmap(_backward_row, in_axes=(None, 0, 0, 0, *axes, 0, 0, 0, 0))
    dq, dk, dv, _, d_ops = bwd(st, qc, kc, vc, *arrays, jnp.arange(b, dtype=jnp.int32),
                               rows(lse, -jnp.inf), rows(delta, 0.0), dout)
    dq = dq.transpose(0, 1, 4, 2, 3, 5).reshape(b, tp, h, d)[:, :t]
    sp = dk.shape[1] * st.block_kv
    dk = dk.transpose(0, 1, 3, 2, 4).reshape(b, sp, kvh, d)[:, :s]
    dv = dv.transpose(0, 1, 3, 2, 4).reshape(b, sp, kvh, -1)[:, :s]
    grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if not request.has_float_score_operands:
      return grads
    return (*grads, mods.cast_grads(tuple(None if d is None else d.sum(0) for d in d_ops), extras.ops))

  def _layout(self, q, k, v, request: Request, args: Args):
    """The chunked layout of one call: (static config, (q, k, v) chunks, segment chunks, block
    map, extras)."""
    b, t, h, d = q.shape
    s, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // kvh
    bq, bk = self.chunk_shape(request)
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    st = _ChunkedCall(request=request, block_q=bq, block_kv=bk,
                      heads_in_mask=args.dense_mask is not None and args.dense_mask.shape[1] != 1,
                      heads_in_bias=args.bias is not None and args.bias.shape[1] != 1)

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
    bm = block_info.block_map(t, s, bq, bk, request.spec, args.q_segment_ids, args.kv_segment_ids,
                         args.q_offset, args.kv_offset, tiles=args.mod_tiles)  # set by _with_mod_tiles
    bias = None
    if args.bias is not None:  # [b|1, h|1, tp, sp]; padded entries are masked anyway
      bias = jnp.broadcast_to(args.bias, (*args.bias.shape[:2], t, s))
      bias = pad_to(pad_to(bias, 2, tp), 3, sp)
    slopes = None if args.alibi_slopes is None else args.alibi_slopes.reshape(kvh, g)
    seed = args.dropout_seed if args.dropout_seed is not None else jnp.zeros((2,), jnp.int32)
    ints = jnp.stack([jnp.asarray(x, jnp.int32) for x in (
        args.q_offset, args.kv_offset, args.batch_offset, args.head_offset)] + [seed[0], seed[1]])
    extras = _Extras(dense, bias, slopes, ints, args.mod_operands)
    return st, (qc, kc, vc), q_seg, kv_seg, bm, extras


def _mod_tiles(request: Request, args: Args, bq: int, bk: int):
  """A mask_mod's (any, all) tile flags [b|1, nq, nk] over the call's heads, for chunks (bq, bk)."""
  heads = args.head_offset + jnp.arange(request.num_heads, dtype=jnp.int32)
  return block_info.tile_flags(request.mask_mod, args.mod_operands, batch=request.batch, heads=heads,
                         batch_offset=args.batch_offset, q_offset=args.q_offset, kv_offset=args.kv_offset,
                         q_len=request.q_len, kv_len=request.kv_len, block_q=bq, block_kv=bk,
                         num_q_blocks=-(-request.q_len // bq), num_kv_blocks=-(-request.kv_len // bk))
