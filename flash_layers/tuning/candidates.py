"""Candidate configurations: what the autotuner times for one call.

Each impl declares its own tuning space (the `tuning_space` capability, impls/base.py): xla_dense
and xla_chunked on the CPU (the per-row/per-head loop flipped; chunk pairs), flash_pallas on TPU and
GPU (the kernels' tiles, warps and stages). This module only combines them:

* an explicit impl: its space, its defaults first;
* "auto": first the impl "auto" runs untuned (`auto.resolve`, so the tuner's baseline is auto's own
  choice, never a copy of its rule), then the spaces of the other impls auto may take here
  (`auto.tunable`), in auto's order.

The first candidate is the default (what the call runs untuned), so a tuned entry can only replace
it with something measured faster. Each list is small on purpose: every candidate is compiled,
checked against the reference and timed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flash_layers import auto
from flash_layers.impls import registry
from flash_layers.impls.base import Request

__all__ = ["MAX_DENSE_LOGITS_BYTES", "Candidate", "baseline", "for_call", "space"]

# An impl that materialises the probabilities (the `sow_weights` capability) keeps [b, h, q, kv]
# float32 (and their gradients under differentiation); above this many bytes "auto" does not time it
# unless it is the baseline: auto takes a chunked impl there to keep memory linear.
MAX_DENSE_LOGITS_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration to time: an impl and the block sizes it runs with (None: its defaults)."""

  impl: str
  block_sizes: Any = None

  def describe(self) -> str:
    if self.block_sizes is None:
      return f"{self.impl} (defaults)"
    fields = {k: v for k, v in dataclasses.asdict(self.block_sizes).items() if v is not None}
    return f"{self.impl} {fields}"


def space(impl: str, request: Request, platform: str) -> list[Candidate]:
  """Impl `impl`'s tuning space on `platform` as candidates (its defaults first); [] without one."""
  tuning_space = registry.method(impl, "tuning_space")
  if tuning_space is None:
    return []
  return [Candidate(impl, sizes) for sizes in tuning_space(request, platform)]


def baseline(impl: str, request: Request, platform: str) -> str:
  """The impl a call runs untuned: `impl` itself, or for "auto" its choice (`auto.resolve`)."""
  return auto.resolve(impl, request, platform)[0]


def _too_big(impl: str, request: Request) -> bool:
  logits_bytes = 4 * request.batch * request.num_heads * request.q_len * request.kv_len
  return registry.impl_has(impl, "sow_weights") and logits_bytes > MAX_DENSE_LOGITS_BYTES


def for_call(impl: str, request: Request, platform: str) -> list[Candidate]:
  """The candidates for `impl` ("auto" or a name) on `platform`; [] when nothing is tunable."""
  if impl != auto.AUTO:
    return space(impl, request, platform)
  first = baseline(impl, request, platform)
  out = space(first, request, platform) or [Candidate(first)]
  for name in auto.tunable(request, platform):
    if name != first and not _too_big(name, request):
      out += space(name, request, platform)
  return out if len(out) > 1 else []  # the baseline alone: nothing to choose between
