"""`jax.nn.dot_product_attention`: XLA's fused attention, cuDNN on GPU where eligible.

It has no softcap, no dropout and needs head_dim_v == head_dim; those requests
raise UnsupportedError. ALiBi becomes part of its `bias` argument (a dense
[heads, q, kv] array: this impl holds dense [b, h, q, kv] logits anyway).
Segment ids, windows and ring offsets become a boolean mask
(which also keeps cuDNN from being picked; a plain causal call stays maskless
and cuDNN-eligible).

Precision: `jax.nn.dot_product_attention` takes no `precision`, so the call is traced
under `jax.default_matmul_precision(...)`, which its XLA path reads when it builds its
einsums (they carry the request's precision in the jaxpr, and their gradients inherit
it). cuDNN serves only bfloat16/float16, whose products are exact at any precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash_layers.impls import dense_logits
from flash_layers.impls.base import Args, Request

_CUDNN_DTYPES = ("bfloat16", "float16")


def _uses_plain_causal(request: Request, args: Args) -> bool:
  static_zero = isinstance(args.q_offset, int) and isinstance(args.kv_offset, int) and (
      args.q_offset == args.kv_offset == 0)
  return (request.spec.window is None and not request.has_segment_ids
          and args.dense_mask is None and request.mask_mod is None and static_zero)


class XlaNative:
  name = "xla_native"
  # No dropout: jax.nn.dot_product_attention has none.
  capabilities = frozenset({"traced_offsets", "sow_weights"})

  def unsupported(self, request: Request, platform: str) -> str | None:
    if request.softcap is not None:
      return "softcap"
    if request.has_dropout:
      return "dropout (jax.nn.dot_product_attention has none)"
    if request.head_dim_v != request.head_dim:
      return "head_dim_v != head_dim"
    if request.score_mod is not None:
      return "score_mod (jax.nn.dot_product_attention takes no score function)"
    return None

  def kernel(self, request: Request, platform: str) -> str:
    cudnn_ok = (platform == "cuda" and request.dtype in _CUDNN_DTYPES
                and request.head_dim <= 128 and request.head_dim % 8 == 0
                and not request.has_segment_ids and request.spec.window is None
                and not request.has_dense_mask and not request.has_alibi and not request.has_bias
                and request.mask_mod is None)
    return "cudnn" if cudnn_ok else "xla"

  def attend(self, q, k, v, *, request: Request, args: Args):
    terms = dense_logits.terms(request, args, grouped=False)  # [b, h, t, s]: jax.nn's layout
    mask = None
    is_causal = request.spec.causal
    if not _uses_plain_causal(request, args):
      is_causal = False
      mask = terms.mask
    dtype = q.dtype
    if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] == 1 and dtype != jnp.float32:
      # XLA:CPU cannot emit a half-precision dot with no free dimension ("ALG_DOT_BF16_BF16_F32
      # not supported by the ElementalIrEmitter"); a single-element call costs nothing in float32.
      q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    bias = terms.extra  # ALiBi + bias, float32
    if bias is not None and dtype != jnp.float32:
      bias = bias.astype(dtype)  # XLA adds it to logits of the input dtype
    with jax.default_matmul_precision(request.precision.name.lower()):
      out, lse = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=request.scale,
                                              is_causal=is_causal, return_residual=True)
      lse_gradient = _lse_gradient(q, k, bias, mask, request.scale, is_causal, request.precision)
    out = out.astype(dtype)
    lse = jnp.swapaxes(lse.astype(jnp.float32), 1, 2)  # [b, t, h] -> [b, h, t]
    lse = lse + lse_gradient
    if mask is not None:
      # XLA gives a row with no visible key the mean of all values; the contract says 0.
      has_key = jnp.any(jnp.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1])),
                        axis=-1)  # [b, h, t]
      out = jnp.where(jnp.swapaxes(has_key, 1, 2)[..., None], out, 0).astype(dtype)
      lse = jnp.where(has_key, lse, -jnp.inf)
    return out, lse


def _lse_gradient(q, k, bias, mask, scale, is_causal, precision):
  """Zero, with the gradient of lse: `dot_product_attention`'s residual carries none.

  d lse_i / d q_i = scale * sum_j p_ij k_j and d lse_i / d k_j = scale * p_ij q_i. With
  `keys_mean_i = sum_j p_ij k_j` computed with p held constant (its gradient in k is p^T),
  ``scale * (q . sg(keys_mean) + sg(q) . keys_mean)`` has exactly that gradient. XLA drops
  the extra attention call when nothing uses lse (attention() alone never does; ring
  attention does).
  """
  sg = jax.lax.stop_gradient
  sg_bias = None if bias is None else sg(bias)
  keys_mean = jax.nn.dot_product_attention(sg(q), sg(k), k, bias=sg_bias, mask=mask, scale=scale,
                                           is_causal=is_causal).astype(jnp.float32)
  q32 = q.astype(jnp.float32)
  surrogate = scale * jnp.sum(q32 * sg(keys_mean) + sg(q32) * keys_mean, axis=-1)  # [b, t, h]
  surrogate = jnp.swapaxes(surrogate, 1, 2)
  if bias is not None:
    # d lse_i / d bias_ij = p_ij: sum_j sg(p_ij) bias_ij, from dense probabilities (this impl
    # holds dense logits anyway; XLA drops it when nothing differentiates lse).
    logits = scale * jnp.einsum("bthd,bshd->bhts", sg(q32),
                                jnp.repeat(sg(k).astype(jnp.float32), q.shape[2] // k.shape[2], 2),
                                precision=precision)
    logits = logits + sg(bias).astype(jnp.float32)
    visible = jnp.ones(logits.shape, bool) if mask is None else jnp.broadcast_to(mask, logits.shape)
    if is_causal:
      visible = visible & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1, where=visible)
    p = jnp.where(visible, p, 0.0)
    surrogate = surrogate + jnp.sum(sg(p) * bias.astype(jnp.float32), axis=-1)
  return surrogate - sg(surrogate)
