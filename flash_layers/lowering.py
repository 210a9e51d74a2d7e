"""Which platform a computation is lowered for, and `interpret_as`.

Kernel families are chosen by the platform the computation is *lowered* for
(`jax.lax.platform_dependent`), never by `jax.default_backend()`: an
ahead-of-time compile for TPU or CUDA from a CPU host must get the real kernels.
`interpret_as("tpu" | "gpu")` overrides that for testing: Pallas kernels of the
named family run in interpret mode, whatever the machine. `interpret_as("tpu",
params=...)` also chooses the TPU interpreter's settings (`pltpu.InterpretParams`:
simulated cores, random parallel order, eager DMAs, the race detector); see
`flash_layers.testing.strict` for the strict preset the test tier uses. `params="plain"`
runs the TPU kernels under Pallas's plain interpreter instead: the same kernel bodies on the
same CPU numerics, without the simulated memory (no NaN-filled uninitialized buffers, no
out-of-bounds errors, no io callbacks), and several times faster on long grids.

Tracing every platform's branch has a price: "auto" attention traces the TPU and GPU kernels
too, which on a CPU was most of an encoder's trace time (per compiled program, in every
process, with or without a compilation cache). Code that knows where its computation runs
(the training job and eval.py: on their mesh's devices) says so with `lowered_only_for`,
and the dispatcher then traces that platform's branch alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

INTERPRET_PLATFORMS = ("tpu", "gpu")
PLAIN = "plain"  # interpret_as("tpu", params=PLAIN): Pallas's plain interpreter, numerics only
LOWERING_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")

_interpret: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flash_layers_interpret", default=None)
_params: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "flash_layers_interpret_params", default=None)


@contextlib.contextmanager
def interpret_as(platform: str, params: Any = None) -> Iterator[None]:
  """Run flash_pallas's `platform` kernels ("tpu" or "gpu") in Pallas interpret mode.

  params: for "tpu" only, a `jax.experimental.pallas.tpu.InterpretParams` the TPU
  kernels are interpreted with (None: its defaults, the TPU-semantics interpreter), or
  "plain": Pallas's plain interpreter (numerics only: no simulated memory, so no NaN-filled
  uninitialized reads and no out-of-bounds errors; no io callbacks, several times faster).
  The choice is read when a function is traced; a function already jitted keeps the kernels
  it was traced with.
  """
  if platform not in INTERPRET_PLATFORMS:
    raise ValueError(f"interpret_as platform must be one of {INTERPRET_PLATFORMS}; got {platform!r}")
  if params is not None:
    if platform != "tpu":
      raise ValueError(f"interpret_as params apply to platform 'tpu' only; got platform {platform!r}")
    from jax.experimental.pallas import tpu as pltpu  # the TPU interpreter's settings type
    if not (isinstance(params, pltpu.InterpretParams) or (isinstance(params, str) and params == PLAIN)):
      raise ValueError("interpret_as params must be a jax.experimental.pallas.tpu.InterpretParams, "
                       f"{PLAIN!r} or None; got {params!r}")
  token, params_token = _interpret.set(platform), _params.set(params)
  try:
    yield
  finally:
    _params.reset(params_token)
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


def platform_dependent(*operands, default: Callable | None = None, **branches: Callable):
  """`jax.lax.platform_dependent`, tracing one branch when `lowered_only_for` names the platform.

  Outside `lowered_only_for`, every branch is traced and the lowering keeps its platform's one.
  Inside, only that platform's branch (or `default`) is traced: the other branches would never
  be lowered, and tracing them costs as much as tracing the one kept (a model's attention runs
  once per layer, so this is most of an eval step's tracing on a CPU).
  """
  only = _only.get()
  branch = branches.get(only, default) if only is not None else None
  if branch is not None:
    return branch(*operands)
  if default is None:
    return jax.lax.platform_dependent(*operands, **branches)
  return jax.lax.platform_dependent(*operands, default=default, **branches)


def platform_of(device) -> str:
  """A device's platform in lowering names ("cpu", "tpu", "cuda", "rocm")."""
  if device.platform == "gpu":
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
  return device.platform


def interpreting() -> str | None:
  """The platform forced by `interpret_as`, or None."""
  return _interpret.get()


def interpret_params() -> Any:
  """The `InterpretParams` or "plain" given to the enclosing `interpret_as("tpu", params=...)`, or None."""
  return _params.get()


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


# ----------------------------------------------------------------------------
# An error raised when a branch is lowered
# ----------------------------------------------------------------------------
# `jax.lax.platform_dependent` traces every branch but lowers only the one of the platform being
# compiled for. A branch that cannot serve a call (flash_pallas's TPU kernels given the GPU
# family's block sizes) returns `fails_when_lowered(...)`: values of the right shapes that raise
# the ValueError when, and only when, that branch is lowered, i.e. when it would run.

_unlowerable_p = jex_core.Primitive("flash_layers_fails_when_lowered")
_unlowerable_p.multiple_results = True


def _unlowerable_abstract(*, message: str, shapes: tuple) -> list:
  return [jax.core.ShapedArray(shape, dtype) for shape, dtype in shapes]


def _unlowerable_raise(*_, message: str, **__):
  raise ValueError(message)


_unlowerable_p.def_abstract_eval(_unlowerable_abstract)
_unlowerable_p.def_impl(_unlowerable_raise)
mlir.register_lowering(_unlowerable_p, _unlowerable_raise)


def _bind(message: str, shapes) -> list:
  return _unlowerable_p.bind(message=message,
                             shapes=tuple((tuple(x.shape), jax.numpy.dtype(x.dtype)) for x in shapes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fails(message, shapes, operands):
  return _bind(message, shapes)


def _fails_fwd(message, shapes, operands):
  return _bind(message, shapes), operands


def _fails_bwd(message, shapes, operands, cotangents):
  # The gradient fails the same way: a branch differentiated with its output unused (a loss
  # linear in it) must not lower to zeros.
  return (tuple(_bind(message, operands)),)


_fails.defvjp(_fails_fwd, _fails_bwd)


def fails_when_lowered(message: str, shapes, *operands: jax.Array) -> list[jax.Array]:
  """Arrays of `shapes` (`jax.ShapeDtypeStruct`s) whose lowering (or eager evaluation) raises
  ValueError(message), and so does that of their gradient with respect to `operands`."""
  shapes = tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in shapes)
  return _fails(message, shapes, tuple(operands))
