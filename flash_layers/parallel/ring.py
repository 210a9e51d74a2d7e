"""Ring attention over the `sequence` mesh axis (runs inside `shard_map`).

Each of the n devices of the ring keeps its queries and passes its keys and
values (and kv segment ids) to its neighbour n - 1 times with `lax.ppermute`.
At every step it attends its queries to the K/V block it holds, with the impl
the caller asked for and the *global* positions of both blocks (Args.q_offset /
kv_offset), so causal masks, windows and segment ids mean what they mean in the
unsharded call. Partial results are merged by their log-sum-exp. A step whose
blocks cannot see each other (decided by `block_info.block_map` with one block per
shard: position arithmetic plus segment-id ranges) skips its compute.

Load balance: with a causal mask a contiguous layout gives the last device n
blocks of work and the first one. For causal calls we use the "zig-zag" layout:
the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i, so
every device does the same work. The arrays arrive in the contiguous layout
`shard_map` gives; two ppermutes move them into zig-zag order and two move the
output back.

Both passes are one `lax.scan` of n (compute, pass on) steps, so each impl
call is compiled once per chunk pair; the forward's last hop is wasted, a price
paid for half the compiled code. Backward is a custom VJP that runs the ring
again: dq stays home, dk and dv travel with their K/V block and arrive home
after the n-th hop. Memory per device is
O(len / n): the residuals are the local q, k, v, out and lse only. Each step
runs only the impl's *backward* (`dispatch.attend_backward`), given the global
statistics of its rows: the normaliser lse and D = <d out, out> - d lse. With
P_ij = exp(s_ij - lse_i), dS_ij = P_ij (dP_ij - D_i) is exactly the global
softmax's gradient restricted to the pair's keys, so the pairs' dq, dk, dv sum
to the unsharded gradients and no forward is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flash_layers import dispatch
from flash_layers.contract import block_info
from flash_layers.impls import Args, Request


@dataclasses.dataclass(frozen=True)
class RingConfig:
  impl: str
  request: Request  # one (query chunk, kv chunk) pair: the local call each step makes
  axis: str
  size: int
  chunks: int  # chunks per device: 1 contiguous, 2 zig-zag
  # Devices per group (ulysses_ring): the ring joins devices m, m + group, ... of the axis, so
  # its position is axis_index // group and every hop moves `group` devices; `size` counts rings
  # positions, the axis has size * group devices.
  group: int = 1


def ring_attention(q, k, v, q_seg, kv_seg, config: RingConfig, args: Args | None = None):
  """Local blocks in (contiguous shard_map layout) -> local (out, lse) in the same layout.

  ``args``: the local call's dropout seed, global batch/head offsets, ALiBi slopes and mod
  operands (globally indexable; passed to every step, and the gradients of a score_mod's float
  operands summed over the steps); its segment ids and positions are ignored: the ring supplies
  them per step.
  """
  args = Args() if args is None else args
  extras = (args.dropout_seed, jnp.asarray(args.batch_offset, jnp.int32),
            jnp.asarray(args.head_offset, jnp.int32), args.alibi_slopes)
  zig = functools.partial(to_zigzag, axis=config.axis, size=config.size, group=config.group)
  if config.chunks == 2:
    q, k, v, q_seg, kv_seg = (zig(x) for x in (q, k, v, q_seg, kv_seg))
  else:
    q, k, v, q_seg, kv_seg = ([x] for x in (q, k, v, q_seg, kv_seg))
  out, lse = _ring(config)(q, k, v, q_seg, kv_seg, extras, tuple(args.mod_operands))
  if config.chunks == 2:
    unzig = functools.partial(from_zigzag, axis=config.axis, size=config.size, group=config.group)
    return unzig(out, seq_dim=1), unzig(lse, seq_dim=2)
  return out[0], lse[0]


# ----------------------------------------------------------------------------
# Layout: which global chunk each device holds
# ----------------------------------------------------------------------------

def _zig(chunk: int, n: int) -> int:
  """The device that holds `chunk` (of 2n) in the zig-zag layout."""
  return chunk if chunk < n else 2 * n - 1 - chunk


def _zigzag_perms(n: int, group: int = 1):
  # Contiguous: ring position i holds chunks 2i (first half) and 2i+1 (second half).
  # Each half goes to its zig-zag position; both maps are permutations of the ring. Device m of
  # a group stays in the ring of the m-th devices: position i is device i * group + m.
  first = [(i * group + m, _zig(2 * i, n) * group + m) for i in range(n) for m in range(group)]
  second = [(i * group + m, _zig(2 * i + 1, n) * group + m) for i in range(n) for m in range(group)]
  return first, second


def _position(axis: str, group: int):
  """This device's position in its ring."""
  return jax.lax.axis_index(axis) // group


def to_zigzag(x, axis: str, size: int, seq_dim: int = 1, group: int = 1):
  """[.., 2c, ..] contiguous block -> [slot 0 = chunk i, slot 1 = chunk 2n-1-i] on ring position i
  of `axis` (`size` positions of `group` devices each); None -> [None, None]. Also used by the
  all-gather strategy."""
  if x is None:
    return [None, None]
  first_perm, second_perm = _zigzag_perms(size, group)
  first, second = jnp.split(x, 2, axis=seq_dim)
  from_first = jax.lax.ppermute(first, axis, first_perm)
  from_second = jax.lax.ppermute(second, axis, second_perm)
  # An even device receives its own-numbered chunk (slot 0) from a first half, an odd one from a
  # second half (see _zigzag_perms).
  even = _position(axis, group) % 2 == 0
  return [jnp.where(even, from_first, from_second), jnp.where(even, from_second, from_first)]


def from_zigzag(slots, axis: str, size: int, seq_dim: int, group: int = 1):
  """The inverse of `to_zigzag`: two slots -> the contiguous block."""
  first_perm, second_perm = _zigzag_perms(size, group)
  even = _position(axis, group) % 2 == 0
  to_first = jnp.where(even, slots[0], slots[1])
  to_second = jnp.where(even, slots[1], slots[0])
  first = jax.lax.ppermute(to_first, axis, [(b, a) for a, b in first_perm])
  second = jax.lax.ppermute(to_second, axis, [(b, a) for a, b in second_perm])
  return jnp.concatenate([first, second], axis=seq_dim)


def _offsets(device, config: RingConfig, chunk_len: int):
  """Global start position of each chunk `device` holds."""
  if config.chunks == 1:
    return [device * chunk_len]
  return [device * chunk_len, (2 * config.size - 1 - device) * chunk_len]


# ----------------------------------------------------------------------------
# One ring step
# ----------------------------------------------------------------------------

def _pair_visible(config: RingConfig, q_off, kv_off, q_seg, kv_seg):
  """May any query of this chunk see any key of that one? (one block per chunk)."""
  r = config.request
  bm = block_info.block_map(r.q_len, r.kv_len, r.q_len, r.kv_len, r.spec, q_seg, kv_seg, q_off, kv_off)
  return jnp.any(bm.visible)


def _step_args(extras, operands, q_seg, kv_seg, q_off, kv_off) -> Args:
  """One step's Args: its blocks' segment ids and global positions, and the call's extras."""
  seed, batch_offset, head_offset, slopes = extras
  return Args(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=q_off, kv_offset=kv_off,
              dropout_seed=seed, batch_offset=batch_offset, head_offset=head_offset,
              alibi_slopes=slopes, mod_operands=operands)


def _attend_pair(config: RingConfig, extras, operands, q, k, v, q_seg, kv_seg, q_off, kv_off):
  args = _step_args(extras, operands, q_seg, kv_seg, q_off, kv_off)
  return dispatch.attend(q, k, v, impl=config.impl, request=config.request, args=args)


def _rotate(tree, config: RingConfig):
  """Send every block to the next device of its ring (`group` devices on)."""
  devices = config.size * config.group
  perm = [(i, (i + config.group) % devices) for i in range(devices)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, config.axis, perm), tree)


def _lse_weight(lse_part, lse_total):
  """exp(lse_part - lse_total), 0 where the part saw no key (never NaN)."""
  safe_total = jnp.where(jnp.isfinite(lse_total), lse_total, 0.0)
  return jnp.where(jnp.isfinite(lse_part), jnp.exp(lse_part - safe_total), 0.0)


def _rows(w):
  """[b, h, t] per-row weights -> [b, t, h, 1] to scale outputs."""
  return jnp.swapaxes(w, 1, 2)[..., None]


def _merge(out_acc, lse_acc, out, lse):
  total = jnp.logaddexp(lse_acc, lse)
  out_acc = (out_acc * _rows(_lse_weight(lse_acc, total))
             + out.astype(jnp.float32) * _rows(_lse_weight(lse, total)))
  return out_acc, total


# ----------------------------------------------------------------------------
# The ring, forward and backward
# ----------------------------------------------------------------------------

def _ring(config: RingConfig):
  @jax.custom_vjp
  # The mod operands are an argument of their own: their cotangents (a score_mod's float
  # operands) are this device's partial sums; shard_map's transpose adds the devices'.
  def ring(q, k, v, q_seg, kv_seg, extras, operands):
    return _ring_forward(config, q, k, v, q_seg, kv_seg, extras, operands)

  def ring_fwd(q, k, v, q_seg, kv_seg, extras, operands):
    out, lse = _ring_forward(config, q, k, v, q_seg, kv_seg, extras, operands)
    return (out, lse), (q, k, v, q_seg, kv_seg, extras, operands, out, lse)

  ring.defvjp(ring_fwd, functools.partial(_ring_backward, config))
  return ring


def _ring_forward(config: RingConfig, q, k, v, q_seg, kv_seg, extras, operands):
  """Each chunk's (out, lse), merged over the ring's n steps: K/V travel, queries stay."""
  r, n, chunks = config.request, config.size, config.chunks
  me = _position(config.axis, config.group)
  q_offs = _offsets(me, config, r.q_len)
  b, t, h, _ = q[0].shape
  dv = v[0].shape[-1]

  def empty(*_):
    return (jnp.zeros((b, t, h, dv), q[0].dtype), jnp.full((b, h, t), -jnp.inf, jnp.float32))

  def compute(step, k, v, kv_seg, out_acc, lse_acc):
    kv_offs = _offsets((me - step) % n, config, r.kv_len)
    out_acc, lse_acc = list(out_acc), list(lse_acc)
    for a in range(chunks):
      for c in range(chunks):
        qs, ks = q_seg[a], kv_seg[c]
        attend = functools.partial(_attend_pair, config, extras, operands)
        part = jax.lax.cond(_pair_visible(config, q_offs[a], kv_offs[c], qs, ks), attend, empty,
                            q[a], k[c], v[c], qs, ks, q_offs[a], kv_offs[c])
        out_acc[a], lse_acc[a] = _merge(out_acc[a], lse_acc[a], *part)
    return out_acc, lse_acc

  def step_fn(carry, step):
    k, v, kv_seg, out_acc, lse_acc = carry
    out_acc, lse_acc = compute(step, k, v, kv_seg, out_acc, lse_acc)
    return (*_rotate((k, v, kv_seg), config), out_acc, lse_acc), None

  out0 = [jnp.zeros((b, t, h, dv), jnp.float32) for _ in range(chunks)]
  lse0 = [jnp.full((b, h, t), -jnp.inf, jnp.float32) for _ in range(chunks)]
  (_, _, _, out_acc, lse_acc), _ = jax.lax.scan(step_fn, (k, v, kv_seg, out0, lse0), jnp.arange(n))
  return [o.astype(q[0].dtype) for o in out_acc], lse_acc


def _operand_zeros(config: RingConfig, operands):
  """float32 zeros for the operands whose gradients the steps return (a score_mod's float
  operands), None for the others."""
  wanted = config.request.has_float_score_operands
  return tuple(jnp.zeros(x.shape, jnp.float32)
               if wanted and jnp.issubdtype(x.dtype, jnp.floating) else None for x in operands)


def _step_operand_grads(grads, zeros):
  """The operand gradients of one `attend_backward` result, aligned with `zeros`."""
  if all(z is None for z in zeros):
    return zeros
  if len(grads) != 4:  # an impl without them would silently train nothing: refuse loudly
    raise NotImplementedError("this impl's attention_backward returns no score_mod operand "
                              "gradients; the ring cannot differentiate its float mod_operands")
  return tuple(None if z is None else g.astype(jnp.float32) for z, g in zip(zeros, grads[3], strict=True))


def _ring_backward(config: RingConfig, residuals, cotangents):
  """dq, dk, dv (and the float mod operands' partial gradients) from the global lse and D: dK/dV
  travel with their K/V and are home after n hops; dq and the operand gradients stay."""
  r, n, chunks = config.request, config.size, config.chunks
  q, k, v, q_seg, kv_seg, extras, operands, out, lse = residuals
  d_out, d_lse = cotangents
  me = _position(config.axis, config.group)
  q_offs = _offsets(me, config, r.q_len)
  # D = <d out, out> - d lse per row, [b, h, t], of the global output and normaliser.
  delta = [jnp.swapaxes(jnp.sum(d_out[a].astype(jnp.float32) * out[a].astype(jnp.float32), -1), 1, 2)
           - d_lse[a] for a in range(chunks)]
  f32_zeros = lambda xs: [jnp.zeros(x.shape, jnp.float32) for x in xs]  # noqa: E731
  op_zeros = _operand_zeros(config, operands)

  def pair_grads(q_a, k_c, v_c, qs, ks, qo, ko, d_out_a, delta_a, lse_a):
    args = _step_args(extras, operands, qs, ks, qo, ko)
    grads = dispatch.attend_backward(q_a, k_c, v_c, lse_a, delta_a, d_out_a, impl=config.impl,
                                     request=r, args=args)
    return (*(g.astype(jnp.float32) for g in grads[:3]), _step_operand_grads(grads, op_zeros))

  def no_grads(q_a, k_c, v_c, *_):
    return (*(jnp.zeros(x.shape, jnp.float32) for x in (q_a, k_c, v_c)), op_zeros)

  def compute(step, k, v, kv_seg, dk, dv, dq, d_ops):
    kv_offs = _offsets((me - step) % n, config, r.kv_len)
    dk, dv, dq = list(dk), list(dv), list(dq)
    for a in range(chunks):
      for c in range(chunks):
        qs, ks = q_seg[a], kv_seg[c]
        gq, gk, gv, g_ops = jax.lax.cond(
            _pair_visible(config, q_offs[a], kv_offs[c], qs, ks), pair_grads, no_grads,
            q[a], k[c], v[c], qs, ks, q_offs[a], kv_offs[c], d_out[a], delta[a], lse[a])
        dq[a], dk[c], dv[c] = dq[a] + gq, dk[c] + gk, dv[c] + gv
        d_ops = jax.tree.map(jnp.add, d_ops, g_ops)
    return dk, dv, dq, d_ops

  def step_fn(carry, step):
    k, v, kv_seg, dk, dv, dq, d_ops = carry
    dk, dv, dq, d_ops = compute(step, k, v, kv_seg, dk, dv, dq, d_ops)
    return (*_rotate((k, v, kv_seg, dk, dv), config), dq, d_ops), None

  # After n hops every dK/dV block (and its K/V) is home again.
  (_, _, _, dk, dv, dq, d_ops), _ = jax.lax.scan(
      step_fn, (k, v, kv_seg, f32_zeros(k), f32_zeros(v), f32_zeros(q), op_zeros), jnp.arange(n))
  cast = lambda gs, xs: [g.astype(x.dtype) for g, x in zip(gs, xs, strict=True)]  # noqa: E731
  d_ops = tuple(None if g is None else g.astype(x.dtype) for g, x in zip(d_ops, operands, strict=True))
  return cast(dq, q), cast(dk, k), cast(dv, v), None, None, None, d_ops
