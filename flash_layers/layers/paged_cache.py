"""The paged KV cache of a decoding layer: `decode=True, cache="paged"` (linen and NNX).

The contiguous cache (kv_cache.py) gives every batch row its own [slots] of keys; a serving loop with
requests of different lengths arriving and finishing wants one pool of pages instead, each request
holding the pages its length needs (flash_layers/contract/paged.py, `fl.paged_attention`). With
`cache="paged"` a decoding layer keeps that pool:

* Its fields: `num_pages` and `page_size` (the pool), `kv_cache_dtype` (None: the layer's dtype;
  "int8": int8 pages with float32 scales per token and kv head, `fl.quantize_kv`), and the existing
  `cache_layout`, which is the pool's layout ("flax" [num_pages, page_size, kv_heads, head_dim], or
  "heads_first" [kv_heads, num_pages, page_size, head_dim], what the TPU kernel reads).
* Its cache variables: `k_pages`, `v_pages` (and `k_scales`, `v_scales` for int8 pages), and
  `page_table` / `kv_lens`: the page table and lengths of the last call, as the allocator gave them
  (for inspection; each call brings its own).
* Its call argument `paged_batch`: a `PagedBatch` (page_allocator.py), the ragged batch of this call,
  made on the host by `PageAllocator.batch` after `grow`ing each scheduled sequence. The call's input is
  the packed new tokens of every sequence, [num_tokens, features] (or [1, num_tokens, features]);
  rows past `cu_q_lens[num_seqs]` are padding (a fixed token budget keeps shapes static).

A call: the new tokens' positions come from the batch (token i of sequence s is at
``kv_lens[s] - q_len[s] + i``) and feed the rotary embeddings unless the call passes `positions`;
the projected keys and values are written into their page slots (``page_table[s, pos // page_size]``,
offset ``pos % page_size``; padding rows write nothing, quantized first for int8 pages); then
`fl.paged_attention` attends every query to its sequence's pages with the layer's causal, window,
softcap, scale, sinks and mask_mod (whose `b` is the sequence's row in the batch). The host owns
which pages are whose: the layer never allocates, it writes where the table says.

The first call (linen's `init`, or NNX's `init_cache(paged_batch=...)`) makes the pool: zeros, scales
one, the table's shape from its `paged_batch` (`PagedBatch.empty(max_seqs, pages_per_seq)` serves).
linen's init call returns that empty pool (its output is the paged call's on it, not kept), as the
contiguous cache's init returns an empty cache.

What the paged path does not take: segment ids, a dense mask, mod_operands, a block mask, sown weights
and dropout (per call, refused); ALiBi, score_mod and a mesh (per layer, refused at construction
whenever cache="paged": NNX's decode is also a call argument); global_tokens (refused with
decode=True, as for the contiguous cache). The layer's `impl` picks the paged impl: "auto",
"reference", "xla_chunked" or "flash_pallas"; another impl raises `fl.UnsupportedError` naming those.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flash_layers import paged_api
from flash_layers.contract import paged
from flash_layers.layers.page_allocator import PagedBatch

CACHES = ("contiguous", "paged")
KV_CACHE_DTYPES = (None, "int8")
# The cache variables of a paged layer; the scales only with quantized pages.
NAMES = ("k_pages", "v_pages", "k_scales", "v_scales", "page_table", "kv_lens")


def is_paged(fields) -> bool:  # fields: core.AttentionFields
  """Whether a layer decodes with the paged cache (decode=True and cache="paged")."""
  return bool(fields.decode) and fields.cache == "paged"


def names(fields) -> tuple[str, ...]:
  """The cache variables of a paged layer: the scales only for quantized pages."""
  return NAMES if fields.kv_cache_dtype is not None else tuple(n for n in NAMES if "scales" not in n)


def check_fields(fields) -> None:
  """The cache fields at construction: their values, and what a paged layer cannot serve (refused
  whether or not it decodes yet: NNX's decode is also a call argument)."""
  if fields.cache not in CACHES:
    raise ValueError(f"cache must be one of {CACHES}; got {fields.cache!r}")
  if fields.kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {fields.kv_cache_dtype!r}")
  if fields.cache == "contiguous":
    for name in ("num_pages", "page_size", "kv_cache_dtype"):
      if getattr(fields, name) is not None:
        raise ValueError(f"{name} is a field of the paged cache (cache='paged'); the contiguous cache "
                         f"keeps the layer's dtype and sizes itself from the init input; got {name}="
                         f"{getattr(fields, name)!r}")
    return
  for name in ("num_pages", "page_size"):
    value = getattr(fields, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"cache='paged' needs {name}, a positive int; got {value!r}")
  refused = {"alibi": fields.alibi not in (None, False), "score_mod": fields.score_mod is not None,
             "mesh": fields.mesh is not None}
  for name, given in refused.items():
    if given:
      raise ValueError(f"cache='paged' does not serve {name} (fl.paged_attention has none); use "
                       "cache='contiguous'")


def check_call(fields, batch_shape: tuple[int, ...], paged_batch, **refused: Any) -> None:
  """A call's arguments: a paged decoding call needs `paged_batch` and one packed row of tokens, and
  takes none of `refused` (name -> value, None when not given); any other call takes no paged_batch."""
  if not is_paged(fields):
    if paged_batch is not None:
      raise ValueError("paged_batch is the ragged batch of a paged decoding call: it needs decode=True and "
                       "cache='paged'")
    return
  if not isinstance(paged_batch, PagedBatch):
    raise TypeError("a decoding layer with cache='paged' takes paged_batch=, a PagedBatch (from "
                    f"PageAllocator.batch), the call's sequences; got {type(paged_batch).__name__}")
  if len(batch_shape) > 1 or (batch_shape and batch_shape[0] != 1):
    raise ValueError("a paged call packs every sequence's new tokens on one axis: inputs [num_tokens, "
                     f"features] or [1, num_tokens, features]; got batch dims {batch_shape}")
  for name, value in refused.items():
    if value is not None and value is not False:
      raise ValueError(f"a paged decoding call takes no {name} (fl.paged_attention has none; the batch's "
                       "page table and lengths say which keys each token sees)")


def init_values(fields, dims, paged_batch: PagedBatch, dtype) -> dict[str, jax.Array]:
  """The cache variables before the first token: a pool of zeros (scales one), an all-zero table."""
  num_pages, page_size, layout = fields.num_pages, fields.page_size, fields.cache_layout
  k_shape = paged.pool_shape(layout, num_pages, page_size, dims.num_kv_heads, dims.head_dim)
  v_shape = paged.pool_shape(layout, num_pages, page_size, dims.num_kv_heads, dims.head_dim_v)
  pool_dtype = dtype if fields.kv_cache_dtype is None else jnp.dtype(fields.kv_cache_dtype)
  values = {"k_pages": jnp.zeros(k_shape, pool_dtype), "v_pages": jnp.zeros(v_shape, pool_dtype)}
  if fields.kv_cache_dtype is not None:
    values["k_scales"] = values["v_scales"] = jnp.ones(k_shape[:-1], jnp.float32)
  values["page_table"] = jnp.zeros(jnp.shape(paged_batch.page_table), jnp.int32)
  values["kv_lens"] = jnp.zeros(jnp.shape(paged_batch.kv_lens), jnp.int32)
  return values


def _token_positions(paged_batch: PagedBatch, num_tokens: int):
  return paged.token_positions(jnp.asarray(paged_batch.cu_q_lens, jnp.int32),
                               jnp.asarray(paged_batch.kv_lens, jnp.int32), paged_batch.num_seqs, num_tokens)


def rotary_positions(paged_batch: PagedBatch, num_tokens: int, positions, kv_positions):
  """(positions, kv_positions) [1, num_tokens] of a paged call's tokens: the given ones, else each token's
  position in its sequence (0 for padding rows); the keys sit at their queries' positions."""
  if positions is None:
    positions = _token_positions(paged_batch, num_tokens)[1][None]
  return positions, positions if kv_positions is None else kv_positions


def _write(pages, new, page, offset, layout: str):
  """pages (or scales) with new [tokens, kv_heads(, d)] at (page, offset) per token; a page number past
  the pool (padding) writes nothing."""
  if layout == "flax":
    return pages.at[page, offset].set(new.astype(pages.dtype), mode="drop")
  return pages.at[:, page, offset].set(jnp.moveaxis(new, 0, 1).astype(pages.dtype), mode="drop")


def step(fields, cache: dict[str, jax.Array], query, key, value, paged_batch: PagedBatch, sinks):
  """One paged decoding call: (attention output [1, tokens, heads, head_dim_v], the updated cache).

  query [1, tokens, heads, d], key/value [1, tokens, kv_heads, d] (the new tokens' projections,
  rotated); `cache` holds the variables `names(fields)`.
  """
  query, key, value = query[0], key[0], value[0]
  layout = fields.cache_layout
  table = jnp.asarray(paged_batch.page_table, jnp.int32)
  kv_lens = jnp.asarray(paged_batch.kv_lens, jnp.int32)
  cu_q_lens = jnp.asarray(paged_batch.cu_q_lens, jnp.int32)
  seq, pos, valid = _token_positions(paged_batch, query.shape[0])
  page = jnp.where(valid, table[seq, pos // fields.page_size], fields.num_pages)
  offset = pos % fields.page_size
  cache = dict(cache, page_table=table, kv_lens=kv_lens)
  scales = {"k_scales": None, "v_scales": None}
  for name, new in (("k", key), ("v", value)):
    if fields.kv_cache_dtype is not None:
      new, new_scales = paged_api.quantize_kv(new, fields.kv_cache_dtype)
      cache[f"{name}_scales"] = scales[f"{name}_scales"] = _write(cache[f"{name}_scales"], new_scales, page,
                                                                  offset, layout)
    cache[f"{name}_pages"] = _write(cache[f"{name}_pages"], new, page, offset, layout)
  out = paged_api.paged_attention(
      query, cache["k_pages"], cache["v_pages"], page_table=table, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
      num_seqs=paged_batch.num_seqs, **scales, layout=layout, causal=fields.causal, window=fields.window,
      softcap=fields.softcap, scale=fields.scale, sinks=sinks, mask_mod=fields.mask_mod, impl=fields.impl)
  return out[None], cache


__all__ = ["CACHES", "KV_CACHE_DTYPES", "NAMES", "PagedBatch", "check_call", "check_fields", "init_values",
           "is_paged", "names", "rotary_positions", "step"]
