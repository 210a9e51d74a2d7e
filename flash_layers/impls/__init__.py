"""The registry of attention implementations (see `base.py` for the interface)."""

from __future__ import annotations

from flash_layers.impls.base import Args, Impl, Request, UnsupportedError
from flash_layers.impls.flash_pallas import FlashPallas
from flash_layers.impls.jax_splash import JaxSplash
from flash_layers.impls.reference import Reference
from flash_layers.impls.xla_chunked import XlaChunked
from flash_layers.impls.xla_dense import XlaDense
from flash_layers.impls.xla_native import XlaNative

REGISTRY: dict[str, Impl] = {
    impl.name: impl for impl in (FlashPallas(), XlaNative(), XlaChunked(), XlaDense(), Reference(),
                                JaxSplash())
}
IMPLS: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["Args", "IMPLS", "Impl", "REGISTRY", "Request", "UnsupportedError"]
