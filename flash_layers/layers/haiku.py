"""The Haiku twin of `fl.MultiHeadAttention` (optional extra: `pip install flash-layers[haiku]`).

The Flax layer's fields except `mesh` (under `jax.set_mesh` the attention still shards over
the current mesh), with Haiku initializers and a module `name`; the same call; the same parameter
layout: modules `query`, `key`, `value`, `out`, each with `kernel` (3-D, e.g. `[embed, heads,
head_dim]`) and `bias`, so `params_from_flax` is only a renaming of the tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

try:
  import haiku as hk
except ImportError as err:  # pragma: no cover - depends on the environment
  raise ImportError("flash_layers.haiku needs dm-haiku; install it with "
                    "`pip install flash-layers[haiku]`") from err

from flash_layers import auto
from flash_layers.layers import core

_PROJECTIONS = ("query", "key", "value", "out")


class MultiHeadAttention(hk.Module):
  """Multi-head attention (MHA, GQA, MQA) whose attention is `fl.attention`.

  Fields as in `flash_layers.MultiHeadAttention` but `mesh` (none: the current mesh applies),
  except that `kernel_init` and `bias_init` are Haiku initializers `(shape, dtype) -> array`. Defaults match
  the Flax layer's: LeCun-normal kernels (fan-in is the input features, not the
  3-D kernel's leading dims) and zero biases. Dropout (dropout_rate > 0 and a call
  with deterministic=False) draws its key with `hk.next_rng_key()`, so it needs
  `hk.transform`'s rng; the mask is `fl.dropout_mask` of that key.
  """

  def __init__(self, num_heads: int, *, num_kv_heads: int | None = None, head_dim: int | None = None,
               head_dim_v: int | None = None, out_features: int | None = None, impl: str = auto.AUTO,
               causal: bool = False, window: int | tuple[int, int] | None = None,
               global_tokens: int = 0, softcap: float | None = None, scale: float | None = None,
               block_sizes: Any = None, rope_theta: float | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True,
               kernel_init: Callable | None = None, bias_init: Callable | None = None,
               precision: Any = None, dropout_rate: float = 0.0, alibi: Any = False,
               use_sinks: bool = False, sinks_init: Callable | None = None,
               mask_mod: Callable | None = None, score_mod: Callable | None = None,
               context_parallel: str = "auto", mesh_axes: Any = None, mod_operand_axes: Any = None,
               name: str | None = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.head_dim_v = head_dim_v
    self.out_features = out_features
    self.impl = impl
    self.causal = causal
    self.window = window
    self.global_tokens = global_tokens
    self.softcap = softcap
    self.scale = scale
    self.block_sizes = block_sizes
    self.rope_theta = rope_theta
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.kernel_init = kernel_init or hk.initializers.VarianceScaling(1.0, "fan_in", "truncated_normal")
    self.bias_init = bias_init or jnp.zeros
    self.precision = precision
    self.dropout_rate = dropout_rate
    self.alibi = alibi
    self.use_sinks = use_sinks
    self.sinks_init = sinks_init or jnp.zeros
    self.mask_mod, self.score_mod = mask_mod, score_mod
    self.context_parallel, self.mesh_axes = context_parallel, mesh_axes
    self.mod_operand_axes = mod_operand_axes
    # Haiku has no mesh, qkv_features, deterministic or decode fields: AttentionFields' defaults stand in.
    self.fields = core.AttentionFields(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
        out_features=out_features, impl=impl, causal=causal, window=window, global_tokens=global_tokens,
        softcap=softcap, scale=scale, block_sizes=block_sizes, rope_theta=rope_theta, precision=precision,
        dropout_rate=dropout_rate, alibi=alibi, use_sinks=use_sinks, mask_mod=mask_mod, score_mod=score_mod,
        context_parallel=context_parallel, mesh_axes=mesh_axes, mod_operand_axes=mod_operand_axes)
    core.check_fields(self.fields)

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, *,
               segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool = True, mod_operands: tuple | None = None,
               block_mask: Any = None) -> jax.Array:
    """inputs_q [batch, q_len, features], inputs_kv [batch, kv_len, kv_features] (None: self-attention).

    segment_ids, kv_segment_ids, positions, kv_positions, mod_operands as in the Flax layer.
    Returns [batch, q_len, out_features].
    """
    self_attention = inputs_kv is None
    if inputs_kv is None:
      inputs_kv = inputs_q
    dims = core.head_dims(self.fields, inputs_q, inputs_kv)
    features, kv_features = inputs_q.shape[-1], inputs_kv.shape[-1]
    query = _dense(self, "query", inputs_q, (features, dims.num_heads, dims.head_dim), 1)
    key = _dense(self, "key", inputs_kv, (kv_features, dims.num_kv_heads, dims.head_dim), 1)
    value = _dense(self, "value", inputs_kv, (kv_features, dims.num_kv_heads, dims.head_dim_v), 1)
    query, key = core.rotate_heads(self.fields, query, key, positions, kv_positions, self_attention)
    dropout_rng = hk.next_rng_key() if core.needs_dropout_rng(self.fields, deterministic) else None
    sinks = (hk.get_parameter("sinks", (self.num_heads,), jnp.float32, init=self.sinks_init)
             if self.use_sinks else None)
    out = core.attend_heads(self.fields, query, key, value, segment_ids, kv_segment_ids, dropout_rng, sinks,
                            mod_operands, block_mask)
    return _dense(self, "out", out, (dims.num_heads, dims.head_dim_v, dims.out_features), 2)


def _dense(layer: MultiHeadAttention, name: str, x, kernel_shape: tuple[int, ...], in_ndim: int):
  """x [..., *kernel_shape[:in_ndim]] -> [..., *kernel_shape[in_ndim:]]; params named as in Flax.

  A function, not a method: Haiku would put the method name into the parameter path.
  """
  fan_in = math.prod(kernel_shape[:in_ndim])
  out_shape = kernel_shape[in_ndim:]
  # Draw the kernel as the 2-D matrix it is, so fan-in counts only the inputs.
  flat = lambda init, flat_shape: lambda shape, dtype: init(flat_shape, dtype).reshape(shape)
  with hk.name_scope(name):
    kernel = hk.get_parameter("kernel", kernel_shape, layer.param_dtype,
                              init=flat(layer.kernel_init, (fan_in, math.prod(out_shape))))
    bias = None
    if layer.use_bias:
      bias = hk.get_parameter("bias", out_shape, layer.param_dtype,
                              init=flat(layer.bias_init, (math.prod(out_shape),)))
  dtype = jnp.result_type(x, kernel) if layer.dtype is None else layer.dtype
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  y = jnp.tensordot(x, kernel, axes=(tuple(range(x.ndim - in_ndim, x.ndim)), tuple(range(in_ndim))),
                    precision=layer.precision)
  return y if bias is None else y + bias.astype(dtype)


def params_from_flax(flax_params: Mapping[str, Any], name: str = "multi_head_attention") -> dict:
  """The Haiku params of a `MultiHeadAttention(name=name)` holding the Flax layer's weights.

  `flax_params` is the Flax layer's variables (`{"params": {...}}`) or their
  "params" collection, boxed (logical axis names) or not.
  """
  params = _unbox(flax_params)
  params = params.get("params", params)
  missing = [p for p in _PROJECTIONS if p not in params]
  if missing:
    raise ValueError(f"flax_params lacks {missing}; expected the params of fl.MultiHeadAttention "
                     f"(modules {list(_PROJECTIONS)})")
  out = {f"{name}/{p}": dict(params[p]) for p in _PROJECTIONS}
  if "sinks" in params:  # use_sinks: the layer's own parameter
    out[name] = {"sinks": params["sinks"]}
  return out


def _unbox(tree):
  """flax's `nn.meta.unbox` without importing flax (this module imports none): a boxed parameter
  (`nn.LogicallyPartitioned`, ...) has an `unbox()` method that returns its array."""
  is_box = lambda x: callable(getattr(x, "unbox", None))
  return jax.tree_util.tree_map(lambda x: x.unbox() if is_box(x) else x, tree, is_leaf=is_box)
