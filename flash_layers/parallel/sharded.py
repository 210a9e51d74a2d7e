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
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flash_layers import auto, dispatch, lowering
from flash_layers.impls import Args, Request, UnsupportedError
from flash_layers.parallel import mesh as mesh_lib
from flash_layers.parallel import ring


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one attention call is split over a mesh."""

  mesh: Any  # jax.sharding.Mesh or AbstractMesh
  batch_axes: tuple[str, ...]  # mesh axes the batch is split over
  tensor: int  # shards of the heads
  sequence: int  # devices in the ring (1: no ring)
  chunks: int  # chunks per ring device: 1 contiguous, 2 zig-zag
  kv_gather: tuple[int, ...] | None  # kv head per (tensor shard, local kv head); None: plain split
  local: Request  # the request of each local impl call (one chunk pair for the ring)

  @property
  def axis_names(self) -> frozenset[str]:
    # Every axis not already manual, also the unused ones (the call is replicated over
    # them): Pallas interpret mode runs callbacks, which need a fully manual mesh.
    return frozenset(self.mesh.axis_names) - mesh_lib.manual_axes(self.mesh)

  def describe(self, request: Request) -> str:
    sizes = mesh_lib.axis_sizes(self.mesh)
    parts = [f"batch over {'x'.join(self.batch_axes)} ({request.batch // self.local.batch} shards)"
             if self.batch_axes else "batch whole"]
    if self.tensor > 1:
      kv = (f"kv heads split {request.num_kv_heads}->{self.local.num_kv_heads}"
            if self.kv_gather is None else
            f"{self.local.num_kv_heads} of {request.num_kv_heads} kv heads gathered per shard")
      parts.append(f"heads over tensor ({self.local.num_heads} per shard; {kv})")
    if self.sequence > 1:
      layout = "zig-zag, 2 chunks" if self.chunks == 2 else "contiguous, 1 chunk"
      parts.append(f"ring attention over sequence={self.sequence} ({layout} of "
                   f"{self.local.q_len} queries per device, collective-permute of K/V)")
    mesh_text = ", ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
    return f"shard_map on mesh ({mesh_text}): " + "; ".join(parts)


def resolve_mesh(mesh) -> Any | None:
  """The mesh to shard over (the given one, else the current one), or None when nothing to split."""
  if mesh is None:
    mesh = mesh_lib.current_mesh()
  if mesh is None:
    return None
  if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
    raise TypeError("mesh must be a jax.sharding.Mesh (see flash_layers.make_mesh); "
                    f"got {type(mesh).__name__}")
  if math.prod(mesh_lib.axis_sizes(mesh).values()) == 1:
    return None
  return mesh


def _kv_heads_plan(num_heads: int, num_kv_heads: int, tensor: int):
  """(local kv heads, gather index or None) for splitting heads `tensor` ways."""
  if tensor == 1 or num_kv_heads % tensor == 0:
    return num_kv_heads // tensor, None
  per_shard = num_heads // tensor
  group = num_heads // num_kv_heads
  # One kv head serves all of a shard's query heads, or the shard's heads straddle groups
  # unevenly and each local query head gets its own kv head.
  local = 1 if group % per_shard == 0 else per_shard
  step = per_shard // local
  index = tuple((s * per_shard + j * step) // group for s in range(tensor) for j in range(local))
  return local, index


def make_plan(request: Request, mesh) -> Plan:
  """Check that `request` splits evenly over `mesh`; raises ValueError naming the dimension."""
  sizes = mesh_lib.axis_sizes(mesh)
  batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if sizes[a] > 1)
  batch_shards = math.prod(sizes[a] for a in batch_axes)
  tensor, sequence = sizes["tensor"], sizes["sequence"]
  checks = (("batch", request.batch, batch_shards, "data x fsdp"),
            ("num_heads", request.num_heads, tensor, "tensor"),
            ("q_len", request.q_len, sequence, "sequence"),
            ("kv_len", request.kv_len, sequence, "sequence"))
  for name, value, shards, axes in checks:
    if value % shards:
      raise ValueError(f"{name}={value} must be divisible by the mesh's {axes} size ({shards}) "
                       f"to shard attention over mesh {dict(mesh.shape)}")
  local_kv_heads, kv_gather = _kv_heads_plan(request.num_heads, request.num_kv_heads, tensor)
  # Zig-zag balances causal work; windows are local already and keep the contiguous layout.
  zigzag = (sequence > 1 and request.spec.causal and request.spec.window is None
            and request.q_len % (2 * sequence) == 0 and request.kv_len % (2 * sequence) == 0)
  chunks = 2 if zigzag else 1
  local = dataclasses.replace(
      request, batch=request.batch // batch_shards, num_heads=request.num_heads // tensor,
      num_kv_heads=local_kv_heads, q_len=request.q_len // (sequence * chunks),
      kv_len=request.kv_len // (sequence * chunks))
  return Plan(mesh, batch_axes, tensor, sequence, chunks, kv_gather, local)


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
  if args.bias is not None and plan.sequence > 1:
    raise UnsupportedError("dense bias with a sequence-sharded (ring) mesh: the bias would travel "
                           "with K/V; use alibi_slopes, or a mesh with sequence=1")
  if args.dense_mask is not None and plan.sequence > 1:
    raise UnsupportedError("dense mask with a sequence-sharded (ring) mesh: the mask would travel "
                           "with K/V; use causal/window/segment ids (fl.MultiHeadAttention), or a "
                           "mesh with sequence=1")
  offsets = {name: x for name, x in (("q_offset", args.q_offset), ("kv_offset", args.kv_offset))
             if not (isinstance(x, int) and x == 0)}
  if offsets and plan.sequence > 1:
    raise UnsupportedError(f"{' and '.join(offsets)} with a sequence-sharded (ring) mesh: the ring sets "
                           "each block's positions itself; use a mesh with sequence=1")
  static_offsets = {name: x for name, x in offsets.items() if isinstance(x, int)}
  if plan.kv_gather is not None:
    index = jnp.asarray(plan.kv_gather, jnp.int32)
    key, value = jnp.take(key, index, axis=2), jnp.take(value, index, axis=2)
  batch = plan.batch_axes or None
  tensor = "tensor" if plan.tensor > 1 else None
  sequence = "sequence" if plan.sequence > 1 else None
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

  def local_call(q, k, v, *rest):
    q_seg, kv_seg = rest[:2] if has_segments else (None, None)
    local = dict(zip(extras, rest[2 if has_segments else 0:], strict=True))
    batch_offset = head_offset = 0
    if plan.batch_axes:
      batch_offset = jax.lax.axis_index(plan.batch_axes) * plan.local.batch
    if plan.tensor > 1:
      head_offset = jax.lax.axis_index("tensor") * plan.local.num_heads
    local_args = Args(q_segment_ids=q_seg, kv_segment_ids=kv_seg, batch_offset=batch_offset,
                      head_offset=head_offset, **static_offsets, **local)
    if plan.sequence == 1:
      return dispatch.attend(q, k, v, impl=impl, request=plan.local, args=local_args)
    config = ring.RingConfig(impl=impl, request=plan.local, axis="sequence", size=plan.sequence,
                             chunks=plan.chunks)
    return ring.ring_attention(q, k, v, q_seg, kv_seg, config, local_args)

  operands = (query, key, value)
  in_specs = (heads_spec,) * 3
  if has_segments:
    operands += (args.q_segment_ids, args.kv_segment_ids)
    in_specs += (seg_spec, seg_spec)
  operands += tuple(extras.values())
  in_specs += tuple(extra_specs[name] for name in extras)
  out_specs = (heads_spec, P(batch, tensor, sequence))
  operands = _match_explicit_axes(plan, operands, in_specs)
  return _shard_map(local_call, plan, in_specs, out_specs)(*operands)


def _match_explicit_axes(plan: Plan, operands, in_specs):
  """On a mesh with Explicit axes (jax.make_mesh's default) shard_map wants inputs whose sharding
  type already is its in_specs; Auto axes are resharded by shard_map itself."""
  types = getattr(plan.mesh, "axis_types", None) or ()
  if not any("explicit" in str(t).lower() for t in types):
    return operands
  reshard = getattr(jax.sharding, "reshard", None) or jax.reshard
  return tuple(reshard(x, NamedSharding(plan.mesh, spec)) for x, spec in zip(operands, in_specs, strict=True))
