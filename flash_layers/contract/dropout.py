"""Attention dropout, in one place.

Dropout. After the softmax each probability p[b, h, i, j] is kept with
probability 1 - rate (and scaled by 1 / (1 - rate)), else zeroed. Whether it is
kept is `keep(...)`: a stateless, counter-based hash of (key, b, h, i, j) with
*global* batch row, query head and positions. It uses only 32-bit integer
operations that wrap (add, multiply, xor, logical shifts), which jnp, Mosaic
(TPU Pallas) and Triton (GPU Pallas) evaluate bit-identically. So the mask of a
call is the same under every impl, platform, block size, chunking, mesh and
ring layout: each computes `keep` on the positions it holds, from global
offsets. Nothing of size [q_len, kv_len] is stored: kernels hash the tile they
are working on, forward and backward alike. The kernels read each (row, head)'s
stream from `scalar_table`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _i32(x: int) -> np.int32:
  """A 32-bit constant as int32 (two's complement), so every backend multiplies it the same way."""
  return np.array(x & 0xFFFFFFFF, np.uint32).view(np.int32)[()]


# "lowbias32" (C. Wellons' hash prospector): a bijection on 32 bits with low avalanche bias.
_M1, _M2 = _i32(0x7FEB352D), _i32(0x846CA68B)
_ROW, _COL, _STREAM = _i32(0x9E3779B9), _i32(0x85EBCA6B), _i32(0xC2B2AE35)


def _shr(x, n: int):
  return jax.lax.shift_right_logical(x, jnp.full(jnp.shape(x), n, jnp.int32))


def _mix(x):
  x = x ^ _shr(x, 16)
  x = x * _M1
  x = x ^ _shr(x, 15)
  x = x * _M2
  return x ^ _shr(x, 16)


def stream(seed, batch, head):
  """int32 per (batch row, query head): the key's stream for that row and head.

  ``seed`` is int32[2] (`seed_words`) or its two entries; batch and head are global
  indices (int32 arrays or ints that broadcast together), 0 for a broadcast mask.
  """
  s0, s1 = seed[0], seed[1]
  s = _mix(s0 ^ _STREAM)
  s = _mix(s ^ s1)
  s = _mix(s ^ jnp.asarray(batch, jnp.int32))
  return _mix(s ^ jnp.asarray(head, jnp.int32))


def bits(stream_bh, q_pos, kv_pos):
  """int32 hash of (stream, global query position, global key position); broadcasts its arguments."""
  row = _mix(stream_bh ^ _mix(jnp.asarray(q_pos, jnp.int32) + _ROW))
  col = _mix(jnp.asarray(kv_pos, jnp.int32) ^ _COL)
  return _mix(row + col)


def threshold(rate: float) -> int:
  """Drop when the top 31 bits of the hash fall below this (an int in [0, 2^31))."""
  return min(int(round(rate * 2.0**31)), 2**31 - 1)


def keep(stream_bh, q_pos, kv_pos, rate: float):
  """bool: is p[i, j] of this (batch row, head) kept? The one predicate every impl evaluates."""
  return _shr(bits(stream_bh, q_pos, kv_pos), 1) >= threshold(rate)


def keep_scale(rate: float) -> float:
  return 1.0 / (1.0 - rate)


def is_key(x) -> bool:
  """A typed PRNG key (jax.random.key) or a raw one (uint32 [2], jax.random.PRNGKey)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  shape = tuple(getattr(x, "shape", ()))
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return shape == ()
  return dtype == jnp.uint32 and shape == (2,)


def seed_words(key) -> jax.Array:
  """int32[2] from a PRNG key (typed keys of any PRNG impl fold their words into two)."""
  if isinstance(key, jax.ShapeDtypeStruct):  # explain() on abstract arguments
    return jax.ShapeDtypeStruct((2,), jnp.int32)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = jax.lax.bitcast_convert_type(jnp.asarray(key, jnp.uint32).reshape(-1), jnp.int32)
  if words.shape[0] == 2:
    return words
  w0, w1 = words[0], words[0] ^ _STREAM
  for w in words[1:]:
    w0, w1 = _mix(w0 ^ w), _mix(w1 + w)
  return jnp.stack([w0, w1])


def dropout_mask(dropout_rng: jax.Array, *, batch: int, num_heads: int, q_len: int, kv_len: int,
                 rate: float, broadcast: bool = False, q_offset: int = 0,
                 kv_offset: int = 0) -> jax.Array:
  """The keep mask `attention(..., dropout_rate=rate, dropout_rng=dropout_rng)` applies.

  Returns bool [batch, num_heads, q_len, kv_len] (True = kept), or [1, 1, q_len, kv_len]
  with ``broadcast=True``. ``q_offset``/``kv_offset``: global position of the first query/key
  (for a slice of a longer sequence). For tests and inspection: it is O(q_len * kv_len).
  """
  if not is_key(dropout_rng):
    raise TypeError("dropout_rng must be a PRNG key (jax.random.key(...) or a uint32[2] "
                    f"jax.random.PRNGKey); got {getattr(dropout_rng, 'dtype', type(dropout_rng))}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"rate must be in [0, 1); got {rate}")
  seed = seed_words(dropout_rng)
  if broadcast:
    b = h = jnp.zeros((1, 1, 1, 1), jnp.int32)
  else:
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
  q_pos = q_offset + jnp.arange(q_len, dtype=jnp.int32)[:, None]
  kv_pos = kv_offset + jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  return keep(stream(seed, b, h), q_pos, kv_pos, rate)
