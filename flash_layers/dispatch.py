"""Dispatch: validate a call once (`prepare`), choose its impl (`resolve`, the auto table), run it (`attend`).

Everything a user can get wrong is checked here, before any impl runs, so a
mistake is a ValueError/TypeError naming the argument, never a traceback from
inside JAX. The impls then trust their inputs. The public `attention`/`explain`
(api.py), the sharded and ring paths (parallel/) and the layers all build on
this module; it imports none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import lowering
from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.impls import IMPLS, REGISTRY, Args, Request, UnsupportedError, cpu_loop, registry, tiling
from flash_layers.impls.flash_pallas import decode as flash_decode
from flash_layers.tuning import cache as tuning_cache

log = logging.getLogger("flash_layers")

AUTO = "auto"

# On CPU, xla_dense's fwd+bwd wins while its [q_len, kv_len] logits stay small; from this many keys
# on, "auto" takes xla_chunked, whose memory is O(len * chunk). Both run a forward pass that is not
# differentiated one batch row and kv head at a time there (impls/cpu_loop.py). (docs/contract.md:
# the auto rule; docs/benchmarks.md: the crossover.)
CPU_CHUNKED_MIN_KV_LEN = 1024
# Decoding (up to cpu_loop.FEW_QUERIES new queries against a long KV cache): the [q_len, kv_len] logits
# stay small at any kv_len, so "auto" keeps xla_dense on CPU, and the call runs whole.



# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

# Every public entry point takes NumPy arrays, jax arrays and Python numbers alike. They are
# converted once, here: array arguments to jax arrays (an impl may index one with a tracer, which
# a NumPy array refuses), static numbers (scale, window, offsets, ...) to the Python bool/int/float
# they hold, so a Request and the jit caches key on the value, not on its type.

def as_array(name: str, x):
  """An array argument as a jax array: a NumPy array or scalar, or a Python number, is converted;
  jax arrays (tracers included), `jax.ShapeDtypeStruct`s (explain on abstract arguments) and None
  pass through unchanged; anything else (a list, a string) is a TypeError naming the argument."""
  if x is None or isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    return x
  if isinstance(x, (np.ndarray, np.generic, int, float)):
    return jnp.asarray(np.asarray(x))  # via NumPy: a Python number is strongly typed, as NumPy's
  raise TypeError(f"{name} must be an array (NumPy or jax) or a Python number; got {type(x).__name__}")


def as_static(name: str, value, *, traced_ok: bool = False):
  """A NumPy scalar or a concrete 0-d array -> the Python bool/int/float it holds; anything else
  unchanged (the checks that follow judge it). A traced 0-d value is refused by name, unless
  `traced_ok` (position offsets, which ring attention traces)."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
    try:
      return value.item()
    except jax.errors.ConcretizationTypeError:
      if traced_ok:
        return value
      raise TypeError(f"{name} must be a static Python number; got a traced value "
                      f"{_shape_str(value)} (pass it as a static argument of jit)") from None
  return value


def as_qkv(query, key, value):
  """query, key and value as jax arrays (`as_array`)."""
  return tuple(as_array(name, x) for name, x in (("query", query), ("key", key), ("value", value)))


def _static_window(window):
  if isinstance(window, (np.ndarray, jax.Array)) and window.ndim == 1:
    window = tuple(window)
  if isinstance(window, (tuple, list)):
    return tuple(as_static("window", w) for w in window)
  return as_static("window", window)


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
  checked = []
  for name, seg, length in (("segment_ids", segment_ids, q_len),
                            ("kv_segment_ids", kv_segment_ids, kv_len)):
    seg = as_array(name, seg)
    if not jnp.issubdtype(seg.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array [batch, length]=({batch}, {length}); "
                      f"got {_shape_str(seg)}")
    if tuple(seg.shape) != (batch, length):
      raise ValueError(f"{name} must have shape [batch, length]=({batch}, {length}); "
                       f"got {tuple(seg.shape)}")
    if isinstance(seg, jax.ShapeDtypeStruct):  # explain() on abstract arguments
      checked.append(jax.ShapeDtypeStruct(seg.shape, jnp.int32))
    else:
      checked.append(seg.astype(jnp.int32))
  return tuple(checked)


def _check_scalar(name, value, *, positive):
  value = as_static(name, value)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float; got {type(value).__name__} {value!r}")
  value = float(value)
  if not np.isfinite(value) or (positive and value <= 0) or value == 0:
    raise ValueError(f"{name} must be a finite {'positive ' if positive else 'non-zero '}float; "
                     f"got {value}")
  return value


def _check_dropout(rate, rng, broadcast):
  """-> (rate, int32[2] seed or None, broadcast)."""
  rate, broadcast = as_static("dropout_rate", rate), as_static("dropout_broadcast", broadcast)
  if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
    raise TypeError(f"dropout_rate must be a Python float in [0, 1); got {type(rate).__name__} {rate!r}")
  rate = float(rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {rate}")
  if not isinstance(broadcast, bool):
    raise TypeError(f"dropout_broadcast must be a bool; got {broadcast!r}")
  if rng is not None and not dropout.is_key(rng):
    got = _shape_str(rng) if hasattr(rng, "dtype") else type(rng).__name__
    raise TypeError("dropout_rng must be a PRNG key: jax.random.key(seed) or a uint32[2] "
                    f"jax.random.PRNGKey(seed); got {got}")
  if rate == 0.0:
    return 0.0, None, False
  if rng is None:
    raise ValueError(f"dropout_rng is required when dropout_rate > 0 (got dropout_rate={rate}); "
                     "pass a PRNG key, e.g. jax.random.key(0)")
  return rate, dropout.seed_words(rng), broadcast


def _per_head_floats(name: str, x, num_heads: int, what: str):
  """`x` as float32 [num_heads] (a ShapeDtypeStruct stays abstract, for explain), or None; else a
  ValueError naming `name` and saying `what` it holds."""
  if x is None:
    return None
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  x = as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or tuple(x.shape) != (num_heads,):
    raise ValueError(f"{name} must be a float array [num_heads]=({num_heads},) {what}; got {_shape_str(x)}")
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((num_heads,), jnp.float32)
  return jnp.asarray(x, jnp.float32)


def _check_alibi(slopes, num_heads):
  return _per_head_floats("alibi_slopes", slopes, num_heads,
                          f"(flash_layers.alibi_slopes({num_heads}) gives the standard ones)")


def check_sinks(sinks, num_heads: int):
  """`sinks` as float32 [num_heads] (or a ShapeDtypeStruct for explain), or None."""
  return _per_head_floats("sinks", sinks, num_heads, "of logits")


def merge_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of a call with attention sinks, from the impl's (out, lse) without them.

  A sink is a logit per head that joins every row's softmax denominator and carries no value:
  lse' = logaddexp(lse, sink[h]) and every probability shrinks by exp(lse - lse'), so
  out' = out * exp(lse - lse'). Exact for every impl (each returns a differentiable lse), on
  any mesh (applied once, after a ring has merged its shards), with dropout (the normaliser is
  taken before dropout). A row that sees no key keeps out = 0 (its lse was -inf). Gradients
  reach q, k, v through (out, lse) and the sinks through lse'.
  out [b, q, h, dv] (any float dtype), lse [b, h, q] float32, sinks [h] float32.
  """
  merged = jnp.logaddexp(lse, sinks[None, :, None])
  factor = jnp.exp(lse - merged)  # [b, h, q]; 0 where lse = -inf
  out = (out.astype(jnp.float32) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(out.dtype)
  return out, merged


def _check_bias(bias, shape):
  if bias is None:
    return None
  bias = as_array("bias", bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating) or bias.ndim > 4:
    raise ValueError(f"bias must be a float array broadcastable to [batch, heads, q_len, kv_len]={shape}; "
                     f"got {_shape_str(bias)}")
  shape4 = (1,) * (4 - bias.ndim) + tuple(bias.shape)
  if any(n not in (1, m) for n, m in zip(shape4, shape, strict=True)):
    raise ValueError(f"bias must broadcast to [batch, heads, q_len, kv_len]={shape}; "
                     f"got shape {tuple(bias.shape)}")
  if isinstance(bias, jax.ShapeDtypeStruct):  # explain() on abstract arguments
    return jax.ShapeDtypeStruct(shape4, bias.dtype)
  return jnp.reshape(bias, shape4)


# What `precision=` accepts besides None and `jax.lax.Precision` values: jax's names for its three
# precisions (those `jax.lax.Precision("...")` takes), so a precision means here what it means in
# `jnp.dot`.
_PRECISION_NAMES = {
    "default": jax.lax.Precision.DEFAULT, "bfloat16": jax.lax.Precision.DEFAULT,
    "high": jax.lax.Precision.HIGH, "bfloat16_3x": jax.lax.Precision.HIGH,
    "tensorfloat32": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST, "float32": jax.lax.Precision.HIGHEST,
}
PRECISIONS = tuple(_PRECISION_NAMES)


def normalize_precision(precision) -> jax.lax.Precision | None:
  """None stays None; a name from PRECISIONS, a `jax.lax.Precision` or a pair of one precision (what
  flax layers may pass to `jnp.einsum`) becomes a `jax.lax.Precision`; anything else is a ValueError."""
  if isinstance(precision, (tuple, list)) and len(precision) == 2 and precision[0] == precision[1]:
    precision = precision[0]
  if precision is None or isinstance(precision, jax.lax.Precision):
    return precision
  if isinstance(precision, str) and precision in _PRECISION_NAMES:
    return _PRECISION_NAMES[precision]
  raise ValueError(f"precision must be None, a jax.lax.Precision or one of {PRECISIONS}; "
                   f"got {precision!r}")


def resolve_precision(precision, dtype) -> jax.lax.Precision:
  """The matmul precision of a call: the user's, else HIGHEST (full float32 products) for every
  dtype but bfloat16, whose products are exact in one bf16 pass (DEFAULT: the kernels unchanged)."""
  precision = normalize_precision(precision)
  if precision is not None:
    return precision
  return jax.lax.Precision.DEFAULT if jnp.dtype(dtype) == jnp.bfloat16 else jax.lax.Precision.HIGHEST


def check_impl(impl: str) -> None:
  """Raise ValueError unless `impl` is one of IMPLS or \"auto\"."""
  if impl != AUTO and impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS + (AUTO,)}; got {impl!r}")


def prepare(query, key, value, *, causal=False, segment_ids=None, kv_segment_ids=None,
            window=None, scale=None, softcap=None, block_sizes=None, dense_mask=None,
            q_offset=0, kv_offset=0, global_tokens=0, dropout_rate=0.0, dropout_rng=None,
            dropout_broadcast=False, alibi_slopes=None, bias=None,
            precision=None, mask_mod=None, score_mod=None, mod_operands=None,
            block_mask=None) -> tuple[Request, Args]:
  """Validate a call; return its static Request and array Args (with global tokens, the segment
  ids are encoded here, on the whole sequence: mask_rules.encode_global)."""
  _check_qkv(query, key, value)
  causal, global_tokens = as_static("causal", causal), as_static("global_tokens", global_tokens)
  window = _static_window(window)
  q_offset = as_static("q_offset", q_offset, traced_ok=True)
  kv_offset = as_static("kv_offset", kv_offset, traced_ok=True)
  b, t, h, d = query.shape
  s, kvh, dv = key.shape[1], key.shape[2], value.shape[3]
  q_seg, kv_seg = _check_segments(segment_ids, kv_segment_ids, b, t, s)
  if not isinstance(causal, bool):
    raise TypeError(f"causal must be a bool; got {causal!r}")
  window = mask_rules.normalize_window(window)
  if isinstance(global_tokens, bool) or not isinstance(global_tokens, (int, np.integer)) or global_tokens < 0:
    raise ValueError(f"global_tokens must be an int >= 0; got {global_tokens!r}")
  if global_tokens and window is None:
    raise ValueError(f"global_tokens={global_tokens} needs a window (global tokens waive the window; "
                     "without one every token already sees its whole document)")
  spec = mask_rules.MaskSpec(causal=causal, window=window, global_tokens=int(global_tokens))
  if spec.global_tokens and q_seg is not None:
    q_seg, kv_seg = mask_rules.encode_global(q_seg, spec.global_tokens), mask_rules.encode_global(kv_seg,
                                                                                        spec.global_tokens)
  scale = _check_scalar("scale", scale, positive=False)
  softcap = _check_scalar("softcap", softcap, positive=True)
  if dense_mask is not None:
    dense_mask = jnp.asarray(as_array("mask", dense_mask), dtype=bool)
    while dense_mask.ndim < 4:
      dense_mask = dense_mask[None]
    try:
      jnp.broadcast_shapes(dense_mask.shape, (b, h, t, s))
    except ValueError:
      raise ValueError(f"mask must broadcast to [batch, heads, q_len, kv_len]=({b}, {h}, {t}, {s}); "
                       f"got {tuple(dense_mask.shape)}") from None
  rate, seed, broadcast = _check_dropout(dropout_rate, dropout_rng, dropout_broadcast)
  slopes = _check_alibi(alibi_slopes, h)
  bias = _check_bias(bias, (b, h, t, s))
  precision = resolve_precision(precision, query.dtype)
  mask_mod, tiles, mod_tiles = _check_block_mask(block_mask, mask_mod, block_sizes, b, t, s)
  mask_mod, score_mod, operands = mods.check(mask_mod, score_mod, mod_operands, as_array)
  if isinstance(block_sizes, str) and block_sizes != tuning_cache.AUTOTUNE:
    raise ValueError(f"block_sizes must be a block-size object, None or {tuning_cache.AUTOTUNE!r}; "
                     f"got {block_sizes!r}")
  if not (block_sizes is None or isinstance(block_sizes, (str, *tiling.BLOCK_SIZE_CLASSES))):
    raise TypeError("block_sizes must be flash_layers.BlockSizes (TPU), GpuBlockSizes or CpuBlockSizes, "
                    f"None or {tuning_cache.AUTOTUNE!r}; got {type(block_sizes).__name__}")
  request = Request(
      batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=kvh, head_dim=d, head_dim_v=dv,
      dtype=jnp.dtype(query.dtype).name, spec=spec, has_segment_ids=q_seg is not None,
      scale=d ** -0.5 if scale is None else scale, softcap=softcap,
      has_dense_mask=dense_mask is not None, block_sizes=block_sizes, dropout_rate=rate,
      dropout_broadcast=broadcast, has_alibi=slopes is not None, has_bias=bias is not None,
      precision=precision, mask_mod=mask_mod, score_mod=score_mod, block_mask_tiles=tiles,
      mod_operand_dtypes=tuple(jnp.dtype(x.dtype).name for x in operands),
      mod_operand_words=sum(int(np.prod(x.shape)) for x in operands))
  return request, Args(q_seg, kv_seg, q_offset, kv_offset, dense_mask, dropout_seed=seed,
                       alibi_slopes=slopes, bias=bias, mod_operands=operands, mod_tiles=mod_tiles)


def _check_block_mask(bm, mask_mod, block_sizes, batch: int, q_len: int, kv_len: int):
  """(mask_mod, (block_q, block_kv) or None, tile flags or None) of a call given `block_mask=`
  (`mods.block_mask`): its mask_mod, its tiles as xla_chunked's chunks, its flags for every layer."""
  if bm is None:
    return mask_mod, None, None
  if not isinstance(bm, block_info.BlockMask):
    raise TypeError(f"block_mask must be a flash_layers.block_mask(...) result; got {type(bm).__name__}")
  if mask_mod is not None and mask_mod != bm.mask_mod:
    raise ValueError("mask_mod differs from the block_mask's own; pass one of them (block_mask carries its "
                     "mask_mod)")
  if (bm.q_len, bm.kv_len) != (q_len, kv_len) or bm.any.shape[0] not in (1, batch):
    raise ValueError(f"block_mask was built for q_len {bm.q_len}, kv_len {bm.kv_len} with tile flags for "
                     f"{bm.any.shape[0]} row(s) (1: shared by every row); this call has batch {batch}, "
                     f"q_len {q_len}, kv_len {kv_len}")
  if isinstance(block_sizes, tiling.CpuBlockSizes) and any(
      size not in (None, mine) for size, mine in ((block_sizes.block_q, bm.block_q),
                                                  (block_sizes.block_kv, bm.block_kv))):
    raise ValueError(f"block_sizes={block_sizes!r} differ from the block_mask's tiles "
                     f"({bm.block_q}, {bm.block_kv}); the block_mask sets xla_chunked's chunks")
  return bm.mask_mod, (bm.block_q, bm.block_kv), (bm.any, bm.all)


# ----------------------------------------------------------------------------
# Choosing an impl
# ----------------------------------------------------------------------------

def _auto_candidates(request: Request, platform: str) -> list[tuple[str, str]]:
  """The per-backend rule table (docs/contract.md, "How auto chooses"): candidates in order, with why."""
  decoding = flash_decode.unserved(request) is None  # up to FEW_QUERIES queries, no dropout/ALiBi/...
  if platform == "tpu":
    if decoding:
      return [("flash_pallas", f"TPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): our "
               "split-KV Mosaic decode kernel"),
              ("xla_chunked", "TPU: flash_pallas cannot serve it; chunked keeps memory linear"),
              ("xla_native", "TPU: fused XLA attention"),
              ("reference", "TPU: nothing else serves this request")]
    return [("flash_pallas", "TPU: our Mosaic flash kernel"),
            ("xla_chunked", "TPU: flash_pallas cannot serve it; chunked keeps memory linear"),
            ("xla_native", "TPU: fused XLA attention"),
            ("reference", "TPU: nothing else serves this request")]
  if platform in ("cuda", "rocm"):
    cands = []
    if decoding:  # before cuDNN, whose kernels tile the queries: one program per (batch, head)
      cands.append(("flash_pallas", f"GPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): our "
                    "split-KV Triton decode kernel"))
    if REGISTRY["xla_native"].kernel(request, platform) == "cudnn":
      cands.append(("xla_native", "GPU: cuDNN flash attention is eligible"))
    return cands + [("flash_pallas", "GPU: our Triton flash kernel"),
                    ("xla_chunked", "GPU: flash_pallas cannot serve it; chunked keeps memory linear"),
                    ("xla_native", "GPU: XLA attention"),
                    ("reference", "GPU: nothing else serves this request")]
  if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN and request.q_len <= cpu_loop.FEW_QUERIES:
    return [("xla_dense", f"CPU: q_len {request.q_len} <= {cpu_loop.FEW_QUERIES} (decoding): the "
             f"[q_len, kv_len] logits stay small at kv_len {request.kv_len}"),
            ("xla_chunked", "CPU: xla_dense cannot serve it"),
            ("reference", "CPU: nothing else serves this request")]
  if request.kv_len >= CPU_CHUNKED_MIN_KV_LEN:
    return [("xla_chunked", f"CPU: kv_len {request.kv_len} >= {CPU_CHUNKED_MIN_KV_LEN}, "
             "chunked attention keeps memory linear"),
            ("xla_dense", "CPU: dense attention"),
            ("reference", "CPU: nothing else serves this request")]
  return [("xla_dense", f"CPU: kv_len {request.kv_len} < {CPU_CHUNKED_MIN_KV_LEN}, dense attention "
           "laid out for XLA:CPU while the [q_len, kv_len] logits are small"),
          ("xla_chunked", "CPU: xla_dense cannot serve it"),
          ("reference", "CPU: nothing else serves this request")]


def _who_can(request: Request, platform: str) -> list[str]:
  return [name for name in IMPLS if REGISTRY[name].unsupported(request, platform) is None]


def resolve(impl: str, request: Request, platform: str) -> tuple[str, str]:
  """(impl name, reason) for `platform`; raises UnsupportedError for an explicit impl."""
  check_impl(impl)
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
  precision = r.precision.name.lower()
  extras = "".join(f"+{name}" for name, on in (
      (f"dropout={r.dropout_rate}", r.has_dropout), ("alibi", r.has_alibi), ("bias", r.has_bias),
      (f"precision={precision}", r.precision != resolve_precision(None, r.dtype)),
      (f"mask_mod={mods.describe(r.mask_mod)}", r.mask_mod is not None),
      (f"score_mod={mods.describe(r.score_mod)}", r.score_mod is not None)) if on)
  return (f"{r.dtype}[b={r.batch}, q={r.q_len}, kv={r.kv_len}, h={r.num_heads}/{r.num_kv_heads}, "
          f"d={r.head_dim}/{r.head_dim_v}] {r.spec.describe(r.has_segment_ids)}{extras}")


# Platforms whose choice may differ: the call is lowered with one branch per platform.
_DISPATCH_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")


def _run(name: str, query, key, value, request: Request, args: Args):
  """``REGISTRY[name].attend`` as one jitted function of (q, k, v, the array arguments).

  A model calls attention once per layer with the same shapes and options: under the jit, the
  impl is traced (and lowered) once per program, not once per layer. The static key holds
  everything the trace reads besides the arrays: the impl, the request, the non-array arguments
  (static offsets), and the platform `lowering.lowered_only_for` names. Under `interpret_as`
  (tests) the impl runs inline: its interpreter parameters are not part of any key.
  """
  if lowering.interpreting() is not None:
    return _run_inline(name, query, key, value, request, args)
  fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
  arrays = {f: x for f, x in fields.items()
            if isinstance(x, (jax.Array, np.ndarray)) or f in ("mod_operands", "mod_tiles")}
  static = tuple((f, x) for f, x in fields.items() if f not in arrays)
  return _run_jit(query, key, value, arrays, name=name, request=request, static=static,
                  only=lowering.only_platform())


def _run_inline(name: str, query, key, value, request: Request, args: Args):
  # The scope names the impl in HLO metadata, so profiler traces show "flash_layers.<impl>".
  with jax.named_scope(f"flash_layers.{name}"):
    return REGISTRY[name].attend(query, key, value, request=request, args=args)


@functools.partial(jax.jit, static_argnames=("name", "request", "static", "only"))
def _run_jit(query, key, value, arrays, *, name: str, request: Request, static: tuple, only):
  del only  # part of the key: read by the impls through `lowering.only_platform()`
  args = Args(**dict(static), **arrays)
  return _run_inline(name, query, key, value, request, args)


def _tuned_impl_allowed(impl: str, tuned: str, request: Request, platform: str) -> bool:
  """A cache entry may choose among the impls "auto" itself may take on this platform (the same
  contract, never `reference`), or confirm the explicit impl it was tuned for."""
  if impl != AUTO:
    return tuned == impl
  allowed = {name for name, _ in _auto_candidates(request, platform)} - {"reference"}
  return tuned in allowed and REGISTRY[tuned].unsupported(request, platform) is None


# The block-size classes each explicitly chosen impl reads (flash_pallas: the family of the platform
# lowered for, checked again there). Sizes of any other class would be ignored, so they raise instead.
# "auto" passes sizes to whichever impl it picks; `explain` shows which.
BLOCK_SIZE_TYPES: dict[str, tuple[type, ...]] = {
    "flash_pallas": (tiling.BlockSizes, tiling.GpuBlockSizes),
    "jax_splash": (tiling.BlockSizes,),
    "xla_chunked": (tiling.CpuBlockSizes,),
    "xla_dense": (tiling.CpuBlockSizes,),
}


def check_block_sizes(impl: str, block_sizes) -> None:
  """Raise if an explicitly chosen impl would ignore `block_sizes` (another family's, or any)."""
  if impl == AUTO or block_sizes is None or isinstance(block_sizes, str):
    return
  accepted = BLOCK_SIZE_TYPES.get(impl, ())
  if not isinstance(block_sizes, accepted):
    takes = " or ".join(t.__name__ for t in accepted) or "no block sizes"
    raise ValueError(f"block_sizes for impl={impl!r} must be {takes}; got {type(block_sizes).__name__} "
                     "(None for the impl's defaults, or 'autotune')")


def choose(impl: str, request: Request, platform: str) -> tuple[str, str, Request, str]:
  """(impl name, reason, the request it runs, where its configuration came from).

  `resolve`, plus the tuning cache (flash_layers/tuning): "auto" without block sizes, and any impl
  with ``block_sizes="autotune"``, take the cached configuration for this device and shape bucket
  when there is one. The source is "tuned (cache hit)", "shipped" or "default".
  """
  check_block_sizes(impl, request.block_sizes)
  autotune = isinstance(request.block_sizes, str) and request.block_sizes == tuning_cache.AUTOTUNE
  if autotune:
    request = dataclasses.replace(request, block_sizes=None)
  if autotune or (impl == AUTO and request.block_sizes is None):
    tuned = tuning_cache.lookup(impl, request, platform)
    if tuned is not None and _tuned_impl_allowed(impl, tuned.impl, request, platform):
      resolve(tuned.impl, request, platform)  # an explicit impl still refuses what it cannot serve
      reason = "measured fastest for this shape bucket on this device"
      seconds, default = tuned.entry.get("seconds"), tuned.entry.get("default_seconds")
      if seconds and default:
        reason += f" ({1e3 * seconds:.1f} ms vs {1e3 * default:.1f} ms untuned, {tuned.entry.get('mode')})"
      return tuned.impl, reason, dataclasses.replace(request, block_sizes=tuned.block_sizes), tuned.source
  name, reason = resolve(impl, request, platform)
  return name, reason, request, tuning_cache.SOURCE_DEFAULT


def _by_platform(impl: str, request: Request, run, query, key, value):
  """``run(name, request, q, k, v)`` with the impl `impl` resolves to (and its tuned configuration,
  `choose`). For "auto", whose choice may differ by platform, the choice follows the platform the
  computation is lowered for, so that an AOT compile for TPU from a CPU host runs the TPU choice."""
  only = lowering.only_platform()
  here = only or lowering.default_platform()
  name, reason, chosen, _ = choose(impl, request, here)
  if impl != AUTO:
    return run(name, chosen, query, key, value)
  _log_auto_choice(request, here, name, reason)
  if only is not None:  # lowered for that platform alone (lowering.lowered_only_for): one branch
    return run(name, chosen, query, key, value)
  choices = {p: choose(AUTO, request, p)[::2] for p in _DISPATCH_PLATFORMS}
  choices[here] = (name, chosen)
  if len(set(choices.values())) == 1:
    return run(name, chosen, query, key, value)
  # One callable per (impl, request): platform_dependent traces a callable shared by platforms once.
  runners = {c: (lambda q, k, v, c=c: run(*c, q, k, v)) for c in set(choices.values())}
  branches = {p: runners[c] for p, c in choices.items()}
  return jax.lax.platform_dependent(query, key, value, default=branches["cpu"], **branches)


def attend(query, key, value, *, impl: str, request: Request, args: Args):
  """Run an already-validated request; returns (out, lse). Used by `attention` and the ring."""
  return _by_platform(impl, request, lambda n, r, q, k, v: _run(n, q, k, v, r, args),
                      query, key, value)


def _run_backward(name: str, query, key, value, lse, delta, d_out, request: Request, args: Args):
  # Impls without a backward of their own (reference, xla_native: dense anyway) use xla_dense's:
  # plain XLA from the same statistics.
  backward = registry.method(name, "attention_backward") or registry.method("xla_dense",
                                                                            "attention_backward")
  with jax.named_scope(f"flash_layers.{name}.backward"):
    return backward(query, key, value, lse, delta, d_out, request=request, args=args)


def attend_backward(query, key, value, lse, delta, d_out, *, impl: str, request: Request,
                    args: Args):
  """(dq, dk, dv) of an already-validated request from given row statistics, without running
  its forward: ``lse [b, h, q]`` the softmax normaliser and ``delta [b, h, q]`` =
  rowsum(dO * O) - dlse of the whole output the rows belong to. Ring attention passes the
  global ones: each (q shard, kv shard) pair then yields its exact share of the gradients.
  """
  return _by_platform(
      impl, request,
      lambda n, r, q, k, v: _run_backward(n, q, k, v, lse, delta, d_out, r, args),
      query, key, value)
