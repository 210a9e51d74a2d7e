"""Validation: check and normalise a call's arguments once (`prepare`), before any impl runs.

Everything a user can get wrong is checked here, so a mistake is a ValueError/TypeError naming the
argument, never a traceback from inside JAX; the impls then trust their inputs. `prepare` returns
the call's static `Request` and its array `Args`. Choosing an impl is auto.py's job and running it
dispatch.py's; this module imports neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.contract import block_info, dropout, mask_rules, mods
from flash_layers.impls import IMPLS, Args, Request, registry, tiling
from flash_layers.tuning import cache as tuning_cache

# The `impl=` value that lets auto.py choose. Defined here, the lowest module that must know it
# (`check_impl` accepts it, `check_block_sizes` defers to the chosen impl); auto.py re-exports it
# as `auto.AUTO`, the name callers use.
AUTO = "auto"


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


def check_block_sizes(impl: str, block_sizes) -> None:
  """Raise if an explicitly chosen impl would ignore `block_sizes` (another family's, or any).

  Each impl declares the block-size classes it reads (`block_size_types`; flash_pallas: both
  families, the one of the platform lowered for is checked again there). Sizes of any other class
  would be ignored, so they raise instead. "auto" passes sizes to whichever impl it picks;
  `explain` shows which."""
  if impl == AUTO or block_sizes is None or isinstance(block_sizes, str):
    return
  accepted = registry.block_size_types(impl)
  if not isinstance(block_sizes, accepted):
    takes = " or ".join(t.__name__ for t in accepted) or "no block sizes"
    raise ValueError(f"block_sizes for impl={impl!r} must be {takes}; got {type(block_sizes).__name__} "
                     "(None for the impl's defaults, or 'autotune')")


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
