"""Which platform a computation is lowered for, and `interpret_as`.

Kernel families are chosen by the platform the computation is *lowered* for
(`jax.lax.platform_dependent`), never by `jax.default_backend()`: an
ahead-of-time compile for TPU or CUDA from a CPU host must get the real kernels.
`interpret_as("tpu" | "gpu")` overrides that for testing: Pallas kernels of the
named family run in interpret mode, whatever the machine.

Tracing every platform's branch has a price: "auto" attention traces the TPU and GPU kernels
too, which on a CPU was most of an encoder's trace time (per compiled program, in every
process, with or without a compilation cache). Code that knows where its computation runs
(the training job and eval.py: on their mesh's devices) says so with `lowered_only_for`,
and the dispatcher then traces that platform's branch alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax

INTERPRET_PLATFORMS = ("tpu", "gpu")
LOWERING_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")

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


_only: contextvars.ContextVar[str | None] = contextvars.ContextVar("flash_layers_lowered_only_for",
                                                                 default=None)


@contextlib.contextmanager
def lowered_only_for(platform: str | None) -> Iterator[None]:
  """Computations traced inside are lowered for `platform` alone ("cpu", "tpu", "cuda", "rocm";
  None: any, as outside): the dispatcher traces only that platform's choice. Like `interpret_as`,
  it is read when a function is traced; lowering such a function for another platform would run
  this platform's choice there.
  """
  if platform not in (None, *LOWERING_PLATFORMS):
    raise ValueError(f"platform must be None or one of {LOWERING_PLATFORMS}; got {platform!r}")
  token = _only.set(platform)
  try:
    yield
  finally:
    _only.reset(token)


def only_platform() -> str | None:
  """The platform declared by `lowered_only_for`, or None (any)."""
  return _only.get()


def platform_of(device) -> str:
  """A device's platform in lowering names ("cpu", "tpu", "cuda", "rocm")."""
  if device.platform == "gpu":
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
  return device.platform


def interpreting() -> str | None:
  """The platform forced by `interpret_as`, or None."""
  return _interpret.get()


def default_platform() -> str:
  """The platform of the default backend, in lowering names ("cpu", "tpu", "cuda", "rocm")."""
  backend = jax.default_backend()
  if backend == "gpu":
    return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"
  return backend


def manual_device_count() -> int:
  """How many devices the enclosing `shard_map` spans (1 outside one), read while tracing.

  The TPU-semantics interpreter synchronises every device at each kernel launch, and its
  callbacks copy their arguments through CPU device 0; on a multi-device CPU host the two can
  wait on each other forever. The TPU family therefore uses the plain interpreter there.
  """
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get_mesh() if get_mesh is not None else None
  if mesh is None or getattr(mesh, "empty", True):
    return 1
  manual = getattr(mesh, "manual_axes", None)
  if manual is None:
    types = getattr(mesh, "axis_types", None) or ()
    manual = [n for n, t in zip(mesh.axis_names, types, strict=False) if "manual" in str(t).lower()]
  shape = dict(mesh.shape)
  return math.prod(int(shape[a]) for a in manual)
