"""`attention()` and `explain()`: validate once, pick the impl, call it.

Everything a user can get wrong is checked here, before any impl runs, so a
mistake is a ValueError/TypeError naming the argument, never a traceback from
inside JAX. The impls then trust their inputs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import masks
from flash_layers import platform as platform_lib
from flash_layers.impls import IMPLS, REGISTRY, Args, Request, UnsupportedError

log = logging.getLogger("flash_layers")

AUTO = "auto"

# On CPU, dense XLA attention wins while its [q_len, kv_len] logits stay small;
# from this many keys on, xla_chunked's O(len * chunk) memory wins (README: rule table).
CPU_CHUNKED_MIN_KV_LEN = 2048


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

def _shape_str(x) -> str:
  return f"{jnp.result_type(x)}{tuple(np.shape(x))}"


def _check_qkv(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, length, heads, head_dim]; "
                       f"got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array; got {_shape_str(x)}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError("query, key and value must share one dtype; got "
                    f"query {query.dtype}, key {key.dtype}, value {value.dtype}")
  b, t, h, d = query.shape
  _, s, kvh, dk = key.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(f"batch size differs: query {b}, key {key.shape[0]}, value {value.shape[0]}")
  if value.shape[1] != s:
    raise ValueError(f"key and value lengths differ: key kv_len={s}, value kv_len={value.shape[1]}")
  if dk != d:
    raise ValueError(f"key head_dim {dk} differs from query head_dim {d}")
  if value.shape[2] != kvh:
    raise ValueError(f"key and value must have the same number of kv heads; "
                     f"got key {kvh}, value {value.shape[2]}")
  if kvh == 0 or h % kvh:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kvh})")
  if min(b, t, s, h, d, value.shape[3]) == 0:
    raise ValueError(f"empty dimension in query {tuple(query.shape)}, key {tuple(key.shape)} "
                     f"or value {tuple(value.shape)}")


def _check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len):
  if segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError("kv_segment_ids was given without segment_ids; pass both")
    return None, None
  if kv_segment_ids is None:
    if q_len != kv_len:
      raise ValueError(f"cross-attention (q_len={q_len} != kv_len={kv_len}) with segment_ids "
                       "needs kv_segment_ids [batch, kv_len] too")
    kv_segment_ids = segment_ids
  for name, seg, length in (("segment_ids", segment_ids, q_len),
                            ("kv_segment_ids", kv_segment_ids, kv_len)):
    if not hasattr(seg, "shape") or not hasattr(seg, "dtype"):
      raise TypeError(f"{name} must be an integer array [batch, length]; got {type(seg).__name__}")
    if not jnp.issubdtype(seg.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array [batch, length]=({batch}, {length}); "
                      f"got {_shape_str(seg)}")
    if tuple(seg.shape) != (batch, length):
      raise ValueError(f"{name} must have shape [batch, length]=({batch}, {length}); "
                       f"got {tuple(seg.shape)}")
  return segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def _check_scalar(name, value, *, positive):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float; got {type(value).__name__} {value!r}")
  value = float(value)
  if not np.isfinite(value) or (positive and value <= 0) or value == 0:
    raise ValueError(f"{name} must be a finite {'positive ' if positive else 'non-zero '}float; "
                     f"got {value}")
  return value


def _check_impl(impl):
  if impl != AUTO and impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS + (AUTO,)}; got {impl!r}")


def prepare(query, key, value, *, causal=False, segment_ids=None, kv_segment_ids=None,
            window=None, scale=None, softcap=None, block_sizes=None, dense_mask=None,
            q_offset=0, kv_offset=0) -> tuple[Request, Args]:
  """Validate a call; return its static Request and array Args."""
  _check_qkv(query, key, value)
  b, t, h, d = query.shape
  s, kvh, dv = key.shape[1], key.shape[2], value.shape[3]
  q_seg, kv_seg = _check_segments(segment_ids, kv_segment_ids, b, t, s)
  if not isinstance(causal, bool):
    raise TypeError(f"causal must be a bool; got {causal!r}")
  spec = masks.MaskSpec(causal=causal, window=masks.normalize_window(window))
  scale = _check_scalar("scale", scale, positive=False)
  softcap = _check_scalar("softcap", softcap, positive=True)
  if dense_mask is not None:
    dense_mask = jnp.asarray(dense_mask, dtype=bool)
    while dense_mask.ndim < 4:
      dense_mask = dense_mask[None]
    try:
      jnp.broadcast_shapes(dense_mask.shape, (b, h, t, s))
    except ValueError:
      raise ValueError(f"mask must broadcast to [batch, heads, q_len, kv_len]=({b}, {h}, {t}, {s}); "
                       f"got {tuple(dense_mask.shape)}") from None
  request = Request(
      batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=kvh, head_dim=d, head_dim_v=dv,
      dtype=jnp.dtype(query.dtype).name, spec=spec, has_segment_ids=q_seg is not None,
      scale=d ** -0.5 if scale is None else scale, softcap=softcap,
      has_dense_mask=dense_mask is not None, block_sizes=block_sizes)
  return request, Args(q_seg, kv_seg, q_offset, kv_offset, dense_mask)


# ----------------------------------------------------------------------------
# Choosing an impl
# ----------------------------------------------------------------------------

def _auto_candidates(request: Request, platform: str) -> list[tuple[str, str]]:
  """The per-backend rule table (README, "How auto chooses"): candidates in order, with why."""
  if platform == "tpu":
    return [("flash_pallas", "TPU: our Mosaic flash kernel"),
            ("xla_chunked", "TPU: flash_pallas cannot serve it; chunked keeps memory linear"),
            ("xla_native", "TPU: fused XLA attention"),
            ("reference", "TPU: nothing else serves this request")]
  if platform in ("cuda", "rocm"):
    cands = []
    if REGISTRY["xla_native"].kernel(request, platform) == "cudnn":
      cands.append(("xla_native", "GPU: cuDNN flash attention is eligible"))
    return cands + [("flash_pallas", "GPU: our Triton flash kernel"),
                    ("xla_chunked", "GPU: flash_pallas cannot serve it; chunked keeps memory linear"),
                    ("xla_native", "GPU: XLA attention"),
                    ("reference", "GPU: nothing else serves this request")]
  if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN:
    return [("xla_chunked", f"CPU: kv_len {request.kv_len} >= {CPU_CHUNKED_MIN_KV_LEN}, "
             "chunked attention keeps memory linear"),
            ("xla_native", "CPU: dense XLA attention"),
            ("reference", "CPU: nothing else serves this request")]
  return [("xla_native", f"CPU: kv_len {request.kv_len} < {CPU_CHUNKED_MIN_KV_LEN}, "
           "dense XLA attention while the logits are small"),
          ("xla_chunked", "CPU: xla_native cannot serve it"),
          ("reference", "CPU: nothing else serves this request")]


def _who_can(request: Request, platform: str) -> list[str]:
  return [name for name in IMPLS if REGISTRY[name].unsupported(request, platform) is None]


def resolve(impl: str, request: Request, platform: str) -> tuple[str, str]:
  """(impl name, reason) for `platform`; raises UnsupportedError for an explicit impl."""
  _check_impl(impl)
  if impl != AUTO:
    missing = REGISTRY[impl].unsupported(request, platform)
    if missing is not None:
      raise UnsupportedError(
          f"impl={impl!r} does not support {missing} on {platform}; impls that do: "
          f"{_who_can(request, platform) or 'none'}")
    return impl, "explicitly requested"
  for name, reason in _auto_candidates(request, platform):
    if REGISTRY[name].unsupported(request, platform) is None:
      return name, reason
  raise UnsupportedError(f"no impl supports this request on {platform}")  # reference supports all


_logged_auto: set[tuple[Request, str]] = set()


def _log_auto_choice(request: Request, platform: str, name: str, reason: str):
  key = (request, platform)
  if key not in _logged_auto:
    _logged_auto.add(key)
    log.info("flash_layers auto: %s on %s for %s (%s)", name, platform, _signature(request), reason)


def _signature(r: Request) -> str:
  return (f"{r.dtype}[b={r.batch}, q={r.q_len}, kv={r.kv_len}, h={r.num_heads}/{r.num_kv_heads}, "
          f"d={r.head_dim}/{r.head_dim_v}] {r.spec.describe(r.has_segment_ids)}")


# Platforms whose choice may differ: the call is lowered with one branch per platform.
_DISPATCH_PLATFORMS = ("cpu", "tpu", "cuda")


def _run(name: str, query, key, value, request: Request, args: Args):
  # The scope names the impl in HLO metadata, so profiler traces show "flash_layers.<impl>".
  with jax.named_scope(f"flash_layers.{name}"):
    return REGISTRY[name].attend(query, key, value, request=request, args=args)


def attend(query, key, value, *, impl: str, request: Request, args: Args):
  """Run an already-validated request; returns (out, lse). Used by `attention` and the ring."""
  here = platform_lib.default_platform()
  if impl != AUTO:
    resolve(impl, request, here)
    return _run(impl, query, key, value, request, args)
  name, reason = resolve(AUTO, request, here)
  _log_auto_choice(request, here, name, reason)
  choices = {p: resolve(AUTO, request, p)[0] for p in _DISPATCH_PLATFORMS}
  if len(set(choices.values())) == 1:
    return _run(name, query, key, value, request, args)
  # Choose by the platform the computation is lowered for, so that an AOT compile
  # for TPU from a CPU host runs the TPU choice.
  branches = {p: (lambda q, k, v, n=n: _run(n, q, k, v, request, args))
              for p, n in choices.items()}
  return jax.lax.platform_dependent(query, key, value, default=branches["cpu"], **branches)


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------

def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = AUTO,
              causal: bool = False, segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None,
              window: int | tuple[int, int] | None = None, scale: float | None = None,
              softcap: float | None = None, block_sizes: Any = None, mesh: Any = None) -> jax.Array:
  """Scaled dot-product attention with one contract for every impl.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key: [batch, kv_len, num_kv_heads, head_dim]; num_heads % num_kv_heads == 0.
    value: [batch, kv_len, num_kv_heads, head_dim_v].
    impl: one of `IMPLS` or "auto" (see `explain`).
    causal: query i sees key j only if j <= i.
    segment_ids: int [batch, q_len]; query i sees key j only if their ids are equal
      (padding is an id of its own, e.g. 0).
    kv_segment_ids: int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    window: (left, right) or w for (w, w): query i sees keys i - left ... i + right.
    scale: logit scale; head_dim ** -0.5 by default.
    softcap: c > 0 -> logits = c * tanh(logits / c).
    block_sizes: flash_pallas tile sizes (see its BlockSizes); None for the defaults.
    mesh: a `jax.sharding.Mesh` with axes from ("data", "fsdp", "tensor", "sequence")
      (`flash_layers.make_mesh`); None uses the current mesh (`jax.set_mesh`), if any.
      The call then runs inside `shard_map`: batch over data x fsdp, heads over
      tensor, ring attention over sequence (`flash_layers.parallel`).

  Returns:
    [batch, q_len, num_heads, head_dim_v] in the query's dtype. A query that sees
    no key gets zeros (and zero gradients).
  """
  _check_impl(impl)
  request, args = prepare(query, key, value, causal=causal, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, window=window, scale=scale,
                          softcap=softcap, block_sizes=block_sizes)
  from flash_layers.parallel import sharded  # imports this module

  mesh = sharded.resolve_mesh(mesh)
  if mesh is not None:
    plan = sharded.make_plan(request, mesh)
    out, _ = sharded.sharded_attend(query, key, value, impl=impl, request=request, args=args, plan=plan)
    return out
  out, _ = attend(query, key, value, impl=impl, request=request, args=args)
  return out


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What `attention` would run for these arguments, and why."""

  impl: str
  kernel: str
  reason: str
  blocks_visited: int | None = None
  blocks_total: int | None = None
  sharding: str | None = None  # how a call with a mesh is split; None: one device

  @property
  def block_fraction(self) -> float | None:
    if self.blocks_visited is None or not self.blocks_total:
      return None
    return self.blocks_visited / self.blocks_total

  def __str__(self) -> str:
    text = f"{self.impl} [{self.kernel}]: {self.reason}"
    if self.blocks_visited is not None:
      text += (f"; blocks visited {self.blocks_visited}/{self.blocks_total} "
               f"({self.block_fraction:.3f})")
    if self.sharding is not None:
      text += f"; {self.sharding}"
    return text


def explain(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = AUTO,
            mesh: Any = None, **kwargs: Any) -> Explanation:
  """Which impl and kernel `attention(query, key, value, impl=impl, **kwargs)` runs here, and why.

  Takes the same arguments as `attention` (arrays or `jax.ShapeDtypeStruct`s;
  block counts need concrete segment ids). With a mesh, the impl is the one each
  device runs on its local shard, and `.sharding` says how the call is split.
  """
  _check_impl(impl)
  request, args = prepare(query, key, value, **kwargs)
  here = platform_lib.default_platform()
  from flash_layers.parallel import sharded  # imports this module

  mesh = sharded.resolve_mesh(mesh)
  plan = None if mesh is None else sharded.make_plan(request, mesh)
  name, reason = resolve(impl, request if plan is None else plan.local, here)
  chosen = REGISTRY[name]
  visited = total = None
  block_stats = getattr(chosen, "block_stats", None)
  if block_stats is not None:
    stats = block_stats(request, args, here)
    if stats is not None:
      visited, total = stats
  sharding = None if plan is None else plan.describe(request)
  return Explanation(name, chosen.kernel(request, here), reason, visited, total, sharding)
