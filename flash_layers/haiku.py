"""The Haiku layer, `flash_layers.haiku.MultiHeadAttention` (`pip install flash-layers[haiku]`): its home is
flash_layers/layers/haiku.py, which imports no flax."""

from flash_layers.layers.haiku import MultiHeadAttention, params_from_flax

__all__ = ["MultiHeadAttention", "params_from_flax"]
