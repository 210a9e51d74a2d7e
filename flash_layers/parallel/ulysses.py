"""DeepSpeed-Ulysses context parallelism (arXiv:2309.14509), and its hybrid with the ring.

"ulysses": each of the `size` devices of the sequence axis holds a contiguous slice of the tokens
and every head. One tiled all-to-all per array swaps that for the whole sequence and a slice of
the heads (num_heads / size per device); the device then makes one ordinary `dispatch.attend` call
over the whole sequence with its heads -- any impl, the flash kernels included -- and the output
and lse take the inverse all-to-all back to the token split. Segment ids are all-gathered (every
device needs all of them). Nothing here has a custom VJP: the all-to-alls transpose to
all-to-alls, so the backward is the impl's own, between two more all-to-alls.

The inner call sees the global positions (q_offset = kv_offset = 0: it holds every token) and
global heads (Args.head_offset += the start of this device's head slice), so mods, dropout and
ALiBi (slopes sliced to the local heads) mean what they mean unsharded.

Grouped kv heads (`kv_heads_plan`): with num_kv_heads divisible by `size` the kv heads are split
like the query heads and never copied. Otherwise each device is sent only the kv heads its query
heads read: when a device's query heads all read one kv head, kv head j is repeated
size / num_kv_heads times across the devices (e.g. 8 heads, 2 kv heads, size 4: each kv head twice,
not num_heads / num_kv_heads = 4 times); only when a device's heads straddle kv groups unevenly
(6 heads, 3 kv heads, size 2) does each of its query heads get its own copy of its kv head.

"ulysses_ring": Ulysses inside each group of `group` consecutive devices of the axis (the
all-to-alls run with axis_index_groups), then ring attention (ring.py) across the size // group
groups: device m of every group joins the ring of the devices m, m + group, ..., and each ring
hop moves K/V by `group` devices. After the group's all-to-all a device holds its group's token
span with num_heads / group heads; causal calls use the ring's zig-zag layout across the groups'
spans (the chunks move between the groups' same-numbered devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flash_layers import dispatch
from flash_layers.impls import Args, Request
from flash_layers.parallel import ring
from flash_layers.parallel.context import CPConfig

NAME = "ulysses"  # the strategy names, as CPConfig users spell them (context.STRATEGIES)
HYBRID = "ulysses_ring"


def kv_heads_plan(num_heads: int, num_kv_heads: int, shards: int):
  """(kv heads per shard, gather index or None) for splitting heads `shards` ways.

  None: the kv heads split evenly. Else ``index[s * local + j]`` is the kv head that shard s holds
  in its j-th local slot; gather them (``jnp.take(k, index, axis=2)``) and split the result.
  """
  if shards == 1 or num_kv_heads % shards == 0:
    return num_kv_heads // shards, None
  per_shard = num_heads // shards
  group = num_heads // num_kv_heads
  # All of a shard's query heads read one kv head, or they straddle groups unevenly and each
  # local query head gets its own copy of its kv head.
  local = 1 if group % per_shard == 0 else per_shard
  step = per_shard // local
  index = tuple((s * per_shard + j * step) // group for s in range(shards) for j in range(local))
  return local, index


# ----------------------------------------------------------------------------
# What each strategy serves
# ----------------------------------------------------------------------------

def _common_refusal(request: Request, size: int, group: int, name: str) -> str | None:
  if request.num_heads % group:
    return (f"num_heads={request.num_heads} is not divisible by the {name} head split "
            f"({group} devices of the sequence axis of size {size})")
  for field in ("q_len", "kv_len"):
    if getattr(request, field) % size:
      return f"{field}={getattr(request, field)} is not divisible by the sequence size ({size}) for {name}"
  if request.has_bias or request.has_dense_mask:
    what = "dense bias" if request.has_bias else "dense mask"
    return f"a {what} with {name}: it is not split over the sequence; use alibi_slopes or mods"
  return None


def refusal(request: Request, size: int, group: int = 1) -> str | None:
  """Why "ulysses" cannot serve `request` on `size` devices (None if it can)."""
  return _common_refusal(request, size, size, NAME)


def hybrid_refusal(request: Request, size: int, group: int) -> str | None:
  """Why "ulysses_ring" cannot serve `request` on `size` devices in groups of `group`."""
  if group < 1 or size % group:
    return f"the sequence size ({size}) is not divisible by the {HYBRID} group ({group})"
  return _common_refusal(request, size, group, HYBRID)


def _ring_chunks(request: Request, rings: int) -> int:
  """Chunks per device of the hybrid's ring: 2 (zig-zag) for causal calls, as sharded.make_plan."""
  zigzag = (rings > 1 and request.spec.causal and request.spec.window is None
            and request.q_len % (2 * rings) == 0 and request.kv_len % (2 * rings) == 0)
  return 2 if zigzag else 1


def local_request(request: Request, size: int, group: int = 1) -> Request:
  """The request of the inner "ulysses" call: the whole sequence, num_heads / size heads."""
  kv_heads, _ = kv_heads_plan(request.num_heads, request.num_kv_heads, size)
  return dataclasses.replace(request, num_heads=request.num_heads // size, num_kv_heads=kv_heads)


def hybrid_local_request(request: Request, size: int, group: int) -> Request:
  """The request of each ring step of "ulysses_ring": one chunk pair, num_heads / group heads."""
  rings = size // group
  chunks = _ring_chunks(request, rings)
  kv_heads, _ = kv_heads_plan(request.num_heads, request.num_kv_heads, group)
  return dataclasses.replace(request, num_heads=request.num_heads // group, num_kv_heads=kv_heads,
                             q_len=request.q_len // (rings * chunks),
                             kv_len=request.kv_len // (rings * chunks))


# ----------------------------------------------------------------------------
# The all-to-alls
# ----------------------------------------------------------------------------

def _groups(config: CPConfig, group: int):
  """axis_index_groups for all-to-alls inside groups of `group` consecutive devices (None: all)."""
  if group == config.size:
    return None
  return [list(range(g * group, (g + 1) * group)) for g in range(config.size // group)]


def _to_heads(x, config: CPConfig, group: int):
  """[b, t, h, d] token slice, all heads -> [b, t * group, h / group, d] (the group's tokens)."""
  if group == 1:  # ulysses_ring with groups of one device: the plain ring
    return x
  return jax.lax.all_to_all(x, config.axis, 2, 1, tiled=True, axis_index_groups=_groups(config, group))


def _to_tokens(out, lse, config: CPConfig, group: int):
  """The inverse: out [b, T, h/g, dv] -> [b, T/g, h, dv]; lse [b, h/g, T] -> [b, h, T/g]."""
  if group == 1:
    return out, lse
  groups = _groups(config, group)
  out = jax.lax.all_to_all(out, config.axis, 1, 2, tiled=True, axis_index_groups=groups)
  lse = jax.lax.all_to_all(lse, config.axis, 2, 1, tiled=True, axis_index_groups=groups)
  return out, lse


def _gather_segments(seg, config: CPConfig, group: int):
  """[b, t] -> [b, t * group]: the group's segment ids, in token order."""
  if seg is None or group == 1:
    return seg
  # An all-to-all of `group` copies is an all-gather that also runs inside axis_index_groups.
  copies = jnp.broadcast_to(seg[:, None], (seg.shape[0], group, seg.shape[1]))
  gathered = jax.lax.all_to_all(copies, config.axis, 1, 1, tiled=True,
                                axis_index_groups=_groups(config, group))
  return gathered.reshape(seg.shape[0], group * seg.shape[1])


def _head_split(q, k, v, q_seg, kv_seg, config: CPConfig, args: Args, group: int):
  """The all-to-alls into the head split, and the Args of the local heads."""
  r = config.request
  _, index = kv_heads_plan(r.num_heads, r.num_kv_heads, group)
  if index is not None:  # repeat kv heads only as far as the devices' query heads need them
    index = jnp.asarray(index, jnp.int32)
    k, v = jnp.take(k, index, axis=2), jnp.take(v, index, axis=2)
  q, k, v = (_to_heads(x, config, group) for x in (q, k, v))
  q_seg, kv_seg = (_gather_segments(s, config, group) for s in (q_seg, kv_seg))
  local_heads = r.num_heads // group
  first = (jax.lax.axis_index(config.axis) % group) * local_heads
  slopes = args.alibi_slopes
  if slopes is not None:
    slopes = jax.lax.dynamic_slice_in_dim(slopes, first, local_heads)
  args = dataclasses.replace(args, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=0,
                             kv_offset=0, head_offset=args.head_offset + first, alibi_slopes=slopes)
  return q, k, v, args


# ----------------------------------------------------------------------------
# The strategies
# ----------------------------------------------------------------------------

def attention(q, k, v, q_seg, kv_seg, config: CPConfig, args: Args):
  """"ulysses": contiguous token shards in -> this shard's (out, lse) (see the module docstring)."""
  q, k, v, local_args = _head_split(q, k, v, q_seg, kv_seg, config, args, config.size)
  request = local_request(config.request, config.size)
  out, lse = dispatch.attend(q, k, v, impl=config.impl, request=request, args=local_args)
  return _to_tokens(out, lse, config, config.size)


def hybrid_attention(q, k, v, q_seg, kv_seg, config: CPConfig, args: Args):
  """"ulysses_ring": Ulysses inside groups of `config.group` devices, a ring across the groups."""
  group = config.group
  q, k, v, local_args = _head_split(q, k, v, q_seg, kv_seg, config, args, group)
  rings = config.size // group
  request = hybrid_local_request(config.request, config.size, group)
  ring_config = ring.RingConfig(impl=config.impl, request=request, axis=config.axis, size=rings,
                                chunks=_ring_chunks(config.request, rings), group=group)
  out, lse = ring.ring_attention(q, k, v, local_args.q_segment_ids, local_args.kv_segment_ids,
                                 ring_config, local_args)
  return _to_tokens(out, lse, config, group)
