"""Which platform a computation is lowered for, and `interpret_as`.

Kernel families are chosen by the platform the computation is *lowered* for
(`jax.lax.platform_dependent`), never by `jax.default_backend()`: an
ahead-of-time compile for TPU or CUDA from a CPU host must get the real kernels.
`interpret_as("tpu" | "gpu")` overrides that for testing: Pallas kernels of the
named family run in interpret mode, whatever the machine.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

INTERPRET_PLATFORMS = ("tpu", "gpu")

_interpret: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flash_layers_interpret", default=None)


@contextlib.contextmanager
def interpret_as(platform: str) -> Iterator[None]:
  """Run flash_pallas's `platform` kernels ("tpu" or "gpu") in Pallas interpret mode.

  The choice is read when a function is traced; a function already jitted keeps
  the kernels it was traced with.
  """
  if platform not in INTERPRET_PLATFORMS:
    raise ValueError(f"interpret_as platform must be one of {INTERPRET_PLATFORMS}; got {platform!r}")
  token = _interpret.set(platform)
  try:
    yield
  finally:
    _interpret.reset(token)


def interpreting() -> str | None:
  """The platform forced by `interpret_as`, or None."""
  return _interpret.get()


def default_platform() -> str:
  """The platform of the default backend, in lowering names ("cpu", "tpu", "cuda", "rocm")."""
  backend = jax.default_backend()
  if backend == "gpu":
    return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"
  return backend
