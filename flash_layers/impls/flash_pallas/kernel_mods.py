"""mask_mod / score_mod inside our kernels: how a mod's operands reach a kernel and how a mod reads them.

Both kernel families evaluate the user's mods (flash_layers/contract/mods.py) on the index vectors of a tile:
``b`` and ``h`` are the program's batch row and query head (int32 scalars), ``q_idx`` / ``kv_idx`` the
tile's global positions (vectors that broadcast to the tile). A mask_mod masks a partial tile with the
built-in rules; its block sparsity comes from `block_info.tile_flags` evaluated on the kernel's tiles
before the call. A score_mod rewrites every visited tile's logits, and the backward applies its
derivative (`jax.vjp` of the elementwise function, inside the kernel).

The operands travel flattened (a 2-D SMEM array pads its rows), as int32 or float32 (what a TPU's scalar
memory holds; bool and narrower ints widen to int32, other floats to float32), and a mod sees each as an
`Operand`: indexing it with scalars (``prefix[b]``, ``table[h, 3]``) reads one element, in any kernel; an
index *array* (``ids[b, q_idx]``, a gather) reads the whole operand as a vector first, which only the
interpreter can do: lowered for a TPU or a GPU it raises `UnsupportedError` naming the gather and the impls
that serve it. Gradients of floating-point operands of a score_mod are not computed by the kernels; such a
request is refused by name ("score_mod operand gradients") before it reaches them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from flash_layers.contract import block_info
from flash_layers.impls import registry
from flash_layers.impls.base import Request, UnsupportedError


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


def request_tile_flags(request: Request, operands: tuple, q_offset, kv_offset, block_q: int,
               block_kv: int) -> tuple[jax.Array, jax.Array]:
  """The request's mask_mod on a kernel's tiles: (any, all) bool [b|1, nq, nk] (`block_info.tile_flags`, over
  every query head; batch and head offsets 0: mods are refused on a mesh)."""
  return block_info.tile_flags(request.mask_mod, tuple(operands), batch=request.batch,
                         heads=jnp.arange(request.num_heads), batch_offset=0, q_offset=q_offset,
                         kv_offset=kv_offset, q_len=request.q_len, kv_len=request.kv_len,
                         block_q=block_q, block_kv=block_kv, num_q_blocks=-(-request.q_len // block_q),
                         num_kv_blocks=-(-request.kv_len // block_kv))


def unflatten(flat: tuple, metas: tuple[Meta, ...]) -> tuple[jax.Array, ...]:
  """The operands as the user passed them (shape and dtype), from `flatten`'s arrays."""
  return tuple(x.reshape(m.shape).astype(m.dtype) for x, m in zip(flat, metas, strict=True))


class Operand:
  """A mod operand inside a kernel: indexed, it reads from the flat ref (see the module docstring)."""

  def __init__(self, ref, meta: Meta, interpret: bool, where: str):
    self._ref, self._meta, self._interpret, self._where = ref, meta, interpret, where

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
    if len(index) == self.ndim and all(jnp.ndim(i) == 0 for i in index):
      flat = 0
      for i, stride in zip(index, _strides(self.shape), strict=True):
        flat = flat + jnp.asarray(i, jnp.int32) * stride
      return self._ref[flat].astype(self.dtype)
    if not self._interpret:
      raise UnsupportedError(
          f"a mod reads an operand of shape {self.shape} with index arrays (a gather), which {self._where} "
          f"cannot lower; impls that serve it: {list(registry.impls_with('mod_gathers'))} (or index the "
          "operand with scalars, e.g. prefix[b])")
    whole = self._ref[...][:math.prod(self.shape)]  # a GPU kernel's operand is padded to a power of two
    return whole.reshape(self.shape).astype(self.dtype)[index]


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def views(refs, metas: tuple[Meta, ...], interpret: bool, where: str) -> tuple[Operand, ...]:
  return tuple(Operand(ref, meta, interpret, where) for ref, meta in zip(refs, metas, strict=True))
