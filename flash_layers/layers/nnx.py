"""The `flax.nnx` twin of `fl.MultiHeadAttention`: same fields, same call, same parameters.

    from flash_layers import nnx as flnnx
    layer = flnnx.MultiHeadAttention(num_heads=8, in_features=512, dropout_rate=0.1,
                                     rngs=nnx.Rngs(params=0, dropout=1))
    y = layer(x, deterministic=False)

NNX builds parameters eagerly, so the layer takes `in_features` (and
`in_kv_features` for cross-attention inputs of another width) and `rngs`.
Submodules `query`, `key`, `value`, `out` are `nnx.LinearGeneral`s whose
`kernel`/`bias` have the linen layer's names and shapes, so `params_from_linen`
and `params_to_linen` only re-nest the tree. Parameters carry the linen layer's
logical axis names as `out_sharding` metadata (`nnx.get_partition_spec` under
`nn.logical_axis_rules(fl.LOGICAL_RULES)` maps them to mesh axes); they are not
sharded eagerly, so the layer builds with or without a mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flash_layers import auto
from flash_layers.layers import core, kv_cache, paged_cache
from flash_layers.layers.page_allocator import PagedBatch

_PROJECTIONS = ("query", "key", "value", "out")
# The linen layer's defaults (flax's DenseGeneral's).
_KERNEL_INIT = nn.initializers.lecun_normal()
_BIAS_INIT = nn.initializers.zeros_init()
_SINKS_INIT = nn.initializers.zeros_init()


def _metadata(axes: tuple[str, ...]) -> dict:
  return {"out_sharding": axes, "eager_sharding": False}


class MultiHeadAttention(nnx.Module):
  """Multi-head attention (MHA, GQA, MQA) whose attention is `fl.attention`.

  Fields as in `flash_layers.MultiHeadAttention`, plus:
    in_features: features of inputs_q.
    in_kv_features: features of inputs_kv; None for in_features.
    deterministic: the default of the call's `deterministic` (True: no dropout);
      `model.train()` / `model.eval()` and `nnx.view` set it.
    rngs: `nnx.Rngs` for the parameters ("params") and, when dropout_rate > 0,
      the dropout keys ("dropout", else "default"), kept by the layer.
    keep_rngs: keep a fork of the dropout stream (flax's field); False: pass `rngs=` to a call with dropout.
    decode: the default of the call's `decode`: calls append to the KV cache that `init_cache` made
      (`nnx.Cache` variables `cached_key`, `cached_value`, `cache_index`, as flax's
      `nnx.MultiHeadAttention`, and `cached_segment_ids`; flash_layers/layers/kv_cache.py).
    cache_layout: "flax" or "heads_first", the cache's layout (`fl.MultiHeadAttention`'s field).
    cache, num_pages, page_size, kv_cache_dtype: the paged cache (`fl.MultiHeadAttention`'s fields):
      with cache="paged", `init_cache(paged_batch=...)` makes a pool of `num_pages` pages (`nnx.Cache`
      variables `k_pages`, `v_pages`, ..., flash_layers/layers/paged_cache.py) and each decoding call
      takes its `paged_batch`.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, head_dim: int | None = None,
               head_dim_v: int | None = None, impl: str = auto.AUTO, causal: bool = False,
               window: int | tuple[int, int] | None = None, global_tokens: int = 0,
               softcap: float | None = None, scale: float | None = None, block_sizes: Any = None,
               rope_theta: float | None = None, mesh: Any = None, context_parallel: str = "auto",
               mesh_axes: Any = None, mod_operand_axes: Any = None,
               dtype: Any = None, param_dtype: Any = jnp.float32, use_bias: bool = True,
               kernel_init: Callable = _KERNEL_INIT,
               bias_init: Callable = _BIAS_INIT, precision: Any = None,
               dropout_rate: float = 0.0, alibi: Any = False, deterministic: bool = True,
               use_sinks: bool = False, sinks_init: Callable = _SINKS_INIT,
               mask_mod: Callable | None = None, score_mod: Callable | None = None, decode: bool = False,
               broadcast_dropout: bool = False, normalize_qk: bool = False,
               out_kernel_init: Callable | None = None, out_bias_init: Callable | None = None,
               force_fp32_for_softmax: bool = False, keep_rngs: bool = True, cache_layout: str = "flax",
               cache: str = "contiguous", num_pages: int | None = None, page_size: int | None = None,
               kv_cache_dtype: str | None = None, rngs: nnx.Rngs):
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
    self.mesh = mesh
    self.context_parallel, self.mesh_axes = context_parallel, mesh_axes
    self.mod_operand_axes = mod_operand_axes
    self.dropout_rate = dropout_rate
    self.alibi = alibi
    self.deterministic = deterministic
    self.precision = precision  # the projections' and the attention's
    self.use_sinks = use_sinks
    self.mask_mod, self.score_mod = mask_mod, score_mod
    self.decode = decode
    self.cache_layout = cache_layout
    self.cache, self.num_pages, self.page_size = cache, num_pages, page_size
    self.kv_cache_dtype = kv_cache_dtype
    self.qkv_features = qkv_features
    self.broadcast_dropout, self.normalize_qk = broadcast_dropout, normalize_qk
    self.force_fp32_for_softmax = force_fp32_for_softmax
    core.check_fields(core.AttentionFields.of(self))
    if alibi is not None and not isinstance(alibi, bool):
      # Static data, not an array attribute (which NNX would treat as state).
      self.alibi = tuple(float(x) for x in np.asarray(alibi))
    for name, value in (("in_features", in_features), ("in_kv_features", in_kv_features)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    self.in_features = in_features
    self.in_kv_features = in_kv_features or in_features
    dims = core.resolve_dims(core.AttentionFields.of(self), in_features)

    def dense(in_shape, out_shape, kernel_axes, bias_axes, axis=-1, out=False):
      return nnx.LinearGeneral(
          in_shape, out_shape, axis=axis, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
          kernel_init=(out and out_kernel_init) or kernel_init,
          bias_init=(out and out_bias_init) or bias_init, precision=precision, rngs=rngs,
          kernel_metadata=_metadata(kernel_axes), bias_metadata=_metadata(bias_axes))

    q_axes, kv_axes = core.QUERY_KERNEL_AXES, core.KV_KERNEL_AXES
    self.query = dense(in_features, (dims.num_heads, dims.head_dim), q_axes, q_axes[1:])
    self.key = dense(self.in_kv_features, (dims.num_kv_heads, dims.head_dim), kv_axes, kv_axes[1:])
    self.value = dense(self.in_kv_features, (dims.num_kv_heads, dims.head_dim_v), kv_axes, kv_axes[1:])
    self.out = dense((dims.num_heads, dims.head_dim_v), dims.out_features, core.OUT_KERNEL_AXES,
                     core.OUT_BIAS_AXES, axis=(-2, -1), out=True)
    # As flax's nnx.MultiHeadAttention(normalize_qk=True): LayerNorms without bias over each head's features.
    self.query_ln = self.key_ln = nnx.data(None)
    if normalize_qk:
      self.query_ln, self.key_ln = (nnx.LayerNorm(dims.head_dim, use_bias=False, dtype=dtype,
                                                  param_dtype=param_dtype, rngs=rngs) for _ in range(2))
    # As the linen layer's "sinks" param: float32 [num_heads] sink logits (fl.attention's `sinks`).
    self.sinks = nnx.Param(sinks_init(rngs.params(), (dims.num_heads,), jnp.float32)) if use_sinks else None
    self.rngs = nnx.data(None)
    self.cached_key = self.cached_value = self.cached_segment_ids = self.cache_index = nnx.data(None)
    for name in paged_cache.NAMES:
      setattr(self, name, nnx.data(None))
    if keep_rngs and dropout_rate and ("dropout" in rngs or "default" in rngs):
      self.rngs = rngs["dropout"].fork()

  def init_cache(self, input_shape: tuple[int, ...] | None = None, dtype: Any = jnp.float32, *,
                 paged_batch: PagedBatch | None = None) -> None:
    """An empty KV cache for inputs of `input_shape` = [batch, max_length, features] (as flax's
    `nnx.MultiHeadAttention.init_cache`); a causal layer with a sliding window keeps a ring buffer of
    the window instead of max_length entries. With cache="paged": an empty pool of `num_pages` pages
    of `dtype` (or `kv_cache_dtype`), and a page table shaped as `paged_batch`'s (input_shape unused;
    `fl.PagedBatch.empty(max_seqs, pages_per_seq)` serves)."""
    fields = core.AttentionFields.of(self)
    if self.cache == "paged":
      if not isinstance(paged_batch, PagedBatch):
        raise TypeError("init_cache of a paged layer takes paged_batch=, a PagedBatch (PagedBatch.empty("
                        f"max_seqs, pages_per_seq) serves); got {type(paged_batch).__name__}")
      dims = core.resolve_dims(fields, self.in_features)
      for name, value in paged_cache.init_values(fields, dims, paged_batch, dtype).items():
        setattr(self, name, nnx.Cache(value))
      return
    if input_shape is None or len(input_shape) < 2:
      raise ValueError(f"input_shape must be [batch..., max_length, features]; got {input_shape!r}")
    input_shape = (math.prod(input_shape[:-2]), *input_shape[-2:])  # the call flattens the batch dims
    if self.global_tokens:
      raise ValueError("decoding with global_tokens is not supported (core.check_fields says why)")
    values = core.cache_init_values(fields, core.resolve_dims(fields, self.in_features), *input_shape[:2],
                                    dtype)
    for name, value in values.items():
      setattr(self, name, nnx.Cache(value))

  def set_view(self, deterministic: bool | None = None):
    """For `nnx.view`: deterministic=False turns dropout on by default."""
    if deterministic is not None:
      self.deterministic = deterministic

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, inputs_k: jax.Array | None = None,
               segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
               mod_operands: tuple | None = None,
               block_mask: Any = None, decode: bool | None = None, mask: jax.Array | None = None,
               sow_weights: bool = False, paged_batch: PagedBatch | None = None) -> jax.Array:
    """inputs_q [batch, q_len, in_features], inputs_kv [batch, kv_len, in_kv_features] (None: self-attention).

    segment_ids [batch, q_len] / kv_segment_ids [batch, kv_len] as in `fl.attention`.
    positions / kv_positions: for the rotary embeddings, as in the linen layer.
    deterministic: None for the layer's attribute. rngs: dropout keys for this call
    (an `nnx.Rngs`, a stream or a key) instead of the layer's own. mod_operands: arrays for the
    layer's mask_mod / score_mod. decode: None for the layer's attribute; True appends this call's
    tokens to the cache (`init_cache` first) and attends to everything cached. inputs_v, inputs_k,
    mask, sow_weights: flax's, as in the linen layer (the weights are sown as
    `nnx.Intermediate` "attention_weights"). paged_batch: a paged decoding call's ragged batch, as in
    the linen layer (cache="paged").
    Returns [batch, q_len, out_features].
    """
    fields = core.AttentionFields.of(self)  # at the call: set_view / model.eval() change deterministic
    inputs_kv, inputs_v, self_attention = core.key_value_inputs(inputs_q, inputs_kv, inputs_k, inputs_v)
    batch_shape, flat = core.flatten_batch_dims(inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids,
                                                positions, kv_positions, mask)
    inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids, positions, kv_positions, mask = flat
    core.head_dims(fields, inputs_q, inputs_kv)  # validates the shapes
    for name, x, want in (("inputs_q", inputs_q, self.in_features),
                          ("inputs_kv", inputs_kv, self.in_kv_features),
                          ("inputs_v", inputs_v, self.in_kv_features)):
      if x.shape[-1] != want:
        raise ValueError(f"{name} has {x.shape[-1]} features; this layer was built for {want} "
                         f"({'in_features' if name == 'inputs_q' else 'in_kv_features'})")
    deterministic = core.resolve_deterministic(fields, deterministic)
    decode = self.decode if decode is None else decode
    core.check_decode_inputs(decode, inputs_q, inputs_kv)
    fields = dataclasses.replace(fields, decode=decode)
    paged = paged_cache.is_paged(fields)
    paged_cache.check_call(fields, batch_shape, paged_batch, segment_ids=segment_ids, mask=mask,
                           kv_segment_ids=kv_segment_ids, mod_operands=mod_operands, block_mask=block_mask,
                           sow_weights=sow_weights, dropout=core.needs_dropout_rng(fields, deterministic))
    dropout_rng = self._dropout_key(rngs) if core.needs_dropout_rng(fields, deterministic) else None
    if decode and (self.k_pages if paged else self.cache_index) is None:
      raise ValueError("decode=True needs a KV cache: call layer.init_cache("
                       f"{'paged_batch=...' if paged else 'input_shape'}) first")
    if paged and self.rope_theta is not None:
      positions, kv_positions = paged_cache.rotary_positions(paged_batch, inputs_q.shape[1], positions,
                                                             kv_positions)
    elif decode and self.rope_theta is not None:
      positions, kv_positions = kv_cache.rotary_positions(self.cache_index[...], *inputs_q.shape[:2],
                                                          positions, kv_positions)
    query, key, value = self.query(inputs_q), self.key(inputs_kv), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    query, key = core.rotate_heads(fields, query, key, positions, kv_positions, self_attention)
    sinks = None if self.sinks is None else self.sinks[...]
    if sow_weights:
      self.sow(nnx.Intermediate, "attention_weights",
               core.attention_weights(fields, batch_shape, query, key, value, segment_ids, kv_segment_ids,
                                      dropout_rng, sinks, mod_operands, mask))
    if paged:
      cache = {name: getattr(self, name)[...] for name in paged_cache.names(fields)}
      out, cache = paged_cache.step(fields, cache, query, key, value, paged_batch, sinks)
      for name, value in cache.items():
        getattr(self, name)[...] = value
    elif decode:
      cache = {name: getattr(self, name)[...] for name in kv_cache.CACHE_NAMES}
      out, cache = core.decode_step(fields, cache, query, key, value, segment_ids, kv_segment_ids,
                                    dropout_rng, sinks, mod_operands, block_mask, mask)
      for name, value in cache.items():
        getattr(self, name)[...] = value
    else:
      out = core.attend_heads(fields, query, key, value, segment_ids, kv_segment_ids, dropout_rng, sinks,
                              mod_operands, block_mask, mask=mask)
    out = self.out(out)
    return out.reshape(batch_shape + out.shape[1:])

  def _dropout_key(self, rngs) -> jax.Array:
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError("dropout_rate > 0 with deterministic=False needs dropout keys: build the layer "
                       "with rngs=nnx.Rngs(..., dropout=...) or pass rngs= to the call")
    if isinstance(rngs, nnx.Rngs):
      return rngs["dropout"]()
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    return rngs


def params_from_linen(linen_params: Mapping[str, Any]) -> dict:
  """The nnx state (`nnx.State.replace_by_pure_dict` form) holding the linen layer's weights.

      nnx.update(layer, nnx.State(params_from_linen(variables)))  # or
      state = nnx.state(layer, nnx.Param); state.replace_by_pure_dict(params_from_linen(variables))

  `linen_params` is the linen layer's variables (`{"params": {...}}`) or their
  "params" collection, boxed or not.
  """
  params = nn.meta.unbox(linen_params)
  params = params.get("params", params)
  missing = [p for p in _PROJECTIONS if p not in params]
  if missing:
    raise ValueError(f"linen_params lacks {missing}; expected the params of fl.MultiHeadAttention "
                     f"(modules {list(_PROJECTIONS)})")
  state = {p: dict(params[p]) for p in _PROJECTIONS}
  if "sinks" in params:
    state["sinks"] = params["sinks"]
  return state


def params_to_linen(layer: MultiHeadAttention) -> dict:
  """The linen layer's variables `{"params": {...}}` holding this NNX layer's weights."""
  pure = nnx.state(layer, nnx.Param).to_pure_dict()
  params = {p: dict(pure[p]) for p in _PROJECTIONS}
  if "sinks" in pure:
    params["sinks"] = pure["sinks"]
  return {"params": params}
