"""Named mask_mods: the mask rules as values to pass to ``fl.attention(..., mask_mod=...)``.

Each is a small frozen dataclass, so two equal ones hash equal (a jitted model does not retrace
for a new but equal mask) and print what they are (`fl.explain` names them). All are called as
``mod(b, h, q_idx, kv_idx, *mod_operands)`` with global int32 index arrays that broadcast
(`contract.mods`), and ignore operands they do not read. Compose them with `all_of` (AND)
and `any_of` (OR). They are reached as ``fl.masks.causal()`` and so on.

The built-in arguments (``causal=True``, ``window=``, ``segment_ids=``, ``global_tokens=``) keep
their own arithmetic block plans; a mask_mod's block sparsity comes from evaluating it on the
tile grid (`block_info.tile_flags`). Passing `causal()` as a mask_mod gives the same output as
``causal=True`` (tests/test_mask_mods.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["all_of", "any_of", "block_table", "causal", "chunked_causal", "dilated", "document",
           "global_tokens", "prefix_lm", "sliding_window"]


class _MaskMod:
  """Base: ``describe()`` is the dataclass repr without the module path."""

  def describe(self) -> str:
    fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
    return f"masks.{type(self).__name__.lstrip('_')}({fields})"

  def __and__(self, other):
    return all_of(self, other)

  def __or__(self, other):
    return any_of(self, other)


def _div(x, n: int):
  """x // n for the non-negative positions a mask reads, as truncating division (`lax.div`): jnp's
  floor division adds a sign fix-up whose Mosaic lowering queries the local chip, so a kernel that
  used it could not be compiled ahead of time for a TPU from another host."""
  x = jnp.asarray(x)
  return jax.lax.div(x, jnp.full(x.shape, n, x.dtype))


def _rem(x, n: int):
  """x % n up to its sign (`lax.rem`): equal to 0 exactly when x % n is."""
  x = jnp.asarray(x)
  return jax.lax.rem(x, jnp.full(x.shape, n, x.dtype))


def _operand_index(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be the index (an int >= 0) of an array in mod_operands; got {value!r}")
  return value


def _positive(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an int >= 1; got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class _Causal(_MaskMod):
  def __call__(self, b, h, q_idx, kv_idx, *operands):
    return kv_idx <= q_idx


@dataclasses.dataclass(frozen=True)
class _SlidingWindow(_MaskMod):
  left: int
  right: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    return (kv_idx >= q_idx - self.left) & (kv_idx <= q_idx + self.right)


@dataclasses.dataclass(frozen=True)
class _Document(_MaskMod):
  operand: int
  kv_operand: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    q_ids, kv_ids = operands[self.operand], operands[self.kv_operand]  # [batch, length] each
    return q_ids[b, q_idx] == kv_ids[b, kv_idx]


@dataclasses.dataclass(frozen=True)
class _PrefixLM(_MaskMod):
  prefix: int | None
  operand: int | None

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    prefix = self.prefix if self.operand is None else operands[self.operand][b]
    return (kv_idx <= q_idx) | (kv_idx < prefix)


@dataclasses.dataclass(frozen=True)
class _ChunkedCausal(_MaskMod):
  chunk: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    return (kv_idx <= q_idx) & (_div(q_idx, self.chunk) == _div(kv_idx, self.chunk))


@dataclasses.dataclass(frozen=True)
class _Dilated(_MaskMod):
  dilation: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    return _rem(q_idx - kv_idx, self.dilation) == 0


@dataclasses.dataclass(frozen=True)
class _GlobalTokens(_MaskMod):
  count: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    return (q_idx < self.count) | (kv_idx < self.count)


@dataclasses.dataclass(frozen=True)
class _BlockTable(_MaskMod):
  operand: int
  block_q: int
  block_kv: int

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    table = operands[self.operand]  # bool [ceil(q_len / block_q), ceil(kv_len / block_kv)]
    return table[_div(q_idx, self.block_q), _div(kv_idx, self.block_kv)]


@dataclasses.dataclass(frozen=True)
class _AllOf(_MaskMod):
  """Visible where every mod says so; `_AnyOf` changes only the combining op and its symbol."""

  mods: tuple
  _combine = staticmethod(jnp.logical_and)
  _symbol = "&"

  def __call__(self, b, h, q_idx, kv_idx, *operands):
    out = self.mods[0](b, h, q_idx, kv_idx, *operands)
    for mod in self.mods[1:]:
      out = self._combine(out, mod(b, h, q_idx, kv_idx, *operands))
    return out

  def describe(self) -> str:
    return "(" + f" {self._symbol} ".join(_name(m) for m in self.mods) + ")"


@dataclasses.dataclass(frozen=True)
class _AnyOf(_AllOf):
  _combine = staticmethod(jnp.logical_or)
  _symbol = "|"


def _name(mod) -> str:
  return mod.describe() if hasattr(mod, "describe") else getattr(mod, "__qualname__", repr(mod))


def causal() -> _MaskMod:
  """Query i sees key j when j <= i (global positions): ``causal=True`` as a mask_mod."""
  return _Causal()


def sliding_window(left: int, right: int | None = None) -> _MaskMod:
  """Query i sees keys i - left ... i + right (right defaults to left): ``window=`` as a mask_mod."""
  right = left if right is None else right
  for name, value in (("left", left), ("right", right)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"sliding_window {name} must be an int >= 0; got {value!r}")
  return _SlidingWindow(left, right)


def document(operand: int = 0, kv_operand: int | None = None) -> _MaskMod:
  """Packed documents: query i sees key j when their segment ids are equal. The ids are
  ``mod_operands[operand]`` (int [batch, q_len]) and ``mod_operands[kv_operand]`` for the keys
  (default: the same array): ``segment_ids=`` as a mask_mod."""
  operand = _operand_index("operand", operand)
  kv_operand = operand if kv_operand is None else _operand_index("kv_operand", kv_operand)
  return _Document(operand, kv_operand)


def prefix_lm(prefix: int | None = None, *, operand: int | None = None) -> _MaskMod:
  """Prefix-LM (T5, PaLM): every query sees the first ``prefix`` keys (bidirectional), and the
  rest causally. ``prefix`` is an int for every row, or ``operand`` names an int [batch] array of
  per-row prefix lengths in mod_operands."""
  if (prefix is None) == (operand is None):
    raise ValueError("prefix_lm takes exactly one of prefix (an int) or operand (the index of an int "
                     f"[batch] array in mod_operands); got prefix={prefix!r}, operand={operand!r}")
  if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0):
    raise ValueError(f"prefix must be an int >= 0; got {prefix!r}")
  return _PrefixLM(prefix, None if operand is None else _operand_index("operand", operand))


def chunked_causal(chunk: int) -> _MaskMod:
  """Causal within consecutive chunks of ``chunk`` positions (Llama 4's local attention): query i
  sees key j when j <= i and both lie in the same chunk."""
  return _ChunkedCausal(_positive("chunk", chunk))


def dilated(dilation: int) -> _MaskMod:
  """Query i sees key j when i - j is a multiple of ``dilation`` (combine with a window or causal)."""
  return _Dilated(_positive("dilation", dilation))


def global_tokens(count: int) -> _MaskMod:
  """The first ``count`` positions see, and are seen by, everything (combine with `any_of` and a
  window; ``global_tokens=`` restarts the count per document, this one counts global positions)."""
  return _GlobalTokens(_positive("count", count))


def block_table(operand: int, block_q: int, block_kv: int) -> _MaskMod:
  """A block-sparse pattern: query i sees key j when ``table[i // block_q, j // block_kv]``, the
  table a bool array in ``mod_operands[operand]``."""
  return _BlockTable(_operand_index("operand", operand), _positive("block_q", block_q),
                     _positive("block_kv", block_kv))


def all_of(*mods) -> _MaskMod:
  """Visible where every mod says so (AND); also ``mod_a & mod_b``."""
  if not mods or not all(callable(m) for m in mods):
    raise ValueError(f"all_of takes one or more mask_mods; got {mods!r}")
  return _AllOf(tuple(mods))


def any_of(*mods) -> _MaskMod:
  """Visible where some mod says so (OR); also ``mod_a | mod_b``."""
  if not mods or not all(callable(m) for m in mods):
    raise ValueError(f"any_of takes one or more mask_mods; got {mods!r}")
  return _AnyOf(tuple(mods))
