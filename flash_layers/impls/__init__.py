"""The attention implementations: the interface is `base.Impl`, the registry `registry.py`."""

from __future__ import annotations

from flash_layers.impls import registry
from flash_layers.impls.base import Args, Impl, Request, UnsupportedError
from flash_layers.impls.flash_pallas import FlashPallas
from flash_layers.impls.jax_splash import JaxSplash
from flash_layers.impls.reference import Reference
from flash_layers.impls.xla_chunked import XlaChunked
from flash_layers.impls.xla_dense import XlaDense
from flash_layers.impls.xla_native import XlaNative

for _impl in (FlashPallas(), XlaNative(), XlaChunked(), XlaDense(), Reference(), JaxSplash()):
  registry.register(_impl)

REGISTRY = registry.REGISTRY  # name -> impl, read-only, in registration order
IMPLS: tuple[str, ...] = registry.names()

__all__ = ["Args", "IMPLS", "Impl", "REGISTRY", "Request", "UnsupportedError"]
