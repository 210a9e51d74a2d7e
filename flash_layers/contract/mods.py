"""`mask_mod` and `score_mod`: the mask and the scores, programmed by the user (docs/contract.md).

    mask_mod(b, h, q_idx, kv_idx, *mod_operands) -> bool          may query q_idx see key kv_idx?
    score_mod(score, b, h, q_idx, kv_idx, *mod_operands) -> score  the logit, rewritten

Both are elementwise jnp functions. Every impl calls them with int32 index arrays that broadcast
against each other (and against ``score``): the batch row ``b``, the query head ``h``, the query
position ``q_idx`` and the key position ``kv_idx``, all *global* (a shard or a CPU-loop step passes
its offsets), so a mod means the same whatever the layout. ``mod_operands`` are extra arrays passed
to both mods unchanged (a relative-bias table, prefix lengths per row); gradients of the loss reach
the floating-point ones through ``score_mod``.

Where they act (the contract's order, docs/contract.md): logits = scale * q.k + ALiBi + bias, then
``score_mod``, then the softcap, then the mask (the built-in rules AND ``mask_mod``), softmax.

This module holds what every impl shares: the checks (`check`), the index arrays of a dense layout
(`dense_indices`) and the calls (`mask`, `score`, `score_vjp`). A mask_mod's tile flags for block
sparsity are `block_info.tile_flags`; the named mask_mods users compose are in `contract.masks`
(`fl.masks.causal()`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Indices(NamedTuple):
  """Global int32 indices that broadcast to the layout of the logits they index."""

  b: jax.Array
  h: jax.Array
  q: jax.Array
  kv: jax.Array


def describe(fn: Callable | None) -> str | None:
  """A mod's name for explain() and logs: its repr for `flash_layers.mask_mods`, else its __name__."""
  if fn is None:
    return None
  if hasattr(fn, "describe"):
    return fn.describe()
  return getattr(fn, "__qualname__", None) or type(fn).__name__


def check(mask_mod, score_mod, mod_operands, as_array: Callable) -> tuple[Any, Any, tuple]:
  """(mask_mod, score_mod, operands as a tuple of jax arrays); TypeError/ValueError naming the
  argument otherwise."""
  for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be a callable {_SIGNATURES[name]} or None; got {type(fn).__name__}")
  if mod_operands is None:
    return mask_mod, score_mod, ()
  if isinstance(mod_operands, (jax.Array, np.ndarray)) or not isinstance(mod_operands, (tuple, list)):
    raise TypeError("mod_operands must be a tuple of arrays (passed to mask_mod and score_mod after "
                    f"the indices); got {type(mod_operands).__name__}")
  if mod_operands and mask_mod is None and score_mod is None:
    raise ValueError("mod_operands were given without a mask_mod or score_mod to read them")
  operands = tuple(as_array(f"mod_operands[{i}]", x) for i, x in enumerate(mod_operands))
  return mask_mod, score_mod, operands


_SIGNATURES = {"mask_mod": "(b, h, q_idx, kv_idx, *mod_operands) -> bool",
               "score_mod": "(score, b, h, q_idx, kv_idx, *mod_operands) -> score"}


def dense_indices(batch_offset, head_offset, q_offset, kv_offset, b: int, kvh: int, g: int, t: int, s: int,
                  *, grouped: bool = True) -> Indices:
  """The indices of logits laid out [b, kvh, g, t, s] (grouped) or [b, kvh * g, t, s]."""
  i32 = jnp.int32
  heads = head_offset + jnp.arange(kvh * g, dtype=i32)
  rows = batch_offset + jnp.arange(b, dtype=i32)
  q = q_offset + jnp.arange(t, dtype=i32)[:, None]
  kv = kv_offset + jnp.arange(s, dtype=i32)[None, :]
  if grouped:
    return Indices(rows.reshape(b, 1, 1, 1, 1), heads.reshape(1, kvh, g, 1, 1), q, kv)
  return Indices(rows.reshape(b, 1, 1, 1), heads.reshape(1, kvh * g, 1, 1), q, kv)


def mask(mask_mod: Callable, idx: Indices, operands: tuple) -> jax.Array:
  """mask_mod's verdict, bool, of the indices' rank (size-1 axes where it does not vary)."""
  out = mask_mod(idx.b, idx.h, idx.q, idx.kv, *operands)
  if not hasattr(out, "dtype") or jnp.result_type(out) != jnp.bool_:
    got = jnp.result_type(out) if hasattr(out, "dtype") else type(out).__name__
    raise TypeError(f"mask_mod must return a bool array (True: the key is visible); got {got}")
  rank = max(jnp.ndim(x) for x in idx)
  return jnp.reshape(out, (1,) * (rank - out.ndim) + tuple(out.shape))


def score(score_mod: Callable, s: jax.Array, idx: Indices, operands: tuple) -> jax.Array:
  """score_mod applied to float32 logits ``s``; the result float32 of s's shape."""
  out = score_mod(s, idx.b, idx.h, idx.q, idx.kv, *operands)
  if not hasattr(out, "dtype") or not jnp.issubdtype(jnp.result_type(out), jnp.floating):
    got = jnp.result_type(out) if hasattr(out, "dtype") else type(out).__name__
    raise TypeError(f"score_mod must return a floating-point array (the new logits); got {got}")
  return jnp.broadcast_to(out.astype(jnp.float32), s.shape)


def differentiable(operands: tuple) -> tuple[bool, ...]:
  """Which operands carry gradients: the floating-point ones."""
  return tuple(jnp.issubdtype(x.dtype, jnp.floating) for x in operands)


def score_vjp(score_mod: Callable, x: jax.Array, idx: Indices, operands: tuple,
              ds: jax.Array) -> tuple[jax.Array, tuple]:
  """(d x, d operands) from d score: the backward of `score` at logits ``x`` (before the mod).
  An integer operand's gradient is None; a float operand's has its own shape and dtype."""
  floats = differentiable(operands)

  def f(x, float_ops):
    it = iter(float_ops)
    ops = tuple(next(it) if is_float else op for op, is_float in zip(operands, floats, strict=True))
    return score(score_mod, x, idx, ops)

  float_ops = tuple(op for op, is_float in zip(operands, floats, strict=True) if is_float)
  _, vjp = jax.vjp(f, x, float_ops)
  dx, d_float = vjp(ds)
  it = iter(d_float)
  return dx, tuple(next(it) if is_float else None for is_float in floats)


def add_grads(a: tuple, b: tuple) -> tuple:
  """Elementwise sum of two operand-gradient tuples (None stays None)."""
  return tuple(None if x is None else x + y for x, y in zip(a, b, strict=True))


def zero_grads(operands: tuple) -> tuple:
  """float32 zeros for each float operand's gradient, None for the others."""
  return tuple(jnp.zeros(x.shape, jnp.float32) if f else None
               for x, f in zip(operands, differentiable(operands), strict=True))


def cast_grads(grads: tuple, operands: tuple) -> tuple:
  """Operand gradients in their operands' dtypes (None stays None)."""
  return tuple(None if d is None else d.astype(x.dtype) for d, x in zip(grads, operands, strict=True))
