"""flash-layers: one attention contract, many implementations.

    import flash_layers as fl
    out = fl.attention(q, k, v, impl="auto", causal=True)
    print(fl.explain(q, k, v, causal=True))
"""

from flash_layers.api import Explanation, attention, explain
from flash_layers.dropout import alibi_slopes, dropout_mask
from flash_layers.impls import IMPLS, UnsupportedError
from flash_layers.impls.tiling import BlockSizes, CpuBlockSizes, GpuBlockSizes
from flash_layers.layers import MultiHeadAttention, attention_fn
from flash_layers.lowering import interpret_as
from flash_layers.parallel import LOGICAL_RULES, make_mesh
from flash_layers.tuning.tuner import autotune

__all__ = ["IMPLS", "LOGICAL_RULES", "BlockSizes", "CpuBlockSizes", "Explanation", "GpuBlockSizes",
           "MultiHeadAttention", "UnsupportedError", "alibi_slopes", "attention", "attention_fn", "autotune",
           "dropout_mask", "explain", "interpret_as", "make_mesh"]
__version__ = "0.1.0"
