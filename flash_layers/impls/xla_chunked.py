"""Placeholder until the chunked impl lands: refuses every request."""

from __future__ import annotations

from flash_layers.impls.base import Args, Request, UnsupportedError


class XlaChunked:
  name = "xla_chunked"

  def unsupported(self, request: Request, platform: str) -> str | None:
    return "xla_chunked (not built yet)"

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def attend(self, q, k, v, *, request: Request, args: Args):
    raise UnsupportedError("xla_chunked is not built yet")
