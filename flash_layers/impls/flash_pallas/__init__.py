"""flash_pallas: our own Pallas flash-attention kernels, one family per platform.

* `tpu.py` — the family of Mosaic kernels designed for the TPU (VMEM scratch, scalar-prefetched block
  map): its interface and custom VJP; the kernels by role in `tpu_fwd.py`, `tpu_bwd.py`,
  `tpu_decode.py`, what they share (the tile logits step, the online softmax) in `tpu_common.py`, the
  grids in `tpu_grid.py`; tiles, VMEM budgets and tuning candidates in `tpu_config.py`.
* `gpu.py` — the family of Triton kernels designed for the GPU (one program per q block, in-kernel kv
  loop), split the same way (`gpu_fwd.py`, `gpu_bwd.py`, `gpu_decode.py`, `gpu_common.py`); tiles,
  warps, stages, shared-memory budgets and tuning candidates in `gpu_config.py`.
* `decode.py` — the split-KV decode plan and merge both decode kernels share; `scalar_table.py` — the
  kernels' int32 scalar table; `kernel_mods.py` — mask_mod / score_mod inside the kernels.

This module only dispatches. The family follows the platform the computation is
*lowered* for (`jax.lax.platform_dependent`): a TPU lowering gets the Mosaic
kernels, a CUDA lowering the Triton ones, anything else (the CPU) the TPU
kernels in interpret mode. `fl.interpret_as("tpu" | "gpu")` forces one family,
interpreted, everywhere.

Each family module satisfies `KernelFamily` (checked when it is first loaded).
"""

from __future__ import annotations

import functools
import importlib
from typing import Protocol

import jax

from flash_layers import lowering
from flash_layers.contract import block_info, mods
from flash_layers.impls import registry
from flash_layers.impls.base import Args, Request, UnsupportedError
from flash_layers.impls.flash_pallas import decode, kernel_mods, scalar_table
from flash_layers.impls.flash_pallas.tuning_space import space as _tuning_space
from flash_layers.impls.tiling import BlockSizes, GpuBlockSizes

_FAMILY_MODULES = {"tpu": "flash_layers.impls.flash_pallas.tpu",
                   "gpu": "flash_layers.impls.flash_pallas.gpu"}


class KernelFamily(Protocol):
  """What a kernel family module (`tpu.py`, `gpu.py`) provides; its functions, module-level."""

  def unsupported(self, request: Request) -> str | None:
    """The first feature of the request it cannot serve, or None."""

  def block_shape(self, request: Request, platform: str) -> tuple[int, int]:
    """The forward's (block_q, block_kv): explain()'s block counts."""

  def grid_steps(self, request: Request, args: Args) -> int | None:
    """The forward grid's steps over batch and heads, or None when its grid does not show them."""

  def flash_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, *, request: Request,
                      args: Args, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(out, lse), differentiable (its own backward kernels)."""

  def attention_backward(self, q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array,
                         delta: jax.Array, d_out: jax.Array, *, request: Request, args: Args,
                         interpret: bool) -> tuple:
    """(dq, dk, dv) from given row statistics, no forward; with a score_mod's float operands
    (dq, dk, dv, their gradients aligned with mod_operands, None for the others)."""


# How the dispatcher calls each KernelFamily function: (positional arguments, keyword arguments).
_FAMILY_CALLS = {
    "unsupported": (1, ()),
    "block_shape": (2, ()),
    "grid_steps": (2, ()),
    "flash_attention": (3, ("request", "args", "interpret")),
    "attention_backward": (6, ("request", "args", "interpret")),
}


@functools.cache
def _family(name: str) -> KernelFamily:
  """The family module, checked against `KernelFamily` the first time it is loaded."""
  module = importlib.import_module(_FAMILY_MODULES[name])
  for function, call in _FAMILY_CALLS.items():
    registry.check_callable(f"kernel family {module.__name__}", module, function, call)
  return module


def family_for(platform: str) -> tuple[str, bool]:
  """(kernel family, interpreted?) for a lowering platform, honouring interpret_as."""
  forced = lowering.interpreting()
  if forced is not None:
    return forced, True
  if platform == "tpu":
    return "tpu", False
  if platform in ("cuda", "rocm"):
    return "gpu", False
  return "tpu", True


# The tile class of each kernel family, as `fl.attention(block_sizes=...)` takes it.
_SIZES_OF_FAMILY = {"tpu": BlockSizes, "gpu": GpuBlockSizes}
_FAMILY_NAMES = {"tpu": "TPU (Mosaic)", "gpu": "GPU (Triton)"}


def wrong_block_sizes(request: Request, family: str, where: str) -> str | None:
  """Why `request.block_sizes` cannot tile `family`'s kernels, or None when it can (None, or that
  family's class; other types are the family's own TypeError). `where` says how the family was
  chosen, for the message."""
  sizes = request.block_sizes
  given = next((f for f, cls in _SIZES_OF_FAMILY.items() if isinstance(sizes, cls)), None)
  if given is None or given == family:
    return None
  return (f"block_sizes is flash_layers.{type(sizes).__name__}, the tiles of flash_pallas's "
          f"{_FAMILY_NAMES[given]} kernel family, but {where} runs its {_FAMILY_NAMES[family]} "
          f"family, which takes flash_layers.{_SIZES_OF_FAMILY[family].__name__}; pass those "
          f"(or None for its defaults); got {sizes!r}")


def _where(platform: str | None) -> str:
  forced = lowering.interpreting()
  if forced is not None:
    return f"fl.interpret_as({forced!r})"
  if platform in ("tpu", "cuda", "rocm"):
    return f"a call lowered for {platform}"
  return f"a call lowered for {platform or 'the CPU'} (the TPU kernels, interpreted)"


class FlashPallas:
  name = "flash_pallas"
  # sharded_mods: both families add the scalar table's batch and head offsets to a program's row and head
  # before evaluating a mod (kernel_mods, scalar_table.origin), so a shard's mods see global indices.
  capabilities = frozenset({"attention_backward", "block_stats", "grid_steps", "traced_offsets", "dropout",
                            "retiles_block_mask", "decode_unserved", "tuning_space", "sharded_mods"})
  block_size_types = (BlockSizes, GpuBlockSizes)  # the family lowered for checks its own again
  tuning_space = staticmethod(_tuning_space)  # tuning_space.py

  def decode_unserved(self, request: Request, platform: str) -> str | None:
    """Why `request` does not take the split-KV decode path (decode.py), or None: the same rule on
    every platform."""
    return decode.unserved(request)

  def unsupported(self, request: Request, platform: str) -> str | None:
    if request.has_dense_mask:  # the kernels skip blocks by the mask spec, never by an array
      return "dense mask"
    if request.has_bias:  # an O(q * kv) operand per head defeats the kernels' purpose
      return "dense bias"
    if request.has_float_score_operands and request.mod_operand_words > kernel_mods.MAX_GRAD_ELEMENTS:
      # The dQ kernels keep one float32 accumulator of the operands per program (registers, VMEM).
      return (f"score_mod operand gradients of mod_operands of {request.mod_operand_words} elements (the "
              f"kernels accumulate at most {kernel_mods.MAX_GRAD_ELEMENTS} per program)")
    family, _ = family_for(platform)
    return _family(family).unsupported(request)

  def kernel(self, request: Request, platform: str) -> str:
    family, interpreted = family_for(platform)
    name = f"pallas-{family}" + (" (interpret)" if interpreted else "")
    if decode.unserved(request) is None:
      name += f", {decode.describe(request, family)}"
    return name

  def block_stats(self, request: Request, args: Args, platform: str) -> tuple[int, int] | None:
    """(blocks visited, blocks total) over batch and heads; None when segment ids are traced."""
    family, _ = family_for(platform)
    message = wrong_block_sizes(request, family, _where(platform))
    if message is not None:  # explain() says now what the call would raise
      raise ValueError(message)
    if decode.unserved(request) is None:
      return decode.block_stats(request, args, family)
    block_q, block_kv = _family(family).block_shape(request, platform)
    tiles = None
    if request.mask_mod is not None:  # the tiles the mask_mod leaves empty are not visited
      if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))
             for x in (*args.mod_operands, args.batch_offset, args.head_offset)):
        return None

      def tiles():
        return kernel_mods.request_tile_flags(
            request, args.mod_operands, scalar_table.Offsets(args.q_offset, args.kv_offset),
            scalar_table.Origin(args.batch_offset, args.head_offset), block_q, block_kv)
    return block_info.block_stats(request.batch, request.num_heads, request.q_len, request.kv_len,
                             block_q, block_kv, request.spec, args.q_segment_ids,
                             args.kv_segment_ids, args.q_offset, args.kv_offset, tiles=tiles)

  def grid_steps(self, request: Request, args: Args, platform: str) -> int | None:
    """Grid steps of the forward kernel over batch and heads (TPU family: its grid holds only
    the visible ranges; the GPU family loops over kv blocks inside each program: None)."""
    family, _ = family_for(platform)
    if decode.unserved(request) is None:
      return decode.grid_steps(request, args, family)
    return _family(family).grid_steps(request, args)

  def attend(self, q, k, v, *, request: Request, args: Args):
    b, t, h, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    shapes = (jax.ShapeDtypeStruct((b, t, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, t), "float32"))
    if decode.unserved(request) is None:  # a few queries against a long cache: split-KV (decode.py)
      return _by_family(request, q, k, v, shapes, lambda family, interpret: (
          lambda q, k, v: decode.attention(q, k, v, request=request, args=args, family=family,
                                           interpret=interpret)))
    return _by_family(request, q, k, v, shapes, lambda family, interpret: (
        lambda q, k, v: _family(family).flash_attention(q, k, v, request=request, args=args,
                                                        interpret=interpret)))

  def attention_backward(self, q, k, v, lse, delta, d_out, *, request: Request, args: Args):
    """(dq, dk, dv) from given row statistics: the family's backward kernels, no forward. With a
    score_mod's float operands, (dq, dk, dv, d_operands): a tuple aligned with args.mod_operands, the
    gradient of each float operand (its shape and dtype), None for the others."""
    floats = mods.differentiable(args.mod_operands) if request.has_float_score_operands else ()
    shapes = (q, k, v, *(x for x, f in zip(args.mod_operands, floats, strict=False) if f))

    def run(family, interpret):  # flat results: what every platform branch must return alike
      def grads(q, k, v):
        out = _family(family).attention_backward(q, k, v, lse, delta, d_out, request=request, args=args,
                                                 interpret=interpret)
        return (*out[:3], *(g for g in (out[3] if floats else ()) if g is not None))
      return grads

    flat = _by_family(request, q, k, v, shapes, run)
    if not floats:
      return tuple(flat)
    rest = iter(flat[3:])
    return (*flat[:3], tuple(next(rest) if f else None for f in floats))


def _lowerable(fn, shapes, interpret: bool):
  """`fn`, except that a mod the compiled kernels cannot lower (`kernel_mods.Operand`: a gather) makes
  the branch fail when it is lowered, naming the op, instead of failing every platform's trace."""
  if interpret:
    return fn

  def run(q, k, v):
    try:
      return fn(q, k, v)
    except UnsupportedError as e:
      return tuple(lowering.fails_when_lowered(str(e), shapes, q, k, v))
  return run


def _by_family(request: Request, q, k, v, shapes, run):
  """``run(family, interpret)(q, k, v)`` with the family of the platform the call is lowered for
  (or the one `interpret_as` forces). A branch whose family the request's block_sizes do not fit
  raises ValueError when lowered; the branches of other platforms are never lowered, so an AOT
  compile for CUDA from a CPU host takes GPU sizes."""
  forced = lowering.interpreting()
  if forced is not None:
    message = wrong_block_sizes(request, forced, _where(None))
    if message is not None:
      raise ValueError(message)
    return run(forced, True)(q, k, v)

  runners = {}  # one callable per family: platform_dependent traces a shared one once (cuda, rocm)

  def branch(family: str, interpret: bool, platform: str | None):
    message = wrong_block_sizes(request, family, _where(platform))
    if message is None:
      return runners.setdefault((family, interpret), _lowerable(run(family, interpret), shapes, interpret))
    return lambda q, k, v: tuple(lowering.fails_when_lowered(message, shapes, q, k, v))

  return lowering.platform_dependent(q, k, v, tpu=branch("tpu", False, "tpu"),
                                   cuda=branch("gpu", False, "cuda"), rocm=branch("gpu", False, "rocm"),
                                   default=branch("tpu", True, None))
