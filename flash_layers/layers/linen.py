"""The flax.linen layers over `fl.attention`.

* `MultiHeadAttention`: q/k/v/out projections around `fl.attention`, with flax's parameter names and
  shapes (`query`, `key`, `value`, `out`, each a DenseGeneral's `kernel` and `bias`), boxed with logical
  axis names by default so that sharding rules place them: the layer our sharded models use.
* `MultiHeadDotProductAttention`: the drop-in for flax's class of that name: the same layer with
  `logical_axis_names=False`, so `init` gives flax's parameter tree exactly (plain arrays).
* `SelfAttention`: flax's (deprecated) self-attention call over the drop-in.

What the layers compute beyond their parameters lives in flash_layers/layers/core.py, shared with the
NNX and Haiku layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flash_layers import auto
from flash_layers.layers import core, kv_cache, paged_cache
from flash_layers.layers.page_allocator import PagedBatch


class _Projection(nn.Module):
  """`nn.DenseGeneral`'s parameters and maths over the last `num_contract` input axes.

  Not DenseGeneral itself: it initializes a flat 2-D kernel and applies the
  logical-axis box to it before reshaping, which fails under a mesh with logical
  rules (a 3-name constraint on a rank-2 value). Here the initializer still sees
  the flat shape (so fan-in matches DenseGeneral's), but the box is made on the
  final shape.
  """

  features: tuple[int, ...]
  num_contract: int
  kernel_axes: tuple[str, ...]
  bias_axes: tuple[str, ...]
  use_bias: bool
  dtype: Any
  param_dtype: Any
  precision: Any
  kernel_init: Callable
  bias_init: Callable
  logical_axis_names: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    contract_shape = x.shape[x.ndim - self.num_contract:]
    flat = (math.prod(contract_shape), math.prod(self.features))

    def kernel_init(key, shape, dtype):
      return jnp.reshape(self.kernel_init(key, flat, dtype), shape)

    def bias_init(key, shape, dtype):
      return jnp.reshape(self.bias_init(key, (flat[1],), dtype), shape)

    if self.logical_axis_names:  # boxed: nn.get_partition_spec reads the names, nn.meta.unbox strips them
      kernel_init = nn.with_logical_partitioning(kernel_init, self.kernel_axes)
      bias_init = nn.with_logical_partitioning(bias_init, self.bias_axes)
    kernel = self.param("kernel", kernel_init, contract_shape + self.features, self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", bias_init, self.features, self.param_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    contract = (tuple(range(x.ndim - self.num_contract, x.ndim)), tuple(range(self.num_contract)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())), precision=self.precision)
    return y if bias is None else y + bias


class MultiHeadAttention(nn.Module):
  """Multi-head attention (MHA, GQA, MQA) whose attention is `fl.attention`.

  Parameters mirror `flax.linen.MultiHeadDotProductAttention`: `query`, `key` and
  `value` kernels `[embed, heads, head_dim]` (kv: `kv_heads`; value: `head_dim_v`),
  biases `[heads, head_dim]`, `out` kernel `[heads, head_dim_v, out_features]`,
  bias `[out_features]`. With logical_axis_names (the default here, not in
  `MultiHeadDotProductAttention`) they are boxed with the logical axis names "embed",
  "heads", "kv_heads" and "head_dim" (`nn.get_partition_spec` reads them;
  `nn.meta.unbox` strips them), so sharding rules place them.

  Attributes:
    num_heads: query heads.
    num_kv_heads: key/value heads, dividing num_heads; None for num_heads.
    head_dim: query/key depth per head; None for features // num_heads.
    head_dim_v: value depth per head; None for head_dim.
    out_features: output features; None for the features of inputs_q.
    impl: one of `fl.IMPLS` or "auto" (see `fl.explain`); an explicit impl that
      cannot serve a call raises `fl.UnsupportedError`.
    causal, window, global_tokens, softcap, scale, block_sizes: as in `fl.attention`.
    rope_theta: rotary position embeddings (`flash_layers.rotary`) with this base, applied to
      the projected queries and keys before attention; None (default) for none.
    mesh: as in `fl.attention`: a mesh (`fl.parallel.make_mesh`) to shard the
      attention over; None shards over the current mesh (`jax.set_mesh`), if any.
    context_parallel, mesh_axes, mod_operand_axes: as in `fl.attention`: the strategy over the
      mesh's sequence axis ("auto", "ring", "ulysses", "all_gather", "ulysses_ring"), the mesh axes
      of a mesh with other names, the layout of the call's mod_operands.
    dtype: computation dtype (None: from inputs and params); param_dtype: of the params.
    use_bias, kernel_init, bias_init: of the projections, as in `nn.DenseGeneral`.
    precision: of every matmul, the projections' and the attention's (as the one `precision`
      of `nn.MultiHeadDotProductAttention`): "default", "high", "highest", a
      `jax.lax.Precision` or None. None: the projections at jax's default, the attention at
      `fl.attention`'s (full float32 products for float32, see docs/contract.md).
    dropout_rate: attention-probability dropout, applied when the call has
      deterministic=False, with keys from the "dropout" rng collection
      (`apply(..., rngs={"dropout": key})`). The mask is `fl.dropout_mask` of that key:
      the same under every impl and mesh. xla_native does not serve it.
    alibi: ALiBi position bias: True for the standard slopes (`fl.alibi_slopes(num_heads)`),
      or float slopes [num_heads]; False/None for none.
    use_sinks: the layer owns a "sinks" parameter [num_heads] (float32 logits, `fl.attention`'s
      `sinks`: they join every row's softmax denominator), initialised by `sinks_init` (zeros:
      each head starts with a sink of logit 0).
    mask_mod, score_mod: `fl.attention`'s (flash_layers/contract/mods.py; `fl.masks` has named mask_mods);
      a call's `mod_operands` are passed to them.
    decode: keep an autoregressive KV cache in the "cache" collection, as flax's
      `MultiHeadDotProductAttention(decode=True)`: the first call (`init`) makes it from its input's
      length, each later call (`apply(..., mutable=["cache"])`) appends its 1...n tokens and attends
      to everything cached; a causal layer with a sliding window keeps a ring buffer of the window
      instead (flash_layers/layers/kv_cache.py). Self-attention only.
    cache_layout: "flax" (`cached_key`/`cached_value` [batch, slots, kv_heads, head_dim], flax's) or
      "heads_first" ([batch, kv_heads, slots, head_dim]: what flash_pallas's decode kernel reads on a
      TPU without copying the cache each step; docs/kernels.md). With cache="paged", the pool's layout.
    cache: "contiguous" (the default: the cache above) or "paged": with decode=True, a pool of `num_pages`
      pages of `page_size` tokens shared by a ragged batch of sequences, each call taking its
      `paged_batch` (flash_layers/layers/paged_cache.py; a serving loop's `fl.PageAllocator` owns the
      pages). kv_cache_dtype: the pages' dtype, None (the layer's) or "int8" (with float32 scales per
      token and kv head).
    qkv_features, broadcast_dropout, deterministic, normalize_qk, out_kernel_init, out_bias_init: flax's
      `MultiHeadDotProductAttention` fields: the q/k/v projections' total width (num_heads * head_dim);
      one dropout mask for every batch row and head (default False here, True in flax); the default of
      the call's `deterministic` (None: True); LayerNorms "query_ln"/"key_ln" (no bias) on each head of
      the projected queries and keys; the out projection's initializers (None: kernel_init, bias_init).
    force_fp32_for_softmax: the softmax is float32 in every impl whatever it says; it sets the dtype of
      sown weights as in flax (float32, else the computation dtype).
    logical_axis_names: box the parameters with their logical axis names (nn.LogicallyPartitioned);
      False: plain arrays, flax's own tree.
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  head_dim_v: int | None = None
  out_features: int | None = None
  impl: str = auto.AUTO
  causal: bool = False
  window: int | tuple[int, int] | None = None
  global_tokens: int = 0
  softcap: float | None = None
  scale: float | None = None
  block_sizes: Any = None
  rope_theta: float | None = None
  mesh: Any = None
  context_parallel: str = "auto"
  mesh_axes: Any = None
  mod_operand_axes: Any = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  precision: Any = None
  dropout_rate: float = 0.0
  alibi: Any = False
  use_sinks: bool = False
  sinks_init: Callable = nn.initializers.zeros_init()
  mask_mod: Callable | None = None
  score_mod: Callable | None = None
  decode: bool = False
  cache_layout: str = "flax"
  cache: str = "contiguous"
  num_pages: int | None = None
  page_size: int | None = None
  kv_cache_dtype: str | None = None
  # flax's MultiHeadDotProductAttention fields, with flax's meaning:
  qkv_features: int | None = None
  broadcast_dropout: bool = False
  deterministic: bool | None = None
  normalize_qk: bool = False
  out_kernel_init: Callable | None = None
  out_bias_init: Callable | None = None
  force_fp32_for_softmax: bool = False
  # Ours: the parameters carry logical axis names (a sharded model's default; flax's drop-in turns it off).
  logical_axis_names: bool = True

  def __post_init__(self):
    core.check_fields(core.AttentionFields.of(self))
    super().__post_init__()

  def _dense(self, name: str, features, axis, kernel_axes, bias_axes) -> _Projection:
    out = name == "out"
    return _Projection(
        features=tuple(features) if isinstance(features, tuple) else (features,),
        num_contract=len(axis) if isinstance(axis, tuple) else 1, kernel_axes=kernel_axes,
        bias_axes=bias_axes, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        kernel_init=(out and self.out_kernel_init) or self.kernel_init,
        bias_init=(out and self.out_bias_init) or self.bias_init,
        logical_axis_names=self.logical_axis_names, name=name)

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, inputs_k: jax.Array | None = None,
               segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool | None = None, mod_operands: tuple | None = None,
               block_mask: Any = None, mask: jax.Array | None = None, dropout_rng: jax.Array | None = None,
               sow_weights: bool = False, paged_batch: PagedBatch | None = None) -> jax.Array:
    """inputs_q [batch, q_len, features], inputs_kv [batch, kv_len, kv_features] (None: self-attention).

    segment_ids [batch, q_len] / kv_segment_ids [batch, kv_len] as in `fl.attention`.
    mod_operands: arrays for the layer's mask_mod / score_mod (as `fl.attention`'s); block_mask: a
    `fl.block_mask` of the layer's mask_mod, built once for every layer of the model.
    positions [batch, q_len] / kv_positions [batch, kv_len]: int positions for the rotary
    embeddings (with rope_theta; e.g. restarting per packed document). None: 0, 1, ... for the
    queries; kv_positions default to positions in self-attention.
    flax's call arguments, with flax's meaning: inputs_v (the values' inputs; default the keys'),
    inputs_k (= inputs_kv), mask (boolean, broadcastable to [batch, heads, q_len, kv_len]; True:
    attend), deterministic (None: the field's, else True), dropout_rng (instead of the "dropout" rng
    stream), sow_weights (sow the probabilities [batch, heads, q_len, kv_len] as
    intermediates/attention_weights; for impls with the "sow_weights" capability, UnsupportedError otherwise).
    paged_batch: with decode=True and cache="paged", the call's ragged batch (`fl.PagedBatch`, from
    `fl.PageAllocator.batch`); inputs_q is then the packed new tokens [num_tokens, features] (or
    [1, num_tokens, features]) and positions default to each token's position in its sequence.
    Returns [batch, q_len, out_features].
    """
    inputs_kv, inputs_v, self_attention = core.key_value_inputs(inputs_q, inputs_kv, inputs_k, inputs_v)
    batch_shape, flat = core.flatten_batch_dims(inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids,
                                                positions, kv_positions, mask)
    inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids, positions, kv_positions, mask = flat
    fields = core.AttentionFields.of(self)
    dims = core.head_dims(fields, inputs_q, inputs_kv)
    core.check_decode_inputs(self.decode, inputs_q, inputs_kv)
    deterministic = core.resolve_deterministic(fields, deterministic)
    paged = paged_cache.is_paged(fields)
    paged_cache.check_call(fields, batch_shape, paged_batch, segment_ids=segment_ids, mask=mask,
                           kv_segment_ids=kv_segment_ids, mod_operands=mod_operands, block_mask=block_mask,
                           sow_weights=sow_weights, dropout=core.needs_dropout_rng(fields, deterministic))
    decoding_now = self.decode and self.has_variable("cache", "k_pages" if paged else "cached_key")
    if self.decode and not decoding_now:  # the init call: an empty cache sized by this input (or batch)
      values = (paged_cache.init_values(fields, dims, paged_batch, self.dtype or inputs_q.dtype) if paged else
                core.cache_init_values(fields, dims, *inputs_q.shape[:2], self.dtype or inputs_q.dtype))
      for name, value in values.items():
        self.variable("cache", name, lambda value=value: value)
    if paged and self.rope_theta is not None:
      positions, kv_positions = paged_cache.rotary_positions(paged_batch, inputs_q.shape[1], positions,
                                                             kv_positions)
    elif decoding_now and self.rope_theta is not None:
      positions, kv_positions = kv_cache.rotary_positions(self.get_variable("cache", "cache_index"),
                                                          *inputs_q.shape[:2], positions, kv_positions)
    query = self._dense("query", (dims.num_heads, dims.head_dim), -1,
                        core.QUERY_KERNEL_AXES, core.QUERY_KERNEL_AXES[1:])(inputs_q)
    key = self._dense("key", (dims.num_kv_heads, dims.head_dim), -1,
                      core.KV_KERNEL_AXES, core.KV_KERNEL_AXES[1:])(inputs_kv)
    value = self._dense("value", (dims.num_kv_heads, dims.head_dim_v), -1,
                        core.KV_KERNEL_AXES, core.KV_KERNEL_AXES[1:])(inputs_v)
    if self.normalize_qk:  # flax's names and LayerNorm: no bias, over each head's features
      norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
      query, key = norm(name="query_ln")(query), norm(name="key_ln")(key)
    query, key = core.rotate_heads(fields, query, key, positions, kv_positions, self_attention)
    if not core.needs_dropout_rng(fields, deterministic):
      dropout_rng = None
    elif dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    sinks = (self.param("sinks", self.sinks_init, (dims.num_heads,), jnp.float32) if self.use_sinks
             else None)
    if sow_weights:
      self.sow("intermediates", "attention_weights",
               core.attention_weights(fields, batch_shape, query, key, value, segment_ids, kv_segment_ids,
                                      dropout_rng, sinks, mod_operands, mask))
    if paged:  # the init call runs the step too, but keeps the empty pool
      cache = {name: self.get_variable("cache", name) for name in paged_cache.names(fields)}
      out, cache = paged_cache.step(fields, cache, query, key, value, paged_batch, sinks)
      for name, value in cache.items() if decoding_now else ():
        self.put_variable("cache", name, value)
    elif decoding_now:
      cache = {name: self.get_variable("cache", name) for name in kv_cache.CACHE_NAMES}
      out, cache = core.decode_step(fields, cache, query, key, value, segment_ids, kv_segment_ids,
                                    dropout_rng, sinks, mod_operands, block_mask, mask)
      for name, value in cache.items():
        self.put_variable("cache", name, value)
    else:
      out = core.attend_heads(fields, query, key, value, segment_ids, kv_segment_ids, dropout_rng, sinks,
                              mod_operands, block_mask, mask=mask)
    out = self._dense("out", dims.out_features, (-2, -1), core.OUT_KERNEL_AXES, core.OUT_BIAS_AXES)(out)
    return out.reshape(batch_shape + out.shape[1:])


class MultiHeadDotProductAttention(MultiHeadAttention):
  """flax's `nn.MultiHeadDotProductAttention`, with `fl.attention` inside: the exact drop-in.

  `init` gives flax's parameter tree (names, shapes, plain arrays: `logical_axis_names=False`), and the
  class name keeps a model's auto-named paths (`MultiHeadDotProductAttention_0`, ...), so checkpoints load
  both ways. Set logical_axis_names=True for the boxed parameters of `MultiHeadAttention`.
  """

  logical_axis_names: bool = False


class SelfAttention(MultiHeadDotProductAttention):
  """flax's `nn.SelfAttention`: the drop-in's self-attention, with flax's call (mask, not inputs_kv)."""

  @nn.compact
  def __call__(self, inputs_q: jax.Array, mask: jax.Array | None = None,  # type: ignore[override]
               deterministic: bool | None = None, dropout_rng: jax.Array | None = None,
               sow_weights: bool = False) -> jax.Array:
    """inputs_q [batch..., length, features]; mask, deterministic, dropout_rng, sow_weights as in
    `MultiHeadAttention.__call__`. Returns [batch..., length, out_features]."""
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic, dropout_rng=dropout_rng,
                            sow_weights=sow_weights)
