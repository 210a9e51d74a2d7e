"""The KV cache of a decoding layer (`fl.MultiHeadAttention(decode=True)` and its NNX twin).

flax's variable names and meaning: `cached_key` / `cached_value` [batch, slots, kv_heads, head_dim]
(kv heads only, so GQA/MQA caches are num_heads / num_kv_heads times smaller), `cache_index` (int32
scalar: the position of the next token), made by the first (init) call from its input length. Each
later call appends its 1...n tokens at `cache_index`, attends its queries to the cache and advances
the index by n. One more variable is ours:

* `cached_segment_ids` [batch, slots]: the segment id of every slot (`UNWRITTEN` = -1 for a slot
  nothing was written to). A query sees a slot only if their ids are equal, so rows of a batch can
  hold prompts of different lengths (padding gets id 0, real tokens 1, as in `fl.attention`), and a
  non-causal layer never sees a slot it has not written.

Two layouts:

* full (the default): `slots` = the init input's length; the new tokens are written first, then
  the queries attend to every slot with `q_offset = cache_index`, so the layer's causal mask, window,
  ALiBi and mods see the same positions as a run over the whole sequence.
* ring buffer (a causal layer with a sliding window of `left` keys, shorter than the init input):
  `slots` = left. Position p lives in slot p % left. A call attends to [the ring, rotated so that
  slot 0 holds position cache_index - left] + [its own new keys], with
  `kv_offset = cache_index - left`, then writes its last min(n, left) keys into the ring. The window
  hides everything older, so the result equals the full cache's while memory stays O(window).

Two cache layouts (the layer's `cache_layout`):

* "flax" (the default): `cached_key` / `cached_value` [batch, slots, kv_heads, head_dim], flax's.
* "heads_first": [batch, kv_heads, slots, head_dim]. On a TPU, whose HBM tiles an array's last two
  dimensions by (8, 128), this is the layout flash_pallas's decode kernel reads: the transpose the
  contract's [batch, len, kv_heads, dim] needs cancels against the kernel's own, where flax's layout
  costs a copy of the cache every step (docs/kernels.md, "Cache layout on a TPU").

Positions past the cache's end are not checked under jit (as flax's `dynamic_update_slice`, the write
is clamped): size the cache for the longest generation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.contract import mask_rules

UNWRITTEN = -1  # cached_segment_ids of a slot nothing was written to
CACHE_LAYOUTS = ("flax", "heads_first")


def check_cache_layout(cache_layout) -> None:
  if cache_layout not in CACHE_LAYOUTS:
    raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}; got {cache_layout!r}")


def _to_cache(x, heads_first: bool):
  """[b, n, kv_heads, d] <-> the cache's layout (the same swap both ways)."""
  return jnp.swapaxes(x, 1, 2) if heads_first else x
CACHE_NAMES = ("cached_key", "cached_value", "cached_segment_ids", "cache_index")


@dataclasses.dataclass(frozen=True)
class Layout:
  slots: int  # cache entries per row
  ring: bool  # a sliding-window ring buffer (slots = the window's left extent)


def _ring_slots(layer) -> int | None:  # layer: core.AttentionFields, or a layer with causal and window
  """The ring buffer's size for a causal layer with a sliding window, else None."""
  window = mask_rules.normalize_window(layer.window)
  if layer.causal and window is not None:
    return max(1, window[0])
  return None


def layout(layer, max_length: int) -> Layout:
  """The cache layout of `layer` for an init input of `max_length` tokens (module doc)."""
  slots = _ring_slots(layer)
  if slots is not None and slots <= max_length:
    return Layout(slots, ring=True)
  return Layout(max_length, ring=False)


def is_ring(layer, slots: int) -> bool:
  """Whether a cache of `slots` entries is the layer's ring buffer (a full cache of that length would
  give the same results: it can hold no position the window hides)."""
  return _ring_slots(layer) == slots


def init_values(batch: int, layout_: Layout, num_kv_heads: int, head_dim: int, head_dim_v: int,
                dtype, cache_layout: str = "flax") -> dict[str, jax.Array]:
  """The cache variables before the first token: zeros, every slot unwritten, index 0."""
  check_cache_layout(cache_layout)
  shape = ((batch, num_kv_heads, layout_.slots) if cache_layout == "heads_first"
           else (batch, layout_.slots, num_kv_heads))
  return {"cached_key": jnp.zeros((*shape, head_dim), dtype),
          "cached_value": jnp.zeros((*shape, head_dim_v), dtype),
          "cached_segment_ids": jnp.full((batch, layout_.slots), UNWRITTEN, jnp.int32),
          "cache_index": jnp.array(0, jnp.int32)}


def check_segment_ids(segment_ids, batch: int, length: int) -> jax.Array:
  """The new tokens' segment ids (ones when None); concrete ones must not be UNWRITTEN."""
  if segment_ids is None:
    return jnp.ones((batch, length), jnp.int32)
  if not isinstance(segment_ids, jax.core.Tracer) and np.any(np.asarray(segment_ids) == UNWRITTEN):
    raise ValueError(f"segment_ids of a decoding call must not be {UNWRITTEN} (it marks unwritten cache "
                     "slots); use 0 for padding")
  segment_ids = jnp.asarray(segment_ids, jnp.int32)
  if segment_ids.shape != (batch, length):
    raise ValueError(f"segment_ids must have shape [batch, q_len] = {(batch, length)}; got "
                     f"{tuple(segment_ids.shape)}")
  return segment_ids


def rotary_positions(cache_index: jax.Array, batch: int, length: int, positions, kv_positions):
  """(positions, kv_positions) of a decoding call's new tokens: the given ones, else cache_index,
  cache_index + 1, ...; the new keys sit at their queries' positions unless kv_positions are given."""
  if positions is None:
    positions = jnp.broadcast_to(cache_index + jnp.arange(length, dtype=jnp.int32), (batch, length))
  return positions, positions if kv_positions is None else kv_positions


def step(cache: dict[str, jax.Array], query, key, value, segment_ids, *, ring: bool, attend,
         cache_layout: str = "flax"):
  """One decoding call: (attention output, the updated cache).

  query [b, n, heads, d], key/value [b, n, kv_heads, d] (the new tokens' projections, rotated);
  `attend(query, key, value, segment_ids, kv_segment_ids, q_offset, kv_offset)` runs the layer's
  attention (`core.attend_heads` with the offsets); `cache_layout` is the layer's."""
  index = cache["cache_index"]
  ck, cv, cs = cache["cached_key"], cache["cached_value"], cache["cached_segment_ids"]
  slots = cs.shape[1]
  heads_first = cache_layout == "heads_first"
  axis = 2 if heads_first else 1  # the slots axis of cached_key / cached_value
  n = query.shape[1]
  key, value = _to_cache(key.astype(ck.dtype), heads_first), _to_cache(value.astype(cv.dtype), heads_first)
  if not ring:
    zero = jnp.zeros((), index.dtype)  # one index type (int32), also under jax_enable_x64
    start = (zero, zero, index, zero) if heads_first else (zero, index, zero, zero)
    ck = jax.lax.dynamic_update_slice(ck, key, start)
    cv = jax.lax.dynamic_update_slice(cv, value, start)
    cs = jax.lax.dynamic_update_slice(cs, segment_ids.astype(cs.dtype), (zero, index))
    out = attend(query, _to_cache(ck, heads_first), _to_cache(cv, heads_first), segment_ids, cs, index, 0)
  else:
    shift = -(index % slots)  # slot 0 of the rotated ring holds position index - slots
    k_ring, v_ring = (jnp.concatenate([jnp.roll(x, shift, axis=axis), new], axis)
                      for x, new in ((ck, key), (cv, value)))
    out = attend(query, _to_cache(k_ring, heads_first), _to_cache(v_ring, heads_first), segment_ids,
                 jnp.concatenate([jnp.roll(cs, shift, axis=1), segment_ids], 1), index, index - slots)
    kept = min(n, slots)  # the newest `kept` tokens stay in the ring
    where = (index + n - kept + jnp.arange(kept, dtype=jnp.int32)) % slots
    if heads_first:
      ck = ck.at[:, :, where].set(key[:, :, n - kept:])
      cv = cv.at[:, :, where].set(value[:, :, n - kept:])
    else:
      ck = ck.at[:, where].set(key[:, n - kept:])
      cv = cv.at[:, where].set(value[:, n - kept:])
    cs = cs.at[:, where].set(segment_ids[:, n - kept:])
  return out, {"cached_key": ck, "cached_value": cv, "cached_segment_ids": cs, "cache_index": index + n}


__all__ = ["CACHE_LAYOUTS", "CACHE_NAMES", "UNWRITTEN", "Layout", "check_cache_layout", "check_segment_ids",
           "init_values", "is_ring", "layout",
           "rotary_positions", "step"]
