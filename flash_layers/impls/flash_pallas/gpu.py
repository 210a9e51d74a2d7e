"""flash_pallas on the GPU: our own Pallas flash-attention kernels, lowered through Triton.

The algorithm (FlashAttention-2, Dao 2023, arXiv 2307.08691), shaped for a GPU:

* Forward: one program per (q block, batch * head). The program keeps its q tile
  in registers and loops (`lax.fori_loop`, an `scf.for` in Triton) over the kv
  blocks that the mask makes visible to it: blocks no query of the tile can see
  are never loaded. Softmax is online, in float32 and in base 2 (`exp2` is one
  instruction): a running row max `m`, a running denominator and an unnormalised
  accumulator, rescaled whenever the max grows. It writes the output and the row
  logsumexp (natural log, `-inf` for a row that sees no key; its output is zeros).
* Backward (custom VJP, from the saved logsumexp, nothing of size q x kv kept):
  P is recomputed tile by tile as exp(s - lse). With D_i = rowsum(dO * O)_i -
  dlse_i (the cotangent of lse enters here, so ring attention can differentiate
  through it), dS = P * (dP - D) where dP = dO V^T. Two kernels, neither needs
  atomics:
    - dK/dV: one program per (kv block, batch * kv head). It loops over the
      query heads of its GQA group and, per head, over the q blocks that see the
      kv block, accumulating dV += P^T dO and dK += dS^T Q in float32. A group's
      heads sum inside the program, so K/V are never repeated and no reduction
      over heads follows.
    - dQ: one program per (q block, batch * head), looping over visible kv
      blocks like the forward: dQ += dS K.
* Which blocks a program visits. Causal and windows make the keys a query sees
  one interval of positions, so without segment ids each program computes its
  range from the global offsets (`q_offset`/`kv_offset`, possibly traced, in a
  tiny int32 array) and the tile sizes (`block_info.visible_block_range`): the interior blocks,
  where every pair is visible and every position real, run in a loop with no
  element mask and no `cond`; the edge blocks (the diagonal, window edges, the
  ragged last block) run in a second loop with the mask. With segment ids
  (packed documents) or global tokens the visible set is not one interval: the
  kernels walk the lists of `block_info.block_map` and its per-tile `full` flag skips
  the mask behind an `scf.if`. The element mask is `mask_rules.visible` itself.
* Any length and head_dim 16..256 without copies: q/k/v/dO stay as given in HBM.
  BlockSpecs are block multiples long and powers of two wide (what `tl.dot`
  wants); tiles are read with masked loads (rows past the length and columns
  past head_dim read as 0, lse as +inf) and written with masked stores. Keys past
  kv_len are masked to -inf in edge tiles; query rows past q_len compute
  harmless values that are never stored (in dK/dV their lse is +inf: P = 0).
* GQA: program (.., b * h) reads kv head h // (num_heads // num_kv_heads).
* Dropout and ALiBi: each tile hashes its keep mask (`dropout.keep`, the function every
  impl uses) and its ALiBi term from global positions, in the forward and again in
  both backward kernels. Slopes and per-(batch, head) dropout streams come in the
  small int32 scalar table (`scalar_table`).

Tile sizes, warps and pipeline stages come from one table (`gpu_config.TILE_TABLE`)
by GPU generation and head_dim, each row citing its yardstick and sized to the
generation's shared memory (`gpu_config.shared_memory_bytes`), and can be overridden per call
with `fl.attention(..., block_sizes=fl.GpuBlockSizes(...))`.

Modules: this one is the family's interface (`KernelFamily` in flash_pallas/__init__.py) and the
custom VJP; `gpu_common.py` what every kernel shares (masked loads, the block walk, the per-tile
logits step), `gpu_fwd.py` the forward kernel, `gpu_bwd.py` the backward kernels, `gpu_decode.py`
the split-KV decode kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas import gpu_config, kernel_mods, scalar_table
from flash_layers.impls.flash_pallas.gpu_bwd import backward_from_stats
from flash_layers.impls.flash_pallas.gpu_common import GpuCall
from flash_layers.impls.flash_pallas.gpu_fwd import forward_call

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256
# CUDA limits grid dimensions y and z to 65535; batch * heads runs on y.
MAX_GRID_Y = 65535


# ----------------------------------------------------------------------------
# The family interface (see flash_pallas/__init__.py)
# ----------------------------------------------------------------------------

def unsupported(request: Request) -> str | None:
  """The first feature of `request` these kernels cannot serve, or None."""
  if request.has_dense_mask:
    return "dense mask"
  if request.has_bias:
    return "dense bias"
  if request.dtype not in SUPPORTED_DTYPES:
    return f"dtype {request.dtype} (GPU kernels take {', '.join(SUPPORTED_DTYPES)})"
  if max(request.head_dim, request.head_dim_v) > MAX_HEAD_DIM:
    return f"head_dim > {MAX_HEAD_DIM}"
  if request.batch * request.num_heads > MAX_GRID_Y:
    return f"batch * num_heads > {MAX_GRID_Y}"
  return None


def block_shape(request: Request, platform: str) -> tuple[int, int]:
  """(block_q, block_kv) of the forward kernel, for explain()'s block counts."""
  del platform  # One table; the generation comes from the local GPU (Hopper without one).
  cfg = gpu_config.config(request)
  return cfg.block_q, cfg.block_kv


def grid_steps(request: Request, args: Args) -> int | None:
  """None: each program loops over its kv blocks inside the kernel, so the grid (q blocks x
  batch * heads) says nothing about the tiles visited; `block_shape` gives explain() the counts."""
  del request, args
  return None


# ----------------------------------------------------------------------------
# The custom VJP
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: GpuCall, q, k, v, q_seg, kv_seg, offsets, ops):
  return _flash_forward(st, q, k, v, q_seg, kv_seg, offsets, ops)[0]


def _flash_forward(st, q, k, v, q_seg, kv_seg, offsets, ops):
  out, lse = forward_call(st, q, k, v, q_seg, kv_seg, offsets, ops)
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, ops, out, lse)


def _flash_backward(st, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, ops, out, lse = residuals
  d_out, d_lse = cotangents
  # D_i = rowsum(dO * O)_i - dlse_i: lse's own cotangent enters dS = P * (dP - D) here.
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32),
                     precision=st.request.precision)
  delta = delta - d_lse
  # The operands: the float ones (flattened to float32) take the dQ kernel's summed partials, a
  # mask_mod's integer ones none; the tile flags are booleans.
  _, prebuilt = ops
  dq, dk, dv, d_flat = backward_from_stats(st, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out)
  return dq, dk, dv, None, None, None, (d_flat, None if prebuilt is None else (None, None))


_flash.defvjp(_flash_forward, _flash_backward)


def _prepare(request: Request, args: Args, interpret: bool, batch: int):
  ops, metas = kernel_mods.flatten(args.mod_operands)
  st = GpuCall(request=request, cfg=gpu_config.config(request), interpret=bool(interpret), operands=metas)
  prebuilt = None  # a block_mask's tile flags, used where the kernel's tiles are the block mask's
  if request.block_mask_tiles is not None and args.mod_tiles is not None:
    prebuilt = tuple(args.mod_tiles)
  # offsets, slopes, streams (scalar_table); the mods' inputs
  return st, scalar_table.build(request, args, batch), (ops, prebuilt)


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv] in q.dtype, lse [b, h, q] float32); differentiable in q, k, v and through lse."""
  st, offsets, ops = _prepare(request, args, interpret, q.shape[0])
  return _flash(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets, ops)


def attention_backward(q, k, v, lse, delta, d_out, *, request: Request, args: Args,
                       interpret: bool):
  """(dq, dk, dv) from given row statistics lse, delta [b, h, q]: the backward kernels only
  (see the TPU family's `attention_backward`); with a score_mod's float operands, (dq, dk, dv, their
  gradients aligned with mod_operands, None for the others)."""
  st, offsets, ops = _prepare(request, args, interpret, q.shape[0])
  dq, dk, dv, d_flat = backward_from_stats(st, q, k, v, args.q_segment_ids, args.kv_segment_ids, offsets,
                                           ops, lse.astype(jnp.float32), delta.astype(jnp.float32), d_out)
  if not request.has_float_score_operands:
    return dq, dk, dv
  return dq, dk, dv, kernel_mods.operand_grads(d_flat, args.mod_operands)
