"""The autotuner: validate, time and choose a configuration for one call's shape class.

    fl.autotune(q, k, v, causal=True)                  # tune now, keep the winner in the cache
    fl.attention(q, k, v, block_sizes="autotune")      # the cached winner; tunes on a miss
    fl.attention(q, k, v)                              # impl="auto" reads the cache too

For each candidate (`candidates.for_call`; the default first):

1. Validate: run it, forward and gradients, on a small call of the same class (batch and kv
   heads cut to at most 2, the same lengths, features and tiles, the same loop decision) and
   compare with the `reference` impl. An error above `TOLERANCE` (relative to the reference's
   largest magnitude), a compile error or a non-finite value rejects it: a rejected candidate is
   never timed and never chosen.
2. Time it on the call's own shapes (random inputs): forward + backward ("train", the default) or
   forward ("eval"). The timer is pluggable; the default is device time from the profiler on an
   accelerator and process CPU time on the CPU, min and median over `repeats` runs after one
   warm-up.
3. Choose the fastest by its minimum; a candidate replaces the default only when it is faster by
   more than `min_gain` (noise must not pick a configuration).

The winner, its time, the default's and every candidate's, go to the user cache
(`flash_layers.tuning.cache`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import dispatch, lowering
from flash_layers.contract.alibi import alibi_slopes
from flash_layers.impls import REGISTRY, cpu_loop, registry
from flash_layers.impls.base import Request
from flash_layers.impls.tiling import CpuBlockSizes
from flash_layers.tuning import cache, candidates
from flash_layers.tuning.candidates import Candidate
from flash_layers.validate import check_impl, prepare

MODES = ("train", "eval")
# A candidate passes when max |candidate - reference| <= TOLERANCE * max |reference| for the output
# and each gradient (the reference impl at the request's precision, same inputs).
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 5e-3}

MAX_REPEATS = 30

Timer = Callable[[Callable[[], Any], int], list[float]]


@dataclasses.dataclass(frozen=True)
class Measured:
  candidate: Candidate
  ok: bool
  error: str | None = None      # why it was rejected
  max_error: float | None = None  # relative error of the conformance check
  seconds: tuple[float, ...] = ()

  @property
  def best(self) -> float:
    return min(self.seconds) if self.seconds else float("inf")


@dataclasses.dataclass(frozen=True)
class TuningResult:
  """What `autotune` found for one call: the chosen configuration and every measurement."""

  impl: str
  block_sizes: Any
  source: str            # cache.SOURCE_CACHE when read back, "tuned" when just measured
  key: str
  measured: tuple[Measured, ...] = ()
  seconds: float | None = None          # the winner's best time
  default_seconds: float | None = None  # the default candidate's best time
  tuning_seconds: float = 0.0           # wall time spent tuning (0 for a cache hit)
  path: str | None = None               # the cache file


# ----------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------

def process_time_timer(run: Callable[[], Any], repeats: int) -> list[float]:
  """Process CPU time per run (all threads): steadier than wall time on a shared CPU."""
  out = []
  for _ in range(repeats):
    start = time.process_time()
    jax.block_until_ready(run())
    out.append(time.process_time() - start)
  return out


def wall_timer(run: Callable[[], Any], repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    out.append(time.perf_counter() - start)
  return out


def device_timer(run: Callable[[], Any], repeats: int) -> list[float]:
  """Device time per run from a profiler trace (the events on the device planes), falling back to
  wall time when the trace has none."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      for _ in range(repeats):
        jax.block_until_ready(run())
    finally:
      jax.profiler.stop_trace()
    total = _device_seconds(trace_dir)
  if not total:
    return wall_timer(run, repeats)
  return [total / repeats] * repeats


def _device_seconds(trace_dir: str) -> float:
  """Seconds of device activity in a trace: the "XLA Modules" line where the device has one (TPU),
  else the sum over the device's stream lines (GPU kernels)."""
  total = 0.0
  for root, _, files in os.walk(trace_dir):
    for name in files:
      if not name.endswith(".xplane.pb"):
        continue
      data = jax.profiler.ProfileData.from_file(os.path.join(root, name))
      for plane in data.planes:
        if not plane.name.startswith("/device:"):
          continue
        lines = list(plane.lines)
        modules = [line for line in lines if line.name == "XLA Modules"]
        for line in modules or [line for line in lines if line.name.startswith("Stream")]:
          total += sum(event.duration_ns for event in line.events) * 1e-9
  return total


def default_timer(platform: str) -> Timer:
  return process_time_timer if platform == "cpu" else device_timer


# ----------------------------------------------------------------------------
# Inputs of a shape class
# ----------------------------------------------------------------------------

def _request_kwargs(request: Request, batch: int, num_heads: int, key) -> dict:
  """`fl.attention` keyword arguments reproducing `request`'s mask and features (synthetic arrays)."""
  spec = request.spec
  kw: dict[str, Any] = {"causal": spec.causal, "window": spec.window, "global_tokens": spec.global_tokens,
                        "scale": request.scale, "softcap": request.softcap, "precision": request.precision}
  if request.has_segment_ids:  # one document per row and some padding: the encoder's case
    kept = max(1, (3 * request.q_len) // 4)
    kw["segment_ids"] = jnp.broadcast_to((jnp.arange(request.q_len) < kept).astype(jnp.int32),
                                         (batch, request.q_len))
    if request.q_len != request.kv_len:
      kv_kept = max(1, (3 * request.kv_len) // 4)
      kw["kv_segment_ids"] = jnp.broadcast_to((jnp.arange(request.kv_len) < kv_kept).astype(jnp.int32),
                                              (batch, request.kv_len))
  if request.has_dropout:
    kw.update(dropout_rate=request.dropout_rate, dropout_rng=jax.random.key(1),
              dropout_broadcast=request.dropout_broadcast)
  if request.has_alibi:
    kw["alibi_slopes"] = alibi_slopes(num_heads)
  if request.has_bias:
    kw["bias"] = 0.1 * jax.random.normal(key, (1, num_heads, request.q_len, request.kv_len), jnp.float32)
  return kw


def _arrays(request: Request, batch: int, kv_heads: int, seed: int = 0):
  group = request.num_heads // request.num_kv_heads
  keys = jax.random.split(jax.random.key(seed), 5)
  dtype = jnp.dtype(request.dtype)
  q = jax.random.normal(keys[0], (batch, request.q_len, kv_heads * group, request.head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, request.kv_len, kv_heads, request.head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, request.kv_len, kv_heads, request.head_dim_v), dtype)
  dout = jax.random.normal(keys[3], (batch, request.q_len, kv_heads * group, request.head_dim_v), dtype)
  return (q, k, v, dout), keys[4]


def _step(impl: str, block_sizes: Any, kwargs: dict, mode: str) -> Callable:
  def out(q, k, v):
    return dispatch_attention(q, k, v, impl=impl, block_sizes=block_sizes, **kwargs)
  if mode == "eval":
    return jax.jit(lambda q, k, v, dout: out(q, k, v))

  def loss(q, k, v, dout):
    y = out(q, k, v)
    return jnp.sum(y.astype(jnp.float32) * dout.astype(jnp.float32)), y
  grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  return jax.jit(lambda q, k, v, dout: grad(q, k, v, dout)[::-1])


def dispatch_attention(q, k, v, *, impl: str, block_sizes: Any, **kwargs):
  """`fl.attention` on one device (the tuner's calls never carry a mesh)."""
  request, args = prepare(q, k, v, block_sizes=block_sizes, **kwargs)
  return dispatch.attend(q, k, v, impl=impl, request=request, args=args)[0]


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

def _validation_sizes(candidate: Candidate, request: Request) -> tuple[int, int, Any]:
  """(batch, kv heads, block sizes) of the small check: at most 2 rows and 2 kv heads, and the
  candidate's loop decision at the full shape forced, so the check runs the code the call will."""
  batch, kv_heads = min(request.batch, 2), min(request.num_kv_heads, 2)
  sizes = candidate.block_sizes
  loop_tile = registry.method(candidate.impl, "cpu_loop_tile")  # impls that run the CPU loop
  if lowering.default_platform() != "cpu" or loop_tile is None:
    return batch, kv_heads, sizes
  full = dataclasses.replace(request, block_sizes=sizes)
  loops = cpu_loop.loops_on_shapes(request, *loop_tile(full), cpu_loop.loop_bytes(full))
  base = sizes if isinstance(sizes, CpuBlockSizes) else CpuBlockSizes()
  return batch, kv_heads, dataclasses.replace(base, loop_bytes=0 if loops else cpu_loop.NEVER_LOOP)


def _max_relative_error(got, want) -> float:
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
      return float("inf")
    worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30))
  return worst


_expected: dict[tuple[Request, str], Any] = {}  # the reference's results of the last request checked


def _reference_result(request: Request, mode: str, arrays, kwargs):
  key = (request, mode)
  if key not in _expected:
    _expected.clear()
    _expected[key] = jax.device_get(_step("reference", None, kwargs, mode)(*arrays))
  return _expected[key]


Validator = Callable[[Candidate, Request, str], tuple[bool, str | None, float | None]]


def validate(candidate: Candidate, request: Request, mode: str = "train") -> tuple[bool, str | None,
                                                                                 float | None]:
  """(passed, why not, relative error): the candidate against the reference impl on a small call."""
  batch, kv_heads, sizes = _validation_sizes(candidate, request)
  arrays, key = _arrays(request, batch, kv_heads, seed=1)
  kwargs = _request_kwargs(request, batch, arrays[0].shape[2], key)
  try:
    got = _step(candidate.impl, sizes, kwargs, mode)(*arrays)
    err = _max_relative_error(got, _reference_result(request, mode, arrays, kwargs))
  except Exception as e:  # a candidate that fails to compile or run is rejected, not fatal
    return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", None
  limit = TOLERANCE.get(request.dtype, 3e-2)
  if not err <= limit:
    return False, f"conformance: relative error {err:.3g} > {limit:g}", err
  return True, None, err


# ----------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------

def tune_request(request: Request, *, impl: str = "auto", mode: str = "train", timer: Timer | None = None,
                 repeats: int = 3, min_gain: float = 0.03, cache_dir: str | os.PathLike | None = None,
                 candidate_list: Sequence[Candidate] | None = None, write: bool = True,
                 validator: Validator | None = None,
                 log: Callable[[str], None] | None = None) -> TuningResult:
  """Tune one call (its `Request`) on this device; store the winner unless `write` is False."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
  check_impl(impl)
  platform = lowering.default_platform()
  request = dataclasses.replace(request, block_sizes=None)
  cands = list(candidate_list) if candidate_list is not None else candidates.for_call(impl, request, platform)
  key = cache.bucket_key(impl, request)
  if not cands:
    name = candidates.baseline(impl, request, platform)
    return TuningResult(name, None, cache.SOURCE_DEFAULT, key)
  timer = timer or default_timer(platform)
  start = time.perf_counter()
  (q, k, v, dout), rng = _arrays(request, request.batch, request.num_kv_heads)
  kwargs = _request_kwargs(request, request.batch, request.num_heads, rng)
  measured: list[Measured] = []
  for cand in cands:
    if REGISTRY[cand.impl].unsupported(request, platform) is not None:
      measured.append(Measured(cand, False, "unsupported"))
      continue
    ok, why, err = (validator or validate)(cand, request, mode)
    if not ok:
      measured.append(Measured(cand, False, why, err))
      if log:
        log(f"  rejected {cand.describe()}: {why}")
      continue
    try:
      step = _step(cand.impl, cand.block_sizes, kwargs, mode)
      jax.block_until_ready(step(q, k, v, dout))  # compile
      warm = time.perf_counter()
      jax.block_until_ready(step(q, k, v, dout))  # warm up
      warm = time.perf_counter() - warm
      # Short calls repeat more, up to ~0.3 s of runs each, so a millisecond's noise cannot decide.
      runs = max(repeats, min(MAX_REPEATS, int(0.3 / max(warm, 1e-6))))
      seconds = tuple(timer(lambda step=step: step(q, k, v, dout), runs))
    except Exception as e:  # noqa: BLE001
      measured.append(Measured(cand, False, f"{type(e).__name__} while timing", err))
      continue
    measured.append(Measured(cand, True, None, err, seconds))
    if log:
      log(f"  {cand.describe()}: min {1e3 * min(seconds):.1f} ms, "
          f"median {1e3 * statistics.median(seconds):.1f} ms")
  winner, default = choose(measured, min_gain)
  elapsed = time.perf_counter() - start
  if winner is None:
    name = candidates.baseline(impl, request, platform)
    return TuningResult(name, None, cache.SOURCE_DEFAULT, key, tuple(measured), tuning_seconds=elapsed)
  entry = {
      "impl": winner.candidate.impl, "block_sizes": cache.encode_block_sizes(winner.candidate.block_sizes),
      "seconds": winner.best, "default_seconds": None if default is None else default.best, "mode": mode,
      "timer": getattr(timer, "__name__", "custom"), "repeats": repeats, "tuning_seconds": round(elapsed, 2),
      "jax": jax.__version__, "date": datetime.date.today().isoformat(),
      "candidates": [{"config": m.candidate.describe(), "ok": m.ok, "error": m.error,
                      "seconds": [round(s, 6) for s in m.seconds]} for m in measured],
  }
  path = cache.store(impl, request, entry, cache_dir=cache_dir) if write else None
  return TuningResult(winner.candidate.impl, winner.candidate.block_sizes, "tuned", key, tuple(measured),
                      winner.best, None if default is None else default.best, elapsed,
                      None if path is None else str(path))


def choose(measured: Sequence[Measured], min_gain: float = 0.03) -> tuple[Measured | None, Measured | None]:
  """(winner, default) among the measured candidates: the fastest by minimum time among those that
  passed validation; the default (the first candidate) is kept unless beaten by more than
  `min_gain` (a fraction). A rejected candidate is never the winner."""
  passed = [m for m in measured if m.ok and m.seconds]
  if not passed:
    return None, None
  default = measured[0] if measured and measured[0].ok and measured[0].seconds else None
  fastest = min(passed, key=lambda m: m.best)
  if default is not None and fastest.best > default.best * (1.0 - min_gain):
    return default, default
  return fastest, default


def autotune(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = "auto", mode: str = "train",
             force: bool = False, cache_dir: str | os.PathLike | None = None, timer: Timer | None = None,
             repeats: int = 3, log: Callable[[str], None] | None = None, **kwargs: Any) -> TuningResult:
  """Tune `attention(query, key, value, impl=impl, **kwargs)` on this device and keep the winner.

  Args:
    query, key, value: arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are used; the
      tuner makes its own random inputs, and synthetic segment ids when `segment_ids` is given).
    impl: "auto" (tunes the impl choice among those "auto" may take here, and their sizes) or one
      impl's sizes.
    mode: "train" times forward + backward, "eval" the forward.
    force: tune even when the user cache already has this bucket.
    cache_dir: the user cache directory (default: `cache.user_dir()`).
    timer: `timer(run, repeats) -> seconds per run` (default: device time on an accelerator,
      process CPU time on the CPU).
    **kwargs: the other `attention` arguments (mask, features, precision).

  Returns:
    A `TuningResult`; `source` is "tuned (cache hit)" when the cache already had it.
  """
  check_impl(impl)
  kwargs.pop("block_sizes", None)
  if kwargs.get("segment_ids") is not None and not hasattr(kwargs["segment_ids"], "dtype"):
    kwargs["segment_ids"] = np.asarray(kwargs["segment_ids"])
  request, _ = prepare(query, key, value, **kwargs)
  if not force:
    hit = cache.lookup(impl, request, lowering.default_platform(), cache_dir=cache_dir, shipped_dir=None)
    if hit is not None and hit.source == cache.SOURCE_CACHE:
      return TuningResult(hit.impl, hit.block_sizes, hit.source, cache.bucket_key(impl, request),
                          path=str(cache.file_for(cache.user_dir(cache_dir), cache.device_kind())))
  return tune_request(request, impl=impl, mode=mode, timer=timer, repeats=repeats, cache_dir=cache_dir,
                      log=log)


def ensure_tuned(impl: str, request: Request) -> None:
  """`block_sizes="autotune"`: tune `request` now unless the user cache has its bucket."""
  platform = lowering.default_platform()
  if cache.lookup(impl, request, platform) is not None:
    return
  if not candidates.for_call(impl, request, platform):
    return
  tune_request(request, impl=impl)
