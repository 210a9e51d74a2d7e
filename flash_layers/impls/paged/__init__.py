"""Paged attention's impls (the contract: flash_layers/contract/paged.py), one per name of `fl.IMPLS`.

Each impl is an object with ``name``, ``unsupported(spec, platform) -> str | None`` (the first feature
it cannot serve on that lowering platform), ``kernel(spec, platform) -> str`` (explain()'s name for what
runs) and ``attend(q, k_pages, v_pages, *, spec, arrays) -> (out, lse)``: out ``[tokens, heads,
head_dim_v]`` in q's dtype, lse ``[tokens, heads]`` float32 (-inf for a row that sees nothing). Sinks
are merged by the caller from (out, lse), as `fl.attention` does (contract/sinks.py).

* reference (`reference.py`): every query row gathers its sequence's pages and attends, in float32.
  Readable, O(tokens * max_kv_len) memory.
* xla_chunked (`xla_chunked.py`): the same in blocks of query rows (`lax.map`), so memory is one
  block's pages; the CPU's path.
* flash_pallas (`kernels.py`): our kernels: the TPU (Mosaic) kernel walks the page table from scalar
  memory, the GPU (Triton) kernel loads pages by pointer, interpreted elsewhere.
"""

from __future__ import annotations

from flash_layers.impls.paged.kernels import PagedKernels
from flash_layers.impls.paged.reference import PagedReference
from flash_layers.impls.paged.xla_chunked import PagedXlaChunked

PAGED_REGISTRY = {impl.name: impl for impl in (PagedKernels(), PagedXlaChunked(), PagedReference())}

__all__ = ["PAGED_REGISTRY"]
