"""The logits step, once, for the impls that materialise the logits (reference, xla_dense, xla_native).

The contract's order (docs/contract.md): logits = scale * q.k + ALiBi + bias, then ``score_mod``, then
the softcap, then the mask (the built-in rules AND a dense mask AND ``mask_mod``), softmax. Each impl
multiplies q and k its own way (that einsum is where they differ: layout, precision, loop); everything
around it is built here, in one of two layouts: the logits grouped by kv head, [b, kvh, g, t, s], or
one axis of query heads (``grouped=False``), [b, h, t, s]. Every term keeps its size-1 axes, so a mask or
bias shared by rows or heads is never materialised per row or head.

The chunked impl and the kernels compute the same terms per tile (ALiBi from positions, the bias
sliced, the mods on index vectors): `impls/xla_chunked.py` and each kernel family's common module.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract import dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Args, Request


class DenseTerms(NamedTuple):
  """What a call adds to scale * q.k, each broadcastable to the logits or None when absent.

  mask:     bool, the pairs a query may see (None: every pair).
  extra:    float32, ALiBi + bias (None: neither).
  keep:     bool, the dropout keep mask on global indices (None: no dropout).
  indices:  the global (b, h, q, kv) indices of the logits, for the mods (None: no mods).
  """

  mask: jax.Array | None
  extra: jax.Array | None
  keep: jax.Array | None
  indices: mods.Indices | None


def terms(request: Request, args: Args, *, grouped: bool) -> DenseTerms:
  """The `DenseTerms` of a call, laid out as its logits: [b, kvh, g, t, s] grouped, else [b, h, t, s]."""
  group = request.num_heads // request.num_kv_heads
  indices = None
  if request.has_mods:
    indices = mods.dense_indices(args.batch_offset, args.head_offset, args.q_offset, args.kv_offset,
                                 request.batch, request.num_kv_heads, group, request.q_len, request.kv_len,
                                 grouped=grouped)
  keep = None
  if request.has_dropout:
    keep = _by_kv_head(dense_keep(request, args), group, grouped)
  extra = dense_terms(args, request.q_len, request.kv_len)
  if extra is not None:
    extra = _by_kv_head(extra, group, grouped)
  return DenseTerms(_mask(request, args, indices, group, grouped), extra, keep, indices)


def logits(qk_scaled: jax.Array, request: Request, extra: jax.Array | None = None,
           indices: mods.Indices | None = None, mod_operands: tuple = ()):
  """(logits before the mask, tanh of the softcap or None) from scale * q.k: + ALiBi + bias (``extra``),
  then score_mod (at ``indices``), then the softcap. The tanh is what a backward needs
  (d softcap = 1 - tanh^2)."""
  s = unmodded(qk_scaled, extra)
  if request.score_mod is not None:
    s = mods.score(request.score_mod, s, indices, mod_operands)
  tanh = None
  if request.softcap is not None:
    tanh = jnp.tanh(s / request.softcap)
    s = request.softcap * tanh
  return s, tanh


def unmodded(qk_scaled: jax.Array, extra: jax.Array | None) -> jax.Array:
  """scale * q.k + ALiBi + bias: the logits score_mod receives (its vjp is taken at them)."""
  return qk_scaled if extra is None else qk_scaled + extra


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


def dense_keep(request: Request, args: Args) -> jax.Array:
  """The dropout keep mask, bool [b, h, t, s] ([1, 1, t, s] when broadcast), global indices."""
  if request.dropout_broadcast:
    bi = hi = jnp.zeros((1, 1, 1, 1), jnp.int32)
  else:
    bi = args.batch_offset + jnp.arange(request.batch, dtype=jnp.int32)[:, None, None, None]
    hi = args.head_offset + jnp.arange(request.num_heads, dtype=jnp.int32)[None, :, None, None]
  q_pos = args.q_offset + jnp.arange(request.q_len, dtype=jnp.int32)[:, None]
  kv_pos = args.kv_offset + jnp.arange(request.kv_len, dtype=jnp.int32)[None, :]
  return dropout.keep(dropout.stream(args.dropout_seed, bi, hi), q_pos, kv_pos, request.dropout_rate)


def _mask(request: Request, args: Args, indices, group: int, grouped: bool):
  """bool broadcastable to the logits, or None when every pair is visible."""
  t, s = request.q_len, request.kv_len
  mask = None
  if request.spec.causal or request.spec.window is not None or request.has_segment_ids:
    mask = mask_rules.dense_mask(t, s, request.spec, args.q_segment_ids, args.kv_segment_ids,
                                 args.q_offset, args.kv_offset)[:, None]  # [b|1, 1, t, s]
    mask = mask[:, :, None] if grouped else mask
  if args.dense_mask is not None:  # [b|1, h|1, t|1, s|1]
    dm = args.dense_mask
    dm = _by_kv_head(jnp.broadcast_to(dm, (*dm.shape[:2], t, s)), group, grouped)
    mask = dm if mask is None else mask & dm
  if request.mask_mod is not None:
    shown = mods.mask(request.mask_mod, indices, args.mod_operands)
    mask = shown if mask is None else mask & shown
  return mask


def _by_kv_head(x, group: int, grouped: bool):
  """[b|1, h|1, t, s] -> [b|1, kvh|1, g|1, t, s] (grouped), or unchanged."""
  if not grouped:
    return x
  heads = x.shape[1]
  return x.reshape(x.shape[0], heads // group if heads > 1 else 1, group if heads > 1 else 1, *x.shape[2:])
