"""The readable oracle: dense float32 logits, a masked softmax, nothing clever.

Memory is O(q_len * kv_len) per head; use it to check the others, not to train
long documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.contract import dropout
from flash_layers.impls import dense_logits
from flash_layers.impls.base import Args, Request


def _probabilities(q, k, request: Request, args: Args):
  """(the attention probabilities [b, kvh, g, t, s] after dropout, lse [b, kvh, g, t]) of a call;
  q [b, t, h, d], k [b, s, kvh, d]. The logits step (ALiBi, bias, score_mod, softcap, the mask's
  terms) is `dense_logits`', the einsums run at the request's precision."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  terms = dense_logits.terms(request, args, grouped=True)
  q, k = q.reshape(b, t, kvh, h // kvh, d).astype(jnp.float32), k.astype(jnp.float32)
  qk = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=request.precision) * request.scale
  logits, _ = dense_logits.logits(qk, request, terms.extra, terms.indices, args.mod_operands)
  mask = jnp.broadcast_to(True if terms.mask is None else terms.mask, logits.shape)
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
  if terms.keep is not None:
    p = jnp.where(terms.keep, p * dropout.keep_scale(request.dropout_rate), 0.0)
  return p, jnp.where(has_key, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]


class Reference:
  name = "reference"
  capabilities = frozenset({"traced_offsets", "sow_weights", "mod_gathers", "dropout", "sharded_mods"})

  def unsupported(self, request: Request, platform: str) -> str | None:
    return None

  def kernel(self, request: Request, platform: str) -> str:
    return "xla"

  def attend(self, q, k, v, *, request: Request, args: Args):
    """out [b, t, h, dv] in q's dtype, lse [b, h, t] float32 (pre-dropout)."""
    b, t, h, _ = q.shape
    p, lse = _probabilities(q, k, request, args)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=request.precision)
    return out.reshape(b, t, h, -1).astype(q.dtype), lse.reshape(b, h, t)


def weights(q, k, *, request: Request, args: Args, sinks=None):
  """The attention probabilities float32 [b, h, t, s] of a call (after dropout, with the sinks in the
  denominator): what flax's `sow_weights` records; O(t * s) memory, as this impl."""
  b, t, h, _ = q.shape
  p, lse = _probabilities(q, k, request, args)
  p, lse = p.reshape(b, h, t, -1), lse.reshape(b, h, t)
  if sinks is not None:  # softmax over [logits, sink]: each probability times Z / (Z + e^sink)
    p = p * jax.nn.sigmoid(lse - jnp.asarray(sinks, jnp.float32)[None, :, None])[..., None]
  return p
