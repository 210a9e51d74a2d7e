"""Device meshes with our four named axes, the default logical-axis rules, and "the current mesh".

The axes, outermost first (the order `make_mesh` lays devices out in, so the
innermost axes -- sequence and tensor, whose collectives run every layer -- get
the nearest neighbours):

* ``data``     -- batch rows; parameters replicated.
* ``fsdp``     -- batch rows too; parameters sharded over it along "embed" (ZeRO-3 style).
* ``tensor``   -- attention heads and MLP columns (Megatron style).
* ``sequence`` -- the token axis; attention over it runs as a ring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")

# Logical axis name -> mesh axes, for `flax.linen.logical_axis_rules`. Flax uses a
# mesh axis at most once per array, so an activation ("batch", "length", "embed")
# takes fsdp for its batch and leaves embed whole, while a weight ("embed", "heads",
# "head_dim") is sharded over fsdp and tensor.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("length", "sequence"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def _auto_axis_types(n: int):
  """Auto axis types where this jax has them (jax.make_mesh defaults to Explicit in 0.10)."""
  axis_type = getattr(jax.sharding, "AxisType", None)
  return None if axis_type is None else (axis_type.Auto,) * n


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, sequence: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `Mesh` with axes ("data", "fsdp", "tensor", "sequence") over all devices of the job.

  One size may be -1: it takes the devices the others leave. `devices` defaults
  to `jax.devices()` -- every device of every process in a multi-host job.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "sequence": sequence}
  for name, size in sizes.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
      raise ValueError(f"make_mesh {name} must be a positive int or -1 (the rest); got {size!r}")
  rest = [name for name, size in sizes.items() if size == -1]
  if len(rest) > 1:
    raise ValueError(f"make_mesh: at most one axis may be -1; got -1 for {rest}")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if rest:
    if len(devices) % fixed:
      raise ValueError(f"make_mesh: {rest[0]}=-1 needs the device count ({len(devices)}) to be a "
                       f"multiple of the other sizes' product ({fixed}); got {sizes}")
    sizes[rest[0]] = len(devices) // fixed
  total = math.prod(sizes.values())
  if total != len(devices):
    named = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all sizes 1"
    raise ValueError(f"make_mesh: {named} needs {total} devices but there are {len(devices)}; "
                     "sizes must multiply to the device count (use -1 for 'the rest')")
  shape = tuple(sizes[a] for a in AXES)
  try:
    # Topology-aware placement on TPU/GPU slices (rings on physical neighbours).
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices, dtype=object).reshape(shape)
  types = _auto_axis_types(len(AXES))
  if types is None:
    return Mesh(grid, AXES)
  return Mesh(grid, AXES, axis_types=types)


def manual_axes(mesh) -> frozenset[str]:
  manual = getattr(mesh, "manual_axes", None)
  if manual is not None:
    return frozenset(manual)
  types = getattr(mesh, "axis_types", None) or ()
  return frozenset(n for n, t in zip(mesh.axis_names, types, strict=False) if "manual" in str(t).lower())


def current_mesh():
  """The mesh set by `jax.set_mesh` / `jax.sharding.use_mesh` (or legacy `with mesh:`), else None.

  Inside `jit` this is the abstract mesh, which is all `shard_map` needs.
  """
  getters = (getattr(jax.sharding, "get_abstract_mesh", None),)
  for get in getters:
    if get is None:
      continue
    try:
      mesh = get()
    except Exception:  # noqa: BLE001 -- private-ish API differs across jax versions
      mesh = None
    if mesh is not None and not getattr(mesh, "empty", False) and mesh.axis_names:
      return mesh
  try:  # `with mesh:` (deprecated, still used by flax's partitioning helpers)
    from jax._src import mesh as mesh_lib
    mesh = mesh_lib.thread_resources.env.physical_mesh
  except Exception:  # noqa: BLE001
    return None
  return None if mesh.empty else mesh


def axis_sizes(mesh) -> dict[str, int]:
  """Sizes of our axes in `mesh`: absent axes, and axes already manual (we are inside the
  user's own shard_map over them), count as 1."""
  manual = manual_axes(mesh)
  shape = dict(mesh.shape)
  return {a: (1 if a in manual else int(shape.get(a, 1))) for a in AXES}
