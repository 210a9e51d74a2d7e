"""The q tiles of a paged call, shared by both paged kernels (`tpu_paged.py`, `gpu_paged.py`).

A ragged batch packs each sequence's new tokens one after another in q ``[tokens, heads, d]``. A kernel
wants tiles that belong to one sequence each (one page table, one run of pages), so the tokens of
sequence s are cut into ``ceil(q_len[s] / block_q)`` tiles of at most `block_q` consecutive tokens.
A tile holds the queries of one GQA group: ``group * block_q`` rows, row ``i * block_q + t`` being query
head ``i`` of the group at the tile's token ``t`` (so every K/V page is read once for the whole group,
and a decoding token of an 8:1 GQA model still fills 8 rows).

Shapes are static: there are at most ``ceil(tokens / block_q) + min(max_seqs, tokens)`` tiles (each
sequence wastes at most one partial tile), `num_tiles`; the tiles past the batch's are empty
(count 0). Everything here is jnp on traced arrays: the plan is built inside the jitted call, so a
serving loop's changing batch never retraces.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec


class QTiles(NamedTuple):
  """Per tile, int32 [num_tiles] each."""

  seq: jax.Array        # its sequence (0 for an empty tile: keep its reads in bounds)
  start: jax.Array      # q row of its first token
  count: jax.Array      # its tokens, 0..block_q (0: an empty tile)
  first_pos: jax.Array  # the position of its first token in its sequence
  kv_start: jax.Array   # the keys some query of the tile can see: [kv_start, kv_stop)
  kv_stop: jax.Array    # (kv_stop == kv_start for an empty tile)


def num_tiles(spec: PagedSpec, block_q: int) -> int:
  """The static number of tiles of a call (an upper bound of the tiles in use)."""
  return -(-spec.num_tokens // block_q) + min(spec.max_seqs, spec.num_tokens)


def q_tiles(spec: PagedSpec, cu_q_lens, kv_lens, num_seqs, block_q: int) -> QTiles:
  """The tiles of the active sequences, in order, then empty ones."""
  cu = cu_q_lens.astype(jnp.int32)
  lens = kv_lens.astype(jnp.int32)
  active = jnp.arange(spec.max_seqs, dtype=jnp.int32) < num_seqs
  q_lens = jnp.where(active, cu[1:] - cu[:-1], 0)
  per_seq = -(-q_lens // block_q)  # tiles of each sequence
  tile_base = jnp.cumsum(per_seq) - per_seq  # index of each sequence's first tile
  t = jnp.arange(num_tiles(spec, block_q), dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(tile_base + per_seq, t, side="right").astype(jnp.int32), 0,
                 spec.max_seqs - 1)
  within = t - tile_base[seq]
  count = jnp.clip(q_lens[seq] - within * block_q, 0, block_q)
  used = (t < jnp.sum(per_seq)) & (count > 0)
  count = jnp.where(used, count, 0)
  seq = jnp.where(used, seq, 0)
  first_pos = lens[seq] - q_lens[seq] + within * block_q
  kv_start, kv_stop = paged.kv_range(spec, first_pos, first_pos + count - 1, lens[seq])
  zero = jnp.zeros_like(t)
  return QTiles(seq, jnp.where(used, cu[seq] + within * block_q, 0), count, jnp.where(used, first_pos, 0),
                jnp.where(used, kv_start, zero), jnp.where(used, kv_stop, zero))


def row_of_token(spec: PagedSpec, cu_q_lens, num_seqs, block_q: int):
  """Per q row: (its tile, its token within the tile, whether it is an active token); int32 [tokens]."""
  cu = cu_q_lens.astype(jnp.int32)
  active = jnp.arange(spec.max_seqs, dtype=jnp.int32) < num_seqs
  q_lens = jnp.where(active, cu[1:] - cu[:-1], 0)
  per_seq = -(-q_lens // block_q)
  tile_base = jnp.cumsum(per_seq) - per_seq
  seq, _, valid = paged.token_positions(cu_q_lens, kv_lens=jnp.zeros_like(cu[1:]), num_seqs=num_seqs,
                                        num_tokens=spec.num_tokens)
  offset = jnp.arange(spec.num_tokens, dtype=jnp.int32) - cu[seq]
  return tile_base[seq] + offset // block_q, offset % block_q, valid


def gather_q(spec: PagedSpec, q, tiles: QTiles, block_q: int):
  """q [tokens, heads, d] -> tiles [num_tiles, kv_heads, group * block_q, d] (rows of empty tiles and past a
  tile's count are copies of row 0 or of the tile's last token: the kernels mask them out)."""
  last = jnp.maximum(tiles.count, 1)[:, None] - 1
  token = tiles.start[:, None] + jnp.minimum(jnp.arange(block_q)[None, :], last)
  rows = q[jnp.clip(token, 0, spec.num_tokens - 1)]  # [tiles, block_q, heads, d]
  rows = rows.reshape(rows.shape[0], block_q, spec.num_kv_heads, spec.group, spec.head_dim)
  rows = jnp.transpose(rows, (0, 2, 3, 1, 4))  # [tiles, kvh, group, block_q, d]
  return rows.reshape(rows.shape[0], spec.num_kv_heads, spec.group * block_q, spec.head_dim)


def scatter_out(spec: PagedSpec, out_tiles, lse_tiles, cu_q_lens, num_seqs, block_q: int, dtype):
  """Tile results back to q's rows: out_tiles [num_tiles, kv_heads, group * block_q, dv] and lse_tiles
  [num_tiles, kv_heads, group * block_q] -> (out [tokens, heads, dv] in dtype, lse [tokens, heads]);
  padding rows get zeros and -inf."""
  tile, token, valid = row_of_token(spec, cu_q_lens, num_seqs, block_q)
  rows = jnp.arange(spec.group, dtype=jnp.int32)[None, :] * block_q + token[:, None]  # [tokens, group]
  out = out_tiles[tile[:, None, None], jnp.arange(spec.num_kv_heads)[None, :, None], rows[:, None, :]]
  lse = lse_tiles[tile[:, None, None], jnp.arange(spec.num_kv_heads)[None, :, None], rows[:, None, :]]
  out = out.reshape(spec.num_tokens, spec.num_heads, -1)
  lse = lse.reshape(spec.num_tokens, spec.num_heads)
  out = jnp.where(valid[:, None, None], out, 0).astype(dtype)
  return out, jnp.where(valid[:, None], lse, -jnp.inf)
