"""The additive score terms of a call, built once for the impls that materialise the logits.

The contract's logits are scale * q.k + ALiBi + bias (docs/contract.md); reference, xla_dense and
xla_native add the last two as one dense float32 array, built here. The chunked impl and the
kernels compute the same terms per tile (ALiBi from positions, the bias sliced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Args


def dense_terms(args: Args, q_len: int, kv_len: int) -> jax.Array | None:
  """ALiBi + bias as one float32 [b|1, h|1, q_len, kv_len] array, or None when the call has neither.

  ALiBi uses global positions (`args.q_offset`, `args.kv_offset`, traced or not); the bias keeps
  its own size-1 axes (shared by batch rows or heads), a 2- or 3-d bias gains leading ones.
  """
  total = None
  if args.alibi_slopes is not None:
    q_pos = args.q_offset + jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kv_pos = args.kv_offset + jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    total = alibi(args.alibi_slopes[:, None, None], q_pos, kv_pos)[None]  # [1, h, t, s]
  if args.bias is not None:
    bias = args.bias.astype(jnp.float32)
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    total = bias if total is None else total + bias
  if total is None:
    return None
  return jnp.broadcast_to(total, (*total.shape[:2], q_len, kv_len))
