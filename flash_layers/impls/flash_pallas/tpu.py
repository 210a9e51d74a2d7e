"""Placeholder until the Mosaic kernels land (issue: flash_pallas on TPU)."""

from __future__ import annotations

from flash_layers.impls.base import UnsupportedError


def unsupported(request):
  return "flash_pallas TPU kernels (not built yet)"


def block_shape(request, platform):
  return (128, 128)


def flash_attention(q, k, v, *, request, args, interpret):
  raise UnsupportedError("flash_pallas TPU kernels are not built yet")
