"""`fl.paged_attention` and `fl.explain_paged`: attention of a ragged batch against a paged KV pool.

The contract (the pool, the page table, the ragged queries, quantized pages) is
`flash_layers/contract/paged.py`; the impls are in `flash_layers/impls/paged/`. As `fl.attention`,
the impl is one argument, an impl that cannot serve the call raises `UnsupportedError` naming
what it lacks, and "auto" chooses per lowering platform and says why (`explain_paged`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import lowering
from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.contract.sinks import merge_sinks
from flash_layers.impls import IMPLS, UnsupportedError
from flash_layers.impls.paged import PAGED_REGISTRY

AUTO = "auto"


def _candidates(platform: str) -> list[tuple[str, str]]:
  """"auto"'s rule: (impl, why) in the order tried on `platform`."""
  if platform in ("tpu", "cuda", "rocm"):
    return [("flash_pallas", f"our paged kernel for {platform}: streams only the pages in use"),
            ("xla_chunked", "the kernel cannot serve this call")]
  return [("xla_chunked", f"on {platform} the XLA path (blocks of query rows) is the fast one; the "
                          "kernels would run interpreted")]


def choose(impl: str, spec: PagedSpec, platform: str) -> tuple[str, str]:
  """(impl name, reason) for a paged call lowered for `platform`; raises UnsupportedError when an
  explicitly chosen impl cannot serve it."""
  if impl == AUTO:
    skipped = []
    for name, why in _candidates(platform):
      missing = PAGED_REGISTRY[name].unsupported(spec, platform)
      if missing is None:
        return name, why + (f" ({'; '.join(skipped)})" if skipped else "")
      skipped.append(f"{name} passed over: {missing}")
    raise UnsupportedError(f"no impl serves this paged call on {platform}: {'; '.join(skipped)}")
  if impl not in PAGED_REGISTRY:
    if impl in IMPLS:
      raise UnsupportedError(f"impl {impl!r} does not serve paged attention; impls that do: "
                             f"{sorted(PAGED_REGISTRY)} or {AUTO!r}")
    raise ValueError(f"impl must be one of {sorted(PAGED_REGISTRY) + [AUTO]}; got {impl!r}")
  missing = PAGED_REGISTRY[impl].unsupported(spec, platform)
  if missing is not None:
    raise UnsupportedError(f"impl {impl!r} cannot serve this paged call on {platform}: {missing}")
  return impl, "chosen by the caller"


def _prepare(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales, sinks,
             **rules) -> tuple[tuple, PagedSpec, dict, Any]:
  q, k_pages, v_pages = (jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in (q, k_pages, v_pages))
  page_table, kv_lens, cu_q_lens = (jnp.asarray(x) if isinstance(x, (np.ndarray, list, tuple)) else x
                                    for x in (page_table, kv_lens, cu_q_lens))
  k_scales, v_scales, sinks = (jnp.asarray(x) if isinstance(x, np.ndarray) else x
                               for x in (k_scales, v_scales, sinks))
  spec = paged.check(q, k_pages, v_pages, page_table=page_table, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                     num_seqs=num_seqs, k_scales=k_scales, v_scales=v_scales, sinks=sinks, **rules)
  arrays = {"page_table": page_table.astype(jnp.int32), "kv_lens": kv_lens.astype(jnp.int32),
            "cu_q_lens": cu_q_lens.astype(jnp.int32),
            "num_seqs": jnp.asarray(spec.max_seqs if num_seqs is None else num_seqs, jnp.int32),
            "k_scales": k_scales, "v_scales": v_scales}
  return (q, k_pages, v_pages), spec, arrays, sinks


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, page_table: jax.Array,
                    kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: Any = None,
                    k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                    layout: str = "flax", causal: bool = True, window: int | tuple[int, int] | None = None,
                    softcap: float | None = None, scale: float | None = None, sinks: jax.Array | None = None,
                    mask_mod: Callable | None = None, impl: str = AUTO) -> jax.Array:
  """Attention of a ragged batch of new tokens against each sequence's pages of a shared KV pool.

  Args:
    q: [num_tokens, num_heads, head_dim], the new tokens of every sequence packed in order.
    k_pages, v_pages: the pool, [num_pages, page_size, kv_heads, head_dim] (layout "flax") or
      [kv_heads, num_pages, page_size, head_dim] ("heads_first", what the TPU kernel reads); float,
      or int8 / float8_e4m3fn with `k_scales` / `v_scales` (`quantize_kv`).
    page_table: int [max_seqs, pages_per_seq]: page i of sequence s holds its tokens
      [i * page_size, (i + 1) * page_size).
    kv_lens: int [max_seqs]: tokens in each sequence's pages, the new ones included (write them first).
    cu_q_lens: int [max_seqs + 1]: sequence s owns q rows cu_q_lens[s]:cu_q_lens[s + 1]; its i-th new
      token is at position kv_lens[s] - q_len + i.
    num_seqs: the active sequences (an int or int32 scalar, may be traced); None: all max_seqs. Rows of
      q past cu_q_lens[num_seqs] are padding and get zeros.
    k_scales, v_scales: float32 scales of quantized pages, per token and kv head (the pages' shape
      without head_dim).
    causal, window, softcap, scale, sinks, mask_mod: as `fl.attention` (mask_mod gets b = the
      sequence, h = the query head, and positions within the sequence).
    impl: one of the paged impls ("reference", "xla_chunked", "flash_pallas") or "auto".

  Returns:
    [num_tokens, num_heads, head_dim_v] in q's dtype.
  """
  (q, k_pages, v_pages), spec, arrays, sinks = _prepare(
      q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales, sinks,
      layout=layout, causal=causal, window=window, softcap=softcap, scale=scale, mask_mod=mask_mod)

  def run(platform: str):
    name, _ = choose(impl, spec, platform)
    return lambda q, k, v: PAGED_REGISTRY[name].attend(q, k, v, spec=spec, arrays=arrays)

  only = lowering.only_platform()
  if only is not None:
    out, lse = run(only)(q, k_pages, v_pages)
  else:
    branches = {}
    for platform in ("cpu", "tpu", "cuda", "rocm"):
      try:
        branches[platform] = run(platform)
      except UnsupportedError:
        if platform == lowering.default_platform():
          raise
        branches[platform] = _fails(impl, spec, platform)
    out, lse = jax.lax.platform_dependent(q, k_pages, v_pages, default=branches.pop("cpu"), **branches)
  if sinks is not None:
    merged, _ = merge_sinks(out[None], lse.T[None], sinks.astype(jnp.float32))
    out = merged[0]
  return out


def _fails(impl, spec, platform):
  """A branch for a platform the impl cannot serve: it fails only if that platform is lowered."""
  try:
    choose(impl, spec, platform)
  except UnsupportedError as e:
    message = str(e)
  shapes = (jax.ShapeDtypeStruct((spec.num_tokens, spec.num_heads, spec.head_dim_v), spec.dtype),
            jax.ShapeDtypeStruct((spec.num_tokens, spec.num_heads), "float32"))
  return lambda q, k, v: tuple(lowering.fails_when_lowered(message, shapes, q, k, v))


@dataclasses.dataclass(frozen=True)
class PagedExplanation:
  """What `paged_attention` would run for these arguments, and why."""

  impl: str
  kernel: str
  reason: str
  pages_touched: int | None  # pages holding a key some query can see (None: traced inputs)
  pages_in_tables: int | None  # pages the active sequences hold
  grid_points: int | None = None  # kernel grid steps that do work, when the kernel's grid shows them

  def __str__(self) -> str:
    text = f"{self.impl} [{self.kernel}]: {self.reason}"
    if self.pages_touched is not None:
      text += f"; pages touched {self.pages_touched} of {self.pages_in_tables} held"
    if self.grid_points is not None:
      text += f"; grid points {self.grid_points}"
    return text


def explain_paged(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, impl: str = AUTO,
                  platform: str | None = None, **kwargs: Any) -> PagedExplanation:
  """Which impl and kernel `paged_attention(q, k_pages, v_pages, impl=impl, **kwargs)` runs, why, and how
  many pages it reads. platform: the lowering platform to explain for (None: this host's)."""
  names = ("page_table", "kv_lens", "cu_q_lens", "num_seqs", "k_scales", "v_scales", "sinks")
  arrays_in = {n: kwargs.pop(n, None) for n in names}
  rules = {"layout": "flax", "causal": True, "window": None, "softcap": None, "scale": None, "mask_mod": None}
  unknown = sorted(set(kwargs) - set(rules))
  if unknown:
    raise TypeError(f"explain_paged got arguments paged_attention does not take: {unknown}")
  _, spec, arrays, _ = _prepare(q, k_pages, v_pages, *(arrays_in[n] for n in names), **{**rules, **kwargs})
  platform = platform or lowering.default_platform()
  name, reason = choose(impl, spec, platform)
  chosen = PAGED_REGISTRY[name]
  touched = held = points = None
  try:
    lens, cu, n = (np.asarray(arrays[k]) for k in ("kv_lens", "cu_q_lens", "num_seqs"))
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    pass
  else:
    touched = paged.pages_touched(spec, lens, cu, int(n))
    held = int(sum(-(-int(x) // spec.page_size) for x in lens[: int(n)]))
    if hasattr(chosen, "grid_points"):
      points = chosen.grid_points(spec, arrays, platform)
  return PagedExplanation(name, chosen.kernel(spec, platform), reason, touched, held, points)


def quantize_kv(pages: jax.Array, dtype: str = "int8") -> tuple[jax.Array, jax.Array]:
  """(quantized pages, float32 scales per token and kv head) of float pages in either layout:
  int8 or float8_e4m3fn, each token-head scaled by its absolute maximum (contract/paged.py)."""
  return paged.quantize(pages, dtype)
