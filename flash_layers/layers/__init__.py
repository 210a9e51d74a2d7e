"""The attention layers over `fl.attention`, one module per framework around a framework-neutral core.

* core.py: the attention fields (`AttentionFields`), their checks, head sizes, the call into
  `fl.attention`, the decoding glue and the sown weights; imports no flax.
* linen.py: `MultiHeadAttention` (boxed, logical axis names), `MultiHeadDotProductAttention` (flax's
  exact drop-in), `SelfAttention`.
* flax_fn.py: `attention_fn`, the `attention_fn=` hook of flax's own modules.
* nnx.py, haiku.py: the NNX and Haiku layers (`flash_layers.nnx`, `flash_layers.haiku` re-export them).
* kv_cache.py: the KV cache of a decoding layer; rotary.py: rotary position embeddings.
* paged_cache.py: the paged KV cache of a decoding layer (cache="paged": a pool of pages, each call's
  `PagedBatch`, `fl.paged_attention`); page_allocator.py: its host-side page allocator (numpy only: no
  jax, no flax).

This package's own namespace holds only core's names, so importing a framework's module (the Haiku one,
say) does not import the others' frameworks.
"""

from flash_layers.layers.core import (  # noqa: F401
    KV_KERNEL_AXES,
    OUT_BIAS_AXES,
    OUT_KERNEL_AXES,
    QUERY_KERNEL_AXES,
    AttentionFields,
)
