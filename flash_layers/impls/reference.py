"""The readable oracle: dense float32 logits, a masked softmax, nothing clever.

Memory is O(q_len * kv_len) per head; use it to check the others, not to train
long documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract import dropout, mask_rules, mods
from flash_layers.impls import dense_logits
from flash_layers.impls.base import Args, Request


def masked_softmax_attention(q, k, v, mask, scale, softcap, extra=None, keep=None, rate=0.0,
                             precision=jax.lax.Precision.HIGHEST, score_fn=None):
  """Attention over grouped heads in float32.

  q [b, t, kvh, g, d], k [b, s, kvh, d], v [b, s, kvh, dv], mask broadcastable to
  [b, kvh, g, t, s]; ``extra`` (alibi + bias) and ``keep`` (the dropout mask) broadcast
  the same way; ``score_fn`` (the request's score_mod at the logits' indices) rewrites the logits
  before the softcap. Returns out [b, t, kvh, g, dv] float32 and lse [b, kvh, g, t] (pre-dropout).
  Both einsums run at ``precision`` (the request's).
  """
  p, lse = _probabilities(q, k, mask, scale, softcap, extra, keep, rate, precision, score_fn)
  out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=precision)
  return out, lse


def _probabilities(q, k, mask, scale, softcap, extra, keep, rate, precision, score_fn):
  """(the attention probabilities [b, kvh, g, t, s] after dropout, lse [b, kvh, g, t])."""
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=precision) * scale
  if extra is not None:
    logits = logits + extra
  if score_fn is not None:
    logits = score_fn(logits)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = jnp.broadcast_to(mask, logits.shape)
  # Double-where: masked entries never reach exp/log, so rows with no visible
  # key give 0 output, lse = -inf, and zero (not NaN) gradients.
  row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  row_max = jax.lax.stop_gradient(row_max)
  p = jnp.where(mask, jnp.exp(jnp.where(mask, logits, row_max) - row_max), 0.0)
  denom = p.sum(-1, keepdims=True)
  has_key = denom > 0
  safe_denom = jnp.where(has_key, denom, 1.0)
  p = p / safe_denom
  if keep is not None:
    p = jnp.where(keep, p * dropout.keep_scale(rate), 0.0)
  return p, jnp.where(has_key, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]


class Reference:
  name = "reference"
  capabilities = frozenset({"traced_offsets"})

  def unsupported(self, request: Request, platform: str) -> str | None:
    return None

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def attend(self, q, k, v, *, request: Request, args: Args):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    mask, extra, keep, score_fn = _terms(q, k, request, args)
    out, lse = masked_softmax_attention(q.reshape(b, t, kvh, g, d), k, v, mask,
                                        request.scale, request.softcap, extra, keep,
                                        request.dropout_rate, request.precision, score_fn)
    return out.reshape(b, t, h, -1).astype(q.dtype), lse.reshape(b, h, t)


def weights(q, k, *, request: Request, args: Args, sinks=None):
  """The attention probabilities float32 [b, h, t, s] of a call (after dropout, with the sinks in the
  denominator): what flax's `sow_weights` records; O(t * s) memory, as this impl."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  mask, extra, keep, score_fn = _terms(q, k, request, args)
  p, lse = _probabilities(q.reshape(b, t, kvh, h // kvh, d), k, mask, request.scale, request.softcap, extra,
                          keep, request.dropout_rate, request.precision, score_fn)
  p, lse = p.reshape(b, h, t, -1), lse.reshape(b, h, t)
  if sinks is not None:  # softmax over [logits, sink]: each probability times Z / (Z + e^sink)
    p = p * jax.nn.sigmoid(lse - jnp.asarray(sinks, jnp.float32)[None, :, None])[..., None]
  return p


def _terms(q, k, request: Request, args: Args):
  """(mask [b|1, kvh|1, g|1, t, s], ALiBi + bias, dropout keep, score_fn) of a call, grouped by kv head."""
  b, t, h, _ = q.shape
  kvh = k.shape[2]
  g = h // kvh
  mask = mask_rules.dense_mask(t, k.shape[1], request.spec, args.q_segment_ids,
                          args.kv_segment_ids, args.q_offset, args.kv_offset)
  mask = mask[:, None, None]  # [b|1, 1, 1, t, s]
  if args.dense_mask is not None:
    # [b, h, t, s] -> [b, kvh, g, t, s]
    dm = jnp.broadcast_to(args.dense_mask, (b, h, t, k.shape[1]))
    mask = mask & dm.reshape(b, kvh, g, t, k.shape[1])
  s = k.shape[1]
  if request.has_mods:
    idx = mods.dense_indices(args.batch_offset, args.head_offset, args.q_offset, args.kv_offset,
                             b, kvh, g, t, s)
  if request.mask_mod is not None:
    mask = mask & mods.mask(request.mask_mod, idx, args.mod_operands)
  score_fn = None
  if request.score_mod is not None:
    score_fn = lambda x: mods.score(request.score_mod, x, idx, args.mod_operands)  # noqa: E731
  extra = dense_logits.dense_terms(args, t, s)  # ALiBi + bias, [b|1, h|1, t, s]
  if extra is not None:
    extra = jnp.broadcast_to(extra, (extra.shape[0], h, t, s)).reshape(-1, kvh, g, t, s)
  keep = None
  if request.has_dropout:
    keep = dense_keep(request, args, b, h, t, s)
    keep = keep.reshape(*((1, 1, 1) if request.dropout_broadcast else (b, kvh, g)), t, s)
  return mask, extra, keep, score_fn


def dense_keep(request: Request, args: Args, b: int, h: int, t: int, s: int):
  """The dropout keep mask, bool [b, h, t, s] ([1, 1, t, s] when broadcast), global indices."""
  if request.dropout_broadcast:
    bi = hi = jnp.zeros((1, 1, 1, 1), jnp.int32)
  else:
    bi = args.batch_offset + jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    hi = args.head_offset + jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
  q_pos = args.q_offset + jnp.arange(t, dtype=jnp.int32)[:, None]
  kv_pos = args.kv_offset + jnp.arange(s, dtype=jnp.int32)[None, :]
  return dropout.keep(dropout.stream(args.dropout_seed, bi, hi), q_pos, kv_pos, request.dropout_rate)
