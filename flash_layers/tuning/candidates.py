"""Candidate configurations per platform: what the autotuner times for one call.

The first candidate of every list is the default (what the call runs untuned), so a tuned entry
can only replace it with something measured faster. Each list is small on purpose: every
candidate is compiled, checked against the reference and timed.

CPU ("auto" or xla_dense / xla_chunked): xla_dense with and without the per-row/per-head loop,
xla_chunked over chunk pairs, and the loop flipped for the default pair. Between the two impls
this is the crossover "auto" otherwise takes at `dispatch.CPU_CHUNKED_MIN_KV_LEN` keys.
TPU / GPU (flash_pallas): the kernels' tiles (GPU: also warps and stages) from the candidate spaces
of `flash_pallas/tpu_config.py` and `gpu_config.py`, each half (forward, backward) varied with the
other at the generation's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flash_layers.impls import cpu_loop
from flash_layers.impls.base import Request
from flash_layers.impls.tiling import CpuBlockSizes
from flash_layers.impls.xla_chunked import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, chunk_size

NEVER_LOOP = 1 << 62  # loop_bytes no call reaches
CHUNKS = (256, 512, 1024)
# xla_dense keeps [b, h, q, kv] float32 logits (and their probabilities under differentiation);
# above this many bytes it is not a candidate: "auto" takes xla_chunked there to keep memory linear.
MAX_DENSE_LOGITS_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration to time: an impl and the block sizes it runs with (None: its defaults)."""

  impl: str
  block_sizes: Any = None

  def describe(self) -> str:
    if self.block_sizes is None:
      return f"{self.impl} (defaults)"
    fields = {k: v for k, v in dataclasses.asdict(self.block_sizes).items() if v is not None}
    return f"{self.impl} {fields}"


def _loops(request: Request, tile_q: int, tile_kv: int, loop_bytes: int) -> bool:
  # cpu_loop.worth_looping on shapes alone
  return (request.batch * request.num_kv_heads > 1
          and 4 * request.batch * request.num_heads * tile_q * tile_kv > loop_bytes)


def _flip(request: Request, tile_q: int, tile_kv: int) -> int:
  """The loop_bytes that flips the default loop decision for this tile."""
  return NEVER_LOOP if _loops(request, tile_q, tile_kv, cpu_loop.CACHE_BYTES) else 0


def cpu(impl: str, request: Request) -> list[Candidate]:
  """CPU candidates for `impl` ("auto", "xla_dense" or "xla_chunked"); [] for other impls."""
  out: list[Candidate] = []
  logits_bytes = 4 * request.batch * request.num_heads * request.q_len * request.kv_len
  dense_ok = logits_bytes <= MAX_DENSE_LOGITS_BYTES
  if impl == "xla_dense" or (impl == "auto" and dense_ok):
    out.append(Candidate("xla_dense"))
    if request.batch * request.num_kv_heads > 1:
      out.append(Candidate("xla_dense", CpuBlockSizes(loop_bytes=_flip(request, request.q_len,
                                                                       request.kv_len))))
  if impl in ("auto", "xla_chunked"):
    default_tile = (chunk_size(request.q_len, DEFAULT_BLOCK_Q), chunk_size(request.kv_len, DEFAULT_BLOCK_KV))
    out.append(Candidate("xla_chunked"))
    seen = {default_tile}
    for block_q in CHUNKS:
      for block_kv in (c for c in CHUNKS if c >= block_q):  # kv chunks at least as long: fewer steps
        tile = (chunk_size(request.q_len, block_q), chunk_size(request.kv_len, block_kv))
        if tile not in seen:
          seen.add(tile)
          out.append(Candidate("xla_chunked", CpuBlockSizes(block_q, block_kv)))
    if request.batch * request.num_kv_heads > 1:
      out.append(Candidate("xla_chunked", CpuBlockSizes(loop_bytes=_flip(request, *default_tile))))
  if impl == "auto" and out and out[0].impl != _default_cpu_impl(request):
    # the untuned choice first (the baseline every other candidate must beat)
    untuned = Candidate(_default_cpu_impl(request))
    first = next(i for i, c in enumerate(out) if c == untuned)
    out.insert(0, out.pop(first))
  return out


def _default_cpu_impl(request: Request) -> str:
  from flash_layers.dispatch import CPU_CHUNKED_MIN_KV_LEN  # noqa: PLC0415 (dispatch imports the cache)
  return "xla_chunked" if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN else "xla_dense"


def _around_default(configs: list, forward, backward) -> list[Candidate]:
  """flash_pallas candidates from a kernel config module's list (its default first): the configs
  that keep one half (forward or backward tiles) at the default, so each half is searched with the
  other fixed instead of timing the full product."""
  default = configs[0]
  out = [Candidate("flash_pallas")]
  for cfg in configs[1:]:
    if forward(cfg) == forward(default) or backward(cfg) == backward(default):
      out.append(Candidate("flash_pallas", cfg))
  return out


def tpu(request: Request) -> list[Candidate]:
  """flash_pallas TPU tiles: `tpu_config.candidates` (VMEM-checked, clamped), one half at a time."""
  from flash_layers.impls.flash_pallas import tpu_config  # noqa: PLC0415 (only when tuning a TPU)
  return _around_default(tpu_config.candidates(request), lambda c: (c.block_q, c.block_kv),
                         lambda c: c.backward)


def gpu(request: Request) -> list[Candidate]:
  """flash_pallas GPU tiles, warps and stages: `gpu_config.candidates` (shared-memory-checked), one
  half at a time."""
  from flash_layers.impls.flash_pallas import gpu_config  # noqa: PLC0415 (only when tuning a GPU)
  return _around_default(
      gpu_config.candidates(request),
      lambda c: (c.block_q, c.block_kv, c.num_warps, c.num_stages),
      lambda c: (c.block_q_bwd, c.block_kv_bwd, c.num_warps_bwd, c.num_stages_bwd))


def for_call(impl: str, request: Request, platform: str) -> list[Candidate]:
  """The candidates for `impl` ("auto" or a name) on `platform`; [] when nothing is tunable."""
  if platform == "cpu":
    return cpu(impl, request)
  if impl not in ("auto", "flash_pallas"):
    return []
  if platform == "tpu":
    return tpu(request)
  if platform in ("cuda", "rocm", "gpu"):
    return gpu(request)
  return []
