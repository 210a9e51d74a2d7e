"""Attention sinks: a per-head logit that joins every row's softmax denominator and carries no value.

Every impl serves sinks the same way: it runs without them and returns a differentiable (out, lse),
and `merge_sinks` folds the sinks in afterwards (api.py calls it once per call, after any sharding
or ring has merged its shards). Part of the contract, so it imports nothing from impls/.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of a call with attention sinks, from the impl's (out, lse) without them.

  A sink is a logit per head that joins every row's softmax denominator and carries no value:
  lse' = logaddexp(lse, sink[h]) and every probability shrinks by exp(lse - lse'), so
  out' = out * exp(lse - lse'). Exact for every impl (each returns a differentiable lse), on
  any mesh (applied once, after a ring has merged its shards), with dropout (the normaliser is
  taken before dropout). A row that sees no key keeps out = 0 (its lse was -inf). Gradients
  reach q, k, v through (out, lse) and the sinks through lse'.
  out [b, q, h, dv] (any float dtype), lse [b, h, q] float32, sinks [h] float32.
  """
  merged = jnp.logaddexp(lse, sinks[None, :, None])
  factor = jnp.exp(lse - merged)  # [b, h, q]; 0 where lse = -inf
  out = (out.astype(jnp.float32) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(out.dtype)
  return out, merged
