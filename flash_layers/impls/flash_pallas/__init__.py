"""flash_pallas: our own Pallas flash-attention kernels (TPU: Mosaic, GPU: Triton).

The kernels land with their own issues; until then every request is refused
with UnsupportedError so that "auto" skips this impl and explicit use is loud.
"""

from __future__ import annotations

from flash_layers.impls.base import Args, Request, UnsupportedError


class FlashPallas:
  name = "flash_pallas"

  def unsupported(self, request: Request, platform: str) -> str | None:
    return "flash_pallas kernels (not built yet)"

  def kernel(self, request: Request, platform: str) -> str:
    return "pallas"

  def attend(self, q, k, v, *, request: Request, args: Args):
    raise UnsupportedError("flash_pallas kernels are not built yet")
