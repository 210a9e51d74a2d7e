"""Device meshes with our four named axes, the default logical-axis rules, and "the current mesh".

The axes, outermost first (the order `make_mesh` lays devices out in, so the
innermost axes -- sequence and tensor, whose collectives run every layer -- get
the nearest neighbours):

* ``data``     -- batch rows; parameters replicated.
* ``fsdp``     -- batch rows too; parameters sharded over it along "embed" (ZeRO-3 style).
* ``tensor``   -- attention heads and MLP columns (Megatron style).
* ``sequence`` -- the token axis; attention over it runs as a ring.

On several TPU slices (joined by the data-center network, DCN) the mesh is hybrid:
data and fsdp may also run across slices (dcn_data x dcn_fsdp = the slices), tensor
and sequence stay inside one.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence

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


def resolve_sizes(sizes: Mapping[str, int], total: int, *, field: str = "{}",
                  unit: str = "devices") -> dict[str, int]:
  """Sizes that multiply to `total`, one of them possibly -1 ("the rest").

  The one place "-1 means the rest" is resolved, for `make_mesh` and `config.mesh`.
  `field` formats a size's name into the name the caller knows it by
  ("config.mesh.{}", "make_mesh {}"), so every error names what to change.
  """
  sizes = dict(sizes)
  for name, size in sizes.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
      raise ValueError(f"{field.format(name)}: must be a positive integer or -1 (the rest); got {size!r}")
  rest = [name for name, size in sizes.items() if size == -1]
  if len(rest) > 1:
    raise ValueError(f"{field.format(rest[1])}: at most one size may be -1; got -1 for {rest}")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if rest:
    if total % fixed:
      raise ValueError(f"{field.format(rest[0])}: -1 takes the rest, but the other sizes' product {fixed} "
                       f"does not divide the {total} {unit} (sizes {sizes})")
    sizes[rest[0]] = total // fixed
  elif fixed != total:
    named = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all sizes 1"
    raise ValueError(f"{field.format('*'.join(sizes))}: {named} needs {fixed} {unit} but there are {total}; "
                     "the sizes must multiply to that count (use -1 for one size to take the rest)")
  return {k: int(v) for k, v in sizes.items()}


def resolve_mesh_sizes(per_slice: Mapping[str, int], dcn: Mapping[str, int], num_devices: int,
                       num_slices: int, *, field: str = "{}") -> dict[str, int]:
  """Per-slice axis sizes (data, fsdp, tensor, sequence) and DCN sizes (dcn_data, dcn_fsdp), -1s resolved.

  The slices must split the devices evenly; the DCN sizes multiply to the slice
  count, the per-slice sizes to the devices of a slice. Tensor and sequence are
  refused when they cannot stay inside one slice.
  """
  if num_slices < 1 or num_devices % num_slices:
    raise ValueError(f"{num_devices} devices do not split into {num_slices} equal slices")
  per = num_devices // num_slices
  for name in ("tensor", "sequence"):
    size = per_slice.get(name, 1)
    if num_slices > 1 and isinstance(size, (int, np.integer)) and size > 0 and per % size:
      raise ValueError(
        f"{field.format(name)}: {size} does not fit in one slice of {per} devices ({num_slices} slices); "
        f"{name} collectives run every layer and must stay on the slice's interconnect (ICI): only data "
        f"and fsdp may span slices ({field.format('dcn_data')}, {field.format('dcn_fsdp')})")
  dcn = resolve_sizes(dcn, num_slices, field=field, unit="slices")
  unit = f"devices per slice ({num_devices} in {num_slices} slices)" if num_slices > 1 else "devices"
  return {**resolve_sizes(per_slice, per, field=field, unit=unit), **dcn}


def slice_count(devices: Sequence[jax.Device]) -> int:
  """How many slices (ICI islands joined by DCN) `devices` span, from their `slice_index`.

  Devices without one (CPU, GPU, a single TPU slice on older runtimes) count as one slice.
  """
  return len({getattr(d, "slice_index", 0) for d in devices})


def _slices(devices: list, num_slices: int | None) -> list[list]:
  """`devices` grouped by slice, slices in `slice_index` order."""
  found = slice_count(devices)
  indexed = any(hasattr(d, "slice_index") for d in devices)
  if num_slices is None or (indexed and num_slices == found):
    groups: dict[int, list] = {}
    for d in devices:
      groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
    return [groups[k] for k in sorted(groups)]
  if indexed:
    raise ValueError(f"make_mesh num_slices={num_slices}, but the devices' slice_index says {found} slice(s)")
  if isinstance(num_slices, bool) or not isinstance(num_slices, (int, np.integer)) or num_slices < 1 \
      or len(devices) % num_slices:
    raise ValueError(f"make_mesh num_slices must be a positive integer dividing the {len(devices)} devices; "
                     f"got {num_slices!r}")
  # Devices that carry no slice_index (CPU tests, simulated slices): consecutive equal groups.
  per = len(devices) // num_slices
  return [devices[i * per:(i + 1) * per] for i in range(num_slices)]


def _slice_grid(devices: list, shape: tuple[int, ...]) -> np.ndarray:
  try:
    # Topology-aware placement on TPU/GPU slices (rings on physical neighbours).
    from jax.experimental import mesh_utils
    return mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, NotImplementedError, AssertionError):
    return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, sequence: int = 1,
              devices: Sequence[jax.Device] | None = None, *, dcn_data: int = 1, dcn_fsdp: int = 1,
              num_slices: int | None = None) -> Mesh:
  """A `Mesh` with axes ("data", "fsdp", "tensor", "sequence") over all devices of the job.

  On one slice the sizes are the mesh's; one of them may be -1 (the devices the
  others leave). `devices` defaults to `jax.devices()` -- every device of every
  process in a multi-host job.

  Several slices (TPU pods joined by the data-center network, DCN): the four
  sizes are per slice, over the slice's own interconnect (ICI), and `dcn_data` x
  `dcn_fsdp` must be the number of slices (one may be -1: the rest). The mesh's
  data axis is then dcn_data x data, laid out slice-major (likewise fsdp), so
  only the data and fsdp collectives -- the gradient all-reduce, fsdp's gathers --
  cross DCN; tensor and sequence (whose collectives run every layer) never leave
  a slice. Slices come from the devices' `slice_index`; `num_slices` states the
  count (checked against it), or on devices without one (CPU) splits the device
  list into that many consecutive slices.
  """
  devices = list(jax.devices() if devices is None else devices)
  slices = _slices(devices, num_slices)
  if any(len(s) != len(slices[0]) for s in slices):
    raise ValueError(f"make_mesh: slices of unequal sizes {[len(s) for s in slices]}")
  sizes = resolve_mesh_sizes({"data": data, "fsdp": fsdp, "tensor": tensor, "sequence": sequence},
                             {"dcn_data": dcn_data, "dcn_fsdp": dcn_fsdp}, len(devices), len(slices),
                             field="make_mesh {}")
  shape = tuple(sizes[a] for a in AXES)
  if len(slices) == 1:
    grid = _slice_grid(devices, shape)
  else:
    dcn_shape = (sizes["dcn_data"], sizes["dcn_fsdp"], 1, 1)
    grid = _hybrid_grid(slices, shape, dcn_shape)
  types = _auto_axis_types(len(AXES))
  if types is None:
    return Mesh(grid, AXES)
  return Mesh(grid, AXES, axis_types=types)


def _hybrid_grid(slices: list[list], shape: tuple[int, ...], dcn_shape: tuple[int, ...]) -> np.ndarray:
  """Each axis of size dcn x ici, slice-major: the ICI mesh of each slice tiled over the DCN grid."""
  if all(hasattr(d, "slice_index") for s in slices for d in s):
    from jax.experimental import mesh_utils
    try:
      return mesh_utils.create_hybrid_device_mesh(shape, dcn_shape, [d for s in slices for d in s])
    except (ValueError, NotImplementedError, AssertionError):
      pass  # a slice shape the topology-aware placement does not handle: plain order below
  return _tile_slices(slices, shape, dcn_shape)


def _tile_slices(slices: list[list], shape: tuple[int, ...], dcn_shape: tuple[int, ...]) -> np.ndarray:
  tiles = np.stack([_slice_grid(s, shape) for s in slices]).reshape(dcn_shape + shape)
  n = len(shape)
  order = [i for pair in zip(range(n), range(n, 2 * n), strict=True) for i in pair]
  return tiles.transpose(order).reshape(tuple(d * i for d, i in zip(dcn_shape, shape, strict=True)))


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


# ----------------------------------------------------------------------------
# Which mesh axes carry an attention call's batch, heads and sequence
# ----------------------------------------------------------------------------

# Logical names (flax.linen.logical_axis_rules) that mean an activation's batch, heads or sequence
# axis: ours (LOGICAL_RULES) and MaxText's activation names.
_LOGICAL_NAMES: dict[str, tuple[str, ...]] = {
    "batch": ("batch", "activation_batch"),
    "heads": ("heads", "activation_heads"),
    "sequence": ("length", "activation_length", "sequence"),
}


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """The mesh axes an attention call is split over: batch rows over `batch` (several axes: their
  product), query heads over `heads`, the sequence over `sequence` (context parallelism).

  The default is this package's own names; a mesh with the user's own names (a flax model's
  ("batch", "model"), MaxText's) is mapped by `attention(..., mesh_axes=MeshAxes(...))` or a dict
  {"batch": ..., "heads": ..., "sequence": ...}, or read from flax's current logical axis rules.
  """

  batch: tuple[str, ...] = BATCH_AXES
  heads: str | None = "tensor"
  sequence: str | None = "sequence"

  def sizes(self, mesh) -> tuple[dict[str, int], int, int]:
    """({batch axis: size}, heads size, sequence size) on `mesh` (absent or manual axes: 1)."""
    manual = manual_axes(mesh)
    shape = dict(mesh.shape)

    def size(a):
      return 1 if a is None or a in manual else int(shape.get(a, 1))
    return {a: size(a) for a in self.batch}, size(self.heads), size(self.sequence)


def _as_axes(value, field: str) -> tuple[str, ...]:
  if value is None:
    return ()
  value = (value,) if isinstance(value, str) else tuple(value)
  if not all(isinstance(a, str) for a in value):
    raise TypeError(f"mesh_axes {field} must be a mesh axis name, a tuple of them, or None; got {value!r}")
  return value


def _single(value, field: str) -> str | None:
  axes = _as_axes(value, field)
  if len(axes) > 1:
    raise ValueError(f"mesh_axes {field} takes one mesh axis (or None); got {axes}")
  return axes[0] if axes else None


def resolve_axes(mesh, mesh_axes=None) -> MeshAxes:
  """The `MeshAxes` of a call on `mesh`: `mesh_axes` if given (a MeshAxes or a dict with keys
  batch / heads / sequence), else ours when the mesh has any of our axis names, else the mapping
  flax's current logical axis rules give ("batch", "heads", "length" or MaxText's "activation_*");
  ValueError naming the mesh's axes otherwise."""
  names = tuple(mesh.axis_names)
  if mesh_axes is None and any(a in names for a in AXES):
    return MeshAxes()
  if mesh_axes is None:
    mesh_axes = _from_logical_rules()
    if mesh_axes is None:
      raise ValueError(f"the mesh's axes {names} are none of flash_layers' ({', '.join(AXES)}), and no flax "
                       "logical_axis_rules map 'batch' / 'heads' / 'length' onto them: pass "
                       "mesh_axes=fl.MeshAxes(batch=..., heads=..., sequence=...) (or a dict) naming "
                       "which of the mesh's axes split the batch, the heads and the sequence")
  if isinstance(mesh_axes, dict):
    unknown = sorted(set(mesh_axes) - {"batch", "heads", "sequence"})
    if unknown:
      raise ValueError(f"mesh_axes keys must be among 'batch', 'heads', 'sequence'; got {unknown}")
    mesh_axes = MeshAxes(batch=_as_axes(mesh_axes.get("batch"), "batch"),
                         heads=_single(mesh_axes.get("heads"), "heads"),
                         sequence=_single(mesh_axes.get("sequence"), "sequence"))
  if not isinstance(mesh_axes, MeshAxes):
    raise TypeError("mesh_axes must be a flash_layers.MeshAxes, a dict or None; "
                    f"got {type(mesh_axes).__name__}")
  used = [*mesh_axes.batch, mesh_axes.heads, mesh_axes.sequence]
  missing = [a for a in used if a is not None and a not in names]
  if missing:
    raise ValueError(f"mesh_axes names {missing}, which the mesh (axes {names}) does not have")
  given = [a for a in used if a is not None]
  if len(set(given)) != len(given):
    raise ValueError(f"mesh_axes uses a mesh axis twice: {mesh_axes}")
  return mesh_axes


def _from_logical_rules() -> MeshAxes | None:
  """The MeshAxes flax's current `logical_axis_rules` imply, or None when they map none of ours.

  Read through sys.modules: rules can only be in force when flax's spmd module has been
  imported, and this package must not import flax for a Haiku or plain-JAX caller."""
  spmd = sys.modules.get("flax.core.spmd")  # where flax keeps the rules `logical_axis_rules` sets
  if spmd is None:
    return None
  try:
    rules = dict(spmd.get_logical_axis_rules())
  except Exception:  # noqa: BLE001 -- no flax rules in force
    return None
  found: dict[str, tuple[str, ...]] = {}
  for role, logical in _LOGICAL_NAMES.items():
    for name in logical:
      if rules.get(name) is not None:
        found[role] = _as_axes(rules[name], role)
        break
  if not found:
    return None
  heads, sequence = found.get("heads", ()), found.get("sequence", ())
  return MeshAxes(batch=found.get("batch", ()), heads=heads[0] if heads else None,
                  sequence=sequence[0] if sequence else None)
