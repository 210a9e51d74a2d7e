"""xla_chunked for paged attention: blocks of query rows, each walking only the pages its rows can see.

`lax.map` takes `ROWS` query rows at a time; for a block, a `while_loop` walks the pages from the first one
any of its rows can see to the last (`contract.paged.kv_range`: causal stops at a row's position, a window
starts at its left edge), `CHUNK_KEYS` keys of pages at a time, gathering each row's pages of its own
sequence and merging the chunks by an online softmax (running max, denominator and output in float32).
So a call reads the pages in use, not the page table's width: a 300-token sequence of a table sized for
32k reads one chunk. Memory is one chunk of one block: ``ROWS * CHUNK_KEYS`` keys.

A decoding batch (one row per sequence) reads each sequence's pages once. Rows of a prefill chunk share a
sequence and each gathers it again (``ROWS`` times per block): the kernels read a page once per q tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.impls.paged.reference import compute_dtype, gather_keys, row_logits

ROWS = 8  # query rows per block
CHUNK_KEYS = 512  # keys gathered per loop step (whole pages: at least one)


def _chunk_pages(spec: PagedSpec) -> int:
  return max(1, min(spec.pages_per_seq, CHUNK_KEYS // spec.page_size))


def _block(spec: PagedSpec, q, k_pages, v_pages, arrays, seq, pos, valid):
  """(out [rows, heads, dv] in q's dtype, lse [rows, heads]) of one block of query rows."""
  dtype = compute_dtype(spec)
  rows = q.shape[0]
  chunk = _chunk_pages(spec)
  kv_lens = arrays["kv_lens"]
  start, stop = paged.kv_range(spec, pos, pos, kv_lens[seq])
  start = jnp.where(valid, start, jnp.iinfo(jnp.int32).max).min()
  stop = jnp.where(valid, stop, 0).max()
  first = jnp.where(stop > start, start // spec.page_size // chunk, 0)
  pages_to_stop = -(-stop // spec.page_size)  # ceil
  last = jnp.where(stop > start, -(-pages_to_stop // chunk), 0)  # the chunk after the last one read
  qg = q.astype(dtype)
  shape = (rows, spec.num_kv_heads, spec.group)

  def body(carry):
    c, m, denom, acc = carry
    page_idx = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    table = arrays["page_table"][seq[:, None], jnp.minimum(page_idx, spec.pages_per_seq - 1)[None, :]]
    table = jnp.clip(table, 0, spec.num_pages - 1)
    keys = gather_keys(spec, k_pages, arrays["k_scales"], table, dtype)
    values = gather_keys(spec, v_pages, arrays["v_scales"], table, dtype)
    s = row_logits(spec, qg, keys, seq, pos, kv_lens, kv_offset=c * chunk * spec.page_size)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    pv = jnp.einsum("rhgj,rjhd->rhgd", p.astype(values.dtype) if dtype == jnp.bfloat16 else p, values,
                    precision=spec.precision, preferred_element_type=jnp.float32)
    return c + 1, m_new, denom * correction + p.sum(-1), acc * correction[..., None] + pv

  init = (first, jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros((*shape, spec.head_dim_v), jnp.float32))
  _, m, denom, acc = jax.lax.while_loop(lambda carry: carry[0] < last, body, init)
  seen = denom > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)) + m, -jnp.inf)
  out = jnp.where(valid[:, None, None, None], out, 0.0).reshape(rows, spec.num_heads, spec.head_dim_v)
  lse = jnp.where(valid[:, None, None], lse, -jnp.inf).reshape(rows, spec.num_heads)
  return out.astype(q.dtype), lse


class PagedXlaChunked:
  name = "xla_chunked"

  def unsupported(self, spec: PagedSpec, platform: str) -> str | None:
    return None

  def kernel(self, spec: PagedSpec, platform: str) -> str:
    return (f"xla (lax.map over blocks of {min(ROWS, spec.num_tokens)} query rows, a while_loop over "
            f"their visible pages, {_chunk_pages(spec) * spec.page_size} keys per step)")

  def attend(self, q, k_pages, v_pages, *, spec: PagedSpec, arrays) -> tuple[jax.Array, jax.Array]:
    seq, pos, valid = paged.token_positions(arrays["cu_q_lens"], arrays["kv_lens"], arrays["num_seqs"],
                                            spec.num_tokens)
    rows = min(ROWS, spec.num_tokens)
    blocks = -(-spec.num_tokens // rows)
    pad = blocks * rows - spec.num_tokens

    def padded(x):
      return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(blocks, rows, *x.shape[1:])

    def block(xs):
      return _block(spec, *xs[:1], k_pages, v_pages, arrays, *xs[1:])

    out, lse = jax.lax.map(block, (padded(q), padded(seq), padded(pos), padded(valid)))
    out = out.reshape(blocks * rows, *out.shape[2:])[: spec.num_tokens]
    return out, lse.reshape(blocks * rows, -1)[: spec.num_tokens]
