"""Configuration of the GPU kernel family (`gpu.py`), as data: the tile and launch table per GPU
generation and head_dim with each entry's reason, the shared-memory budgets and estimate, the
heuristics that turn a request into a configuration, and the candidate space an autotuner would
search.

Nothing here builds a kernel; `gpu.py` asks `config(request)` for its tiles, warps and stages.
docs/kernels.md's "Tile and launch configuration" table is this module's `TILE_TABLE` written out
(`tests/test_kernel_config.py` compares them).

Yardsticks: jax's Pallas mha defaults (jax/experimental/pallas/ops/gpu/attention.py: forward
128 x 128, 4 warps at head_dim <= 64 else 8, 2 stages; backward 32 x 32) and tokamax's autotuned
H100 picks for its Pallas-Triton flash attention
(tokamax/data/autotuning/nvidia_h100_80gb_hbm3/pallas_triton_flash_attention{,_vjp}.json, bf16,
2k-16k tokens). Every entry fits its generation's shared memory by `shared_memory_bytes`
(tests/test_flash_pallas_gpu.py checks it). Not tuned on hardware here: see docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flash_layers.impls.base import Request
from flash_layers.impls.tiling import MIN_GPU_TILE, BlockSizes, CpuBlockSizes, GpuBlockSizes

KiB = 1024

# Shared memory one program (thread block) may use, by generation: H100/H200 228 KiB per SM, 227
# per block; A100 (sm_80) 164 / 163; consumer Ampere and Ada (sm_86, sm_89) 100 / 99 (CUDA C
# Programming Guide, "Compute capabilities").
SHARED_MEMORY = {"hopper": 227 * KiB, "ampere": 163 * KiB, "ada": 99 * KiB}

# head_dim buckets: a request takes the smallest bucket >= max(head_dim, head_dim_v).
HEAD_DIM_BUCKETS = (64, 128, 256)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileEntry:
  """One row of the table: a (generation, head_dim bucket)'s defaults, and why."""

  generation: str       # "hopper", "ampere" or "ada" (`generation_of`)
  head_dim: int         # the bucket: head dims up to this
  sizes: GpuBlockSizes  # forward / backward tiles, warps and stages
  why: str              # the reason for these values (docs/kernels.md prints it)


# Shared memory per entry (bf16) is in the docs' table; `shared_memory_bytes` computes it.
TILE_TABLE: tuple[TileEntry, ...] = (
    # tokamax H100 d64 at 2k-16k: forward 128 x 64, 3 stages, 4 warps (causal); backward 64 x 64,
    # 3 stages, 4 warps. Forward 64 KiB, dK/dV 64 KiB: 4 warps hold the 64-wide accumulator.
    TileEntry(generation="hopper", head_dim=64, sizes=GpuBlockSizes(128, 64, 64, 64, 4, 3, 4, 3),
              why="tokamax H100 d64 (causal 2k–16k)"),
    # tokamax H100 d128 at 8k/16k: forward 128 x 128, 3 stages, 8 warps (jax's mha: 128 x 128,
    # 8 warps); backward 64 x 64, 2 stages, 4 warps. Forward 192 KiB of 227: the largest that fits.
    TileEntry(generation="hopper", head_dim=128, sizes=GpuBlockSizes(128, 128, 64, 64, 8, 3, 4, 2),
              why="tokamax H100 d128 8k/16k; jax mha's tile and warps"),
    # tokamax H100 d256 at 8k/16k: forward 128 x 32, 3 stages, 8 warps; backward 64 x 32,
    # 3 stages, 4 warps (dK/dV 168 KiB).
    TileEntry(generation="hopper", head_dim=256, sizes=GpuBlockSizes(128, 32, 64, 32, 8, 3, 4, 3),
              why="tokamax H100 d256; 8 warps hold the 256-wide float32 accumulator"),
    # A100: same 64K registers per SM as Hopper.
    TileEntry(generation="ampere", head_dim=64, sizes=GpuBlockSizes(128, 64, 64, 64, 4, 3, 4, 3),
              why="Hopper's row fits 163 KiB"),
    # jax's 128 x 128 x 2 stages would be 128 KiB. Backward as Hopper (80 KiB).
    TileEntry(generation="ampere", head_dim=128, sizes=GpuBlockSizes(128, 64, 64, 64, 8, 3, 4, 2),
              why="Hopper's 192 KiB does not fit: half the kv tile, 3 stages kept"),
    # Forward 104 KiB, dK/dV 104 KiB (168 with 3 stages).
    TileEntry(generation="ampere", head_dim=256, sizes=GpuBlockSizes(128, 32, 64, 32, 8, 2, 4, 2),
              why="Hopper's with one stage fewer"),
    # Consumer Ampere / Ada (99 KiB): no published yardstick; the A100 rows cut to fit.
    TileEntry(generation="ada", head_dim=64, sizes=GpuBlockSizes(128, 64, 64, 64, 4, 3, 4, 3),
              why="A100's row fits 99 KiB (no published yardstick)"),
    # Backward 80 KiB.
    TileEntry(generation="ada", head_dim=128, sizes=GpuBlockSizes(128, 64, 64, 64, 8, 2, 4, 2),
              why="A100's 112 KiB does not fit: 2 stages"),
    # tokamax's short causal H100 d256 pick, 64 x 32 x 2 stages (68 KiB); backward 32 x 32 (68 KiB).
    TileEntry(generation="ada", head_dim=256, sizes=GpuBlockSizes(64, 32, 32, 32, 4, 2, 4, 2),
              why="tokamax's short causal H100 d256 forward pick"),
)

# (generation, head_dim bucket) -> defaults, GpuBlockSizes(fwd q, fwd kv, bwd q, bwd kv, fwd warps,
# fwd stages, bwd warps, bwd stages).
CONFIG_TABLE: dict[tuple[str, int], GpuBlockSizes] = {
    (e.generation, e.head_dim): e.sizes for e in TILE_TABLE}

# What an autotuner may try (see `candidates`): tiles (powers of two), warps, pipeline stages.
CANDIDATE_BLOCKS = (32, 64, 128)
CANDIDATE_WARPS = (4, 8)
CANDIDATE_STAGES = (2, 3)


def shared_memory_bytes(cfg: GpuBlockSizes, head_dim: int, head_dim_v: int, itemsize: int) -> int:
  """Shared memory of the largest of the three kernels for these tiles (an estimate, in bytes).

  Per program: the tiles it keeps (its q, or its k and v, block), num_stages - 1 pipelined
  buffers of the tiles its loop streams (Triton's pipeliner keeps num_stages - 1 loads in flight;
  with num_stages buffers tokamax's measured H100 d128 pick, 128 x 128 x 3 stages, would need
  256 KiB and could not launch), and the [block_q, block_kv] probability tile (and dS in dK/dV)
  that goes through shared memory on its way to the next dot. Widths are the padded (power of
  two) head dims.
  """
  d = max(MIN_GPU_TILE, pl.next_power_of_2(head_dim))
  dv = max(MIN_GPU_TILE, pl.next_power_of_2(head_dim_v))
  fwd_buffers, bwd_buffers = max(cfg.num_stages - 1, 1), max(cfg.num_stages_bwd - 1, 1)
  bq, bk, bq2, bk2 = cfg.block_q, cfg.block_kv, cfg.block_q_bwd, cfg.block_kv_bwd
  forward = bq * d + fwd_buffers * bk * (d + dv) + bq * bk
  dkv = bk2 * (d + dv) + bwd_buffers * bq2 * (d + dv) + 2 * bq2 * bk2
  dq = bq2 * (d + dv) + bwd_buffers * bk2 * (d + dv) + bq2 * bk2
  return itemsize * max(forward, dkv, dq)


@functools.cache
def gpu_generation() -> str:
  """The CONFIG_TABLE generation of the local GPU; 'hopper' when there is none (CPU lowering)."""
  try:
    device = jax.local_devices(backend="gpu")[0]
  except (RuntimeError, ValueError):  # no GPU backend in this process
    return "hopper"
  return generation_of(str(getattr(device, "compute_capability", "9.0")))


def generation_of(capability: str) -> str:
  """'hopper' for sm_90/sm_100 (227 KiB of shared memory per block), 'ampere' for sm_80/sm_87
  (163 KiB), 'ada' for the consumer parts sm_86/sm_89/sm_12x (99 KiB); unknown strings: hopper."""
  try:
    major, minor = (int(x) for x in capability.split(".")[:2])
  except ValueError:
    return "hopper"
  if major in (9, 10, 11):
    return "hopper"
  if major == 8 and minor in (0, 7):
    return "ampere"
  return "ada" if major in (8, 12) else "hopper"


def head_dim_bucket(request: Request) -> int:
  """The table's head_dim bucket for this request (64, 128 or 256)."""
  head_dim = max(request.head_dim, request.head_dim_v)
  return next((b for b in HEAD_DIM_BUCKETS if head_dim <= b), HEAD_DIM_BUCKETS[-1])


def override(base: GpuBlockSizes, block_sizes: Any) -> GpuBlockSizes:
  """Apply `request.block_sizes`.

  `jax.lax.platform_dependent` traces both kernel families with the same request,
  so each family takes its own sizes and uses its defaults for the other's: a
  `GpuBlockSizes` replaces the table entry, the TPU family's `BlockSizes` is not
  for us.
  """
  if block_sizes is None or isinstance(block_sizes, (BlockSizes, CpuBlockSizes)):
    return base
  if isinstance(block_sizes, GpuBlockSizes):
    return block_sizes
  raise TypeError("block_sizes for the flash_pallas GPU kernels must be a flash_layers.GpuBlockSizes "
                  f"(or the TPU family's flash_layers.BlockSizes, ignored on GPU); got {block_sizes!r}")


def fit(block: int, length: int) -> int:
  """Shrink a tile for short sequences (a 7-token call needs no 128-row tile)."""
  return max(MIN_GPU_TILE, min(block, pl.next_power_of_2(length)))


def fit_lengths(cfg: GpuBlockSizes, request: Request) -> GpuBlockSizes:
  """Every tile of `cfg` shrunk to the request's lengths (`fit`)."""
  return dataclasses.replace(
      cfg, block_q=fit(cfg.block_q, request.q_len), block_kv=fit(cfg.block_kv, request.kv_len),
      block_q_bwd=fit(cfg.block_q_bwd, request.q_len),
      block_kv_bwd=fit(cfg.block_kv_bwd, request.kv_len))


def fit_float32(cfg: GpuBlockSizes, request: Request, budget: int) -> GpuBlockSizes:
  """The table is sized for 2-byte inputs; float32 tiles are twice the bytes. Drop pipeline
  stages, then halve the kv and q tiles, until the estimate fits the budget."""
  while shared_memory_bytes(cfg, request.head_dim, request.head_dim_v, 4) > budget:
    if max(cfg.num_stages, cfg.num_stages_bwd) > 2:
      cfg = dataclasses.replace(cfg, num_stages=min(cfg.num_stages, 2),
                                num_stages_bwd=min(cfg.num_stages_bwd, 2))
    elif max(cfg.block_kv, cfg.block_kv_bwd) > 32:
      cfg = dataclasses.replace(cfg, block_kv=max(cfg.block_kv // 2, 32),
                                block_kv_bwd=max(cfg.block_kv_bwd // 2, 32))
    elif max(cfg.block_q, cfg.block_q_bwd) > 32:
      cfg = dataclasses.replace(cfg, block_q=max(cfg.block_q // 2, 32),
                                block_q_bwd=max(cfg.block_q_bwd // 2, 32))
    else:
      break
  return cfg


def config(request: Request) -> GpuBlockSizes:
  """The table entry for this GPU and head_dim (float32: cut to fit shared memory), overridden by
  request.block_sizes, fit to the lengths."""
  generation = gpu_generation()
  cfg = CONFIG_TABLE[(generation, head_dim_bucket(request))]
  if jnp.dtype(request.dtype).itemsize > 2:
    cfg = fit_float32(cfg, request, SHARED_MEMORY[generation])
  return fit_lengths(override(cfg, request.block_sizes), request)


def candidates(request: Request, generation: str | None = None) -> list[GpuBlockSizes]:
  """The configurations an autotuner may time for this request, the default first.

  Forward (block_q, block_kv, warps, stages) and backward (block_q, block_kv, warps, stages) from
  `CANDIDATE_BLOCKS`, `CANDIDATE_WARPS` and `CANDIDATE_STAGES`, as the kernels would use them
  (tiles fit to the lengths, duplicates dropped), whose `shared_memory_bytes` in the request's
  dtype fits the generation's shared memory (`SHARED_MEMORY`). `generation` defaults to the
  local GPU's. The forward kernel uses only the forward half and the backward kernels only the
  backward half, so a tuner may time the halves apart instead of their full product.
  """
  generation = generation if generation is not None else gpu_generation()
  budget = SHARED_MEMORY[generation]
  itemsize = jnp.dtype(request.dtype).itemsize
  default = CONFIG_TABLE[(generation, head_dim_bucket(request))]
  if itemsize > 2:
    default = fit_float32(default, request, budget)
  found = {fit_lengths(default, request): None}  # a dict: ordered, and duplicates drop out
  launch = list(itertools.product(CANDIDATE_BLOCKS, CANDIDATE_BLOCKS, CANDIDATE_WARPS,
                                  CANDIDATE_STAGES))
  for (bq, bk, warps, stages), (bq2, bk2, warps2, stages2) in itertools.product(launch, repeat=2):
    cfg = fit_lengths(GpuBlockSizes(bq, bk, bq2, bk2, warps, stages, warps2, stages2), request)
    if shared_memory_bytes(cfg, request.head_dim, request.head_dim_v, itemsize) <= budget:
      found.setdefault(cfg)
  return list(found)
