"""flash-layers: one attention contract, many implementations.

    import flash_layers as fl
    out = fl.attention(q, k, v, impl="auto", causal=True)
    print(fl.explain(q, k, v, causal=True))
"""

from flash_layers import host as _host

# Before jax starts a backend: on a CPU-only host with libtpu installed, the CPU, quietly.
_host.default_to_cpu_without_accelerator()

from flash_layers import masks  # noqa: E402  (fl.masks.causal(), ...: named mask_mods)
from flash_layers.api import Explanation, attention, block_mask, explain  # noqa: E402
from flash_layers.contract.alibi import alibi_slopes  # noqa: E402
from flash_layers.contract.block_info import BlockMask  # noqa: E402
from flash_layers.contract.dropout import dropout_mask  # noqa: E402
from flash_layers.impls import IMPLS, UnsupportedError  # noqa: E402
from flash_layers.impls.tiling import BlockSizes, CpuBlockSizes, GpuBlockSizes  # noqa: E402
from flash_layers.layers.flax_fn import attention_fn  # noqa: E402
from flash_layers.layers.linen import MultiHeadAttention, MultiHeadDotProductAttention, SelfAttention  # noqa: E402
from flash_layers.layers.page_allocator import PageAllocator, PagedBatch, PoolExhaustedError  # noqa: E402
from flash_layers.lowering import interpret_as  # noqa: E402
from flash_layers.paged_api import PagedExplanation, explain_paged, paged_attention, quantize_kv  # noqa: E402
from flash_layers.parallel import LOGICAL_RULES, MeshAxes, make_mesh  # noqa: E402
from flash_layers.tuning.tuner import autotune  # noqa: E402

__all__ = ["IMPLS", "LOGICAL_RULES", "BlockMask", "MeshAxes", "BlockSizes", "CpuBlockSizes", "Explanation",
           "GpuBlockSizes", "MultiHeadAttention", "MultiHeadDotProductAttention", "PageAllocator",
           "PagedBatch", "PagedExplanation", "PoolExhaustedError", "SelfAttention", "UnsupportedError",
           "alibi_slopes", "attention", "attention_fn", "autotune", "block_mask", "dropout_mask", "explain",
           "explain_paged", "interpret_as", "make_mesh", "masks", "paged_attention", "quantize_kv"]
__version__ = "0.1.0"
