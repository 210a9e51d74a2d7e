"""ALiBi (Press et al. 2022, arXiv 2108.12409): logits[b, h, i, j] += -slope[h] * |i - j|.

Positions are global (a query offset, a ring shard or a sequence shard sees the same term), and
every impl computes the term from positions alone: the kernels per tile, the dense impls through
`dense_logits.dense_terms`. The slopes reach the kernels through `scalar_table`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def alibi_slopes(num_heads: int) -> jax.Array:
  """The standard geometric ALiBi slopes for `num_heads` heads, float32 [num_heads].

  For n a power of two: 2^(-8 k / n), k = 1..n. Otherwise the slopes of the largest power of
  two m < n, followed by every other slope of 2m (Press et al., reference implementation).
  """
  if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
    raise ValueError(f"num_heads must be a positive int; got {num_heads!r}")

  def power_of_two(n):
    return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

  m = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(m)
  if m != num_heads:
    slopes += power_of_two(2 * m)[0::2][:num_heads - m]
  return jnp.asarray(slopes, jnp.float32)


def alibi(slope, q_pos, kv_pos):
  """float32 -slope * |i - j| (broadcasts; positions global)."""
  dist = jnp.abs(jnp.asarray(q_pos, jnp.int32) - jnp.asarray(kv_pos, jnp.int32)).astype(jnp.float32)
  return -jnp.asarray(slope, jnp.float32) * dist
