"""flash_pallas on TPU: our own Mosaic flash-attention kernels, forward and backward.

Layout. The wrapper moves heads in front of the sequence (``[batch, heads, len, dim]``) and pads
``len`` to a multiple of the block sizes; padded keys and queries are masked by position. Tiles
are ``(block, head_dim)`` with blocks multiples of 128, so they respect the TPU's (8 sublanes,
128 lanes) tiling. A tile spans the whole head_dim, so any head_dim is legal; one that is not a
multiple of 128 (BERT's 32 and 64) is padded to 128 lanes inside VMEM and the vregs by Mosaic,
not in HBM: no zero columns are stored, copied or re-read with every K/V block. (Compiled for
v4, v5e, v5p and v6e with head_dim 17, 32, 64, 80, 128, 200 and 256.)

Grid. The forward kernel runs over ``(batch, heads, q blocks, kv steps)``. The first three axes
are independent ("parallel": Mosaic may split them across TensorCores); the last one carries the
online softmax of one q block across its kv blocks ("arbitrary": in order, on one core), so the
running statistics live in VMEM scratch between steps.

Block skipping. `masks.block_map` (the one shared map, computed here in plain JAX) lists, for
each q block, the kv blocks holding at least one visible pair, in order, followed by the last
visible one repeated. Kernel step ``s`` of q block ``i`` handles kv block ``plan[i, s]``. It is
scalar-prefetched to SMEM, so the BlockSpec index_map reads it before the step's DMA is issued:
for a skipped step (``s >= count[i]``) the index repeats the previous one, Pallas sees an
unchanged block index and issues no DMA, and ``pl.when(s < count[i])`` skips the compute.
Invisible blocks therefore cost one grid step of bookkeeping and nothing else. Blocks the map
marks *full* (every pair visible) skip the element-wise mask too.

Backward (custom VJP, from the saved logsumexp L):
  P = exp(S - L),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = dS K,  dK = dS^T Q
with ``D_i = rowsum(dO * O)_i - dlse_i`` (the second term carries a cotangent on lse, which ring
attention produces). One kernel accumulates dK and dV for a kv block over the q blocks that see it
(and over the query heads sharing the kv head: GQA never repeats K/V in HBM); a second kernel
accumulates dQ for a q block over its kv blocks. Both skip blocks like the forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flash_layers import masks
from flash_layers import platform as platform_lib
from flash_layers.impls.base import Args, Request
from flash_layers.impls.flash_pallas.gpu import GpuBlockSizes

LANES = 128    # vreg minor dimension; the MXU is 128 (v4, v5e, v5p) or 256 (v6e) wide


# ----------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the TPU kernels (tokens per block).

  block_q / block_kv tile the forward pass; block_q_bwd / block_kv_bwd tile both backward
  kernels (default: the forward sizes). Every size must be a positive multiple of 128: a q block
  is the lane dimension of the saved logsumexp row and of the transposed backward logits, a kv
  block the lane dimension of the logits. Blocks longer than the (128-rounded) sequence are
  shrunk to it, so a short sequence never computes a mostly padded tile.
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      value = getattr(self, name)
      if value is None and name.endswith("_bwd"):
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"BlockSizes.{name} must be an int; got {value!r}")
      if value <= 0 or value % LANES:
        raise ValueError(f"BlockSizes.{name} must be a positive multiple of {LANES} (TPU lanes); "
                         f"got {value}")

  @property
  def backward(self) -> tuple[int, int]:
    return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)

  @classmethod
  def for_generation(cls, generation: str | None) -> BlockSizes:
    """The default sizes for "v4", "v5e", "v5p", "v6e" (None or unknown: a generic default)."""
    return DEFAULT_BLOCK_SIZES.get(generation, GENERIC_BLOCK_SIZES)


# Defaults per TPU generation. Chosen from the hardware, not tuned on it (these machines have no
# TPU): large enough that each step's MXU work hides the K/V DMA of the next, small enough that
# the f32 logits tiles and their temporaries (~5 x block_q x block_kv x 4 bytes) stay well inside
# the default scoped VMEM, 16 MiB on v4/v5e and 32 MiB on v5p/v6e. v5e has the least HBM
# bandwidth per FLOP, so longer kv blocks there would help most, but bounded VMEM keeps 512.
# Square 512 tiles also keep packed 512-token documents block-diagonal.
#   generation  fwd (q, kv)   bwd (q, kv)
#   v4          512, 512      256, 512    16 MiB scoped VMEM; backward holds ~2x the temporaries
#   v5e         512, 512      256, 512    same VMEM budget as v4
#   v5p         512, 1024     512, 512    32 MiB scoped VMEM
#   v6e         512, 1024     512, 512    32 MiB scoped VMEM, 256-wide MXU likes long kv tiles
DEFAULT_BLOCK_SIZES = {
    "v4": BlockSizes(512, 512, 256, 512),
    "v5e": BlockSizes(512, 512, 256, 512),
    "v5p": BlockSizes(512, 1024, 512, 512),
    "v6e": BlockSizes(512, 1024, 512, 512),
}
GENERIC_BLOCK_SIZES = BlockSizes(512, 512, 512, 512)

_GENERATION_OF_KIND = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                       "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def tpu_generation() -> str | None:
  """The generation being compiled for, when it can be known while tracing.

  Under ``jax.sharding.set_mesh(mesh)`` the abstract mesh names the device kind (also for an
  ahead-of-time compile onto topology devices); otherwise the default device, if it is a TPU.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is None:
    device = jax.devices()[0]
    if device.platform != "tpu":
      return None
  return _GENERATION_OF_KIND.get(device.device_kind)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _blocks(request: Request) -> tuple[tuple[int, int], tuple[int, int]]:
  """Effective ((block_q, block_kv), (block_q_bwd, block_kv_bwd)) for this request."""
  sizes = request.block_sizes
  # platform_dependent traces every kernel family with the same request: sizes meant for the
  # GPU family (flash_layers.GpuBlockSizes) leave the TPU family on its defaults.
  if sizes is None or isinstance(sizes, GpuBlockSizes):
    sizes = BlockSizes.for_generation(tpu_generation())
  elif not isinstance(sizes, BlockSizes):
    raise TypeError("block_sizes must be flash_layers.BlockSizes (TPU), flash_layers.GpuBlockSizes "
                    f"(GPU) or None; got {sizes!r}")
  q_cap, kv_cap = _round_up(request.q_len, LANES), _round_up(request.kv_len, LANES)
  fwd = (min(sizes.block_q, q_cap), min(sizes.block_kv, kv_cap))
  bwd = (min(sizes.backward[0], q_cap), min(sizes.backward[1], kv_cap))
  return fwd, bwd


# ----------------------------------------------------------------------------
# The family interface (see flash_pallas/__init__.py)
# ----------------------------------------------------------------------------

def unsupported(request: Request) -> str | None:
  if request.has_dense_mask:
    return "dense mask"
  if request.dtype not in ("float32", "bfloat16"):
    return f"dtype {request.dtype} (TPU kernels take float32 or bfloat16)"
  return None


def block_shape(request: Request, platform: str) -> tuple[int, int]:
  return _blocks(request)[0]


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernels need that is known while tracing (hashable: a custom_vjp static)."""

  spec: masks.MaskSpec
  scale: float
  softcap: float | None
  q_len: int
  kv_len: int
  head_dim: int      # unpadded, for the cost estimate
  head_dim_v: int
  fwd: tuple[int, int]
  bwd: tuple[int, int]
  has_segments: bool
  static_offsets: tuple[int, int] | None  # for the cost estimate; None when traced
  interpret: bool


def flash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv], lse [b, h, q] float32) by the Mosaic kernels."""
  fwd, bwd = _blocks(request)
  offsets_static = None
  if not any(isinstance(o, jax.core.Tracer) for o in (args.q_offset, args.kv_offset)):
    offsets_static = (int(args.q_offset), int(args.kv_offset))
  cfg = _Static(request.spec, request.scale, request.softcap, request.q_len, request.kv_len,
                request.head_dim, request.head_dim_v, fwd, bwd, request.has_segment_ids,
                offsets_static, interpret)
  q_pad = _round_up(request.q_len, math.lcm(fwd[0], bwd[0]))
  kv_pad = _round_up(request.kv_len, math.lcm(fwd[1], bwd[1]))

  def to_kernel_layout(x, length):  # [b, len, h, d] -> [b, h, len_pad, d]
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

  offsets = jnp.stack([jnp.asarray(args.q_offset, jnp.int32), jnp.asarray(args.kv_offset, jnp.int32)])
  out, lse = _flash(cfg, to_kernel_layout(q, q_pad), to_kernel_layout(k, kv_pad),
                    to_kernel_layout(v, kv_pad), args.q_segment_ids, args.kv_segment_ids, offsets)
  out = jnp.swapaxes(out[:, :, :request.q_len], 1, 2)
  return out, lse[:, :, 0, :request.q_len]


# ----------------------------------------------------------------------------
# Pallas plumbing shared by the three kernels
# ----------------------------------------------------------------------------

def _interpret_arg(interpret: bool):
  """What to pass as pallas_call(interpret=...).

  Under `fl.interpret_as("tpu")`: the TPU-semantics interpreter (`pltpu.InterpretParams`:
  uninitialized memory reads as NaN, out-of-bounds reads raise). Otherwise an interpreted kernel
  is the CPU branch of the dispatcher's `platform_dependent`, next to the compiled TPU branch;
  InterpretParams' io callbacks carry an ordered effect that the TPU branch lacks, and JAX then
  fails to lower the TPU branch alone. The plain interpreter (`True`) has no effects.
  """
  if not interpret:
    return False
  params = getattr(pltpu, "InterpretParams", None)  # jax 0.10.2 and 0.11
  if params is None or platform_lib.interpreting() != "tpu":
    return True
  return params()


def _compiler_params(semantics: tuple[str, ...]):
  params = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
  return params(dimension_semantics=semantics)


def _plan(index, full, count):
  """Flatten a block map's (index, full, count) into the two SMEM tables a kernel reads.

  plan[row, step] = 2 * block + full(row, block): which block step ``step`` of ``row`` handles
  and whether it needs no element mask. Flat 1-D tables keep SMEM padding small.
  """
  full_at = jnp.take_along_axis(full, index, axis=-1).astype(jnp.int32)
  return (2 * index + full_at).reshape(-1), count.reshape(-1)


def _decode(entry):
  """plan entry -> (block, full). Shifts, not // and %: signed division lowers to `sign`,
  whose Mosaic rule asks for the local TPU's generation (absent in an AOT compile on a CPU host)."""
  return entry >> 1, (entry & 1) == 1


def _segment_rows(seg, padded_len):
  """Segment ids [b, len] -> [b, 1, len_pad] rows (tiles of (1, block) in VMEM)."""
  return jnp.pad(seg, ((0, 0), (0, padded_len - seg.shape[1])))[:, None, :]


def _column(row):
  """A [1, n] row as an [n, LANES] lane-replicated column, via a supported 2-D transpose."""
  return jnp.transpose(jnp.broadcast_to(row, (LANES, row.shape[1])))


def _tile_visible(cfg: _Static, offsets_ref, q_block, kv_block, shape, q_axis, q_seg, kv_seg):
  """The element mask of one tile; q positions run along ``q_axis`` (0, or 1 when transposed)."""
  block_q, block_kv = shape[q_axis], shape[1 - q_axis]
  q_local = q_block * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
  kv_local = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  ok = masks.visible(offsets_ref[0] + q_local, offsets_ref[1] + kv_local, cfg.spec, q_seg, kv_seg)
  # Padded tail positions see nothing and are seen by nothing (q_len % block_q etc. may be != 0).
  return ok & (q_local < cfg.q_len) & (kv_local < cfg.kv_len)


def _logits(cfg: _Static, a, b):
  """scale * a @ b^T in float32, soft-capped; also returns tanh(.) for the softcap gradient."""
  s = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * cfg.scale
  if cfg.softcap is None:
    return s, None
  capped = jnp.tanh(s / cfg.softcap)
  return cfg.softcap * capped, capped


def _cost(cfg: _Static, b, h, per_pair_flops, per_pair_exp, nbytes):
  """A CostEstimate from the analytic count of visible pairs (ignoring segment ids, not known
  while tracing: an upper bound for packed sequences)."""
  q_off, kv_off = cfg.static_offsets or (0, 0)
  pairs = masks.count_visible(cfg.q_len, cfg.kv_len, cfg.spec, q_off, kv_off) * b * h
  return pl.CostEstimate(flops=int(pairs * per_pair_flops), transcendentals=int(pairs * per_pair_exp),
                         bytes_accessed=int(nbytes))


def _nbytes(*arrays):
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------

def _forward_kernel(offsets_ref, plan_ref, count_ref, *refs, cfg: _Static, num_kv_steps: int):
  if cfg.has_segments:
    q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, q_seg_scr = refs
  else:
    q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  # m_scr [bq, 128]: running row max of the logits seen so far (lane-replicated).
  # l_scr [bq, 128]: running sum of exp(logit - m) over those logits (lane-replicated).
  # acc_scr [bq, dv]: running sum of exp(logit - m) * v, rescaled whenever m grows.
  # q_seg_scr [bq, 128]: this q block's segment ids as a column (made once per q block).
  batch, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = (batch if cfg.has_segments else 0) * pl.num_programs(2) + q_block
  entry = plan_ref[row * num_kv_steps + step]
  kv_block, full = _decode(entry)

  @pl.when(step == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    if cfg.has_segments:
      q_seg_scr[...] = _column(q_seg_ref[...])

  def update(masked: bool):
    s, _ = _logits(cfg, q_ref[...], k_ref[...])
    if masked:
      seg = (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None)
      s = jnp.where(_tile_visible(cfg, offsets_ref, q_block, kv_block, s.shape, 0, *seg), s, -jnp.inf)
    # Online softmax: with the new row max m', rescale what was summed under the old max m by
    # exp(m - m') and add this block's exp(s - m'). A row with nothing visible yet keeps
    # m' = -inf; shifting it by 0 instead makes its p and its rescale factor exactly 0, not NaN.
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(s - shift[:, :1])
    rescale = jnp.exp(m_prev - shift)
    l_scr[...] = rescale * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_scr[...] = acc_scr[...] * rescale[:, :1] + jnp.dot(
        p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_scr[...] = m_next

  visited = step < count_ref[row]
  pl.when(visited & full)(lambda: update(masked=False))
  pl.when(visited & ~full)(lambda: update(masked=True))

  @pl.when(step == num_kv_steps - 1)
  def _finish():
    total = l_scr[...]
    seen = total > 0  # rows that saw no key: output 0, lse -inf
    o_ref[...] = (acc_scr[...] * jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)[:, :1]
                  ).astype(o_ref.dtype)
    lse = jnp.where(seen, m_scr[...] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    lse_ref[...] = jnp.transpose(lse)[:1, :]  # [bq, 128] column -> [1, bq] row


def _forward(cfg: _Static, q, k, v, q_seg, kv_seg, offsets):
  b, h, q_pad, d = q.shape
  kv_heads, kv_pad, dv = k.shape[1], k.shape[2], v.shape[3]
  group = h // kv_heads
  block_q, block_kv = cfg.fwd
  bm = masks.block_map(cfg.q_len, cfg.kv_len, block_q, block_kv, cfg.spec, q_seg, kv_seg,
                       offsets[0], offsets[1])
  num_q, num_kv = bm.kv_index.shape[1:]
  plan, count = _plan(bm.kv_index, bm.full, bm.kv_count)

  def kv_block(bi, qi, si, plan_ref):
    return plan_ref[((bi if cfg.has_segments else 0) * num_q + qi) * num_kv + si] >> 1

  def kv_spec(width):  # GQA: query head hi reads kv head hi // group, straight from HBM
    return pl.BlockSpec((None, None, block_kv, width), lambda bi, hi, qi, si, _, plan_ref, __: (
        bi, jax.lax.div(hi, group), kv_block(bi, qi, si, plan_ref), 0))

  in_specs = [pl.BlockSpec((None, None, block_q, d), lambda bi, hi, qi, si, *_: (bi, hi, qi, 0)),
              kv_spec(d), kv_spec(dv)]
  inputs = [q, k, v]
  scratch = [pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
             pltpu.VMEM((block_q, dv), jnp.float32)]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, 1, block_q), lambda bi, hi, qi, si, *_: (bi, 0, qi)),
        pl.BlockSpec((None, 1, block_kv),
                     lambda bi, hi, qi, si, _, plan_ref, __: (bi, 0, kv_block(bi, qi, si, plan_ref))),
    ]
    inputs += [_segment_rows(q_seg, q_pad), _segment_rows(kv_seg, kv_pad)]
    scratch.append(pltpu.VMEM((block_q, LANES), jnp.int32))
  out_shape = [jax.ShapeDtypeStruct((b, h, q_pad, dv), q.dtype),
               jax.ShapeDtypeStruct((b, h, 1, q_pad), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, block_q, dv), lambda bi, hi, qi, si, *_: (bi, hi, qi, 0)),
               pl.BlockSpec((None, None, 1, block_q), lambda bi, hi, qi, si, *_: (bi, hi, 0, qi))]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, h, num_q, num_kv), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=scratch)
  cost = _cost(cfg, b, h, 2 * cfg.head_dim + 2 * cfg.head_dim_v, 1 + (cfg.softcap is not None),
               _nbytes(q, *out_shape) + _nbytes(k, v) * num_q)
  return pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg, num_kv_steps=num_kv),
      grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=_interpret_arg(cfg.interpret), name="flash_layers_fwd",
  )(offsets, plan, count, *inputs)


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------

def _dkv_kernel(offsets_ref, plan_ref, count_ref, *refs, cfg: _Static, num_q_steps: int,
                group: int):
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dk_ref, dv_ref,
     dk_scr, dv_scr, kv_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr = refs
  # dk_scr [bk, d], dv_scr [bk, dv]: float32 sums over every (query head of the group, q block)
  # that sees this kv block. kv_seg_scr [bk, 128]: this kv block's segment ids as a column.
  # Tiles are transposed ([kv, q]) so the per-query rows lse and D broadcast along sublanes.
  batch, kv_block, head_in_group, step = (pl.program_id(0), pl.program_id(2), pl.program_id(3),
                                          pl.program_id(4))
  row = (batch if cfg.has_segments else 0) * pl.num_programs(2) + kv_block
  entry = plan_ref[row * num_q_steps + step]
  q_block, full = _decode(entry)

  @pl.when((head_in_group == 0) & (step == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)
    if cfg.has_segments:
      kv_seg_scr[...] = _column(kv_seg_ref[...])

  def update(masked: bool):
    q, do = q_ref[...], do_ref[...]
    s_t, capped = _logits(cfg, k_ref[...], q)  # [bk, bq]
    if masked:
      seg = (q_seg_ref[...], kv_seg_scr[:, :1]) if cfg.has_segments else (None, None)
      s_t = jnp.where(_tile_visible(cfg, offsets_ref, q_block, kv_block, s_t.shape, 1, *seg),
                      s_t, -jnp.inf)
    # lse is +inf for rows that see no key (set by the wrapper): their p is exactly 0.
    p_t = jnp.exp(s_t - lse_ref[...])
    dv_scr[...] += jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp_t = jax.lax.dot_general(v_ref[...], do, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    ds_t = p_t * (dp_t - delta_ref[...])
    if capped is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
      ds_t = ds_t * (1.0 - capped * capped)
    dk_scr[...] += jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)

  visited = step < count_ref[row]
  pl.when(visited & full)(lambda: update(masked=False))
  pl.when(visited & ~full)(lambda: update(masked=True))

  @pl.when((head_in_group == group - 1) & (step == num_q_steps - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(offsets_ref, plan_ref, count_ref, *refs, cfg: _Static, num_kv_steps: int):
  if cfg.has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref,
     dq_scr, lse_scr, delta_scr, q_seg_scr) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, lse_scr, delta_scr = refs
  # dq_scr [bq, d]: float32 sum over the visible kv blocks. lse_scr, delta_scr, q_seg_scr
  # [bq, 128]: this q block's lse, D and segment ids as columns (made once per q block).
  batch, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = (batch if cfg.has_segments else 0) * pl.num_programs(2) + q_block
  entry = plan_ref[row * num_kv_steps + step]
  kv_block, full = _decode(entry)

  @pl.when(step == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
    lse_scr[...] = _column(lse_ref[...])
    delta_scr[...] = _column(delta_ref[...])
    if cfg.has_segments:
      q_seg_scr[...] = _column(q_seg_ref[...])

  def update(masked: bool):
    k, do = k_ref[...], do_ref[...]
    s, capped = _logits(cfg, q_ref[...], k)  # [bq, bk]
    if masked:
      seg = (q_seg_scr[:, :1], kv_seg_ref[...]) if cfg.has_segments else (None, None)
      s = jnp.where(_tile_visible(cfg, offsets_ref, q_block, kv_block, s.shape, 0, *seg), s, -jnp.inf)
    p = jnp.exp(s - lse_scr[:, :1])
    dp = jax.lax.dot_general(do, v_ref[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ds = p * (dp - delta_scr[:, :1])
    if capped is not None:
      ds = ds * (1.0 - capped * capped)
    dq_scr[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  visited = step < count_ref[row]
  pl.when(visited & full)(lambda: update(masked=False))
  pl.when(visited & ~full)(lambda: update(masked=True))

  @pl.when(step == num_kv_steps - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _backward(cfg: _Static, q, k, v, q_seg, kv_seg, offsets, lse, delta, do):
  b, h, q_pad, d = q.shape
  kv_heads, kv_pad, dv = k.shape[1], k.shape[2], v.shape[3]
  group = h // kv_heads
  block_q, block_kv = cfg.bwd
  bm = masks.block_map(cfg.q_len, cfg.kv_len, block_q, block_kv, cfg.spec, q_seg, kv_seg,
                       offsets[0], offsets[1])
  num_q, num_kv = bm.kv_index.shape[1:]
  seg_inputs = []
  if cfg.has_segments:
    seg_inputs = [_segment_rows(q_seg, q_pad), _segment_rows(kv_seg, kv_pad)]
  semantics = _compiler_params(("parallel", "parallel", "parallel", "arbitrary"))
  vmem = functools.partial(pltpu.VMEM, dtype=jnp.float32)

  # dK, dV: grid (batch, kv heads, kv blocks, heads of the group, q steps).
  plan_t, count_t = _plan(bm.q_index, jnp.swapaxes(bm.full, 1, 2), bm.q_count)

  def q_block(bi, ki, si, plan_ref):
    return plan_ref[((bi if cfg.has_segments else 0) * num_kv + ki) * num_q + si] >> 1

  def per_query(block, dim):  # tiles of arrays indexed by query head and q position
    return pl.BlockSpec(block, lambda bi, kh, ki, gi, si, _, plan_ref, __: (
        bi, kh * group + gi, *((0, q_block(bi, ki, si, plan_ref)) if dim == 3 else
                               (q_block(bi, ki, si, plan_ref), 0))))

  def per_kv(width):
    return pl.BlockSpec((None, None, block_kv, width), lambda bi, kh, ki, gi, si, *_: (bi, kh, ki, 0))

  in_specs = [per_query((None, None, block_q, d), 2), per_kv(d), per_kv(dv),
              per_query((None, None, block_q, dv), 2), per_query((None, None, 1, block_q), 3),
              per_query((None, None, 1, block_q), 3)]
  scratch = [vmem((block_kv, d)), vmem((block_kv, dv))]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, 1, block_q),
                     lambda bi, kh, ki, gi, si, _, plan_ref, __: (bi, 0, q_block(bi, ki, si, plan_ref))),
        pl.BlockSpec((None, 1, block_kv), lambda bi, kh, ki, gi, si, *_: (bi, 0, ki))]
    scratch.append(pltpu.VMEM((block_kv, LANES), jnp.int32))
  dk_dv_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, kv_heads, num_kv, group, num_q), in_specs=in_specs,
      out_specs=[per_kv(d), per_kv(dv)], scratch_shapes=scratch)
  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, num_q_steps=num_q, group=group),
      grid_spec=grid_spec, out_shape=dk_dv_shape,
      compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      cost_estimate=_cost(cfg, b, h, 4 * cfg.head_dim + 4 * cfg.head_dim_v,
                          1 + (cfg.softcap is not None),
                          _nbytes(k, v, *dk_dv_shape) + _nbytes(q, do, lse, delta) * num_kv),
      interpret=_interpret_arg(cfg.interpret), name="flash_layers_bwd_dkv",
  )(offsets, plan_t, count_t, q, k, v, do, lse, delta, *seg_inputs)

  # dQ: grid (batch, heads, q blocks, kv steps), like the forward.
  plan, count = _plan(bm.kv_index, bm.full, bm.kv_count)

  def kv_block(bi, qi, si, plan_ref):
    return plan_ref[((bi if cfg.has_segments else 0) * num_q + qi) * num_kv + si] >> 1

  def kv_spec(width):
    return pl.BlockSpec((None, None, block_kv, width), lambda bi, hi, qi, si, _, plan_ref, __: (
        bi, jax.lax.div(hi, group), kv_block(bi, qi, si, plan_ref), 0))

  def q_spec(block, dim):
    return pl.BlockSpec(block, lambda bi, hi, qi, si, *_: (bi, hi, *((0, qi) if dim == 3 else (qi, 0))))

  in_specs = [q_spec((None, None, block_q, d), 2), kv_spec(d), kv_spec(dv),
              q_spec((None, None, block_q, dv), 2), q_spec((None, None, 1, block_q), 3),
              q_spec((None, None, 1, block_q), 3)]
  scratch = [vmem((block_q, d)), vmem((block_q, LANES)), vmem((block_q, LANES))]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, 1, block_q), lambda bi, hi, qi, si, *_: (bi, 0, qi)),
        pl.BlockSpec((None, 1, block_kv),
                     lambda bi, hi, qi, si, _, plan_ref, __: (bi, 0, kv_block(bi, qi, si, plan_ref)))]
    scratch.append(pltpu.VMEM((block_q, LANES), jnp.int32))
  dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, h, num_q, num_kv), in_specs=in_specs,
      out_specs=q_spec((None, None, block_q, d), 2), scratch_shapes=scratch)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, num_kv_steps=num_kv),
      grid_spec=grid_spec, out_shape=dq_shape, compiler_params=semantics,
      cost_estimate=_cost(cfg, b, h, 4 * cfg.head_dim + 2 * cfg.head_dim_v,
                          1 + (cfg.softcap is not None),
                          _nbytes(q, do, lse, delta, dq_shape) + _nbytes(k, v) * num_q),
      interpret=_interpret_arg(cfg.interpret), name="flash_layers_bwd_dq",
  )(offsets, plan, count, q, k, v, do, lse, delta, *seg_inputs)
  return dq, dk, dv_


# ----------------------------------------------------------------------------
# The custom VJP (on padded, head-major arrays)
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Static, q, k, v, q_seg, kv_seg, offsets):
  return _forward(cfg, q, k, v, q_seg, kv_seg, offsets)


def _flash_fwd(cfg: _Static, q, k, v, q_seg, kv_seg, offsets):
  out, lse = _forward(cfg, q, k, v, q_seg, kv_seg, offsets)
  return (out, lse), (q, k, v, q_seg, kv_seg, offsets, out, lse)


def _flash_bwd(cfg: _Static, residuals, cotangents):
  q, k, v, q_seg, kv_seg, offsets, out, lse = residuals
  d_out, d_lse = cotangents
  # Rows past q_len may lie in a backward block beyond the forward grid (block sizes differ),
  # where out and lse were never written: give them lse = +inf and D = 0, so p = 0 there. Rows
  # that see no key get lse = +inf too (p = exp(s - inf) = 0, never exp(+inf)).
  real = (jnp.arange(lse.shape[-1]) < cfg.q_len)[None, None, None, :]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :] - d_lse
  delta = jnp.where(real, delta, 0.0)
  lse = jnp.where(real & (lse > -jnp.inf), lse, jnp.inf)
  d_out = jnp.where(real[..., 0, :, None], d_out, 0)
  dq, dk, dv = _backward(cfg, q, k, v, q_seg, kv_seg, offsets, lse, delta, d_out)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
