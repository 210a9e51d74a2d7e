"""Paged attention: a ragged batch of sequences attending to their pages of a shared KV pool.

The serving layout (docs/contract.md, "Paged attention"), in the shape jax's ragged paged attention and
vLLM use:

* The pool. ``k_pages`` / ``v_pages`` hold ``num_pages`` pages of ``page_size`` tokens each, shared
  by every sequence. Two layouts (`LAYOUTS`): "flax" ``[num_pages, page_size, kv_heads, head_dim]``
  (a token's heads side by side, as flax's cache) and "heads_first"
  ``[kv_heads, num_pages, page_size, head_dim]``, the layout the TPU kernel reads (a page of one head
  is a contiguous ``[page_size, head_dim]`` tile, which a TPU's HBM tiles by (8, 128) without a copy).
* The page table. ``page_table[s, i]`` is the pool page holding tokens ``[i * page_size,
  (i + 1) * page_size)`` of sequence s; ``kv_lens[s]`` says how many tokens sequence s has in its
  pages, *the new ones included* (a caller writes the new keys first, then attends). Entries past a
  sequence's last page are never read.
* The ragged queries. ``q`` is ``[num_tokens, num_heads, head_dim]``: the new tokens of every sequence
  packed one after another, sequence s owning rows ``cu_q_lens[s] : cu_q_lens[s + 1]`` (a prefill
  chunk of any length, or one decoding token). Its i-th query is at position
  ``kv_lens[s] - q_len[s] + i``, so a prefill chunk is causal within itself and sees all the tokens
  before it. Only the first ``num_seqs`` sequences are active; rows past ``cu_q_lens[num_seqs]`` are
  padding (a fixed-shape batch) and give zeros.
* What a query sees: the keys ``0 .. kv_lens[s] - 1`` of its own sequence, cut by the contract's
  rules (causal, a sliding window ``(left, right)``, a `mask_mod(b=s, h, q_pos, kv_pos)`), then
  ``scale * q.k``, the softcap, the softmax (with attention sinks in its denominator), ``p.v``.
* Quantized pages. int8 (any platform) or float8_e4m3fn (GPU) pages carry float32 scales per token
  and kv head (``k_scales`` shaped as the pages without head_dim): a key is ``k.astype(f32) *
  k_scale``. `quantize` makes them by each token-head's absolute maximum, so an element's rounding
  error is at most ``absmax / 254`` (int8), or 1/16 of the element (e4m3's 3 mantissa bits) plus
  ``absmax / 448 * 2**-10`` below e4m3's normal range (docs/contract.md states the bound on the
  output and tests/test_paged.py holds it).

This module holds what every paged impl shares: the static description (`PagedSpec`), the checks,
the query-token bookkeeping (`token_positions`), the visibility predicate (`visible`), quantization
and the page counts explain() reports. Part of the contract: it imports nothing from impls/.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers.contract import mask_rules

LAYOUTS = ("flax", "heads_first")
# Page dtypes beside the float ones: quantized, with float32 scales per token and kv head.
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")
# The largest magnitude of each quantized dtype: quantize maps a token-head's absmax there.
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedSpec:
  """The static description of one paged call (hashable: a jit static argument)."""

  num_tokens: int      # rows of q (packed new tokens, padding included)
  max_seqs: int        # rows of page_table / kv_lens
  num_heads: int
  num_kv_heads: int
  head_dim: int
  head_dim_v: int
  num_pages: int       # pages in the pool
  page_size: int
  pages_per_seq: int   # columns of page_table
  layout: str          # one of LAYOUTS
  dtype: str           # q's dtype (and the output's)
  kv_dtype: str        # the pages' dtype
  causal: bool = True
  window: tuple[int, int] | None = None
  softcap: float | None = None
  scale: float = 1.0
  has_sinks: bool = False
  mask_mod: Any = None  # hashed by identity, as fl.attention's mods
  precision: jax.lax.Precision = jax.lax.Precision.HIGHEST

  @property
  def quantized(self) -> bool:
    return self.kv_dtype in QUANTIZED_DTYPES

  @property
  def group(self) -> int:
    """Query heads per kv head (GQA)."""
    return self.num_heads // self.num_kv_heads

  @property
  def max_kv_len(self) -> int:
    return self.pages_per_seq * self.page_size


def pool_shape(layout: str, num_pages: int, page_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
  """The pages' shape in `layout`."""
  if layout == "flax":
    return (num_pages, page_size, kv_heads, head_dim)
  return (kv_heads, num_pages, page_size, head_dim)


def pool_dims(layout: str, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
  """(num_pages, page_size, kv_heads, head_dim) of pages shaped `shape` in `layout`."""
  if layout == "flax":
    return tuple(shape)
  kv_heads, num_pages, page_size, head_dim = shape
  return num_pages, page_size, kv_heads, head_dim


def to_flax(pages: jax.Array, layout: str) -> jax.Array:
  """Pages (or their scales, without the last axis) in the flax layout."""
  if layout == "flax":
    return pages
  return jnp.moveaxis(pages, 0, 2)


def to_heads_first(pages: jax.Array, layout: str) -> jax.Array:
  """Pages (or their scales) in the heads_first layout."""
  if layout == "heads_first":
    return pages
  return jnp.moveaxis(pages, 2, 0)


def _shape_str(x) -> str:
  return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


def check(q, k_pages, v_pages, *, page_table, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales, sinks,
          layout: str, causal: bool, window, softcap, scale, mask_mod: Callable | None) -> PagedSpec:
  """Validate a paged call's arguments (each error names the argument) and describe it."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("page_table", page_table),
                  ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array; got {type(x).__name__}")
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, num_heads, head_dim]; got {_shape_str(q)}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be a floating-point array; got {_shape_str(q)}")
  layout_str = "[num_pages, page_size, kv_heads, head_dim]" if layout == "flax" else \
      "[kv_heads, num_pages, page_size, head_dim]"
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be {layout_str} (layout {layout!r}); got {_shape_str(x)}")
  num_pages, page_size, kv_heads, head_dim = pool_dims(layout, k_pages.shape)
  v_num_pages, v_page_size, v_kv_heads, head_dim_v = pool_dims(layout, v_pages.shape)
  if (v_num_pages, v_page_size, v_kv_heads) != (num_pages, page_size, kv_heads):
    raise ValueError(f"v_pages must have k_pages' pages, page size and kv heads ({layout_str}); "
                     f"got k_pages {_shape_str(k_pages)}, v_pages {_shape_str(v_pages)}")
  num_tokens, num_heads, q_dim = q.shape
  if q_dim != head_dim:
    raise ValueError(f"q's head_dim {q_dim} must equal k_pages' {head_dim}")
  if num_heads % kv_heads:
    raise ValueError(f"q's num_heads {num_heads} must be a multiple of the pages' kv_heads {kv_heads}")
  kv_dtype = jnp.dtype(k_pages.dtype).name
  if jnp.dtype(v_pages.dtype).name != kv_dtype:
    raise ValueError(f"v_pages must have k_pages' dtype {kv_dtype}; got {_shape_str(v_pages)}")
  if not (jnp.issubdtype(k_pages.dtype, jnp.floating) or kv_dtype in QUANTIZED_DTYPES):
    raise ValueError(f"k_pages' dtype must be floating or one of {QUANTIZED_DTYPES}; got {kv_dtype}")
  quantized = kv_dtype in QUANTIZED_DTYPES
  scales_shape = pool_shape(layout, num_pages, page_size, kv_heads, 1)[:-1]
  for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
    if quantized and s is None:
      raise ValueError(f"{kv_dtype} pages need {name}, float32 {scales_shape} (per token and kv head)")
    if not quantized and s is not None:
      raise ValueError(f"{name} is for quantized pages ({QUANTIZED_DTYPES}); the pages are {kv_dtype}")
    if s is not None and (tuple(s.shape) != scales_shape or s.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 {scales_shape}; got {_shape_str(s)}")
  if page_table.ndim != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"page_table must be int [max_seqs, pages_per_seq]; got {_shape_str(page_table)}")
  max_seqs, pages_per_seq = page_table.shape
  if kv_lens.shape != (max_seqs,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
    raise ValueError(f"kv_lens must be int [{max_seqs}] (one per page_table row); got {_shape_str(kv_lens)}")
  if cu_q_lens.shape != (max_seqs + 1,) or not jnp.issubdtype(cu_q_lens.dtype, jnp.integer):
    raise ValueError(f"cu_q_lens must be int [{max_seqs + 1}] (page_table rows + 1); got "
                     f"{_shape_str(cu_q_lens)}")
  if num_seqs is not None and (jnp.ndim(num_seqs) != 0 or not jnp.issubdtype(jnp.result_type(num_seqs),
                                                                              jnp.integer)):
    raise ValueError(f"num_seqs must be an int scalar or None; got {num_seqs!r}")
  if sinks is not None and (tuple(sinks.shape) != (num_heads,)):
    raise ValueError(f"sinks must be [{num_heads}] (one logit per query head); got {_shape_str(sinks)}")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"softcap must be > 0 or None; got {softcap!r}")
  if scale is not None and not scale > 0:
    raise ValueError(f"scale must be > 0 or None; got {scale!r}")
  if mask_mod is not None and not callable(mask_mod):
    raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool; got {mask_mod!r}")
  _check_concrete(page_table, kv_lens, cu_q_lens, num_seqs, num_pages, page_size, num_tokens)
  return PagedSpec(
      num_tokens=num_tokens, max_seqs=max_seqs, num_heads=num_heads, num_kv_heads=kv_heads,
      head_dim=head_dim, head_dim_v=head_dim_v, num_pages=num_pages, page_size=page_size,
      pages_per_seq=pages_per_seq, layout=layout, dtype=jnp.dtype(q.dtype).name, kv_dtype=kv_dtype,
      causal=bool(causal), window=mask_rules.normalize_window(window),
      softcap=None if softcap is None else float(softcap),
      scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
      has_sinks=sinks is not None, mask_mod=mask_mod,
      precision=jax.lax.Precision.DEFAULT if q.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST)


def _concrete(x):
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_concrete(page_table, kv_lens, cu_q_lens, num_seqs, num_pages, page_size, num_tokens) -> None:
  """The checks of the batch's values, when they are concrete (not under jit)."""
  table, lens, cu = _concrete(page_table), _concrete(kv_lens), _concrete(cu_q_lens)
  n = len(lens) if lens is not None else None
  if num_seqs is not None:
    active = _concrete(num_seqs)
    if active is not None and n is not None:
      if not 0 <= int(active) <= n:
        raise ValueError(f"num_seqs must be in [0, {n}] (the page_table rows); got {int(active)}")
      n = int(active)
  if cu is not None and n is not None:
    q_lens = np.diff(cu[: n + 1])
    if cu[0] != 0 or (q_lens < 0).any() or cu[n] > num_tokens:
      raise ValueError(f"cu_q_lens must start at 0, never decrease and end at most at q's {num_tokens} "
                       f"tokens; got {cu[: n + 1].tolist()}")
    if lens is not None:
      short = np.nonzero(lens[:n] < q_lens)[0]
      if short.size:
        s = int(short[0])
        raise ValueError(f"kv_lens[{s}] = {int(lens[s])} is less than sequence {s}'s {int(q_lens[s])} new "
                         "tokens: kv_lens counts the new tokens too (write them to the pages first)")
  if lens is not None and n is not None:
    pages_per_seq = page_table.shape[1]
    if (lens[:n] < 0).any() or (lens[:n] > pages_per_seq * page_size).any():
      raise ValueError(f"kv_lens must be in [0, pages_per_seq * page_size = {pages_per_seq * page_size}]; "
                       f"got {lens[:n].tolist()}")
    if table is not None:
      for s in range(n):
        used = table[s, : -(-int(lens[s]) // page_size)]
        if ((used < 0) | (used >= num_pages)).any():
          raise ValueError(f"page_table[{s}] names pages outside the pool's {num_pages}: {used.tolist()}")


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs, num_tokens: int):
  """Per query row: (its sequence, its position in the sequence, whether it is an active token).

  int32 [num_tokens] each (a padding row gets sequence 0 and valid False).
  """
  cu = cu_q_lens.astype(jnp.int32)
  max_seqs = kv_lens.shape[0]
  n = max_seqs if num_seqs is None else jnp.asarray(num_seqs, jnp.int32)
  rows = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu, rows, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
  valid = rows < cu[jnp.minimum(n, max_seqs)]
  q_lens = cu[1:] - cu[:-1]
  pos = kv_lens.astype(jnp.int32)[seq] - q_lens[seq] + (rows - cu[seq])
  return seq, jnp.where(valid, pos, 0), valid


def visible(spec: PagedSpec, q_pos, kv_pos, kv_len, seq=None, head=None):
  """May a query at q_pos see the key at kv_pos of a sequence with kv_len keys? (broadcasts)

  The contract's rules (`mask_rules.visible`: causal, the window) and the sequence's length; with
  a mask_mod, also mask_mod(seq, head, q_pos, kv_pos) (seq and head then required).
  """
  ok = (kv_pos < kv_len) & mask_rules.visible(
      q_pos, kv_pos, mask_rules.MaskSpec(causal=spec.causal, window=spec.window))
  if spec.mask_mod is not None:
    ok = ok & spec.mask_mod(seq, head, q_pos, kv_pos)
  return ok


def kv_range(spec: PagedSpec, first_q_pos, last_q_pos, kv_len):
  """[start, stop) of the keys some query in positions [first, last] can see (the rules without a
  mask_mod): causal stops at last + 1, a window's left side starts at first - left. Works on arrays."""
  start = jnp.zeros_like(first_q_pos)
  stop = kv_len
  if spec.causal:
    stop = jnp.minimum(stop, last_q_pos + 1)
  if spec.window is not None:
    left, right = spec.window
    start = jnp.maximum(start, first_q_pos - left)
    if not spec.causal:
      stop = jnp.minimum(stop, last_q_pos + right + 1)
  return start, jnp.maximum(stop, start)


def pages_touched(spec: PagedSpec, kv_lens, cu_q_lens, num_seqs=None) -> int:
  """The pages a call reads (concrete inputs): per sequence, those holding a key some query can see."""
  lens, cu = np.asarray(kv_lens), np.asarray(cu_q_lens)
  n = len(lens) if num_seqs is None else int(num_seqs)
  total = 0
  for s in range(n):
    q_len = int(cu[s + 1] - cu[s])
    if q_len == 0:
      continue
    first, last = int(lens[s]) - q_len, int(lens[s]) - 1
    start, stop = (int(x) for x in kv_range(spec, np.int64(first), np.int64(last), np.int64(lens[s])))
    if stop > start:
      total += (stop - 1) // spec.page_size - start // spec.page_size + 1
  return total


def quantize(x: jax.Array, dtype: str = "int8") -> tuple[jax.Array, jax.Array]:
  """(values, scales) of float keys or values ``[..., head_dim]`` quantized per token and head.

  scale = absmax over head_dim / qmax (127 for int8, 448 for float8_e4m3fn), values = x / scale
  rounded (int8) or cast (e4m3); x is recovered as ``values.astype(f32) * scale[..., None]``. A row
  of zeros gets scale 1 (its values are 0).
  """
  if dtype not in QUANTIZED_DTYPES:
    raise ValueError(f"dtype must be one of {QUANTIZED_DTYPES}; got {dtype!r}")
  x = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(x), axis=-1)
  scales = jnp.where(absmax > 0, absmax / _QMAX[dtype], 1.0).astype(jnp.float32)
  y = x / scales[..., None]
  if dtype == "int8":
    return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scales
  return y.astype(jnp.float8_e4m3fn), scales


def dequantize(values: jax.Array, scales: jax.Array | None, dtype=jnp.float32) -> jax.Array:
  """Pages as floats: values * scales per token and head (values as they are without scales)."""
  if scales is None:
    return values.astype(dtype)
  return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)
