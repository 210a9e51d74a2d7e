"""A written-down cost model of the context-parallel strategies: what "auto" picks and why.

Pure Python arithmetic on a `Request`: no device, no compile. For each strategy it counts the bytes
one chip sends per attention layer, forward plus backward, splits them between the slice's
interconnect (ICI) and the data-center network (DCN), and turns them into modelled seconds with the
bandwidths of `GENERATIONS`. It models communication only: every strategy does the same attention
FLOPs (up to load balance, which the ring's zig-zag layout evens out), so the bytes are what differ.

Notation. The request holds the GLOBAL lengths and one (data, tensor) shard's batch and heads:
b = batch, T = q_len, S = kv_len, h = num_heads, kvh = num_kv_heads, d = head_dim, dv = head_dim_v,
e = bytes per element of q/k/v (the request's dtype), f = 4 (float32), n = `size` (devices on the
sequence axis). One chip's local blocks, in bytes:

  Q  = b * T/n * h * d * e          K  = b * S/n * kvh * d * e       V = b * S/n * kvh * dv * e
  O  = b * T/n * h * dv * e         L  = b * T/n * h * f  (the float32 lse)

The formulas (bytes each chip sends, forward + backward; `strategy_cost` computes exactly these):

* ring (parallel/ring.py): the forward scan makes n hops of the visiting K/V block (the last hop is
  wasted: the scan does n, not n - 1); the backward scan makes n hops of K/V plus their float32 dK/dV:
      fwd n (K + V),   bwd n (K + V) (1 + f/e).
  Causal calls add the zig-zag reorder: q, k, v halves in and (out, lse) back in the forward, and
  the transposes in the backward (d_out, d_lse in; dq, dk, dv back):
      zig-zag  2 (Q + K + V + O + L).
* ulysses: all-to-alls swap the sequence split for a head split. Each chip keeps 1/n of every block
  and sends the rest: forward q, k, v in and (out, lse) back, backward d_out, d_lse in and dq, dk, dv
  back. With kvh < n the K/V heads are first repeated to n heads, so K/V count at kvh' = max(kvh, n):
      fwd (n-1)/n (Q + K' + V' + O + L),   bwd the same,   K' = K kvh'/kvh, V' = V kvh'/kvh.
  Feasible only if h % n == 0 (and kvh % n == 0 or n % kvh == 0).
* all_gather: K/V are gathered along the sequence axis, dK/dV reduce-scattered back in the input
  dtype: fwd (n-1) (K + V),   bwd (n-1) (K + V), or 2 (n-1) (K + V) on a TPU, whose compiler turns
  the reduce-scatter into an all-reduce + slice (`Generation.reduce_scatter_as_all_reduce`).
  Causal calls add the queries' zig-zag shuffle, q in and (out, lse) back forward, their
  cotangents backward:   zig-zag  2 (Q + O + L).  Memory: the gathered K/V, n (K + V) per chip;
  refused when that exceeds `ALL_GATHER_HBM_FRACTION` of the chip's HBM.
* ulysses_ring (group g, m = n/g groups): Ulysses inside each group of g consecutive devices, then a
  ring across the m groups. After the group's all-to-all a chip holds the group's g*S/n tokens at
  kvh'/g kv heads (kvh' = max(kvh, g)), so a ring hop moves b * g*S/n * kvh'/g * (d+dv) * e =
  (K' + V') bytes, the same as a plain ring hop but at kvh' heads:
      Ulysses part   2 (g-1)/g (Q + K' + V' + O + L)                    (ICI: a group is in one slice)
      ring part      m (K' + V') + m (K' + V') (1 + f/e) [+ 2 (Q + K' + V' + O + L) if causal]
  With dcn_groups > 1 (the groups sit on different slices) the ring part goes over DCN: a ring step
  waits for its slowest hop, and the hop that leaves a slice is a DCN transfer, so every ring byte is
  timed at DCN bandwidth. Each slice must hold whole groups: (n / dcn_groups) % g == 0.

When `dcn_groups` > 1 for the plain strategies (the sequence axis itself spanning slices, which
`make_mesh` refuses today but the model prices), the ring's bytes are all DCN (as above), and an
all-to-all's or all-gather's bytes split by destination: a fraction (n - n/dcn_groups) / (n - 1) of
the peers is in another slice.

Time: seconds = ici_bytes / ici_bw + dcn_bytes / dcn_bw. `ici_bw` is HALF the bidirectional ICI
bandwidth Google quotes per chip (all links, both directions): every byte a chip sends is a byte
another chip receives, and the quote counts both. That is optimistic for the ring, whose one-way
ppermute uses one link direction out of the chip's several; the model does not charge topology or
latency (a few microseconds per collective), so treat its seconds as a lower bound and its ordering
as the point. `dcn_bw` is the per-chip DCN line rate (one direction). Not counted: int32 segment ids
(a 1/(h d e/4) fraction of the K/V bytes), the strategy modules' own layout shuffles beyond those
above, and any overlap of communication with compute.
"""

from __future__ import annotations

import dataclasses
import re
import sys

from flash_layers.contract.mask_rules import MaskSpec
from flash_layers.impls import Request
from flash_layers.parallel.context import STRATEGIES

GIB = 1024**3
MIB = 1024**2
F32 = 4
# all_gather holds the whole sequence's K/V on every chip: refused above this fraction of HBM.
ALL_GATHER_HBM_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class Generation:
  """One accelerator generation's per-chip numbers (bytes and bytes/s) and where they come from."""

  name: str
  ici_bidirectional: float  # bytes/s per chip, all ICI links, both directions (as Google quotes it)
  dcn: float  # bytes/s per chip, one direction
  hbm: float  # bytes per chip
  source: str
  # Whether XLA compiles a reduce-scatter as an all-reduce + dynamic-slice for this chip, so it
  # sends 2 (n-1)/n of the buffer instead of (n-1)/n: seen for every TPU generation in libtpu
  # 0.0.52's AOT compiles, even for a bare `psum_scatter` (benchmarks/results/cp-aot-2026-12-06.json).
  reduce_scatter_as_all_reduce: bool = False

  @property
  def ici_bw(self) -> float:
    """The one-way bandwidth the model divides a chip's sent bytes by: half the bidirectional figure."""
    return self.ici_bidirectional / 2


_GB = 1e9
_GBIT = 1e9 / 8
GENERATIONS: dict[str, Generation] = {
    # https://docs.cloud.google.com/tpu/docs/v4 : HBM2 32 GiB. The page gives no per-chip ICI or DCN
    # figure. ICI is an ASSUMPTION: 6 links (3D torus) x 50 GB/s each way (400 Gbps per direction
    # per link, https://glennklockwood.com/garden/processors/TPUv4) x 2 directions = 600 GB/s.
    # DCN is an ASSUMPTION: 25 Gbps per chip, as v5e's NICs give.
    "v4": Generation("v4", 600 * _GB, 25 * _GBIT, 32 * GIB,
                     "HBM: cloud.google.com/tpu/docs/v4; ICI, DCN: assumptions (see cost.py)", True),
    # https://docs.cloud.google.com/tpu/docs/v5e : HBM 16 GB, bidirectional ICI 400 GBps per chip,
    # per-host NIC 2 x 100 Gbps for 8 chips per host (= 25 Gbps per chip; 6.4 Tbps per 256-chip pod
    # agrees).
    "v5e": Generation("v5e", 400 * _GB, 25 * _GBIT, 16 * _GB,
                      "cloud.google.com/tpu/docs/v5e (DCN: per-host NIC / chips per host)", True),
    # https://docs.cloud.google.com/tpu/docs/v5p : HBM 95 GiB, bidirectional ICI 1200 GBps per chip,
    # DCN 50 Gbps per chip.
    "v5p": Generation("v5p", 1200 * _GB, 50 * _GBIT, 95 * GIB, "cloud.google.com/tpu/docs/v5p", True),
    # https://docs.cloud.google.com/tpu/docs/v6e : HBM 32 GB, bidirectional ICI 800 GBps per chip.
    # DCN per chip is not on the page: an ASSUMPTION of 25 Gbps, as v5e.
    "v6e": Generation("v6e", 800 * _GB, 25 * _GBIT, 32 * _GB,
                      "cloud.google.com/tpu/docs/v6e; DCN: assumption (as v5e)", True),
    # Generic entries, ASSUMPTIONS all: host devices share memory (20 GB/s both ways, 16 GiB),
    # a networked host 10 Gbps.
    "cpu": Generation("cpu", 20 * _GB, 10 * _GBIT, 16 * GIB, "assumption (simulated host devices)"),
    # An H100-class GPU: NVLink 900 GB/s bidirectional per GPU, one 400 Gbps NIC per GPU, 80 GB HBM
    # (NVIDIA's published H100 SXM figures, not checked against a page in this repo: an ASSUMPTION).
    "gpu": Generation("gpu", 900 * _GB, 400 * _GBIT, 80 * _GB, "assumption (H100 SXM class)"),
}


@dataclasses.dataclass(frozen=True)
class StrategyCost:
  """One strategy's modelled communication per chip per layer, forward + backward."""

  strategy: str
  feasible: bool
  why_not: str | None
  ici_bytes: float
  dcn_bytes: float
  memory_bytes: float  # extra per-chip activation memory the strategy holds
  seconds: float
  group: int | None = None  # ulysses_ring's group

  @property
  def bytes(self) -> float:
    return self.ici_bytes + self.dcn_bytes


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of a dtype name ("bfloat16" -> 2; "float8_e4m3fn" -> 1)."""
  name = str(dtype)
  if name in _DTYPE_BYTES:
    return _DTYPE_BYTES[name]
  bits = re.search(r"(\d+)", name)
  if not bits:
    raise ValueError(f"dtype {name!r}: cannot tell its size")
  return max(1, int(bits.group(1)) // 8)


@dataclasses.dataclass(frozen=True)
class _Blocks:
  """One chip's local blocks in bytes (the docstring's Q, K, V, O, L), K/V at `kv_heads` heads."""

  q: float
  k: float
  v: float
  o: float
  lse: float
  e: int

  @property
  def kv(self) -> float:
    return self.k + self.v

  @property
  def all(self) -> float:
    return self.q + self.k + self.v + self.o + self.lse


def _blocks(r: Request, n: int, kv_heads: int | None = None) -> _Blocks:
  e = dtype_bytes(r.dtype)
  t, s = r.batch * r.q_len / n, r.batch * r.kv_len / n
  kvh = r.num_kv_heads if kv_heads is None else kv_heads
  return _Blocks(q=t * r.num_heads * r.head_dim * e, k=s * kvh * r.head_dim * e,
                 v=s * kvh * r.head_dim_v * e, o=t * r.num_heads * r.head_dim_v * e,
                 lse=t * r.num_heads * F32, e=e)


def _ring_bytes(blocks: _Blocks, hops: int, causal: bool) -> float:
  fwd = hops * blocks.kv
  bwd = hops * blocks.kv * (1 + F32 / blocks.e)
  zigzag = 2 * blocks.all if causal else 0.0
  return fwd + bwd + zigzag


def _a2a_bytes(blocks: _Blocks, n: int) -> float:
  """Ulysses: (n-1)/n of q, k, v, out, lse forward and of their cotangents backward."""
  return 2 * (n - 1) / n * blocks.all


def _split(total: float, n: int, dcn_groups: int) -> tuple[float, float]:
  """(ici, dcn) of a collective whose chip talks to every other chip of the axis evenly."""
  if dcn_groups <= 1 or n <= 1:
    return total, 0.0
  remote = (n - n // dcn_groups) / (n - 1)
  return total * (1 - remote), total * remote


def _kv_heads_refusal(r: Request, g: int, what: str) -> str | None:
  if r.num_heads % g:
    return f"{what}: num_heads {r.num_heads} does not divide by {g} devices"
  kvh = r.num_kv_heads
  if kvh % g and g % kvh:
    return f"{what}: num_kv_heads {kvh} neither divides nor is divided by {g} devices"
  return None


def _length_refusal(r: Request, n: int, what: str, chunks: int) -> str | None:
  for name, length in (("q_len", r.q_len), ("kv_len", r.kv_len)):
    if length % (n * chunks):
      return f"{what}: {name} {length} does not divide into {n * chunks} chunks ({n} devices x {chunks})"
  return None


def _zigzag(r: Request, n: int) -> bool:
  """Whether the ring runs zig-zag (as parallel/sharded.py decides): causal, no window, 2n chunks."""
  return (n > 1 and r.spec.causal and r.spec.window is None
          and r.q_len % (2 * n) == 0 and r.kv_len % (2 * n) == 0)


def _cost(strategy, r, n, gen, *, ici=0.0, dcn=0.0, memory=0.0, why_not=None, group=None):
  if why_not is not None:
    return StrategyCost(strategy, False, why_not, ici, dcn, memory, float("inf"), group)
  seconds = ici / gen.ici_bw + dcn / gen.dcn
  return StrategyCost(strategy, True, None, ici, dcn, memory, seconds, group)


def _ring_cost(r: Request, n: int, gen: Generation, dcn_groups: int) -> StrategyCost:
  why = _length_refusal(r, n, "ring", 1)
  blocks = _blocks(r, n)
  total = _ring_bytes(blocks, n, _zigzag(r, n))
  ici, dcn = (0.0, total) if dcn_groups > 1 else (total, 0.0)
  # The visiting K/V block and, in the backward, its float32 dK/dV carriers.
  memory = blocks.kv * (1 + F32 / blocks.e)
  return _cost("ring", r, n, gen, ici=ici, dcn=dcn, memory=memory, why_not=why)


def _ulysses_cost(r: Request, n: int, gen: Generation, dcn_groups: int) -> StrategyCost:
  why = _length_refusal(r, n, "ulysses", 1) or _kv_heads_refusal(r, n, "ulysses")
  blocks = _blocks(r, n, max(r.num_kv_heads, n))
  ici, dcn = _split(_a2a_bytes(blocks, n), n, dcn_groups)
  # The head-split copies of q, k, v, out (the whole sequence at h/n heads: as large as the shards).
  return _cost("ulysses", r, n, gen, ici=ici, dcn=dcn, memory=blocks.all, why_not=why)


def _all_gather_cost(r: Request, n: int, gen: Generation, dcn_groups: int) -> StrategyCost:
  why = _length_refusal(r, n, "all_gather", 1)
  blocks = _blocks(r, n)
  # Forward: the gather of K/V; backward: the reduce-scatter of dK/dV (twice that as an all-reduce);
  # causal: the queries' zig-zag shuffle, q and (out, lse) forward, their cotangents backward.
  backward = (n - 1) * blocks.kv * (2 if gen.reduce_scatter_as_all_reduce else 1)
  zigzag = 2 * (blocks.q + blocks.o + blocks.lse) if _zigzag(r, n) else 0.0
  ici, dcn = _split((n - 1) * blocks.kv + backward + zigzag, n, dcn_groups)
  memory = n * blocks.kv
  limit = ALL_GATHER_HBM_FRACTION * gen.hbm
  if why is None and memory > limit:
    why = (f"all_gather: the gathered K/V take {memory / MIB:.1f} MiB per chip, over "
           f"{ALL_GATHER_HBM_FRACTION:g} of {gen.name}'s {gen.hbm / GIB:.1f} GiB HBM ({limit / MIB:.1f} MiB)")
  return _cost("all_gather", r, n, gen, ici=ici, dcn=dcn, memory=memory, why_not=why)


def _ulysses_ring_cost(r: Request, n: int, gen: Generation, dcn_groups: int, g: int) -> StrategyCost:
  why = None
  if not 1 < g < n or n % g:
    why = f"ulysses_ring: group {g} must divide {n} devices and lie strictly between 1 and {n}"
  elif dcn_groups > 1 and (n // dcn_groups) % g:
    why = (f"ulysses_ring: group {g} does not divide the {n // dcn_groups} devices of a slice "
           f"({n} devices over {dcn_groups} slices)")
  why = why or _length_refusal(r, n, "ulysses_ring", 1) or _kv_heads_refusal(r, g, "ulysses_ring")
  m = n // g if n % g == 0 else 1
  blocks = _blocks(r, n, max(r.num_kv_heads, g))
  a2a = _a2a_bytes(blocks, g)
  ring = _ring_bytes(blocks, m, _zigzag(r, n))
  ici, dcn = (a2a, ring) if dcn_groups > 1 else (a2a + ring, 0.0)
  memory = blocks.all + blocks.kv * (1 + F32 / blocks.e)
  return _cost("ulysses_ring", r, n, gen, ici=ici, dcn=dcn, memory=memory, why_not=why, group=g)


def ulysses_ring_group(request: Request, size: int, dcn_groups: int = 1) -> int | None:
  """The group "auto" gives ulysses_ring: the largest divisor g of `size` with 1 < g < size and
  num_heads % g == 0 (within one slice: g divides size / dcn_groups); None if there is none."""
  per_slice = size // dcn_groups if dcn_groups > 1 and size % dcn_groups == 0 else size
  for g in range(size - 1, 1, -1):
    if size % g == 0 and per_slice % g == 0 and _kv_heads_refusal(request, g, "") is None:
      return g
  return None


def strategy_cost(strategy: str, request: Request, size: int, group: int = 1, generation: str = "v5p",
                  dcn_groups: int = 1) -> StrategyCost:
  """The modelled communication of `strategy` for `request` (global lengths, one shard's batch and
  heads) on `size` devices of the sequence axis (`group`: ulysses_ring's devices per Ulysses group;
  `dcn_groups`: the slices the axis spans). Formulas: the module docstring."""
  gen = GENERATIONS[generation]
  if dcn_groups < 1 or size % dcn_groups:
    raise ValueError(f"dcn_groups {dcn_groups} must divide size {size}")
  if strategy == "ring":
    return _ring_cost(request, size, gen, dcn_groups)
  if strategy == "ulysses":
    return _ulysses_cost(request, size, gen, dcn_groups)
  if strategy == "all_gather":
    return _all_gather_cost(request, size, gen, dcn_groups)
  if strategy == "ulysses_ring":
    return _ulysses_ring_cost(request, size, gen, dcn_groups, group)
  raise ValueError(f"unknown context-parallel strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def _name(c: StrategyCost) -> str:
  return c.strategy if c.group is None else f"{c.strategy}(group={c.group})"


def _describe(c: StrategyCost, generation: str) -> str:
  """"<MiB> MiB/chip/layer over <network> (<ms> ms on <generation>)"."""
  nets = "over ICI" if not c.dcn_bytes else ("over DCN" if not c.ici_bytes else
                                              f"({c.dcn_bytes / MIB:.1f} MiB of it over DCN)")
  return f"{c.bytes / MIB:.1f} MiB/chip/layer {nets} ({c.seconds * 1e3:.3g} ms on {generation})"


def choose(request: Request, size: int, generation: str = "v5p", dcn_groups: int = 1,
           allowed: tuple[str, ...] = STRATEGIES):
  """The feasible strategy with the least modelled seconds (ties: fewer bytes, then STRATEGIES
  order) -> (strategy, group, reason, costs); group is ulysses_ring's (else None), costs every
  allowed strategy's StrategyCost. Raises ValueError when none is feasible, naming why each is not."""
  group = ulysses_ring_group(request, size, dcn_groups)
  costs = {}
  for s in allowed:
    if s == "ulysses_ring" and group is None:
      costs[s] = _cost(s, request, size, GENERATIONS[generation],
                       why_not=f"ulysses_ring: no group g with 1 < g < {size} dividing {size} devices "
                               f"and num_heads {request.num_heads}")
      continue
    costs[s] = strategy_cost(s, request, size, group or 1, generation, dcn_groups)
  order = {s: i for i, s in enumerate(STRATEGIES)}
  ranked = sorted((c for c in costs.values() if c.feasible),
                  key=lambda c: (c.seconds, c.bytes, order.get(c.strategy, len(order))))
  if not ranked:
    raise ValueError("no context-parallel strategy fits: " + "; ".join(c.why_not for c in costs.values()))
  best = ranked[0]
  reason = f"{_name(best)}: {_describe(best, generation)}"
  if len(ranked) > 1:
    reason += f" < {_name(ranked[1])} {_describe(ranked[1], generation)}"
  else:
    reason += " (the only feasible strategy)"
  return best.strategy, best.group, reason, costs


def generation_of(platform_or_device_kind: str) -> str:
  """A jax platform or `device_kind` ("TPU v5 lite", "TPU v5p", "TPU v4", "TPU v6 lite", "cpu",
  "gpu", "NVIDIA H100 80GB HBM3", ...) -> a key of GENERATIONS."""
  kind = platform_or_device_kind.lower().strip()
  table = (("v6", "v6e"), ("trillium", "v6e"), ("v5 lite", "v5e"), ("v5lite", "v5e"), ("v5e", "v5e"),
           ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"))
  for key, generation in table:
    if key in kind:
      return generation
  if kind in ("cpu", "host"):
    return "cpu"
  if any(word in kind for word in ("gpu", "cuda", "rocm", "nvidia", "amd")):
    return "gpu"
  raise ValueError(f"generation_of: unknown platform or device kind {platform_or_device_kind!r}; "
                   f"known generations: {', '.join(GENERATIONS)}")


def make_request(batch: int, q_len: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 causal: bool = True, dtype: str = "bfloat16", kv_len: int | None = None,
                 head_dim_v: int | None = None) -> Request:
  """A plain self-attention Request for the model (what the table below and the tests price)."""
  return Request(batch=batch, q_len=q_len, kv_len=q_len if kv_len is None else kv_len,
                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 head_dim_v=head_dim if head_dim_v is None else head_dim_v, dtype=dtype,
                 spec=MaskSpec(causal=causal), has_segment_ids=False, scale=head_dim**-0.5, softcap=None)


# (label, make_request args, size, generation, dcn_groups): the table in docs/sharding.md.
CASES = (
    ("128k tokens, 16:4 heads, d 128, causal", (1, 131072, 16, 4, 128), 8, "v5p", 1),
    ("8k tokens, 16:1 heads, d 128, causal", (1, 8192, 16, 1, 128), 4, "v5p", 1),
    ("8k tokens, 16:1 heads, d 128, bidirectional", (1, 8192, 16, 1, 128), 4, "v5p", 1),
    ("32k tokens, 6:6 heads, d 128, causal", (1, 32768, 6, 6, 128), 4, "v5p", 1),
    ("32k tokens, 8:8 heads, d 128, causal", (1, 32768, 8, 8, 128), 16, "v5p", 1),
    ("64k tokens, 8:8 heads, d 128, causal, 2 slices", (1, 65536, 8, 8, 128), 8, "v5p", 2),
    ("1M tokens, 8:8 heads, d 128, causal", (1, 1048576, 8, 8, 128), 8, "v5e", 1),
    ("1M tokens, 8:8 heads, d 128, causal", (1, 1048576, 8, 8, 128), 8, "v5p", 1),
    ("batch 2 x 32k tokens, 32:8 heads, d 128, causal", (2, 32768, 32, 8, 128), 8, "v4", 1),
    ("batch 2 x 32k tokens, 32:8 heads, d 128, causal", (2, 32768, 32, 8, 128), 8, "v5e", 1),
    ("batch 2 x 32k tokens, 32:8 heads, d 128, causal", (2, 32768, 32, 8, 128), 8, "v6e", 1),
    ("batch 2 x 32k tokens, 32:8 heads, d 128, causal", (2, 32768, 32, 8, 128), 8, "gpu", 1),
    ("batch 2 x 4k tokens, 8:8 heads, d 64, causal, float32", (2, 4096, 8, 8, 64), 4, "cpu", 1),
)


def table(cases=CASES) -> list[dict]:
  """Every case's choice and every strategy's modelled cost, as plain data (JSON-ready)."""
  rows = []
  for label, shape, size, generation, dcn_groups in cases:
    dtype = "float32" if "float32" in label else "bfloat16"
    causal = "bidirectional" not in label
    r = make_request(*shape, dtype=dtype, causal=causal)
    strategy, group, reason, costs = choose(r, size, generation, dcn_groups)
    rows.append({
        "case": label, "batch": shape[0], "tokens": shape[1], "heads": shape[2], "kv_heads": shape[3],
        "head_dim": shape[4], "dtype": dtype, "causal": causal, "size": size, "generation": generation,
        "dcn_groups": dcn_groups, "choice": strategy, "group": group, "reason": reason,
        "costs": {s: {"feasible": c.feasible, "why_not": c.why_not, "group": c.group,
                      "ici_mib": round(c.ici_bytes / MIB, 3), "dcn_mib": round(c.dcn_bytes / MIB, 3),
                      "memory_mib": round(c.memory_bytes / MIB, 3),
                      "ms": round(c.seconds * 1e3, 4) if c.feasible else None}
                  for s, c in costs.items()}})
  return rows


def _cell(c: dict) -> str:
  if not c["feasible"]:
    return "refused"
  dcn = f" ({c['dcn_mib']:.1f} DCN)" if c["dcn_mib"] else ""
  return f"{c['ici_mib'] + c['dcn_mib']:.1f}{dcn} / {c['ms']:.3g} ms"


def main(argv: list[str]) -> None:
  """`python -m flash_layers.parallel.cost [--json PATH]`: print the table (MiB per chip per layer /
  modelled ms for each strategy, and the choice); --json also writes it with the bandwidths used."""
  rows = table()
  print("| case | size | gen | " + " | ".join(STRATEGIES) + " | auto picks |")
  print("|---|---|---|" + "---|" * (len(STRATEGIES) + 1))
  for row in rows:
    cells = " | ".join(_cell(row["costs"][s]) for s in STRATEGIES)
    group = f" (group {row['group']})" if row["choice"] == "ulysses_ring" else ""
    dcn = f" x {row['dcn_groups']} slices" if row["dcn_groups"] > 1 else ""
    print(f"| {row['case']} | {row['size']}{dcn} | {row['generation']} | {cells} | {row['choice']}{group} |")
  if "--json" in argv:
    import json
    path = argv[argv.index("--json") + 1]
    generations = {g.name: {"ici_bidirectional_GBps": g.ici_bidirectional / 1e9,
                            "ici_model_GBps": g.ici_bw / 1e9, "dcn_Gbps": g.dcn * 8 / 1e9,
                            "hbm_GiB": round(g.hbm / GIB, 2), "source": g.source}
                   for g in GENERATIONS.values()}
    with open(path, "w") as f:
      json.dump({"what": "context-parallel cost model (flash_layers/parallel/cost.py), per chip per "
                         "layer, forward + backward, batch 1 unless stated",
                 "generations": generations, "cases": rows}, f, indent=1)
      f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
  main(sys.argv[1:])
