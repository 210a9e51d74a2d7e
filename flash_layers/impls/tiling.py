"""Tile sizes of the flash_pallas kernels and the padding arithmetic every blocked impl shares.

`BlockSizes` (TPU: multiples of the 128 lanes) and `GpuBlockSizes` (GPU: powers of
two >= 16, plus Triton launch parameters) are user-facing: pass either as
`fl.attention(..., block_sizes=...)`. The family is the one of the platform the call
is lowered for; the other family's sizes raise a ValueError then
(`flash_pallas.wrong_block_sizes`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LANES = 128    # TPU vreg minor dimension; the MXU is 128 (v4, v5e, v5p) or 256 (v6e) wide
MIN_GPU_TILE = 16  # `tl.dot` needs every matmul dimension >= 16


def cdiv(x: int, divisor: int) -> int:
  """ceil(x / divisor) for positive ints."""
  return -(-x // divisor)


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= x."""
  return cdiv(x, multiple) * multiple


def pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """`x` padded with `value` at the end of `axis` to `size` (unchanged if already that long)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


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


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tiles and launch parameters of the GPU kernels (all block sizes powers of two >= 16).

  block_q / block_kv:          forward tile (queries per program, keys per loop step)
  block_q_bwd / block_kv_bwd:  tile of both backward kernels (dK/dV and dQ)
  num_warps / num_stages:      forward launch: warps per program, software-pipeline depth
  num_warps_bwd / num_stages_bwd: the same for the backward kernels
  """

  block_q: int = 128
  block_kv: int = 64
  block_q_bwd: int = 64
  block_kv_bwd: int = 64
  num_warps: int = 4
  num_stages: int = 3
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < MIN_GPU_TILE or value & (value - 1):
        raise ValueError(f"GpuBlockSizes.{field} must be a power of two >= {MIN_GPU_TILE}; got {value!r}")
    for field in ("num_warps", "num_warps_bwd"):
      value = getattr(self, field)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"GpuBlockSizes.{field} must be one of 1, 2, 4, 8, 16; got {value!r}")
    for field in ("num_stages", "num_stages_bwd"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GpuBlockSizes.{field} must be an int >= 1; got {value!r}")


@dataclasses.dataclass(frozen=True)
class CpuBlockSizes:
  """What the CPU layouts tune (None: the impl's default, the value the autotuner starts from).

  block_q / block_kv: xla_chunked's chunk lengths (clamped to the sequence, `xla_chunked.chunk_size`).
  loop_bytes: the per-row/per-head loop threshold (`impls/cpu_loop.py`): a call whose float32
    logits tile over every row and head exceeds this many bytes runs one batch row and kv head at
    a time. 0 always loops; a huge value never does.
  Only xla_chunked and xla_dense take them: any other explicitly chosen impl raises
  (`validate.check_block_sizes`); "auto" hands them to the impl it picks.
  """

  block_q: int | None = None
  block_kv: int | None = None
  loop_bytes: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv", "loop_bytes"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"CpuBlockSizes.{name} must be an int or None; got {value!r}")
      if value < (0 if name == "loop_bytes" else 8) or (name != "loop_bytes" and value % 8):
        allowed = "an int >= 0" if name == "loop_bytes" else "a positive multiple of 8"
        raise ValueError(f"CpuBlockSizes.{name} must be {allowed}; got {value}")


# Every block-size class; `validate.prepare` rejects anything else by type.
BLOCK_SIZE_CLASSES: tuple[type, ...] = (BlockSizes, GpuBlockSizes, CpuBlockSizes)
