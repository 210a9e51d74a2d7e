"""xla_chunked for paged attention: blocks of query rows, each gathering only its rows' pages (`lax.map`).

Memory is one block's gathered pages, ``ROWS * pages_per_seq * page_size`` keys, whatever the batch; a
decoding batch (one row per sequence) reads each sequence's pages once. Rows of a prefill chunk share a
sequence, and each gathers it again: the TPU and GPU kernels read a page once per q tile instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.impls.paged.reference import attend_rows

ROWS = 8  # query rows per block


class PagedXlaChunked:
  name = "xla_chunked"

  def unsupported(self, spec: PagedSpec, platform: str) -> str | None:
    return None

  def kernel(self, spec: PagedSpec, platform: str) -> str:
    return f"xla (lax.map over blocks of {min(ROWS, spec.num_tokens)} query rows, their pages gathered)"

  def attend(self, q, k_pages, v_pages, *, spec: PagedSpec, arrays) -> tuple[jax.Array, jax.Array]:
    seq, pos, valid = paged.token_positions(arrays["cu_q_lens"], arrays["kv_lens"], arrays["num_seqs"],
                                            spec.num_tokens)
    rows = min(ROWS, spec.num_tokens)
    blocks = -(-spec.num_tokens // rows)
    pad = blocks * rows - spec.num_tokens

    def padded(x):
      return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(blocks, rows, *x.shape[1:])

    def block(xs):
      q_b, seq_b, pos_b, valid_b = xs
      return attend_rows(spec, q_b, k_pages, v_pages, arrays, seq_b, pos_b, valid_b)

    out, lse = jax.lax.map(block, (padded(q), padded(seq), padded(pos), padded(valid)))
    out = out.reshape(blocks * rows, *out.shape[2:])[: spec.num_tokens]
    return out, lse.reshape(blocks * rows, -1)[: spec.num_tokens]
