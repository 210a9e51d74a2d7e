"""Run the benchmark grid: compile each cell, read its memory, time it, never crash.

For every (impl, mask, dtype, pass) series the lengths run in ascending order.
Each cell is compiled first (cheap at any length) so its compiled temporary
memory is known before anything runs; it is then run only if

* that memory fits the limit (the dense impls stop here at long lengths; their
  memory is still reported, which is what the "x below reference" comparison needs),
* its predicted time (the previous length's time scaled by the work) fits the
  per-run limit, and
* for flash_pallas in interpret mode (the TPU kernels on a CPU), the length is
  within the interpret cap: the interpreter is a correctness tool, far slower
  than any real kernel.

Timing is the median over repeated runs after one warm-up run, each blocked
with `jax.block_until_ready`. With a TPU AOT target nothing runs: each cell is
compiled for the TPU and its memory and FLOPs are reported.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from benchmarks import cases
from flash_layers import auto, host, lowering, validate
from flash_layers.impls import REGISTRY, registry

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class Target:
  """Where cells are compiled (and run): the local backend, or a TPU compiled for ahead of time."""

  platform: str               # lowering platform: "cpu", "cuda", "tpu"
  runs: bool                  # False: compile only (AOT)
  device: Any = None          # the AOT device; None for the local default device
  name: str = ""

  @property
  def label(self) -> str:
    return self.name or self.platform


def local_target() -> Target:
  return Target(lowering.default_platform(), runs=True)


def tpu_aot_target(topology: str) -> Target:
  """A single-chip TPU from `jax.experimental.topologies` ("v5e" means "v5e:1x1"); needs libtpu."""
  from jax.experimental import topologies

  # Compiling claims no TPU, so don't let another process's libtpu lockfile refuse us.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  name = topology if ":" in topology else f"{topology}:1x1"
  try:
    with host.quiet_libtpu():
      desc = topologies.get_topology_desc(name, "tpu")
  except Exception as e:  # libtpu missing, or an unknown chip name
    raise ValueError(f"--tpu-aot {topology!r}: cannot describe TPU topology {name!r} "
                     f"(is libtpu installed? chips like v4, v5e, v5p, v6e): {e}") from None
  return Target("tpu", runs=False, device=desc.devices[0], name=f"tpu-aot {name}")


@dataclasses.dataclass(frozen=True)
class Config:
  impls: tuple[str, ...] = tuple(fl.IMPLS)
  lengths: tuple[int, ...] = LENGTHS
  masks: tuple[str, ...] = cases.MASK_KINDS
  dtypes: tuple[str, ...] = ("float32",)
  passes: tuple[str, ...] = cases.PASSES
  shape: cases.Shape = cases.Shape()
  repeats: int = 5               # timed runs per cell at most
  cell_seconds: float = 10.0     # stop repeating once the timed runs took this long (>= 2 runs)
  max_run_seconds: float = 8.0   # don't run a cell predicted to take longer than this per run
  mem_limit_bytes: int = 4 << 30  # don't run a cell whose compiled temp + argument memory exceeds this
  interpret_max_len: int = 2048  # flash_pallas interpret mode: the longest length run


def default_mem_limit() -> int:
  """A quarter of the memory available now (the machine may be shared), at most 8 GiB."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    available = 16 << 30
  return min(available // 4, 8 << 30)


# ----------------------------------------------------------------------------
# One cell
# ----------------------------------------------------------------------------

def _function(impl: str, static_kwargs: dict[str, Any], pass_: str) -> Callable:
  """The jitted computation of a cell: attention, or its gradient w.r.t. q, k and v."""

  def forward(q, k, v, segment_ids):
    return fl.attention(q, k, v, impl=impl, segment_ids=segment_ids, **static_kwargs)

  if pass_ == "fwd":
    return jax.jit(forward)

  def loss(q, k, v, segment_ids, cotangent):
    out = forward(q, k, v, segment_ids)
    return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _abstract(x, target: Target):
  if x is None:
    return None
  sharding = None if target.device is None else jax.sharding.SingleDeviceSharding(target.device)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _compile(fn, args, target: Target):
  if target.runs:
    return fn.lower(*args).compile()
  abstract = [_abstract(a, target) for a in args]
  return fn.trace(*abstract).lower(lowering_platforms=(target.platform,)).compile()


def _time(compiled, args, config: Config) -> dict[str, Any]:
  """Median wall and process-CPU seconds per run, after one warm-up run.

  CPU seconds (all threads of this process) are the steadier measure on a shared
  machine: time spent waiting for a core is not counted.
  """
  jax.block_until_ready(compiled(*args))
  walls, cpus = [], []
  while len(walls) < config.repeats:
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    walls.append(time.perf_counter() - start)
    cpus.append(time.process_time() - start_cpu)
    if len(walls) >= 2 and sum(walls) > config.cell_seconds:
      break
  return {"time_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "runs": len(walls)}


def _block_stats(impl: str, q, k, v, kwargs, target: Target) -> tuple[str, int | None, int | None]:
  """(kernel, blocks visited, blocks total); raises UnsupportedError."""
  if target.runs:
    info = fl.explain(q, k, v, impl=impl, **kwargs)
    return info.kernel, info.blocks_visited, info.blocks_total
  # fl.explain answers for the local platform; an AOT target asks the impl about its own.
  request, args = validate.prepare(q, k, v, **kwargs)
  name, _ = auto.resolve(impl, request, target.platform)
  chosen = REGISTRY[name]
  stats = registry.method(name, "block_stats")
  visited, total = (stats(request, args, target.platform) or (None, None)) if stats else (None, None)
  return chosen.kernel(request, target.platform), visited, total


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _error_fields(e: Exception) -> dict[str, Any]:
  """status "oom" or "error", its reason, and for a compile-time OOM the memory it asked for."""
  text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
  if not ("RESOURCE_EXHAUSTED" in text or isinstance(e, MemoryError)):
    return {"status": "error", "reason": text[:200]}
  fields = {"status": "oom", "reason": text[:200]}
  # XLA:TPU says e.g. "the total memory required for HLO temporaries (16.06G) exceeds available HBM".
  needed = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", text)
  if needed:
    fields["temp_bytes"] = int(float(needed.group(1)) * _UNITS[needed.group(2)])
  return fields


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------

class _Work:
  """Visible pairs (and ideal tile counts) per (mask, length, block), computed once."""

  def __init__(self, batch: int):
    self.batch = batch
    self._cache: dict[tuple, tuple[int, int | None]] = {}

  def __call__(self, mask: str, seq_len: int, kwargs, block=None) -> tuple[int, int | None]:
    key = (mask, seq_len, block)
    if key not in self._cache:
      self._cache[key] = cases.visible_work(kwargs, self.batch, seq_len, block)
    return self._cache[key]


def _tile_counts(work: _Work, mask, seq_len, kwargs, shape, total, pairs) -> dict[str, Any]:
  """Two yardsticks for blocks visited, at the impl's tile shape (inferred from its total; square).

  blocks_ideal:       tiles holding >= 1 visible pair: what an exact block-sparse kernel visits.
  blocks_lower_bound: visible pairs / tile area: the tiles the pairs would fill if packed densely.
  """
  per_row = total // (shape.batch * shape.heads)
  side = int(round(per_row ** 0.5))
  if side * side != per_row or seq_len % side:
    return {}  # non-square tiling: no yardstick
  block = seq_len // side
  _, tiles = work(mask, seq_len, kwargs, (block, block))
  return {"block": block, "blocks_ideal": tiles * shape.heads,
          "blocks_lower_bound": -(-pairs * shape.heads // (block * block))}


def run_cell(impl: str, seq_len: int, mask: str, dtype: str, pass_: str, *, config: Config,
             target: Target, work: _Work, previous: dict | None) -> dict[str, Any]:
  shape = config.shape
  row: dict[str, Any] = {"impl": impl, "seq_len": seq_len, "mask": mask, "dtype": dtype,
                         "pass": pass_, "target": target.label, "batch": shape.batch,
                         "heads": shape.heads, "head_dim": shape.head_dim}
  kwargs = cases.mask_kwargs(mask, shape.batch, seq_len)
  q, k, v, cotangent = cases.inputs(shape, seq_len, dtype)
  pairs, _ = work(mask, seq_len, kwargs)
  row["visible_pairs"] = pairs
  row["flops"] = cases.attention_flops(pairs, shape, pass_)
  try:
    kernel, visited, total = _block_stats(impl, q, k, v, kwargs, target)
  except fl.UnsupportedError as e:
    return row | {"status": "unsupported", "reason": str(e).splitlines()[0][:200]}
  row |= {"kernel": kernel, "blocks_visited": visited, "blocks_total": total}
  if visited is not None:
    row |= _tile_counts(work, mask, seq_len, kwargs, shape, total, pairs)
    if row.get("blocks_ideal"):
      row["blocks_over_ideal"] = visited / row["blocks_ideal"]
      row["blocks_over_lower_bound"] = visited / row["blocks_lower_bound"]

  interpreted = "interpret" in kernel
  if interpreted and target.runs and seq_len > config.interpret_max_len:
    return row | {"status": "not run", "reason": f"interpret mode: lengths up to "
                  f"{config.interpret_max_len} only"}

  static = {name: val for name, val in kwargs.items() if name != "segment_ids"}
  segment_ids = kwargs.get("segment_ids")
  args = [q, k, v, None if segment_ids is None else jnp.asarray(segment_ids)]
  if pass_ == "fwd+bwd":
    args.append(cotangent)
  try:
    compiled = _compile(_function(impl, static, pass_), args, target)
    memory = compiled.memory_analysis()
    row |= {"temp_bytes": int(memory.temp_size_in_bytes),
            "arg_bytes": int(memory.argument_size_in_bytes),
            "out_bytes": int(memory.output_size_in_bytes)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and "flops" in cost:
      row["xla_flops"] = float(cost["flops"])
  except Exception as e:  # a cell never stops the grid
    return row | _error_fields(e)
  if not target.runs:
    return row | {"status": "compiled"}

  needed = row["temp_bytes"] + row["arg_bytes"]
  if needed > config.mem_limit_bytes:
    return row | {"status": "not run", "reason": f"compiled memory {needed / 2**30:.1f} GiB > "
                  f"limit {config.mem_limit_bytes / 2**30:.1f} GiB"}
  if previous is not None and previous.get("blocked_at"):
    return row | {"status": "not run", "reason": f"length {previous['blocked_at']} was not run"}
  if previous is not None and previous.get("time_s"):
    # Block-sparse impls scale with the visible work, dense ones with length squared.
    ratio = (row["flops"] / previous["flops"] if visited is not None
             else (seq_len / previous["seq_len"]) ** 2)
    predicted = previous["time_s"] * ratio
    if predicted > config.max_run_seconds:
      return row | {"status": "not run", "reason": f"predicted {predicted:.0f} s per run > "
                    f"{config.max_run_seconds:.0f} s"}
  try:
    timing = _time(compiled, args, config)
  except Exception as e:
    return row | _error_fields(e)
  return row | timing | {"status": "ok", "gflops_per_s": row["flops"] / timing["time_s"] / 1e9}


def run_grid(config: Config, target: Target,
             progress: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
  """Every cell of the grid, in order; `progress` sees each row as it is done."""
  work = _Work(config.shape.batch)
  rows = []
  for impl, mask, dtype, pass_ in _series(config):
    previous = None
    for seq_len in sorted(config.lengths):
      row = run_cell(impl, seq_len, mask, dtype, pass_, config=config, target=target, work=work,
                     previous=previous)
      if row["status"] == "ok":
        previous = row
      elif row["status"] in ("not run", "oom") and previous is not None and not previous.get("blocked_at"):
        # Longer lengths only cost more: none runs after a length that did not.
        previous = previous | {"blocked_at": seq_len}
      rows.append(row)
      if progress is not None:
        progress(row)
  return rows


def _series(config: Config) -> Iterable[tuple[str, str, str, str]]:
  for dtype in config.dtypes:
    for pass_ in config.passes:
      for mask in config.masks:
        for impl in config.impls:
          yield impl, mask, dtype, pass_
