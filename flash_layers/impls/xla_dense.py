"""Dense attention written for XLA:CPU, with a custom VJP that saves the probabilities.

The math is the reference's (float32 logits, masked softmax, ``(out, lse)``), laid
out for what XLA:CPU does well:

* Lowered for CPU, a forward pass that is not differentiated (evaluation, inference)
  runs once per batch row and kv head (`lax.map`s, as `impls/cpu_loop.py` explains),
  so a step's ``[g, t, s]`` logits stay in cache. Under differentiation the forward
  and backward run on the whole call (looping them was slower at batch > 1), as on
  every other platform.

* Query heads keep the ``[b, t, h, d]`` layout flax uses; the einsums below are
  written once with a group axis ``g`` (query heads per kv head) that is dropped
  when ``g == 1``, so multi-head attention runs flax's ``bthd,bshd->bhts``
  contraction and GQA/MQA reads each kv head once, never repeated. (In
  exploratory runs an einsum carrying a size-1 group axis, or with heads
  transposed to the front first, was 1.3-1.8x slower in fwd+bwd on XLA:CPU.)
* q is scaled before the matmul ([t, d] multiplies, not [t, s]).
* A custom VJP saves the unnormalised probabilities ``exp(s - m)`` and ``1 / l``
  and writes the backward as four matmuls and one fused elementwise pass; the
  normalisation is folded into the small operands (``dO / l``), so the
  ``[t, s]`` probabilities are never rescaled. (Autodiff through
  ``jax.nn.softmax`` was up to 1.2x slower in exploratory runs.)
* The mask is applied with one ``where`` and only when the request has one.
* ALiBi and an additive bias join the logits as one dense ``extra`` term (its
  gradient is the logits' gradient); dropout multiplies the probabilities by the
  keep mask of `flash_layers.dropout`, the same hash every impl evaluates.

Why not `jax.nn.dot_product_attention` on CPU (xla_native): it reshapes q to
``[b, t, kvh, g, d]`` and vmaps its core over ``g`` even when ``g == 1``, the
layout found slow above; with a mask it also broadcasts the mask per group and
zeroes rows with no visible key afterwards through a ``[b, h, t, s]`` reduction.

* Decoding (up to `cpu_loop.FEW_QUERIES` queries, a mask, no dropout, ALiBi, bias or mods), lowered for
  CPU and not differentiated: the step reads only the keys some query can see. A cache is written from
  slot 0 on, so most of a generation's steps mask a tail of unwritten slots (and a window masks a
  head); the forward walks the visible run of `DECODE_CHUNK`-key chunks, found from the mask, in a loop
  with a run-time trip count, merging the chunks by an online softmax. K/V traffic is the cost of a
  step on a CPU, so a half-full cache costs about half (docs/benchmarks.md, "Decoding: one step").

Memory is O(q_len * kv_len) per head, like flax's attention; "auto" takes
xla_chunked from `auto.CPU_CHUNKED_MIN_KV_LEN` keys on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flash_layers import lowering
from flash_layers.contract import dropout, mods
from flash_layers.impls import cpu_loop, dense_logits
from flash_layers.impls.base import Args, Request
from flash_layers.impls.tiling import CpuBlockSizes

# Keys per chunk of the decoding forward: a [4, 512, 12, 64] float32 chunk of K is 6 MiB, so a step's chunks
# stream through the caches and an 8,192-slot cache is 16 trips of the loop.
DECODE_CHUNK = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DenseCall:
  """One call as the traced computation sees it: the request and what is derived from it
  (hashable: a custom_vjp static argument)."""

  request: Request
  looped: bool = False  # the forward alone one batch row and kv head at a time (the CPU layout)
  bounded: bool = False  # the forward alone over the visible run of key chunks (decoding on CPU)

  @property
  def group(self) -> int:  # query heads per kv head; 1 drops the "g" axis from every einsum
    return self.request.num_heads // self.request.num_kv_heads


def _einsum(st: _DenseCall, spec: str, a, b):
  if st.group == 1:
    spec = spec.replace("g", "")
  return jnp.einsum(spec, a, b, precision=st.request.precision, preferred_element_type=jnp.float32)


def _to_rows(x):
  """[b, k, (g), t] (per-row statistics) -> [b, t, k, (g), 1], to scale [b, t, k, (g), d] arrays."""
  return jnp.moveaxis(x, -1, 1)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense(st, q, k, v, mask, extra, keep, mod):
  # Not differentiated (evaluation, inference): the looped forward when lowered for CPU.
  # Differentiated: `_dense_fwd` on the whole call, saving what `_dense_bwd` needs.
  if st.looped:
    return _dense_looped(st, q, k, v, mask, extra, keep, mod)
  if st.bounded:
    return _dense_bounded(st, q, k, v, mask)
  return _dense_fwd(st, q, k, v, mask, extra, keep, mod)[0]


class _Mod(NamedTuple):
  """A score_mod's arrays: its indices (`mods.Indices`, laid out as the logits) and mod_operands."""

  idx: mods.Indices
  operands: tuple


# The batch axis of every operand and result of `_dense_fwd` is 0; its kv-head axis:
_KV_AXIS = {"q": 2, "k": 2, "v": 2, "mask": 1, "extra": 1, "keep": 1, "out": 2, "lse": 1, "mod_b": 1,
            "mod_h": 1}


def _dense_looped(st, q, k, v, mask, extra, keep, mod):
  """(out, lse) of `_dense_fwd`, one batch row and kv head at a time (`lax.map`s), so a step's
  [g, t, s] logits stay in cache. Only for the forward alone: under differentiation the whole-call
  forward and backward ran faster on XLA:CPU at batch > 1 (docs/benchmarks.md, "Attention on the
  CPU"), so `_dense`'s VJP uses those."""
  b, kvh = q.shape[0], k.shape[2]
  operands = {"q": q, "k": k, "v": v, "mask": mask, "extra": extra, "keep": keep}
  if mod is not None:  # the row and head indices travel with the maps; positions and operands are shared
    operands.update(mod_b=mod.idx.b, mod_h=mod.idx.h)
  # Each operand with its batch and kv-head axes first ([B', KVH', ...], B' and KVH' the size or 1).
  lead = {n: jnp.moveaxis(x, _KV_AXIS[n], 1) for n, x in operands.items() if x is not None}

  def head(x):
    one = {n: None if n not in x else jnp.expand_dims(x[n], (0, _KV_AXIS[n])) for n in operands}
    step_mod = None
    if mod is not None:
      step_mod = _Mod(mod.idx._replace(b=one.pop("mod_b"), h=one.pop("mod_h")), mod.operands)
    out, lse = _dense_fwd(st, **one, mod=step_mod)[0]
    return {"out": out, "lse": lse}

  stacked = cpu_loop.map_rows_and_heads(head, lead, b, kvh)  # [b, kvh, *step result], its b/kvh axes 1
  whole = {n: jnp.moveaxis(jnp.squeeze(y, (2, 2 + _KV_AXIS[n])), 1, _KV_AXIS[n]) for n, y in stacked.items()}
  return whole["out"], whole["lse"]


def _dense_bounded(st, q, k, v, mask):
  """(out, lse) of `_dense_fwd` for a decoding call, reading only the chunks of keys that hold a visible one.

  The run [first, last] of visible keys comes from the mask (any query of any row); the loop visits its
  `DECODE_CHUNK`-key chunks, the count known at run time, each chunk's logits masked as in `_dense_fwd`
  and merged by an online softmax (running max m, denominator l, unnormalised output)."""
  s_len = k.shape[1]
  seen = mask.reshape(-1, s_len).any(axis=0)  # [s]: a key some query of some row sees
  any_seen = seen.any()
  first = jnp.argmax(seen)
  last = s_len - 1 - jnp.argmax(seen[::-1])
  lo, hi = first // DECODE_CHUNK, jnp.where(any_seen, last // DECODE_CHUNK + 1, first // DECODE_CHUNK)
  q = q * st.request.scale
  stats = q.shape[:1] + (k.shape[2],) + ((st.group,) if st.group > 1 else ()) + (q.shape[1],)  # [b,k,(g),t]
  dv = v.shape[-1]

  def chunk(i, carry):
    m, denom, acc = carry
    start = i * DECODE_CHUNK
    k_c = jax.lax.dynamic_slice_in_dim(k, start, DECODE_CHUNK, axis=1)
    v_c = jax.lax.dynamic_slice_in_dim(v, start, DECODE_CHUNK, axis=1)
    s_c, _ = dense_logits.logits(_einsum(st, "btkgd,bskd->bkgts", q, k_c), st.request)
    s_c = jnp.where(jax.lax.dynamic_slice_in_dim(mask, start, DECODE_CHUNK, axis=mask.ndim - 1), s_c,
                    -jnp.inf)
    m_new = jnp.maximum(m, s_c.max(-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp gives 0, not NaN
    p = jnp.exp(s_c - shift[..., None])
    rescale = jnp.exp(m - shift)
    pv = _einsum(st, "bkgts,bskv->btkgv", p, v_c)
    return m_new, denom * rescale + p.sum(-1), acc * _to_rows(rescale) + pv

  init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
          jnp.zeros((*q.shape[:-1], dv), jnp.float32))
  m, denom, acc = jax.lax.fori_loop(lo, hi, chunk, init)
  has_key = denom > 0
  inv = jnp.where(has_key, 1.0 / jnp.where(has_key, denom, 1.0), 0.0)
  lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
  return acc * _to_rows(inv), lse


def _logits(st, q, k, mask, extra, mod):
  """(scale * q, the masked (capped) logits [b, kvh, (g), t, s], tanh of the softcap or None)."""
  q = q * st.request.scale
  idx, ops = (None, ()) if mod is None else (mod.idx, mod.operands)
  s, tanh = dense_logits.logits(_einsum(st, "btkgd,bskd->bkgts", q, k), st.request, extra, idx, ops)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  return q, s, tanh


def _dense_fwd(st, q, k, v, mask, extra, keep, mod):
  """q [b, t, kvh, (g), d] float32, k/v [b, s, kvh, d|dv]; mask and keep None or bool, extra None or
  float32, each broadcastable to the logits [b, kvh, (g), t, s]; mod a `_Mod` or None."""
  q, s, tanh = _logits(st, q, k, mask, extra, mod)
  row_max = s.max(-1)
  if mask is not None:
    # A row that sees no key has max -inf: shift it by 0 so exp() gives 0, not NaN.
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
  p = jnp.exp(s - row_max[..., None])  # unnormalised probabilities
  denom = p.sum(-1)
  has_key = denom > 0
  inv = jnp.where(has_key, 1.0 / jnp.where(has_key, denom, 1.0), 0.0)
  kept = p if keep is None else jnp.where(keep, p * dropout.keep_scale(st.request.dropout_rate), 0.0)
  out = _einsum(st, "bkgts,bskv->btkgv", kept, v) * _to_rows(inv)
  lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
  return (out, lse), (q, k, v, p, inv, tanh, out, extra, keep, mod)


def _dense_bwd(st, residuals, cotangents):
  q, k, v, p, inv, tanh, out, extra, keep, mod = residuals
  dout, dlse = cotangents
  delta = jnp.moveaxis(jnp.sum(dout * out, axis=-1), 1, -1) - dlse  # [b, k, (g), t]
  dq, dk, dv, d_extra, d_ops = _grads(st, q, k, v, p, inv, tanh, extra, keep, mod, dout, delta)
  d_mod = None if mod is None else _Mod(mods.Indices(None, None, None, None), d_ops)
  return dq, dk, dv, None, d_extra, None, d_mod


def _grads(st, q, k, v, p, inv, tanh, extra, keep, mod, dout, delta):
  """With P = p / l:  dv = P^T dO;  ds = P * (dO v^T - delta), delta = rowsum(dO * O) - dlse
  (times 1 - tanh^2 through the softcap);  dq = scale * ds k;  dk = ds^T (scale * q)."""
  # Dropout: out = (P * keep * c) v, so dv sees the kept probabilities and dP = (dO v^T) * keep * c;
  # delta = rowsum(P * dP) is still rowsum(dO * out).
  kept = p if keep is None else jnp.where(keep, p * dropout.keep_scale(st.request.dropout_rate), 0.0)
  dv = _einsum(st, "bkgts,btkgv->bskv", kept, dout * _to_rows(inv))
  dp = _einsum(st, "btkgv,bskv->bkgts", dout, v)
  if keep is not None:
    dp = jnp.where(keep, dp * dropout.keep_scale(st.request.dropout_rate), 0.0)
  ds = p * ((dp - delta[..., None]) * inv[..., None])
  if tanh is not None:
    ds = ds * (1.0 - tanh * tanh)
  d_ops = None
  if st.request.score_mod is not None:  # through score_mod, at the logits it received
    unmodded = dense_logits.unmodded(_einsum(st, "btkgd,bskd->bkgts", q, k), extra)
    ds, d_ops = mods.score_vjp(st.request.score_mod, unmodded, mod.idx, mod.operands, ds)
    d_ops = mods.cast_grads(d_ops, mod.operands)
  dq = _einsum(st, "bkgts,bskd->btkgd", ds, k) * st.request.scale
  dk = _einsum(st, "bkgts,btkgd->bskd", ds, q)
  d_extra = None
  if extra is not None:  # the logits' gradient, summed over the axes `extra` broadcasts along
    axes = tuple(i for i, (n, m) in enumerate(zip(extra.shape, ds.shape, strict=True)) if n == 1 and m > 1)
    d_extra = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
  return dq, dk, dv, d_extra, d_ops


_dense.defvjp(_dense_fwd, _dense_bwd)


class XlaDense:
  """Dense float32 attention with a custom VJP, laid out for XLA:CPU (see the module docstring)."""

  name = "xla_dense"
  capabilities = frozenset({"attention_backward", "traced_offsets", "sow_weights", "mod_gathers", "dropout",
                            "sharded_mods", "tuning_space", "cpu_loop_tile"})
  block_size_types = (CpuBlockSizes,)  # only its loop_bytes: the logits are never tiled

  def tuning_space(self, request: Request, platform: str) -> list[CpuBlockSizes | None]:
    """On CPU: the defaults, and the CPU loop decision flipped (when there is a loop to run)."""
    if platform != "cpu":
      return []
    space: list[CpuBlockSizes | None] = [None]
    if request.batch * request.num_kv_heads > 1:
      flipped = cpu_loop.flipped_loop_bytes(request, *self.cpu_loop_tile(request))
      space.append(CpuBlockSizes(loop_bytes=flipped))
    return space

  def cpu_loop_tile(self, request: Request) -> tuple[int, int]:
    """The whole [q_len, kv_len] logits: the CPU loop weighs them at once."""
    return request.q_len, request.kv_len

  def unsupported(self, request: Request, platform: str) -> str | None:
    return None

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def attend(self, q, k, v, *, request: Request, args: Args):
    if _bounded(request):
      return lowering.platform_dependent(
          q, k, v, cpu=lambda q, k, v: self._attend(q, k, v, request=request, args=args, bounded=True),
          default=lambda q, k, v: self._attend(q, k, v, request=request, args=args))
    if not cpu_loop.worth_looping(q, k, q.shape[1], k.shape[1], cpu_loop.loop_bytes(request)):
      return self._attend(q, k, v, request=request, args=args)
    return lowering.platform_dependent(
        q, k, v, cpu=lambda q, k, v: self._attend(q, k, v, request=request, args=args, looped=True),
        default=lambda q, k, v: self._attend(q, k, v, request=request, args=args))

  def _attend(self, q, k, v, *, request: Request, args: Args, looped: bool = False, bounded: bool = False):
    b, t, h, _ = q.shape
    st, f32, mask, extra, keep, mod = _operands(q, k, v, request, args)
    out, lse = _dense(dataclasses.replace(st, looped=looped, bounded=bounded), *f32, mask, extra, keep, mod)
    return out.reshape(b, t, h, -1).astype(q.dtype), lse.reshape(b, h, t)

  def attention_backward(self, q, k, v, lse, delta, d_out, *, request: Request, args: Args):
    """(dq, dk, dv) from given row statistics ``lse, delta [b, h, q]`` (the softmax's normaliser
    and rowsum(dO * O) - dlse of the whole output): P = exp(logits - lse), then the same
    gradients as the VJP; with a score_mod's float operands (dq, dk, dv, their gradients: a tuple
    aligned with mod_operands, None for the others). Also serves reference and xla_native in ring
    attention's backward."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    st, (q32, k32, v32), mask, extra, keep, mod = _operands(q, k, v, request, args)
    q32, logits, tanh = _logits(st, q32, k32, mask, extra, mod)
    stats = (lambda x: x.reshape(b, kvh, group, t)) if group > 1 else (lambda x: x)
    lse = stats(jnp.where(lse > -jnp.inf, lse, jnp.inf).astype(jnp.float32))  # no key: P = 0
    p = jnp.exp(logits - lse[..., None])
    dout = d_out.astype(jnp.float32)
    dout = dout.reshape(b, t, kvh, group, -1) if group > 1 else dout
    dq, dk, dv, _, d_ops = _grads(st, q32, k32, v32, p, jnp.ones_like(lse), tanh, extra, keep, mod, dout,
                                  stats(delta.astype(jnp.float32)))
    grads = dq.reshape(b, t, h, d).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    # A score_mod's float operands: their gradients too, aligned with mod_operands (ring attention's
    # backward sums each shard pair's share).
    return (*grads, d_ops) if request.has_float_score_operands else grads


def _bounded(request: Request) -> bool:
  """Whether a call takes the decoding forward on CPU (`_dense_bounded`): few queries, a mask from
  causal / window / segment ids that may hide a run of keys, whole chunks, nothing else on the logits."""
  r = request
  return (r.q_len <= cpu_loop.FEW_QUERIES and r.kv_len % DECODE_CHUNK == 0 and r.kv_len > DECODE_CHUNK
          and (r.spec.causal or r.spec.window is not None or r.has_segment_ids)
          and not (r.has_dense_mask or r.has_dropout or r.has_alibi or r.has_bias or r.has_mods
                   or r.spec.global_tokens))


def _operands(q, k, v, request: Request, args: Args):
  """(static config, float32 (q grouped, k, v), mask, ALiBi + bias term, dropout keep, score_mod's
  `_Mod` or None) of a call, laid out as the logits [b, kvh, (g), t, s] broadcast."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  group = h // kvh
  st = _DenseCall(request=request)
  qg = q.reshape(b, t, kvh, group, d) if group > 1 else q
  f32 = tuple(x.astype(jnp.float32) for x in (qg, k, v))
  terms = dense_logits.terms(request, args, grouped=group > 1)
  mod = None if request.score_mod is None else _Mod(terms.indices, args.mod_operands)
  return st, f32, terms.mask, terms.extra, terms.keep, mod
