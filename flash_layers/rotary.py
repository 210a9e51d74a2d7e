"""Rotary position embeddings, `flash_layers.rotary`: their home is flash_layers/layers/rotary.py."""

from flash_layers.layers.rotary import apply_rotary, check_theta

__all__ = ["apply_rotary", "check_theta"]
