"""The `flax.nnx` layer, `flash_layers.nnx.MultiHeadAttention`: its home is flash_layers/layers/nnx.py."""

from flash_layers.layers.nnx import MultiHeadAttention, params_from_linen, params_to_linen

__all__ = ["MultiHeadAttention", "params_from_linen", "params_to_linen"]
