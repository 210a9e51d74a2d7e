"""Configuration of the TPU kernel family (`tpu.py`), as data: tile tables per generation with
their reasons, VMEM budgets, the heuristics that turn a request into tiles, and the candidate
space an autotuner would search.

Nothing here builds a kernel; `tpu.py` asks `blocks(request)` for its tiles,
`forward_tiles` / `dq_tile_heads` for its GQA tiles and `vmem_limit` for each kernel's scoped
VMEM. docs/kernels.md's "Block sizes" table is this module's `TILE_TABLE` written out
(`tests/test_kernel_config.py` compares them).

Where the numbers come from: each chip's published bf16 peak and HBM bandwidth (Google Cloud TPU
system architecture pages) and its VMEM, measured as the largest scratch Mosaic accepts when
compiling ahead of time. Not yet tuned on hardware.

* block_q: a forward tile does ~block_q FLOPs per byte of K/V it streams (4 bq bk d FLOPs for
  4 bk d bytes of bfloat16 K and V), so block_q must exceed the chip's FLOP/byte ratio for the
  MXU, not HBM, to bound a step: v4 275 TF/s / 1.2 TB/s ~ 230, v5e 197 / 0.82 ~ 240, v5p 459 / 2.8
  ~ 166, v6e 918 / 1.6 ~ 560 (hence 1,024-row q tiles on v6e). The dQ kernel streams K/V the same
  way; dK/dV streams q and dO: ~2 block_kv FLOPs per byte.
* block_kv: a step's MXU time should dwarf the ~0.35 us a grid step costs: a 512 x 512 x 128 tile
  is ~0.7 us on v5e, 512 x 1024 ~1.4 us; 1,024 x 1,024 ~0.6 us on v6e.
* VMEM: the f32 logits tile and ~5 temporaries of its size (6 x 4 x bq x bk bytes) plus the
  double-buffered tiles must fit the kernel's scoped VMEM. Each kernel asks for what its tiles
  need (`vmem_limit`: never below Mosaic's default, at most 3/4 of the capacity), no more: every
  byte of scoped VMEM is taken from XLA's memory-space assignment, which keeps small buffers on
  chip (measured on v5e, 8k tokens: a flat 64 MiB limit turned 16 MiB of HBM temporaries into
  49 MiB). v4 has only 16 MiB, so its backward keeps 256-row q tiles.
Square 512 tiles keep packed 512-token documents block-diagonal; longer kv tiles (v5e, v5p, v6e)
trade that for fewer, longer steps.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax

from flash_layers.impls.base import Request
from flash_layers.impls.tiling import LANES, BlockSizes, CpuBlockSizes, GpuBlockSizes, round_up

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileEntry:
  """One row of the tile table: a generation's default tiles and VMEM, and why."""

  generation: str                  # "v4", "v5e", ...; the generic row: "other / unknown"
  sizes: BlockSizes                # forward (block_q, block_kv), backward (block_q_bwd, block_kv_bwd)
  vmem_capacity: int | None        # bytes of VMEM (measured: the largest scratch Mosaic accepts)
  default_scoped_vmem: int | None  # Mosaic's default scoped VMEM limit, bytes
  why: str                         # the reason for these tiles (docs/kernels.md prints it)


TILE_TABLE: tuple[TileEntry, ...] = (
    TileEntry(generation="v4", sizes=BlockSizes(512, 512, 256, 512), vmem_capacity=16 * MiB,
              default_scoped_vmem=16 * MiB,
              why="all the VMEM there is; the backward holds ~2× the forward's temporaries"),
    TileEntry(generation="v5e", sizes=BlockSizes(512, 1024, 512, 512), vmem_capacity=128 * MiB,
              default_scoped_vmem=16 * MiB,
              why="least HBM bandwidth per FLOP: long kv tiles, ~1.4 µs of MXU work per step "
                  "against ~0.35 µs of step overhead"),
    TileEntry(generation="v5p", sizes=BlockSizes(512, 1024, 512, 512), vmem_capacity=64 * MiB,
              default_scoped_vmem=32 * MiB,
              why="166 FLOPs/byte: 512-row q tiles already keep the MXU the bound"),
    TileEntry(generation="v6e", sizes=BlockSizes(1024, 1024, 512, 1024), vmem_capacity=128 * MiB,
              default_scoped_vmem=32 * MiB,
              why="~560 FLOPs per HBM byte: a forward tile does ~block_q FLOPs per byte of K/V, "
                  "so ≥ 1,024 q rows"),
)
GENERIC = TileEntry(generation="other / unknown", sizes=BlockSizes(512, 512, 512, 512),
                    vmem_capacity=None, default_scoped_vmem=None,
                    why="square tiles keep 512-token documents block-diagonal")

DEFAULT_BLOCK_SIZES: dict[str, BlockSizes] = {e.generation: e.sizes for e in TILE_TABLE}
VMEM_CAPACITY: dict[str, int] = {e.generation: e.vmem_capacity for e in TILE_TABLE}
DEFAULT_SCOPED_VMEM: dict[str, int] = {e.generation: e.default_scoped_vmem for e in TILE_TABLE}
GENERIC_BLOCK_SIZES = GENERIC.sizes

# What `jax.Device.device_kind` says for each generation.
GENERATION_OF_KIND = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                      "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}

# The plan and tile tables are scalar-prefetched into SMEM (1 MiB on v5e: 2^18 int32 words, some
# taken by Mosaic itself); half of it keeps a margin. Both grow linearly with the length: one
# token row of 2^20 tokens at 512-token blocks takes 2 x 2,048 plan words, with segment ids
# 4 x 4,096 more.
MAX_PLAN_WORDS = 2**17

# The forward's q tile covers up to this many query heads of a GQA group: each K/V tile is then
# fetched once per MAX_TILE_HEADS heads instead of once per head. The heads run in a loop (code
# size does not grow with them), but the q-side tiles and scratch do, and the "parallel" grid
# shrinks by the same factor; at 8 heads per K/V tile the K/V stream is already a small share of
# the forward's HBM traffic.
MAX_TILE_HEADS = 8

# The tile sizes an autotuner may try (each a multiple of the 128 lanes; see `candidates`).
CANDIDATE_TILES = (128, 256, 512, 1024, 2048)


def default_block_sizes(generation: str | None) -> BlockSizes:
  """The default sizes for "v4", "v5e", "v5p", "v6e" (None or unknown: a generic default)."""
  return DEFAULT_BLOCK_SIZES.get(generation, GENERIC_BLOCK_SIZES)


def tpu_generation() -> str | None:
  """The generation being compiled for, when it can be known while tracing.

  Under ``jax.sharding.set_mesh(mesh)`` the abstract mesh names the device kind (also for an
  ahead-of-time compile onto topology devices); otherwise the default device, if it is a TPU.
  """
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get_mesh(), "abstract_device", None) if get_mesh else None
  if device is None:
    device = jax.devices()[0]
    if device.platform != "tpu":
      return None
  return GENERATION_OF_KIND.get(device.device_kind)


def blocks(request: Request) -> tuple[tuple[int, int], tuple[int, int]]:
  """Effective ((block_q, block_kv), (block_q_bwd, block_kv_bwd)) for this request."""
  sizes = request.block_sizes
  # platform_dependent traces every kernel family with the same request: sizes meant for the
  # GPU family (flash_layers.GpuBlockSizes) leave the TPU family on its defaults.
  if sizes is None or isinstance(sizes, (GpuBlockSizes, CpuBlockSizes)):
    sizes = default_block_sizes(tpu_generation())
    tiles = request.block_mask_tiles
    if tiles is not None and all(t % LANES == 0 for t in tiles):
      # A prebuilt block_mask (fl.block_mask) was made for these tiles: the kernels take them, so its
      # flags serve every kernel of every layer instead of being rebuilt per call.
      sizes = BlockSizes(*tiles, *tiles)
  elif not isinstance(sizes, BlockSizes):
    raise TypeError("block_sizes must be flash_layers.BlockSizes (TPU), flash_layers.GpuBlockSizes "
                    f"(GPU) or None; got {sizes!r}")
  return clamp(sizes, request)


def clamp(sizes: BlockSizes, request: Request) -> tuple[tuple[int, int], tuple[int, int]]:
  """Blocks longer than the (128-rounded) sequence shrink to it."""
  q_cap, kv_cap = round_up(request.q_len, LANES), round_up(request.kv_len, LANES)
  fwd = (min(sizes.block_q, q_cap), min(sizes.block_kv, kv_cap))
  bwd = (min(sizes.backward[0], q_cap), min(sizes.backward[1], kv_cap))
  return fwd, bwd


def plan_words(request: Request, tiles: tuple[int, int]) -> int:
  """SMEM words (int32) of one kernel's plan and tile tables with these (block_q, block_kv)."""
  num_q, num_kv = -(-request.q_len // tiles[0]), -(-request.kv_len // tiles[1])
  rows = request.batch if request.has_segment_ids else 1
  segment_words = 4 * request.batch * (num_q + num_kv) if request.has_segment_ids else 0
  return 2 * rows * max(num_q, num_kv) + segment_words


def vmem_need(head_dim: int, head_dim_v: int, bq: int, bk: int, itemsize: int,
              heads: int = 1) -> int:
  """VMEM for a kernel with these tiles, an estimate with a 25% margin: the double-buffered
  q/k/v/output tiles, the scratch (float32 statistics and accumulators, the scaled q or k tile),
  and six float32 [block_q, block_kv] tiles (logits, probabilities and their gradients). The q-side
  tiles and scratch are per query head of the tile (`heads`); the logits tiles are not."""
  d, dv = round_up(head_dim, LANES), round_up(head_dim_v, LANES)
  tiles = 2 * itemsize * (heads * (bq * d + 2 * bq * dv) + bk * d + bk * dv + bk * (d + dv))
  scratch = (4 * (heads * (bq * dv + 4 * bq * LANES) + bk * (d + dv))
             + itemsize * max(heads * bq, bk) * d)
  return round_up(5 * (tiles + scratch + 6 * 4 * bq * bk) // 4, MiB)


def vmem_budget(generation: str | None) -> int | None:
  """The most scoped VMEM a kernel may ask for: 3/4 of the capacity (None: unknown generation)."""
  if generation not in VMEM_CAPACITY:
    return None
  return 3 * VMEM_CAPACITY[generation] // 4


def vmem_limit(head_dim: int, head_dim_v: int, bq: int, bk: int, itemsize: int,
               heads: int = 1) -> int | None:
  """The scoped VMEM a kernel with these tiles asks for (None: Mosaic's default, generation
  unknown): `vmem_need`, never below Mosaic's default, at most `vmem_budget`."""
  generation = tpu_generation()
  budget = vmem_budget(generation)
  if budget is None:
    return None
  need = vmem_need(head_dim, head_dim_v, bq, bk, itemsize, heads)
  return int(min(max(need, DEFAULT_SCOPED_VMEM[generation]), budget))


def forward_tiles(request: Request, fwd: tuple[int, int], token_major: bool
                  ) -> tuple[tuple[int, int], int]:
  """(forward blocks, query heads per forward q tile).

  With token-major operands the q tile of a GQA group is the (block_q, heads * head_dim) window
  of its heads' columns (contiguous: query head i uses kv head i // group), so one program
  serves them all. Only head-major layouts (head_dim not a multiple of 128) keep one head per
  tile. The per-generation tiles were sized for one head; the q-side tiles and scratch (q, out,
  the scaled q, the statistics and the accumulator) grow with the heads, the [block_q, block_kv]
  logits temporaries do not (the heads run one after another, in a loop). When the estimate
  exceeds the budget `vmem_limit` may grant (3/4 of VMEM), block_q halves (down to 128 rows: a
  shorter q tile costs FLOPs per K/V byte, which the shared K/V stream more than returns); if
  even 128 rows do not fit, fewer heads share a tile (a divisor of the group), down to one.
  """
  return group_tiles(request, fwd, token_major, min_block_q=LANES)


def dq_tile_heads(request: Request, bwd: tuple[int, int], token_major: bool) -> int:
  """Query heads per dQ q tile: the forward's rule (`forward_tiles`) on the backward blocks,
  except that block_q_bwd stays (it is also the dK/dV kernel's q tile and sets the padding with
  the forward's block_q): only the heads shrink, to a divisor of the group, until the tile fits.
  dQ's q-side tiles (q, dO, dQ) and scratch (the scaled q, dO, the accumulator, lse and D
  columns) are what `vmem_need` counts per head."""
  return group_tiles(request, bwd, token_major, min_block_q=bwd[0])[1]


def group_tiles(request: Request, tiles: tuple[int, int], token_major: bool, min_block_q: int
                ) -> tuple[tuple[int, int], int]:
  """(blocks, heads per q tile): the most heads of a GQA group (at most MAX_TILE_HEADS) whose
  tiles fit 3/4 of VMEM, halving block_q down to `min_block_q` before giving up heads."""
  group = request.num_heads // request.num_kv_heads
  if not token_major or group == 1:
    return tiles, 1
  candidates = [h for h in range(min(group, MAX_TILE_HEADS), 1, -1) if group % h == 0]
  budget = vmem_budget(tpu_generation())
  if budget is None:  # generic tiles, no known budget: the largest group
    return tiles, candidates[0] if candidates else 1
  itemsize = 2 if request.dtype == "bfloat16" else 4
  for heads in candidates:
    block_q = tiles[0]
    while True:
      if vmem_need(request.head_dim, request.head_dim_v, block_q, tiles[1], itemsize,
                   heads) <= budget:
        return (block_q, tiles[1]), heads
      if block_q <= min_block_q:
        break
      block_q = max(min_block_q, block_q // 2 // LANES * LANES)
  return tiles, 1


def candidates(request: Request, generation: str | None = None) -> list[BlockSizes]:
  """The block sizes an autotuner may time for this request, the generation's default first.

  Every forward and backward (block_q, block_kv) from `CANDIDATE_TILES`, as the kernels would
  use them (clamped to the 128-rounded lengths, duplicates dropped), whose plan fits
  `MAX_PLAN_WORDS` and whose one-head estimate (`vmem_need`, which carries a 25% margin) fits the
  generation's VMEM capacity (no VMEM cut when the generation is unknown). A coarse cut: it drops
  hopeless tiles, and compiling each candidate is the real check. GQA head sharing
  (`forward_tiles`) still applies on top. `generation` defaults to the one being compiled for.
  The list is the full product of forward and backward pairs; the two meet only in the padding
  (the lengths round up to both), so a tuner may time the forward and the backward pairs apart.
  """
  generation = generation if generation is not None else tpu_generation()
  capacity = VMEM_CAPACITY.get(generation)
  itemsize = 2 if request.dtype == "bfloat16" else 4

  def fits(tiles: tuple[int, int]) -> bool:
    if plan_words(request, tiles) > MAX_PLAN_WORDS:
      return False
    return capacity is None or vmem_need(request.head_dim, request.head_dim_v, *tiles,
                                         itemsize) <= capacity

  found = [clamp(default_block_sizes(generation), request)]
  pairs = sorted({clamp(BlockSizes(q, kv), request)[0]
                  for q, kv in itertools.product(CANDIDATE_TILES, repeat=2)})
  pairs = [p for p in pairs if fits(p)]
  for fwd, bwd in itertools.product(pairs, repeat=2):
    if (fwd, bwd) not in found:
      found.append((fwd, bwd))
  return [BlockSizes(*fwd, *bwd) for fwd, bwd in found]
