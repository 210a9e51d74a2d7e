"""What the TPU (Mosaic) kernels share: the call's description, Pallas plumbing, a grid step's
positions, and the per-tile logits step (scale * q.k + ALiBi -> score_mod -> softcap -> mask) and
online-softmax pieces that the forward (`tpu_fwd.py`), backward (`tpu_bwd.py`) and decode
(`tpu_decode.py`) kernels all run.

Inner loops: the q tile is multiplied once per q block, when its first step copies it to a VMEM
scratch, by scale * log2 e (with a softcap by scale / softcap, the tanh's natural units; the cap
then multiplies by softcap * log2 e), so the logits leave the dot in base 2 and no [bq, bkv]
tile is scaled; ALiBi's slope takes the same unit. The online softmax and the backward's P use
exp2; lse stays natural at the interface (the backward converts it once per row). bfloat16 q is
rounded to bfloat16 again after scaling, as in JAX's splash kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers import lowering
from flash_layers.contract import dropout, mask_rules, mods
from flash_layers.contract.alibi import alibi
from flash_layers.impls.base import Request
from flash_layers.impls.flash_pallas import decode, kernel_mods, scalar_table
from flash_layers.impls.tiling import LANES

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuCall(kernel_mods.ModOperands):
  """One call as the kernels see it: the request and what is derived from it while tracing
  (hashable: a custom_vjp static argument)."""

  KERNEL = "a TPU (Mosaic) kernel"  # in the mod operands' errors (kernel_mods.ModOperands)

  request: Request
  interpret: bool
  fwd: tuple[int, int]  # forward (block_q, block_kv), after `tpu_config.forward_tiles`
  bwd: tuple[int, int]  # backward (block_q, block_kv)
  static_offsets: tuple[int, int] | None  # for the cost estimate; None when traced
  # Token-major operands: q, k, v, out, dO and the gradients stay [b, len, heads * dim] (the
  # caller's layout, reshaped for free) and a tile is the (block, dim) window at column
  # head * dim; legal for Mosaic when dim is a multiple of 128 lanes. Otherwise head-major
  # copies [b, heads, len, dim] are made (a transpose each way).
  token_major: bool
  # Query heads per forward / dQ q tile: a GQA group's heads (token-major only) share one K/V
  # stream.
  fwd_heads: int = 1
  dq_heads: int = 1
  # mask_mod / score_mod operands (kernel_mods.flatten), scalar-prefetched after the plan tables.
  operands: tuple[kernel_mods.Meta, ...] = ()

  @property
  def has_segments(self) -> bool:
    return self.request.has_segment_ids

  @property
  def needs_positions(self) -> bool:  # every visited tile, full or not, hashes, biases or mods positions
    return self.request.has_alibi or self.request.has_dropout or self.request.score_mod is not None


def dims(cfg: TpuCall, q, k):
  """(batch, heads, q_pad, kv_pad, head_dim, head_dim_v) of kernel-layout operands."""
  length_axis = 1 if cfg.token_major else 2
  return (q.shape[0], cfg.request.num_heads, q.shape[length_axis], k.shape[length_axis], cfg.request.head_dim,
          cfg.request.head_dim_v)


# ----------------------------------------------------------------------------
# Pallas plumbing shared by the kernels
# ----------------------------------------------------------------------------

def interpret_arg(interpret: bool):
  """What to pass as pallas_call(interpret=...).

  Under `fl.interpret_as("tpu")`: the TPU-semantics interpreter (`pltpu.InterpretParams`:
  uninitialized memory reads as NaN, out-of-bounds reads raise), with the settings given to
  `interpret_as(..., params=)` when there are some (the strict test tier); `params="plain"` asks for
  the plain interpreter (`True`: numerics only, no simulated memory, no callbacks). Otherwise an
  interpreted kernel is the CPU branch of the dispatcher's `platform_dependent`, next to the
  compiled TPU branch; InterpretParams' io callbacks carry an ordered effect that the TPU branch
  lacks, and JAX then fails to lower the TPU branch alone. The plain interpreter (`True`) has no effects.

  Inside a `shard_map` over several devices the plain interpreter is used too: InterpretParams
  holds every device at a barrier when a kernel starts, while its callbacks copy their arguments
  through CPU device 0, whose stream may be the one held at the barrier -- a deadlock on a
  multi-device CPU host (seen with GQA under an 8-device data mesh).
  """
  if not interpret:
    return False
  params = getattr(pltpu, "InterpretParams", None)  # jax 0.10.2 and 0.11
  if params is None or lowering.interpreting() != "tpu" or lowering.manual_device_count() > 1:
    return True
  chosen = lowering.interpret_params()  # None, InterpretParams or PLAIN (interpret_as checked it)
  if chosen == lowering.PLAIN:
    return True
  return chosen or params()


def compiler_params(semantics: tuple[str, ...], vmem_bytes: int | None = None):
  params = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
  return params(dimension_semantics=semantics, vmem_limit_bytes=vmem_bytes)


class Step(NamedTuple):
  batch: jax.Array    # local batch row and query head of this grid point
  head: jax.Array
  q_block: jax.Array
  kv_block: jax.Array
  full: jax.Array     # every pair of the tile is visible: no element mask (may be a Python bool)
  visited: jax.Array  # a step of the row's range whose tile holds a visible pair (else skipped)
  first: jax.Array    # first step of an accumulation (initialize the scratch)
  last: jax.Array     # last step (write the output block)


# ----------------------------------------------------------------------------
# One grid step's tile: positions, mods, element mask, ALiBi, dropout
# ----------------------------------------------------------------------------

def column(row):
  """A [1, n] row as an [n, LANES] lane-replicated column, via a supported 2-D transpose."""
  return jnp.transpose(jnp.broadcast_to(row, (LANES, row.shape[1])))


class Tile(NamedTuple):
  """Positions of one tile (q along ``q_axis``: 0, or 1 when transposed), local and global."""

  q_local: jax.Array
  kv_local: jax.Array
  q_pos: jax.Array
  kv_pos: jax.Array


def tile_positions(offsets_ref, step: Step, shape, q_axis) -> Tile:
  block_q, block_kv = shape[q_axis], shape[1 - q_axis]
  q_local = step.q_block * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
  kv_local = step.kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  offsets = scalar_table.offsets(offsets_ref)
  return Tile(q_local, kv_local, offsets.q + q_local, offsets.kv + kv_local)


class Mod(NamedTuple):
  """What a mod reads in one tile: its global indices (the program's batch row and query head, the tile's
  positions) and the operands' views."""

  idx: mods.Indices
  operands: tuple


def mod_at(cfg: TpuCall, offsets_ref, operands: tuple, batch, head, tile: Tile | None) -> Mod | None:
  """The `Mod` of local (batch row, query head)'s tile: the row and head made global by the SMEM table's
  origin (a shard's first row and head, traced on a mesh; 0 unsharded), as the positions are by its
  offsets."""
  if not cfg.request.has_mods or tile is None:
    return None
  origin = scalar_table.origin(offsets_ref)
  return Mod(mods.Indices(origin.batch + batch, origin.head + head, tile.q_pos, tile.kv_pos), operands)


def tile_visible(cfg: TpuCall | decode.DecodeCall, tile: Tile, q_seg, kv_seg, mod: Mod | None = None):
  """The element mask of one tile: the built-in rules, AND the mask_mod's verdict."""
  ok = mask_rules.visible(tile.q_pos, tile.kv_pos, cfg.request.spec, q_seg, kv_seg)
  if cfg.request.mask_mod is not None:
    ok = ok & mods.mask(cfg.request.mask_mod, mod.idx, mod.operands)
  # Padded tail positions see nothing and are seen by nothing (q_len % block_q etc. may be != 0).
  return ok & (tile.q_local < cfg.request.q_len) & (tile.kv_local < cfg.request.kv_len)


class TileMask(NamedTuple):
  """What a forward or backward kernel needs of one tile before its logits: the positions (None when
  nothing reads them), the mods' view of them, and the element mask (None for a fully visible tile)."""

  tile: Tile | None
  mod: Mod | None
  visible: jax.Array | None


def tile_mask(cfg: TpuCall, offsets_ref, operands: tuple, step: Step, shape, q_axis, masked: bool,
              segments: Callable[[], tuple]) -> TileMask:
  """`TileMask` of the step's tile of ``shape`` (q along ``q_axis``), one for every head the step
  covers (mods read one head per tile). ``segments()`` gives the (q, kv) segment-id operands of
  `tile_visible`, read only for a masked tile."""
  tile = tile_positions(offsets_ref, step, shape, q_axis) if masked or cfg.needs_positions else None
  mod = mod_at(cfg, offsets_ref, operands, step.batch, step.head, tile)
  visible = tile_visible(cfg, tile, *segments(), mod) if masked else None
  return TileMask(tile, mod, visible)


def alibi_term(cfg: TpuCall, offsets_ref, head, tile: Tile | None):
  """The ALiBi term of query head `head`'s tile (slope bits read from SMEM) in the units of the
  pre-scaled logits (`unit`: the scalar slope takes the factor), or None."""
  if not cfg.request.has_alibi:
    return None
  slope = scalar_table.Table.of(cfg.request).slope(offsets_ref, head)
  return alibi(slope * unit(cfg), tile.q_pos, tile.kv_pos)


def dropout_keep(cfg: TpuCall, offsets_ref, batch, head, tile: Tile | None):
  """The dropout multiplier of a tile (0 or 1 / (1 - rate)), or None: `dropout.keep` on global
  positions with this (batch row, head)'s stream from SMEM."""
  if cfg.request.dropout_rate == 0:
    return None
  stream = scalar_table.Table.of(cfg.request).stream(offsets_ref, batch, head)
  kept = dropout.keep(stream, tile.q_pos, tile.kv_pos, cfg.request.dropout_rate)
  return jnp.where(kept, jnp.float32(dropout.keep_scale(cfg.request.dropout_rate)), jnp.float32(0.0))


def when_visited(step: Step, update):
  """Skipping rule: compute only visible blocks; mask element-wise only the partial ones."""
  if isinstance(step.full, bool):  # decided while tracing (e.g. causal only: never full and...)
    pl.when(step.visited)(lambda: update(masked=not step.full))
    return
  pl.when(step.visited & step.full)(lambda: update(masked=False))
  pl.when(step.visited & ~step.full)(lambda: update(masked=True))


# ----------------------------------------------------------------------------
# The logits step and the online softmax
# ----------------------------------------------------------------------------

NT = ((1,), (1,))  # dot_general contractions: a @ b^T and a @ b
NN = ((1,), (0,))


def dot(cfg: TpuCall | decode.DecodeCall, a, b, contract):
  """a @ b (or a @ b^T) in float32 at the call's precision.

  Pallas lowers DEFAULT to a Mosaic matmul without a contraction precision (Mosaic's default) and
  HIGHEST to `contract_precision<fp32>`, and rejects HIGH, so HIGH is written out as what XLA runs for it
  on TPU (bf16_3x): a = a_hi + a_lo in bfloat16, a @ b ~ lo.hi + hi.lo + hi.hi. bfloat16
  operands multiply exactly in one pass and Mosaic refuses a contraction precision on them
  ("Bad lhs type"): they always get DEFAULT.
  """
  one = functools.partial(jax.lax.dot_general, dimension_numbers=(contract, ((), ())),
                          preferred_element_type=jnp.float32)
  if a.dtype != jnp.float32:
    return one(a, b, precision=jax.lax.Precision.DEFAULT)
  if cfg.request.precision != jax.lax.Precision.HIGH:
    return one(a, b, precision=cfg.request.precision)
  a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  a_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16)
  b_lo = (b - b_hi.astype(jnp.float32)).astype(jnp.bfloat16)
  return one(a_lo, b_hi) + one(a_hi, b_lo) + one(a_hi, b_hi)


def unit(cfg: TpuCall | decode.DecodeCall) -> float:
  """What the logits (scale * q.k + alibi) are multiplied by before `tile_logits` returns or caps
  them: base 2 (log2 e; the softmax runs on exp2) without a softcap; with one, whose tanh needs
  natural units, 1 / softcap (`tile_logits` then multiplies the tanh by softcap * log2 e: one multiply
  where there were three). A score_mod reads the logits themselves: 1."""
  if cfg.request.score_mod is not None:
    return 1.0
  return LOG2E if cfg.request.softcap is None else 1.0 / cfg.request.softcap


def fold(cfg: TpuCall | decode.DecodeCall) -> float:
  """The factor folded into the q tile once per q block, so that the dot itself yields the
  logits in `unit`s: scale * log2 e, or scale / softcap."""
  return cfg.request.scale * unit(cfg)


def folded(cfg: TpuCall, x):
  """x * `fold(cfg)`, multiplied in float32 and stored in x's dtype.

  For bfloat16 the scaled tile is rounded to bfloat16 again (as JAX's splash kernels do with
  their pre-scaled q): the logits then carry one more bfloat16 rounding of q (relative 2^-9),
  the size of the rounding the inputs already have. A float32 tile would make every logits dot
  a multi-pass float32 matmul. For float32 the product changes q by at most an ulp.
  """
  return (x.astype(jnp.float32) * fold(cfg)).astype(x.dtype)


def tile_logits(cfg: TpuCall | decode.DecodeCall, a, b, *, alibi=None, mod: Mod | None = None,
                visible=None, grad: bool = False, prescaled: bool = True, operand_grads: bool = False):
  """The logits step of every TPU kernel: (s2, chain), the base-2 logits
  log2(e) * cap(score_mod(scale * q.k + alibi)) of a tile in float32, -inf where ``visible`` (a
  `tile_visible` mask, or None: every pair) is False; and, for the backward (``grad``), the chain
  rule from the capped logits' gradient to the raw logits' (the softcap's 1 - tanh^2, then
  score_mod's derivative by `jax.vjp` of the elementwise mod), or None (identity).

  With ``operand_grads`` the chain returns (d raw logits, the reads' cotangents:
  `kernel_mods.score_vjp`) for `kernel_mods.accumulate`.

  ``a @ b^T`` is q.k; `prescaled`: a `folded` operand already carries `fold` (forward, backward),
  else the [rows, bk] tile takes it after the dot (the decode kernel, whose few q rows are used as
  loaded). `alibi` is an `alibi_term`, in the same units.
  """
  s = dot(cfg, a, b, NT)
  if not prescaled:
    s = s * fold(cfg)
  if alibi is not None:
    s = s + alibi
  s2, chain = _capped(cfg.request, s, mod, grad, operand_grads)
  if visible is not None:
    s2 = jnp.where(visible, s2, -jnp.inf)
  return s2, chain


def _capped(r: Request, s, mod: Mod | None, grad: bool, operand_grads: bool = False):
  """`tile_logits`' score_mod and softcap on s (scale * q.k + alibi, in `unit`s): (s2, chain)."""
  if r.score_mod is None:
    if r.softcap is None:
      return s, None
    capped = jnp.tanh(s)
    return (r.softcap * LOG2E) * capped, lambda ds: ds * (1.0 - capped * capped)
  # `unit` is 1 with a score_mod: s holds the natural logits it rewrites.
  y, back = kernel_mods.score_mod_vjp(r.score_mod, s, mod.idx, mod.operands, grad, operand_grads)
  if r.softcap is None:
    return y * LOG2E, back
  capped = jnp.tanh(y * (1.0 / r.softcap))
  chain = (lambda ds: back(ds * (1.0 - capped * capped))) if grad else None
  return (r.softcap * LOG2E) * capped, chain



def softmax_update(m_prev, s):
  """One online-softmax step (forward and decode kernels): (m_next, p, rescale) for the base-2
  logits s [rows, bk] of a tile against the running row max m_prev [rows, 128] (lane-replicated).

  With the new row max m', what was summed under the old max m is rescaled by exp2(m - m') and
  this tile adds p = exp2(s - m'). A row with nothing visible yet keeps m' = -inf; shifting it by 0
  instead makes its p and its rescale factor exactly 0, not NaN.
  """
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  p = jnp.exp2(s - shift[:, :1])
  rescale = jnp.exp2(m_prev - shift)
  return m_next, p, rescale


def softmax_result(m, total):
  """(1 / total, lse) [rows, 128] of an online softmax's running max m (base 2) and sum `total`: the
  output is acc * (1 / total); a row that saw no key gets 0 there (output 0) and lse -inf. m is in
  base 2: lse = ln 2 * m + ln(sum exp2(s - m)), natural at the interface."""
  seen = total > 0
  inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
  lse = jnp.where(seen, m * math.log(2.0) + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  return inverse, lse


def cost_estimate(cfg: TpuCall, b, h, per_pair_flops, bytes_accessed):
  """A CostEstimate from the analytic count of visible pairs (ignoring segment ids, not known
  while tracing: an upper bound for packed sequences)."""
  q_off, kv_off = cfg.static_offsets or (0, 0)
  request = cfg.request
  pairs = mask_rules.count_visible(request.q_len, request.kv_len, request.spec, q_off, kv_off) * b * h
  return pl.CostEstimate(flops=int(pairs * per_pair_flops),
                         transcendentals=int(pairs * (1 + (cfg.request.softcap is not None))),
                         bytes_accessed=int(bytes_accessed))


def nbytes(*arrays):
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
