"""`attention(..., mesh=...)`: run any impl inside `shard_map`.

XLA cannot partition a Pallas kernel (nor see through our custom VJPs), so a
sharded call is split by hand: batch over ("data", "fsdp"), heads over
"tensor", and -- when "sequence" is larger than 1 -- the token axis over a ring
(`ring.py`). Every device then makes an ordinary local call with the impl that
was asked for.

Grouped kv heads: with fewer kv heads than tensor shards (GQA/MQA), each shard
is given exactly the one kv head its query heads read, by gathering kv heads
before `shard_map` (kv head j is repeated tensor/num_kv_heads times, never
num_heads/num_kv_heads times). Only when a shard's query heads straddle kv
groups unevenly (e.g. 6 heads, 3 kv heads, tensor=2) does each local query head
get its own copy of its kv head.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flash_layers import auto, dispatch, lowering
from flash_layers.impls import Args, Request, UnsupportedError, registry
from flash_layers.parallel import all_gather, context, cost, ring, ulysses
from flash_layers.parallel import mesh as mesh_lib
from flash_layers.parallel import operands as operands_lib
from flash_layers.parallel.context import AUTO_STRATEGY

# The strategies besides the ring (which sharded_attend calls with its own RingConfig), by name:
# each has attention / refusal / local_request (parallel/context.py).
STRATEGY_MODULES: dict[str, Any] = {
    "ring": ring, "ulysses": ulysses, "all_gather": all_gather,
    "ulysses_ring": types.SimpleNamespace(attention=ulysses.hybrid_attention, refusal=ulysses.hybrid_refusal,
                                          local_request=ulysses.hybrid_local_request)}


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one attention call is split over a mesh."""

  mesh: Any  # jax.sharding.Mesh or AbstractMesh
  axes: mesh_lib.MeshAxes  # the mesh axes of the batch, the heads and the sequence
  batch_axes: tuple[str, ...]  # mesh axes the batch is split over (the used ones of axes.batch)
  tensor: int  # shards of the heads
  sequence: int  # devices on the sequence axis (1: no context parallelism)
  strategy: str | None  # the context-parallel strategy (parallel/context.py); None when sequence == 1
  group: int  # ulysses_ring: devices per Ulysses group
  chunks: int  # ring: chunks per device: 1 contiguous, 2 zig-zag
  kv_gather: tuple[int, ...] | None  # kv head per (tensor shard, local kv head); None: plain split
  block: Request  # this device's batch rows and heads with the *global* lengths (what a strategy splits)
  local: Request  # the request of each local impl call
  reason: str = ""  # why this strategy (auto's cost model, or "asked for")
  operand_layouts: tuple = ()  # mod_operand_axes, one entry per operand (parallel/operands.py)

  @property
  def axis_names(self) -> frozenset[str]:
    # Every axis not already manual, also the unused ones (the call is replicated over
    # them): Pallas interpret mode runs callbacks, which need a fully manual mesh.
    return frozenset(self.mesh.axis_names) - mesh_lib.manual_axes(self.mesh)

  def describe(self, request: Request) -> str:
    parts = [f"batch over {'x'.join(self.batch_axes)} ({request.batch // self.local.batch} shards)"
             if self.batch_axes else "batch whole"]
    if self.tensor > 1:
      kv = (f"kv heads split {request.num_kv_heads}->{self.block.num_kv_heads}"
            if self.kv_gather is None else
            f"{self.block.num_kv_heads} of {request.num_kv_heads} kv heads gathered per shard")
      parts.append(f"heads over {self.axes.heads} ({self.block.num_heads} per shard; {kv})")
    if self.sequence > 1:
      parts.append(f"context parallel over {self.axes.sequence}={self.sequence}: {self._strategy_text()}"
                   + (f" ({self.reason})" if self.reason else ""))
    shape = dict(self.mesh.shape)
    mesh_text = ", ".join(f"{a}={s}" for a, s in shape.items() if s > 1)
    return f"shard_map on mesh ({mesh_text}): " + "; ".join(parts)

  def _strategy_text(self) -> str:
    if self.strategy == "ring":
      layout = "zig-zag, 2 chunks" if self.chunks == 2 else "contiguous, 1 chunk"
      return (f"strategy ring ({layout} of {self.local.q_len} queries per device, collective-permute "
              "of K/V)")
    if self.strategy == "ulysses_ring":
      return f"strategy ulysses_ring (Ulysses in groups of {self.group}, a ring across the groups)"
    return f"strategy {self.strategy}"


def resolve_mesh(mesh) -> Any | None:
  """The mesh to shard over (the given one, else the current one), or None when nothing to split."""
  if mesh is None:
    mesh = mesh_lib.current_mesh()
  if mesh is None:
    return None
  if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
    raise TypeError("mesh must be a jax.sharding.Mesh (see flash_layers.make_mesh); "
                    f"got {type(mesh).__name__}")
  if math.prod(int(s) for a, s in dict(mesh.shape).items() if a not in mesh_lib.manual_axes(mesh)) == 1:
    return None
  return mesh


def make_plan(request: Request, mesh, *, axes: mesh_lib.MeshAxes | None = None,
              strategy: str = AUTO_STRATEGY, group: int | None = None, operand_layouts: tuple = (),
              operand_shapes: tuple = ()) -> Plan:
  """Check that `request` splits evenly over `mesh`; raises ValueError naming the dimension, or
  UnsupportedError naming the strategy that cannot serve it."""
  axes = mesh_lib.resolve_axes(mesh) if axes is None else axes
  batch_sizes, tensor, sequence = axes.sizes(mesh)
  batch_axes = tuple(a for a, size in batch_sizes.items() if size > 1)
  batch_shards = math.prod(batch_sizes[a] for a in batch_axes)
  checks = (("batch", request.batch, batch_shards, " x ".join(axes.batch) or "batch"),
            ("num_heads", request.num_heads, tensor, axes.heads),
            ("q_len", request.q_len, sequence, axes.sequence),
            ("kv_len", request.kv_len, sequence, axes.sequence))
  for name, value, shards, axis in checks:
    if value % shards:
      raise ValueError(f"{name}={value} must be divisible by the mesh's {axis} size ({shards}) "
                       f"to shard attention over mesh {dict(mesh.shape)}")
  operands_lib.check_divides(operand_layouts, operand_shapes, {"batch": batch_shards, "heads": tensor})
  local_kv_heads, kv_gather = ulysses.kv_heads_plan(request.num_heads, request.num_kv_heads, tensor)
  block = dataclasses.replace(
      request, batch=request.batch // batch_shards, num_heads=request.num_heads // tensor,
      num_kv_heads=local_kv_heads)
  plan = dict(mesh=mesh, axes=axes, batch_axes=batch_axes, tensor=tensor, sequence=sequence,
              kv_gather=kv_gather, operand_layouts=operand_layouts)
  if sequence == 1:
    return Plan(**plan, strategy=None, group=1, chunks=1, block=block, local=block)
  # A block mask's tile flags are for the whole sequence: each shard builds its own from the mask_mod.
  block = dataclasses.replace(block, block_mask_tiles=None)
  strategy, group, reason = _choose_strategy(block, sequence, strategy, group, mesh,
                                             _sequence_slices(mesh, axes.sequence))
  if strategy == "ring":
    # Zig-zag balances causal work; windows are local already and keep the contiguous layout.
    zigzag = (block.spec.causal and block.spec.window is None
              and block.q_len % (2 * sequence) == 0 and block.kv_len % (2 * sequence) == 0)
    chunks = 2 if zigzag else 1
    local = dataclasses.replace(block, q_len=block.q_len // (sequence * chunks),
                                kv_len=block.kv_len // (sequence * chunks))
    return Plan(**plan, strategy=strategy, group=1, chunks=chunks, block=block, local=local, reason=reason)
  local = STRATEGY_MODULES[strategy].local_request(block, sequence, group)
  return Plan(**plan, strategy=strategy, group=group, chunks=1, block=block, local=local, reason=reason)


def _concrete_devices(mesh) -> np.ndarray | None:
  """The mesh's device array, or None for an AbstractMesh (which has none)."""
  try:
    devices = mesh.devices
  except (AttributeError, ValueError):
    return None
  return devices if getattr(devices, "size", 0) else None


def _generation(mesh) -> str:
  """The TPU generation (or "cpu" / "gpu") whose bandwidths auto's cost model uses: from the mesh's
  devices, or for an AbstractMesh from the platform being lowered for."""
  devices = _concrete_devices(mesh)
  kind = None if devices is None else getattr(devices.flat[0], "device_kind", None)
  platform = lowering.only_platform() or lowering.default_platform()
  try:
    return cost.generation_of(kind or platform)
  except ValueError:
    return {"tpu": "v5p", "cuda": "gpu", "rocm": "gpu"}.get(platform, "cpu")


def _sequence_slices(mesh, axis: str) -> int:
  """How many slices (devices' `slice_index`) the mesh's sequence axis spans: 1 for an AbstractMesh
  and for meshes from `make_mesh`, which keeps the sequence inside a slice."""
  devices = _concrete_devices(mesh)
  if devices is None:
    return 1
  at = list(mesh.axis_names).index(axis)
  line = np.moveaxis(np.asarray(devices), at, 0).reshape(devices.shape[at], -1)[:, 0]
  return len({getattr(d, "slice_index", 0) for d in line})


def _auto_strategy(block: Request, size: int, mesh, dcn_groups: int = 1):
  """auto: the cost model's cheapest strategy that also serves the call (parallel/cost.py); a
  sequence axis spanning slices puts the bytes that leave a slice on DCN."""
  generation = _generation(mesh)
  allowed = tuple(s for s in context.STRATEGIES if s in ("ring", "ulysses", "all_gather", "ulysses_ring"))
  try:
    strategy, group, reason, _ = cost.choose(block, size, generation, dcn_groups, allowed=allowed)
  except ValueError:
    return "ring", 1, "auto: the cost model finds no other strategy feasible; the ring"
  group = group or 1
  module = STRATEGY_MODULES[strategy]
  why = None if strategy == "ring" else module.refusal(block, size, group)
  if why is not None:
    return "ring", 1, f"auto: {strategy} cannot serve the call ({why}); the ring"
  return strategy, group, f"auto on {generation}: {reason}"


def _choose_strategy(block: Request, size: int, strategy: str, group: int | None, mesh=None,
                     dcn_groups: int = 1):
  """(strategy, group, reason): the asked-for strategy if it serves the call (else UnsupportedError
  naming it), or auto's choice."""
  if strategy not in (*context.STRATEGIES, AUTO_STRATEGY):
    raise ValueError(f"context_parallel must be one of {(*context.STRATEGIES, AUTO_STRATEGY)}; "
                     f"got {strategy!r}")
  if strategy == AUTO_STRATEGY:
    return _auto_strategy(block, size, mesh, dcn_groups)
  if strategy == "ulysses_ring":
    group = group or cost.ulysses_ring_group(block, size, dcn_groups) or 1
  else:
    group = 1
  module = STRATEGY_MODULES.get(strategy)
  why = None if module is None or strategy == "ring" else module.refusal(block, size, group)
  if why is not None:
    raise UnsupportedError(f"context_parallel={strategy!r} cannot serve this call: {why}")
  return strategy, group, "asked for"


def _shard_map(f, plan: Plan, in_specs, out_specs):
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is not None:
    return shard_map(f, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                     axis_names=plan.axis_names, check_vma=False)
  from jax.experimental.shard_map import shard_map  # jax < 0.7
  return shard_map(f, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False,
                   auto=frozenset(plan.mesh.axis_names) - plan.axis_names)


def sharded_attend(query, key, value, *, impl: str, request: Request, args: Args, plan: Plan):
  """`dispatch.attend`, split over `plan.mesh`; returns the global (out, lse)."""
  auto.resolve(impl, plan.local, lowering.default_platform())  # an explicit impl refuses here
  _check_sequence_split(plan, args)
  _check_mods_split(impl, plan)
  offsets = {name: x for name, x in (("q_offset", args.q_offset), ("kv_offset", args.kv_offset))
             if not (isinstance(x, int) and x == 0)}
  static_offsets = {name: x for name, x in offsets.items() if isinstance(x, int)}
  if plan.kv_gather is not None:
    index = jnp.asarray(plan.kv_gather, jnp.int32)
    key, value = jnp.take(key, index, axis=2), jnp.take(value, index, axis=2)
  batch = plan.batch_axes or None
  tensor = plan.axes.heads if plan.tensor > 1 else None
  sequence = plan.axes.sequence if plan.sequence > 1 else None
  heads_spec = P(batch, sequence, tensor, None)
  seg_spec = P(batch, sequence)
  has_segments = args.q_segment_ids is not None
  # Dropout hashes *global* batch rows and heads: each device adds the start of its shard.
  extras = {name: x for name, x in (("dropout_seed", args.dropout_seed), ("alibi_slopes", args.alibi_slopes),
                                    ("bias", args.bias), ("dense_mask", args.dense_mask)) if x is not None}
  extras.update({name: x for name, x in offsets.items() if name not in static_offsets})  # traced: operands
  extra_specs = {"dropout_seed": P(), "alibi_slopes": P(tensor), "q_offset": P(), "kv_offset": P()}
  for name in ("bias", "dense_mask"):  # rank 4 [b|1, h|1, q, kv]: split only the full dimensions
    if name in extras:
      shape = extras[name].shape
      extra_specs[name] = P(batch if shape[0] > 1 else None, tensor if shape[1] > 1 else None, None, None)
  layouts = plan.operand_layouts or (None,) * len(args.mod_operands)
  operand_specs = tuple(P(*operands_lib.spec(layout, batch, tensor)) for layout in layouts)
  operand_shapes = tuple(tuple(x.shape) for x in args.mod_operands)
  # A prebuilt block mask's flags [b|1, nq, nk] follow the batch; with a sequence split each shard
  # builds its own (make_plan dropped the tiles from the request).
  tiles = args.mod_tiles if plan.sequence == 1 else None
  tile_specs = () if tiles is None else tuple(P(batch if t.shape[0] > 1 else None, None, None) for t in tiles)

  def local_call(q, k, v, *rest):
    rest = list(rest)
    q_seg, kv_seg = (rest.pop(0), rest.pop(0)) if has_segments else (None, None)
    local = {name: rest.pop(0) for name in extras}
    ops = tuple(rest.pop(0) for _ in operand_specs)
    local_tiles = tuple(rest.pop(0) for _ in tile_specs) or None
    batch_offset = head_offset = 0
    if plan.batch_axes:
      batch_offset = jax.lax.axis_index(plan.batch_axes) * plan.block.batch
    if plan.tensor > 1:
      head_offset = jax.lax.axis_index(plan.axes.heads) * plan.block.num_heads
    ops = operands_lib.embed(ops, layouts, operand_shapes, batch_offset, head_offset)
    local_args = Args(q_segment_ids=q_seg, kv_segment_ids=kv_seg, batch_offset=batch_offset,
                      head_offset=head_offset, mod_operands=ops, mod_tiles=local_tiles,
                      **static_offsets, **local)
    if plan.sequence == 1:
      return dispatch.attend(q, k, v, impl=impl, request=plan.local, args=local_args)
    if plan.strategy == "ring":
      config = ring.RingConfig(impl=impl, request=plan.local, axis=plan.axes.sequence, size=plan.sequence,
                               chunks=plan.chunks)
      return ring.ring_attention(q, k, v, q_seg, kv_seg, config, local_args)
    config = context.CPConfig(impl=impl, request=plan.block, axis=plan.axes.sequence, size=plan.sequence,
                              group=plan.group)
    return STRATEGY_MODULES[plan.strategy].attention(q, k, v, q_seg, kv_seg, config, local_args)

  operands = (query, key, value)
  in_specs = (heads_spec,) * 3
  if has_segments:
    operands += (args.q_segment_ids, args.kv_segment_ids)
    in_specs += (seg_spec, seg_spec)
  operands += (*extras.values(), *args.mod_operands, *(tiles or ()))
  in_specs += (*(extra_specs[name] for name in extras), *operand_specs, *tile_specs)
  out_specs = (heads_spec, P(batch, tensor, sequence))
  operands = _match_explicit_axes(plan, operands, in_specs)
  return _shard_map(local_call, plan, in_specs, out_specs)(*operands)


def _check_mods_split(impl: str, plan: Plan) -> None:
  """Mods on a batch or head split need an impl that hands them global rows and heads."""
  heads_split = plan.tensor > 1 or plan.strategy in ("ulysses", "ulysses_ring")
  if not plan.local.has_mods or not (plan.batch_axes or heads_split):
    return
  name = auto.choose(impl, plan.local, lowering.default_platform())[0]
  if not registry.impl_has(name, "sharded_mods"):
    split = "batch and heads" if plan.batch_axes and heads_split else "batch" if plan.batch_axes else "heads"
    raise UnsupportedError(
        f"mask_mod/score_mod with impl {name!r} on a mesh that splits the {split}: its kernels read the mods "
        "with shard-local batch rows and heads; use a mesh that splits only the sequence with the ring or "
        f"all_gather, or impl= one of {list(registry.impls_with('sharded_mods'))}")


def _check_sequence_split(plan: Plan, args: Args) -> None:
  """What no context-parallel strategy serves: arrays over (q, kv) and fixed offsets."""
  if plan.sequence == 1:
    return
  where = (f"a sequence-sharded mesh ({plan.axes.sequence}={plan.sequence}, "
           f"context_parallel={plan.strategy!r})")
  if args.bias is not None:
    raise UnsupportedError(f"dense bias with {where}: the bias would travel with K/V; use alibi_slopes or a "
                           "score_mod, or a mesh without a sequence axis")
  if args.dense_mask is not None:
    raise UnsupportedError(f"dense mask with {where}: the mask would travel with K/V; use causal/window/"
                           "segment ids or a mask_mod, or a mesh without a sequence axis")
  offsets = [name for name, x in (("q_offset", args.q_offset), ("kv_offset", args.kv_offset))
             if not (isinstance(x, int) and x == 0)]
  if offsets:
    raise UnsupportedError(f"{' and '.join(offsets)} with {where}: the strategy sets each block's positions "
                           "itself; use a mesh without a sequence axis")


def _match_explicit_axes(plan: Plan, operands, in_specs):
  """On a mesh with Explicit axes (jax.make_mesh's default) shard_map wants inputs whose sharding
  type already is its in_specs; Auto axes are resharded by shard_map itself."""
  types = getattr(plan.mesh, "axis_types", None) or ()
  if not any("explicit" in str(t).lower() for t in types):
    return operands
  reshard = getattr(jax.sharding, "reshard", None) or jax.reshard
  return tuple(reshard(x, NamedSharding(plan.mesh, spec)) for x, spec in zip(operands, in_specs, strict=True))
