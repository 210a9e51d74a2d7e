"""`attention_fn(impl=...)`: flash_layers inside flax's own attention modules.

A drop-in `attention_fn=` for `flax.linen.MultiHeadDotProductAttention` and `flax.nnx.MultiHeadAttention`:
flax keeps its projections and parameters, and the attention itself runs through `fl.attention`'s path
(`api.run`), its impls, meshes and kernels included. The one module here that needs both linen and nnx
(to sow the weights into either kind of module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx as flax_nnx

from flash_layers import api, auto, validate
from flash_layers.impls import UnsupportedError
from flash_layers.layers import core

_FIXED_KWARGS = ("causal", "window", "scale", "softcap", "block_sizes", "mesh", "mask_mod", "score_mod",
                 "mod_operands", "mod_operand_axes", "context_parallel", "mesh_axes")
# Keywords flax passes that change nothing here: our softmax is always float32 and
# dtype promotion is done below.
_HARMLESS_EXTRA = ("promote_dtype", "force_fp32_for_softmax")
# Keywords that ask for custom einsums (e.g. quantization); fine while None.
_EINSUM_EXTRA = ("qk_attn_weights_einsum", "attn_weights_value_einsum", "einsum_dot_general", "einsum")


def _sow(module, weights) -> None:
  """Sow attention weights into a flax module as flax's own attention does (linen or nnx)."""
  if isinstance(module, flax_nnx.Module):
    module.sow(flax_nnx.Intermediate, "attention_weights", weights)
  else:
    module.sow("intermediates", "attention_weights", weights)


def attention_fn(impl: str = auto.AUTO, **fixed_kwargs: Any) -> Callable[..., jax.Array]:
  """An `attention_fn` for `flax.linen.MultiHeadDotProductAttention` / `flax.nnx.MultiHeadAttention`.

      layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=fl.attention_fn(impl="xla_chunked"))

  Args:
    impl: one of `fl.IMPLS` or "auto".
    **fixed_kwargs: `fl.attention` options applied to every call: causal, window,
      scale, softcap, block_sizes, mesh, mask_mod, score_mod, mod_operands (the mods' `b` is
      the index in the batch dims flattened to one), mod_operand_axes, context_parallel and
      mesh_axes (a mesh with the model's own axis names, e.g. ("batch", "model"), maps through
      them or through flax's current logical_axis_rules).

  Each call runs `fl.attention`'s own path (`api.run`), mesh included: with `mesh=`
  fixed here or a current mesh (`jax.set_mesh`), the call runs inside `shard_map`,
  batch over data x fsdp, heads over tensor, ring attention over sequence, so a
  sharded flax model runs the Pallas kernels too (GSPMD cannot partition them).
  A dense mask or bias is split with the batch and heads; a sequence axis > 1
  refuses them (UnsupportedError: they would travel around the ring with K/V).

  What the modules pass is honoured:
  * `mask` (dense boolean, [batch..., heads|1, q_len, kv_len], True = attend) and
    nnx's `is_causal`. A dense mask needs reference, xla_native, xla_chunked or xla_dense;
    flash_pallas raises UnsupportedError("dense mask"). Unlike flax's softmax, a
    row whose mask hides every key gets zeros.
  * `dropout_rate`, `dropout_rng`, `broadcast_dropout`, `deterministic`: attention
    dropout through `fl.attention` (its mask is `fl.dropout_mask`, not flax's
    bernoulli draw); xla_native raises UnsupportedError("dropout").
  * `bias`: an additive logits bias [batch..., heads|1, q_len, kv_len] (for callers
    that pass one); flash_pallas raises UnsupportedError("dense bias").
  * `precision` (the module's field, which flax also uses for its projections): the
    attention's matmul precision, as `fl.attention(precision=...)`; None for its default.
  * `module` (flax passes it for `sow_weights=True`): the probabilities
    [batch..., heads, q_len, kv_len] are sown into it as "attention_weights" (linen's
    "intermediates", nnx's `nnx.Intermediate`) when the call runs an impl that materialises
    them (reference, xla_dense, xla_native); any other raises UnsupportedError("sow_weights").
  Refused by name: custom einsums.
  """
  validate.check_impl(impl)
  unknown = sorted(set(fixed_kwargs) - set(_FIXED_KWARGS))
  if unknown:
    raise TypeError(f"attention_fn got unknown option(s) {unknown}; allowed: {list(_FIXED_KWARGS)}")

  def fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
         dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
         **extra):
    causal = fixed_kwargs.get("causal", False)
    for name, value_ in extra.items():
      if name == "is_causal":
        causal = causal or bool(value_)
      elif name in _EINSUM_EXTRA:
        if value_ is not None:
          raise UnsupportedError(f"attention_fn: a custom {name} is not supported")
      elif name not in _HARMLESS_EXTRA:
        raise TypeError(f"attention_fn got an unexpected keyword argument {name!r}")
    dropout_kwargs = {}
    if dropout_rate and not deterministic:
      if dropout_rng is None:
        raise ValueError(f"attention_fn: dropout_rate={dropout_rate} with deterministic=False "
                         "needs a dropout_rng (flax modules pass one from the 'dropout' rng stream)")
      dropout_kwargs = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            dropout_broadcast=bool(broadcast_dropout))
    query, key, value = validate.as_qkv(query, key, value)
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    q, k, v = (core.flatten_batch(x, batch_shape) for x in (query, key, value))
    if mask is not None:
      mask = core.flatten_logits_operand(mask, batch_shape)
    if bias is not None:
      bias = core.flatten_logits_operand(bias, batch_shape)
    options = {**fixed_kwargs, "causal": causal, "dense_mask": mask, "bias": bias, "precision": precision,
               **dropout_kwargs}
    mesh = options.pop("mesh", None)
    if module is not None:
      weights = core.probabilities(q, k, v, impl, mesh, None, options)
      _sow(module, weights.reshape(batch_shape + weights.shape[1:]))
    out = api.run(q, k, v, impl=impl, mesh=mesh, **options)
    return out.reshape(batch_shape + out.shape[1:])

  return fn
