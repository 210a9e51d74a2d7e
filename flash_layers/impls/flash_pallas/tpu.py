"""flash_pallas on TPU: the entry points of our own Mosaic flash-attention kernels (forward and
backward), which live beside it (Modules, below). The tile sizes (per generation, with their
reasons), VMEM budgets, the GQA tile rule and the autotuning candidates are data and heuristics in
`tpu_config.py`.

Tiles. ``len`` is padded to a multiple of the forward and backward block sizes; padded keys and
queries are masked by position. Tiles are ``(block, head_dim)`` with blocks multiples of 128,
so they respect the TPU's (8 sublanes, 128 lanes) tiling. A tile spans the whole head_dim, so
any head_dim is legal; one that is not a multiple of 128 (BERT's 32 and 64) is padded to 128
lanes inside VMEM and the vregs by Mosaic, not in HBM: no zero columns are stored, copied or
re-read with every K/V block. (Compiled for v4, v5e, v5p and v6e with head_dim 17, 32, 64, 80,
128, 200 and 256.)

Layout: with head_dim (and head_dim_v) a multiple of 128, q, k, v, the output, dO and the
gradients stay token-major ``[b, len, heads * dim]`` (the caller's layout reshaped) and a tile is
the ``(block, dim)`` window at column ``head * dim``; otherwise head-major copies
``[b, heads, len, dim]`` are made, a layout Mosaic can tile for any dim.

Modules: this one is the family's interface (`KernelFamily` in flash_pallas/__init__.py), the
layout in and out of the kernels and the custom VJP; `tpu_common.py` what every kernel shares (the
per-tile logits step and the online softmax), `tpu_grid.py` the grids and block plans,
`tpu_fwd.py` the forward kernel, `tpu_bwd.py` the backward kernels, `tpu_decode.py` the split-KV
decode kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas import kernel_mods, scalar_table, tpu_config
from flash_layers.impls.flash_pallas.tpu_bwd import backward_from_stats, row_delta
from flash_layers.impls.flash_pallas.tpu_common import TpuCall
from flash_layers.impls.flash_pallas.tpu_fwd import forward
from flash_layers.impls.flash_pallas.tpu_grid import block_plan
from flash_layers.impls.tiling import LANES, round_up

# ----------------------------------------------------------------------------
# The family interface (see flash_pallas/__init__.py)
# ----------------------------------------------------------------------------

def unsupported(request: Request) -> str | None:
  if request.has_dense_mask:  # blocks are skipped by the mask spec; an arbitrary array has none
    return "dense mask"
  if request.has_bias:
    return "dense bias"
  words = max(tpu_config.plan_words(request, tiles) for tiles in tpu_config.blocks(request))
  if request.mask_mod is not None:  # the plan's full-tile runs: two more words per outer block
    words *= 2
  if request.has_mods and words + request.mod_operand_words > tpu_config.MAX_PLAN_WORDS:
    return (f"mod_operands of {request.mod_operand_words} elements, with a block plan of {words} words "
            f"(SMEM holds {tpu_config.MAX_PLAN_WORDS} int32 words for both)")
  if words > tpu_config.MAX_PLAN_WORDS:
    return (f"a block plan of {words} int32 words (SMEM holds {tpu_config.MAX_PLAN_WORDS}; use "
            "larger block_sizes, fewer rows or ring attention)")
  return None


def block_shape(request: Request, platform: str) -> tuple[int, int]:
  return tpu_config.blocks(request)[0]


def _config(request: Request, args: Args, interpret: bool) -> TpuCall:
  fwd, bwd = tpu_config.blocks(request)
  offsets_static = None  # python ints are known while tracing; traced offsets only at run time
  if all(isinstance(o, (int, np.integer)) for o in (args.q_offset, args.kv_offset)):
    offsets_static = (int(args.q_offset), int(args.kv_offset))
  token_major = request.head_dim % LANES == 0 and request.head_dim_v % LANES == 0
  fwd, fwd_heads = tpu_config.forward_tiles(request, fwd, token_major)
  dq_heads = tpu_config.dq_tile_heads(request, bwd, token_major)
  if request.has_mods:  # a mod may read the head: one query head per tile, its own element mask
    fwd_heads = dq_heads = 1
  return TpuCall(request=request, interpret=interpret, fwd=fwd, bwd=bwd,
                 static_offsets=offsets_static, token_major=token_major, fwd_heads=fwd_heads,
                  dq_heads=dq_heads, operands=kernel_mods.flatten(args.mod_operands)[1])


def grid_steps(request: Request, args: Args) -> int | None:
  """Grid steps the forward kernel runs, over batch and heads (None when segment ids or
  offsets are traced: the grid is then sized at run time)."""
  # Known only at run time (traced) or only by shape (explain on ShapeDtypeStructs): no count.
  if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for x in (
      args.q_segment_ids, args.kv_segment_ids, args.q_offset, args.kv_offset, args.batch_offset,
      args.head_offset, *args.mod_operands)):
    return None
  cfg = _config(request, args, interpret=True)
  offsets = scalar_table.offsets_table(args.q_offset, args.kv_offset, args.batch_offset, args.head_offset)
  row_steps, _, _ = block_plan(cfg, cfg.fwd, args.q_segment_ids, args.kv_segment_ids, offsets,
                               kv_major=False, operands=args.mod_operands)
  row_steps = np.asarray(row_steps)
  programs = request.batch * request.num_heads // cfg.fwd_heads  # one per (row, q tile's heads)
  return programs * row_steps.shape[-1] * int(row_steps.max())


def _to_kernel(cfg: TpuCall, x, length):
  """[b, len, h, d] -> the kernels' layout, padded to `length` tokens: [b, len_pad, h * d]
  (token-major, a free reshape when no padding is needed) or [b, h, len_pad, d]."""
  b, t, h, d = x.shape
  if cfg.token_major:
    return jnp.pad(x.reshape(b, t, h * d), ((0, 0), (0, length - t), (0, 0)))
  return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, length - t), (0, 0)))


def _from_kernel(cfg: TpuCall, x, length: int, heads: int):
  """The kernels' layout -> [b, length, heads, d] (the padding sliced off)."""
  if cfg.token_major:
    return x[:, :length].reshape(x.shape[0], length, heads, -1)
  return jnp.swapaxes(x[:, :, :length], 1, 2)


def _prepare(request: Request, args: Args, interpret: bool, batch: int):
  """(config, padded q length, padded kv length, SMEM offsets table) of one call."""
  cfg = _config(request, args, interpret)
  q_pad = round_up(request.q_len, math.lcm(cfg.fwd[0], cfg.bwd[0]))
  kv_pad = round_up(request.kv_len, math.lcm(cfg.fwd[1], cfg.bwd[1]))
  # Offsets (positions, and the batch row and head a shard starts at), ALiBi slopes and dropout
  # streams (scalar_table), in SMEM.
  return cfg, q_pad, kv_pad, scalar_table.build(request, args, batch)


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv], lse [b, h, q] float32) by the Mosaic kernels."""
  if q.dtype not in (jnp.float32, jnp.bfloat16):
    # float16 (or float64): the kernels run in float32, the output returns to the input dtype.
    out, lse = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               request=request, args=args, interpret=interpret)
    return out.astype(q.dtype), lse
  cfg, q_pad, kv_pad, offsets = _prepare(request, args, interpret, q.shape[0])
  out, lse = _flash(cfg, _to_kernel(cfg, q, q_pad), _to_kernel(cfg, k, kv_pad),
                    _to_kernel(cfg, v, kv_pad), args.q_segment_ids, args.kv_segment_ids, offsets,
                    kernel_mods.flatten(args.mod_operands)[0], _prebuilt(request, args))
  return _from_kernel(cfg, out, request.q_len, request.num_heads), lse[:, :, 0, :request.q_len]


def attention_backward(q, k, v, lse, delta, d_out, *, request: Request, args: Args,
                       interpret: bool):
  """(dq, dk, dv) from given row statistics: the two backward kernels, no forward; with a score_mod's
  float operands (dq, dk, dv, their gradients: a tuple aligned with mod_operands, None for the others).

  ``lse [b, h, q]`` is the normaliser of the whole softmax the rows belong to and
  ``delta [b, h, q]`` = rowsum(dO * O) - dlse of its whole output (ring attention passes the
  global ones, so each (q shard, kv shard) pair's gradients are its exact share).
  """
  if q.dtype not in (jnp.float32, jnp.bfloat16):
    grads = attention_backward(*(x.astype(jnp.float32) for x in (q, k, v)), lse, delta, d_out,
                               request=request, args=args, interpret=interpret)
    return (*(g.astype(x.dtype) for g, x in zip(grads[:3], (q, k, v), strict=True)), *grads[3:])
  cfg, q_pad, kv_pad, offsets = _prepare(request, args, interpret, q.shape[0])
  dq, dk, dv, d_flat = backward_from_stats(
      cfg, _to_kernel(cfg, q, q_pad), _to_kernel(cfg, k, kv_pad), _to_kernel(cfg, v, kv_pad),
      args.q_segment_ids, args.kv_segment_ids, offsets,
      (kernel_mods.flatten(args.mod_operands)[0], _prebuilt(request, args)),
      _row_stat(lse, q_pad), _row_stat(delta, q_pad), _to_kernel(cfg, d_out.astype(q.dtype), q_pad))
  grads = (_from_kernel(cfg, dq, request.q_len, request.num_heads),
           _from_kernel(cfg, dk, request.kv_len, request.num_kv_heads),
           _from_kernel(cfg, dv, request.kv_len, request.num_kv_heads))
  if not request.has_float_score_operands:
    return grads
  return (*grads, kernel_mods.operand_grads(d_flat, args.mod_operands))


def _prebuilt(request: Request, args: Args):
  """A block_mask's (any, all) tile flags when the call was given one (`tpu_config.blocks` then takes its
  tiles), else None: `block_plan` builds them."""
  if request.block_mask_tiles is None or args.mod_tiles is None:
    return None
  return tuple(args.mod_tiles)


def _row_stat(x, length):  # [b, h, q] -> [b, h, 1, q_pad] float32
  x = x.astype(jnp.float32)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])))[:, :, None, :]


# ----------------------------------------------------------------------------
# The custom VJP (on padded arrays in the kernels' layout: token-major [b, len_pad, heads * dim]
# when both head dims are multiples of 128, else head-major [b, heads, len_pad, dim]; `_to_kernel`)
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, prebuilt):
  return forward(cfg, q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt))


def _flash_fwd(cfg: TpuCall, q, k, v, q_seg, kv_seg, offsets, ops, prebuilt):
  out, lse = forward(cfg, q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt))
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, (ops, prebuilt), out, lse)


def _flash_bwd(cfg: TpuCall, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, ops, out, lse = residuals
  d_out, d_lse = cotangents
  # Rows past q_len get a zero cotangent (the wrapper slices them off), but they may lie in a
  # backward block beyond the forward grid (block sizes differ), where out and lse were never
  # written: give them lse = +inf and D = 0, so p = 0 there, never NaN. Rows that see no key get
  # lse = +inf too (p = exp(s - inf) = 0, never exp(+inf)).
  delta = row_delta(cfg, out, d_out) - d_lse
  dq, dk, dv, d_flat = backward_from_stats(cfg, q, k, v, q_seg, kv_seg, offsets, ops, lse, delta, d_out,
                                           reuse_do=True)
  # The operands: the float ones (flattened to float32) take the dQ kernel's summed partials, a
  # mask_mod's integer ones none; the tile flags are booleans.
  _, prebuilt = ops
  return (dq, dk, dv, None, None, None, d_flat,
          None if prebuilt is None else tuple(None for _ in prebuilt))


_flash.defvjp(_flash_fwd, _flash_bwd)
