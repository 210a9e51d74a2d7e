"""mask_mod / score_mod inside our kernels: how a mod's operands reach a kernel and how a mod reads them.

Both kernel families evaluate the user's mods (flash_layers/contract/mods.py) on the index vectors of a
tile: ``b`` and ``h`` are the program's *global* batch row and query head (int32 scalars: the local ones
plus the scalar table's `scalar_table.origin`, which a shard of a mesh sets from its axis index), ``q_idx``
/ ``kv_idx`` the tile's global positions (vectors that broadcast to the tile). A mask_mod masks a partial
tile with the built-in rules; its block sparsity comes from `block_info.tile_flags` evaluated on the
kernel's tiles before the call, with the same global rows and heads. A score_mod rewrites every visited
tile's logits, and the backward applies its derivative (`jax.vjp` of the elementwise function, inside
the kernel).

The operands travel flattened (a 2-D SMEM array pads its rows), as int32 or float32 (what a TPU's scalar
memory holds; bool and narrower ints widen to int32, other floats to float32), and a mod sees each as an
`Operand`: indexing it with scalars (``prefix[b]``, ``table[h, 3]``) reads one element, in any kernel. An
index *array* (``table[h, bucket]``, a gather) is unrolled into a chain of selects over the elements the
array axes can reach (``table[h, 0]`` ... ``table[h, n - 1]``, scalar reads), when there are at most
`MAX_GATHER` of them: Mosaic and Triton lower that, and a T5 table of 32 buckets costs 32 selects per
tile. Wider gathers (``ids[b, q_idx]``, one candidate per position) read the whole operand as a vector,
which only the interpreter can do: lowered for a TPU or a GPU they raise `UnsupportedError` naming the
gather and the impls that serve it. Indices must be in range (a select chain reads 0 past the end).

Operand gradients (docs/kernels.md, "Operand gradients"): `score_vjp` differentiates score_mod with
respect to every value it read from a floating-point operand (a `Read`: where, and the value broadcast to
the tile), and `accumulate` scatters each read's cotangent, summed over the tile, into a float32
accumulator of the flattened float operands (`GradLayout`): a scalar read adds to one slot, a gather to
each of its candidates (the cotangent where the index picked it). The families keep one accumulator
per dQ program and sum the programs' partials after the grid.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flash_layers.contract import block_info, mods
from flash_layers.impls import registry
from flash_layers.impls.base import Request, UnsupportedError
from flash_layers.impls.flash_pallas import scalar_table


@dataclasses.dataclass(frozen=True)
class Meta:
  """What a flattened operand was: its shape and dtype (hashable: part of a kernel's static config)."""

  shape: tuple[int, ...]
  dtype: str


def flatten(operands: tuple) -> tuple[tuple[jax.Array, ...], tuple[Meta, ...]]:
  """(flat int32 / float32 arrays, their `Meta`s) of a call's mod_operands."""
  flat, metas = [], []
  for x in operands:
    x = jnp.asarray(x)
    wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
    flat.append(x.astype(wide).reshape(-1))
    metas.append(Meta(tuple(x.shape), jnp.dtype(x.dtype).name))
  return tuple(flat), tuple(metas)


def request_tile_flags(request: Request, operands: tuple, offsets: scalar_table.Offsets,
                       origin: scalar_table.Origin, block_q: int, block_kv: int) -> tuple[jax.Array, ...]:
  """The request's mask_mod on a kernel's tiles: (any, all) bool [b|1, nq, nk] (`block_info.tile_flags`,
  over every local query head). ``origin``: the global batch row and query head of local row and head 0
  (a shard's, read from the scalar table), so the flags agree with the kernels' element mask on a mesh."""
  heads = origin.head + jnp.arange(request.num_heads, dtype=jnp.int32)
  return block_info.tile_flags(
      request.mask_mod, tuple(operands), batch=request.batch, heads=heads, batch_offset=origin.batch,
      q_offset=offsets.q, kv_offset=offsets.kv, q_len=request.q_len, kv_len=request.kv_len, block_q=block_q,
      block_kv=block_kv, num_q_blocks=-(-request.q_len // block_q),
      num_kv_blocks=-(-request.kv_len // block_kv))


def unflatten(flat: tuple, metas: tuple[Meta, ...]) -> tuple[jax.Array, ...]:
  """The operands as the user passed them (shape and dtype), from `flatten`'s arrays."""
  return tuple(x.reshape(m.shape).astype(m.dtype) for x, m in zip(flat, metas, strict=True))


# Candidates a compiled kernel unrolls for one read with index arrays (a select each, per tile).
MAX_GATHER = 64
# Elements of the float operands whose gradients a kernel accumulates (one float32 accumulator per
# program: registers on a GPU, a VMEM block on a TPU); larger requests are refused by name.
MAX_GRAD_ELEMENTS = 2048


class Read(NamedTuple):
  """One read of an operand by a mod: flat index ``base + offset``; ``offset`` (int32, broadcasting to
  the tile) is None for a scalar read, else the index arrays' part, one of ``candidates``."""

  operand: int
  base: Any
  offset: Any
  candidates: tuple[int, ...] | None


class Tape:
  """The reads of the float operands during one score_mod call: recorded (`values` None), or replayed
  with the given values, in the order the mod reads them (the mod is a deterministic function)."""

  def __init__(self, values: tuple | None = None):
    self.reads: list[tuple[Read, jax.Array]] = []
    self._values = None if values is None else iter(values)

  def take(self, read: Read, value):
    if self._values is None:
      self.reads.append((read, value))
      return value
    return next(self._values)


class Operand:
  """A mod operand inside a kernel: indexed, it reads from the flat ref (see the module docstring)."""

  def __init__(self, ref, meta: Meta, interpret: bool, where: str, number: int = 0,
               tape: Tape | None = None):
    self._ref, self._meta, self._interpret, self._where = ref, meta, interpret, where
    self._number, self._tape = number, tape

  def taped(self, tape: Tape) -> Operand:
    """This operand, its reads recorded on (or replayed from) `tape`."""
    return Operand(self._ref, self._meta, self._interpret, self._where, self._number, tape)

  @property
  def shape(self) -> tuple[int, ...]:
    return self._meta.shape

  @property
  def ndim(self) -> int:
    return len(self._meta.shape)

  @property
  def dtype(self):
    return jnp.dtype(self._meta.dtype)

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    read = self._read_of(index)
    if read is None or (read.candidates is not None and len(read.candidates) > MAX_GATHER):
      if not self._interpret:
        raise UnsupportedError(
            f"a mod reads an operand of shape {self.shape} with index arrays (a gather of more than "
            f"{MAX_GATHER} candidates), which {self._where} cannot lower; impls that serve it: "
            f"{list(registry.impls_with('mod_gathers'))} (or index the operand with scalars, e.g. "
            "prefix[b], or with arrays over a smaller range)")
      whole = self._ref[...][:math.prod(self.shape)]  # a GPU kernel's operand is padded to a power of two
      value = whole.reshape(self.shape).astype(self.dtype)[index]
      if read is None:  # slices and the like: only the interpreter, and no operand gradient
        return value
    elif read.candidates is None:
      value = self._ref[read.base].astype(self.dtype)
    else:  # a select per candidate: scalar reads only, which both compilers lower
      value = jnp.zeros(jnp.shape(read.offset), self.dtype)
      for c in read.candidates:
        value = jnp.where(read.offset == c, self._ref[read.base + c].astype(self.dtype), value)
    return value if self._tape is None else self._tape.take(read, value)

  def _read_of(self, index) -> Read | None:
    """The `Read` of an index of one integer scalar or array per axis; None for anything else."""
    if len(index) != self.ndim or not all(
        isinstance(i, int) or (hasattr(i, "dtype") and jnp.issubdtype(i.dtype, jnp.integer)) for i in index):
      return None
    base, offset, axes = jnp.int32(0), None, []
    for i, stride, size in zip(index, _strides(self.shape), self.shape, strict=True):
      term = jnp.asarray(i, jnp.int32) * stride
      if jnp.ndim(i) == 0:
        base = base + term
      else:
        offset = term if offset is None else offset + term
        axes.append((stride, size))
    if offset is None:
      return Read(self._number, base, None, None)
    candidates = tuple(sum(c * stride for c, (stride, _) in zip(combo, axes, strict=True))
                       for combo in itertools.product(*(range(size) for _, size in axes)))
    return Read(self._number, base, offset, candidates)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def views(refs, metas: tuple[Meta, ...], interpret: bool, where: str) -> tuple[Operand, ...]:
  return tuple(Operand(ref, meta, interpret, where, n)
               for n, (ref, meta) in enumerate(zip(refs, metas, strict=True)))


class ModOperands:
  """What a kernel family's call record (TpuCall, GpuCall: fields `request`, `interpret`,
  `operands`) derives about its mod operands; `KERNEL` names the kernel in error messages."""

  KERNEL = "a Pallas kernel"

  def mod_views(self, refs) -> tuple[Operand, ...]:
    """The operands as a mod sees them inside a kernel (`Operand`)."""
    return views(refs, self.operands, self.interpret, self.KERNEL)

  @property
  def operand_grads(self) -> bool:
    """Whether the dQ kernel accumulates the gradients of score_mod's float operands."""
    return self.request.has_float_score_operands

  @property
  def grad_layout(self) -> GradLayout:
    return GradLayout.of(self.operands)


# ----------------------------------------------------------------------------
# Operand gradients (module docstring)
# ----------------------------------------------------------------------------

def is_float(meta: Meta) -> bool:
  return jnp.issubdtype(jnp.dtype(meta.dtype), jnp.floating)


@dataclasses.dataclass(frozen=True)
class GradLayout:
  """Where each float operand's gradient lies in a kernel's flat float32 accumulator."""

  starts: tuple[int | None, ...]  # per operand: its first slot, None for an integer operand
  sizes: tuple[int, ...]
  total: int

  @classmethod
  def of(cls, metas: tuple[Meta, ...]) -> GradLayout:
    starts, total = [], 0
    for m in metas:
      starts.append(total if is_float(m) else None)
      total += math.prod(m.shape) if is_float(m) else 0
    return cls(tuple(starts), tuple(math.prod(m.shape) for m in metas), total)

  def split(self, flat: jax.Array) -> tuple:
    """Per operand: its flat float32 gradient (a slice of the summed accumulator), or None."""
    return tuple(None if s is None else flat[s:s + n] for s, n in zip(self.starts, self.sizes, strict=True))


def score_vjp(score_mod, x, idx: mods.Indices, operands: tuple):
  """(y, back): score_mod on the tile ``x``, and ``back(dy) -> (dx, ((Read, cotangent), ...))`` with a
  cotangent of the tile's shape for every read of a float operand.

  The mod runs twice while tracing: once recording its reads of the float operands (their values are
  the inputs of the second run; its own result is dead code), once replaying them as arrays of the
  tile's shape, which `jax.vjp` differentiates. Broadcasting even a scalar read to the tile keeps every
  cotangent a tile: `accumulate` sums it with reductions both compilers lower.
  """
  floats = tuple(isinstance(op, Operand) and jnp.issubdtype(op.dtype, jnp.floating) for op in operands)
  tape = Tape()
  mods.score(score_mod, x, idx,
             tuple(op.taped(tape) if f else op for op, f in zip(operands, floats, strict=True)))
  reads = tuple(read for read, _ in tape.reads)
  values = tuple(jnp.broadcast_to(v, x.shape) for _, v in tape.reads)

  def replayed(x, values):
    tape = Tape(values)
    return mods.score(score_mod, x, idx,
                      tuple(op.taped(tape) if f else op for op, f in zip(operands, floats, strict=True)))

  y, vjp = jax.vjp(replayed, x, values)

  def back(dy):
    dx, d_values = vjp(dy)
    return dx, tuple(zip(reads, d_values, strict=True))
  return y, back


def score_mod_vjp(score_mod, x, idx: mods.Indices, operands: tuple, grad: bool, operand_grads: bool):
  """(score_mod(x), back or None) of both families' logits step: back(dy) is dx, or with
  ``operand_grads`` (dx, the reads' cotangents) (`score_vjp`)."""
  if operand_grads:
    return score_vjp(score_mod, x, idx, operands)

  def rewrite(x):
    return mods.score(score_mod, x, idx, operands)

  if not grad:
    return rewrite(x), None
  y, vjp = jax.vjp(rewrite, x)
  return y, lambda dy: vjp(dy)[0]


def operand_grads(d_flat: tuple, operands: tuple) -> tuple:
  """`attention_backward`'s operand gradients: per operand, its flat float32 gradient reshaped and cast
  to the operand's shape and dtype, or None (an integer operand)."""
  return tuple(None if d is None else d.reshape(jnp.shape(x)).astype(jnp.result_type(x))
               for d, x in zip(d_flat, operands, strict=True))


def accumulate(acc, slots, layout: GradLayout, contributions, total):
  """``acc`` plus each read's cotangent, summed over the tile, at its element's slot. ``slots``: int32
  of acc's shape, the slot each entry holds; ``total(x)``: the family's sum of a tile (a scalar or a
  [1, 1] array), which broadcasts against acc."""
  for read, g in contributions:
    start = layout.starts[read.operand]
    g = g.astype(jnp.float32)
    if read.candidates is None:
      acc = acc + jnp.where(slots == start + read.base, total(g), 0.0)
      continue
    for c in read.candidates:  # the gather's scatter-add: per candidate, where the index picked it
      acc = acc + jnp.where(slots == start + read.base + c, total(jnp.where(read.offset == c, g, 0.0)), 0.0)
  return acc
