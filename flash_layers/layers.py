"""Flax layers over `fl.attention`, and an adapter for flax's own attention modules.

* `MultiHeadAttention` (flax.linen): q/k/v/out projections around `fl.attention`.
  Its parameter tree is the one of `flax.linen.MultiHeadDotProductAttention`
  (`query`, `key`, `value`, `out`, each a DenseGeneral with `kernel` and `bias`),
  so weights port both ways; the kernels carry logical axis names so that
  sharding rules can place them.
* `attention_fn(impl=...)`: a drop-in `attention_fn=` for
  `flax.linen.MultiHeadDotProductAttention` and `flax.nnx.MultiHeadAttention`.

The field checks, head-size defaults and the call into `fl.attention` live here
once and are shared with the NNX and Haiku layers (`flash_layers.nnx`,
`flash_layers.haiku`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx as flax_nnx

from flash_layers import api, decoding, dispatch, lowering, rotary
from flash_layers.contract import alibi
from flash_layers.impls import UnsupportedError
from flash_layers.impls import reference as reference_impl
from flash_layers.parallel import sharded

# The impls whose attention materialises the probabilities: a call with sow_weights=True must resolve to one.
SOWS_WEIGHTS = ("reference", "xla_dense", "xla_native")

# Logical axis names of the parameters; sharding rules map them to mesh axes.
QUERY_KERNEL_AXES = ("embed", "heads", "head_dim")
KV_KERNEL_AXES = ("embed", "kv_heads", "head_dim")
OUT_KERNEL_AXES = ("heads", "head_dim", "embed")
OUT_BIAS_AXES = ("embed",)


# ----------------------------------------------------------------------------
# Field checks and head sizes, shared with the Haiku layer
# ----------------------------------------------------------------------------

def _check_positive_int(name: str, value, *, optional: bool):
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}; got {value!r}")


def check_fields(layer) -> None:
  """Validate a layer's fields at construction (everything that does not need the inputs)."""
  dispatch.check_impl(layer.impl)
  _check_positive_int("num_heads", layer.num_heads, optional=False)
  for name in ("num_kv_heads", "head_dim", "head_dim_v", "out_features", "qkv_features"):
    _check_positive_int(name, getattr(layer, name, None), optional=True)
  for name in ("broadcast_dropout", "normalize_qk", "force_fp32_for_softmax"):
    if not isinstance(getattr(layer, name, False), bool):
      raise TypeError(f"{name} must be a bool; got {getattr(layer, name)!r}")
  deterministic = getattr(layer, "deterministic", None)
  if deterministic is not None and not isinstance(deterministic, bool):
    raise TypeError(f"deterministic must be a bool or None; got {deterministic!r}")
  if layer.num_kv_heads is not None and layer.num_heads % layer.num_kv_heads:
    raise ValueError(f"num_heads ({layer.num_heads}) must be a multiple of num_kv_heads "
                     f"({layer.num_kv_heads})")
  if not isinstance(layer.causal, bool):
    raise TypeError(f"causal must be a bool; got {layer.causal!r}")
  rate = layer.dropout_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
    raise ValueError(f"dropout_rate must be a float in [0, 1); got {rate!r}")
  _check_alibi(layer.alibi, layer.num_heads)
  if not isinstance(getattr(layer, "use_sinks", False), bool):
    raise TypeError(f"use_sinks must be a bool; got {layer.use_sinks!r}")
  for name in ("mask_mod", "score_mod"):
    fn = getattr(layer, name, None)
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be a callable (contract/mods.py) or None; got {type(fn).__name__}")
  dispatch.normalize_precision(layer.precision)
  rotary.check_theta(getattr(layer, "rope_theta", None))
  if not isinstance(getattr(layer, "decode", False), bool):
    raise TypeError(f"decode must be a bool; got {layer.decode!r}")
  decoding.check_cache_layout(getattr(layer, "cache_layout", "flax"))
  if getattr(layer, "decode", False) and getattr(layer, "global_tokens", 0):
    raise ValueError("decode=True with global_tokens is not supported: a document's global tokens are "
                     "found from the segment ids of the whole sequence, which a decoding call does not see")


def _check_alibi(alibi, num_heads: int) -> None:
  if alibi is None or isinstance(alibi, bool):
    return
  slopes = np.asarray(alibi)
  if slopes.shape != (num_heads,) or not np.issubdtype(slopes.dtype, np.floating):
    raise ValueError(f"alibi must be a bool or float slopes [num_heads]=({num_heads},); "
                     f"got {slopes.dtype}{slopes.shape}")


def alibi_slopes(layer) -> jax.Array | None:
  """The slopes `fl.attention` gets: None, the standard ones (alibi=True) or the layer's own."""
  if layer.alibi is None or layer.alibi is False:
    return None
  if layer.alibi is True:
    return alibi.alibi_slopes(layer.num_heads)
  return jnp.asarray(layer.alibi, jnp.float32)


@dataclasses.dataclass(frozen=True)
class HeadDims:
  """The resolved sizes of one layer call."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  head_dim_v: int
  out_features: int


def head_dims(layer, inputs_q, inputs_kv) -> HeadDims:
  """Resolve the defaults (num_kv_heads = num_heads, head_dim = features // num_heads, ...)."""
  for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
    if not hasattr(x, "shape") or x.ndim != 3:
      raise ValueError(f"{name} must have shape [batch, length, features]; "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  if inputs_q.shape[0] != inputs_kv.shape[0]:
    raise ValueError(f"inputs_q and inputs_kv batch sizes differ: {inputs_q.shape[0]} vs "
                     f"{inputs_kv.shape[0]}")
  return resolve_dims(layer, inputs_q.shape[-1])


def resolve_dims(layer, features: int) -> HeadDims:
  """head_dims for query inputs of `features` features (the NNX layer knows them at construction)."""
  head_dim = layer.head_dim
  qkv_features = getattr(layer, "qkv_features", None)
  if qkv_features is not None:  # flax's field: the width of the q/k/v projections, all heads together
    if qkv_features % layer.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be a multiple of num_heads ({layer.num_heads})")
    if head_dim is not None and head_dim * layer.num_heads != qkv_features:
      raise ValueError(f"head_dim ({head_dim}) and qkv_features ({qkv_features}) disagree: qkv_features is "
                       "num_heads * head_dim; give one of them")
    head_dim = qkv_features // layer.num_heads
  if head_dim is None:
    if features % layer.num_heads:
      raise ValueError(f"features of inputs_q ({features}) must be a multiple of num_heads "
                       f"({layer.num_heads}) when head_dim is not given")
    head_dim = features // layer.num_heads
  return HeadDims(
      num_heads=layer.num_heads,
      num_kv_heads=layer.num_kv_heads or layer.num_heads,
      head_dim=head_dim,
      head_dim_v=layer.head_dim_v or head_dim,
      out_features=layer.out_features or features)


def needs_dropout_rng(layer, deterministic: bool) -> bool:
  return bool(layer.dropout_rate) and not deterministic


def resolve_deterministic(layer, deterministic: bool | None) -> bool:
  """The call's `deterministic`, else the layer's field, else True (no dropout), as flax's merge."""
  if deterministic is not None:
    return bool(deterministic)
  field = getattr(layer, "deterministic", None)
  return True if field is None else field


def check_decode_inputs(decode: bool, inputs_q, inputs_kv) -> None:
  """A decoding call appends one key and value per query: their inputs must have the queries' length."""
  if decode and inputs_kv.shape[-2] != inputs_q.shape[-2]:
    raise ValueError(f"decode=True appends a key and value per query to the cache: the keys' inputs must "
                     f"have the queries' length {inputs_q.shape[-2]}; got {inputs_kv.shape[-2]}")


def key_value_inputs(inputs_q, inputs_kv, inputs_k, inputs_v):
  """(inputs of the keys, inputs of the values, self-attention?) from flax's call arguments:
  `inputs_kv` (positional, or flax's `inputs_k`) defaults to inputs_q, `inputs_v` to the keys' inputs."""
  if inputs_k is not None:
    if inputs_kv is not None:
      raise ValueError("give the keys' inputs once: as the second positional argument (inputs_kv) or as "
                       "inputs_k=")
    inputs_kv = inputs_k
  self_attention = inputs_kv is None and inputs_v is None
  inputs_kv = inputs_q if inputs_kv is None else inputs_kv
  if inputs_v is None:
    return inputs_kv, inputs_kv, self_attention
  shape = getattr(inputs_v, "shape", None)
  if shape is None or tuple(shape[:-1]) != tuple(inputs_kv.shape[:-1]):
    raise ValueError(f"inputs_v must have shape [batch..., kv_len, features] with the keys' batch dims and "
                     f"length {tuple(inputs_kv.shape[:-1])}; got {shape or type(inputs_v).__name__}")
  return inputs_kv, inputs_v, self_attention


def flatten_batch_dims(inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids, positions, kv_positions,
                       mask):
  """flax's layouts, [batch..., length, features] with any number of batch dims (none too), as the
  layers' one batch axis: (batch_shape, then every argument flattened). The output is reshaped back
  to batch_shape by the caller."""
  if not hasattr(inputs_q, "ndim") or inputs_q.ndim < 2:
    raise ValueError("inputs_q must have shape [batch..., length, features]; got "
                     f"{getattr(inputs_q, 'shape', type(inputs_q).__name__)}")
  batch_shape = tuple(inputs_q.shape[:-2])
  if len(batch_shape) == 1:
    return batch_shape, (inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids, positions, kv_positions,
                         mask)
  n = len(batch_shape)

  def rows(x, trailing: int):  # [batch..., *trailing axes] -> [batch, *trailing axes]
    if x is None:
      return None
    x = jnp.asarray(x)
    if x.ndim != n + trailing:
      raise ValueError(f"an argument of shape {tuple(x.shape)} does not have the batch dims {batch_shape} of "
                       "inputs_q")
    return _flatten_batch(x, batch_shape)

  flat = (rows(inputs_q, 2), rows(inputs_kv, 2), rows(inputs_v, 2), rows(segment_ids, 1),
          rows(kv_segment_ids, 1), rows(positions, 1), rows(kv_positions, 1),
          None if mask is None else _flatten_logits_operand(mask, batch_shape))
  return batch_shape, flat


def attention_weights(layer, batch_shape, query, key, value, segment_ids, kv_segment_ids, dropout_rng=None,
                      sinks=None, mod_operands=None, mask=None) -> jax.Array:
  """The probabilities [batch..., heads, q_len, kv_len] of the call `attend_heads` makes, for flax's
  `sow_weights`: served when that call runs an impl that materialises them (SOWS_WEIGHTS), unsharded.
  Their dtype is flax's: float32 with force_fp32_for_softmax, else the queries'."""
  options = _options(layer, segment_ids, kv_segment_ids, dropout_rng, mod_operands, None, 0, 0, mask)
  weights = _weights(query, key, value, layer.impl, getattr(layer, "mesh", None), sinks, options)
  weights = weights.astype(jnp.float32 if getattr(layer, "force_fp32_for_softmax", False) else query.dtype)
  return weights.reshape(tuple(batch_shape) + weights.shape[1:])


def _weights(query, key, value, impl: str, mesh, sinks, options: dict) -> jax.Array:
  """The probabilities [batch, heads, q_len, kv_len] of `api.run(query, key, value, impl=impl, **options)`."""
  if sharded.resolve_mesh(mesh) is not None:
    raise UnsupportedError("sow_weights on a mesh: the probabilities are not gathered; call without a mesh")
  request, args = dispatch.prepare(query, key, value, **options)
  name = dispatch.choose(impl, request, lowering.default_platform())[0]
  if name not in SOWS_WEIGHTS:
    raise UnsupportedError(f"sow_weights with impl {name!r}, which never materialises the attention "
                           f"probabilities; use impl= one of {SOWS_WEIGHTS}")
  return reference_impl.weights(query, key, request=request, args=args, sinks=sinks)


def rotate_heads(layer, query, key, positions, kv_positions, self_attention: bool):
  """The rotary embeddings of query/key [batch, len, heads, dim] when layer.rope_theta is set.

  positions [batch, q_len] / kv_positions [batch, kv_len]: None for 0, 1, ...; kv_positions
  default to positions in self-attention. Without rope_theta, positions are an error (they would
  be ignored).
  """
  theta = getattr(layer, "rope_theta", None)
  if theta is None:
    if positions is not None or kv_positions is not None:
      raise ValueError("positions / kv_positions are used by the rotary embeddings only; set rope_theta")
    return query, key
  if self_attention and kv_positions is None:
    kv_positions = positions

  def rotate(x, positions, name):
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    elif tuple(positions.shape) != tuple(x.shape[:2]):
      raise ValueError(f"{name} must have shape [batch, len] = {tuple(x.shape[:2])}; got "
                       f"{tuple(positions.shape)}")
    return rotary.apply_rotary(x, positions, theta)

  return rotate(query, positions, "positions"), rotate(key, kv_positions, "kv_positions")


def attend_heads(layer, query, key, value, segment_ids, kv_segment_ids, dropout_rng=None, sinks=None,
                 mod_operands=None, block_mask=None, q_offset=0, kv_offset=0, mask=None):
  """`fl.attention` with the layer's attention fields; dropout applies when given a key; `sinks`:
  the layer's sink logits [num_heads] (use_sinks) or None; `mod_operands`: the call's, for the
  layer's mask_mod / score_mod; `block_mask`: a prebuilt `fl.block_mask` of that mask_mod;
  q_offset / kv_offset: positions of the first query and key (a decoding call's cache index);
  `mask`: flax's boolean mask, broadcastable to [batch, heads, q_len, kv_len] (True: attend)."""
  return api.run(query, key, value, impl=layer.impl, mesh=getattr(layer, "mesh", None), sinks=sinks,
                 **_options(layer, segment_ids, kv_segment_ids, dropout_rng, mod_operands, block_mask,
                            q_offset, kv_offset, mask))


def _options(layer, segment_ids, kv_segment_ids, dropout_rng, mod_operands, block_mask, q_offset, kv_offset,
             mask):
  """`dispatch.prepare`'s keywords for a layer's call."""
  return dict(causal=layer.causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
              window=layer.window,
              global_tokens=getattr(layer, "global_tokens", 0), scale=layer.scale, softcap=layer.softcap,
              dropout_rate=layer.dropout_rate if dropout_rng is not None else 0.0, dropout_rng=dropout_rng,
              dropout_broadcast=getattr(layer, "broadcast_dropout", False), alibi_slopes=alibi_slopes(layer),
              precision=layer.precision, block_sizes=layer.block_sizes, mask_mod=layer.mask_mod,
              score_mod=layer.score_mod, mod_operands=mod_operands, block_mask=block_mask, q_offset=q_offset,
              kv_offset=kv_offset, dense_mask=mask)


def decode_step(layer, cache: dict, query, key, value, segment_ids, kv_segment_ids, dropout_rng, sinks,
                mod_operands, block_mask, mask):
  """A decoding call of a layer with decode=True (flash_layers/decoding.py): (output, new cache)."""
  if kv_segment_ids is not None or block_mask is not None:
    raise ValueError("a decoding call takes segment_ids for its new tokens only (the cache keeps the "
                     "keys' ids); kv_segment_ids and block_mask are not accepted")
  if mask is not None:
    raise ValueError("a decoding call takes no dense mask (the cache's positions and segment ids mask it)")
  batch, length = query.shape[:2]
  segment_ids = decoding.check_segment_ids(segment_ids, batch, length)
  ring = decoding.is_ring(layer, cache["cached_segment_ids"].shape[1])

  def attend(q, k, v, seg, kv_seg, q_offset, kv_offset):
    return attend_heads(layer, q, k, v, seg, kv_seg, dropout_rng, sinks, mod_operands, None, q_offset,
                        kv_offset)

  return decoding.step(cache, query, key, value, segment_ids, ring=ring, attend=attend,
                       cache_layout=layer.cache_layout)


# ----------------------------------------------------------------------------
# The Flax layer
# ----------------------------------------------------------------------------

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

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    contract_shape = x.shape[x.ndim - self.num_contract:]
    flat = (math.prod(contract_shape), math.prod(self.features))

    def kernel_init(key, shape, dtype):
      return jnp.reshape(self.kernel_init(key, flat, dtype), shape)

    def bias_init(key, shape, dtype):
      return jnp.reshape(self.bias_init(key, (flat[1],), dtype), shape)

    kernel = self.param("kernel", nn.with_logical_partitioning(kernel_init, self.kernel_axes),
                        contract_shape + self.features, self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(bias_init, self.bias_axes),
                        self.features, self.param_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    contract = (tuple(range(x.ndim - self.num_contract, x.ndim)), tuple(range(self.num_contract)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())), precision=self.precision)
    return y if bias is None else y + bias


class MultiHeadAttention(nn.Module):
  """Multi-head attention (MHA, GQA, MQA) whose attention is `fl.attention`.

  Parameters mirror `flax.linen.MultiHeadDotProductAttention`: `query`, `key` and
  `value` kernels `[embed, heads, head_dim]` (kv: `kv_heads`; value: `head_dim_v`),
  biases `[heads, head_dim]`, `out` kernel `[heads, head_dim_v, out_features]`,
  bias `[out_features]`. They are boxed with the logical axis names "embed",
  "heads", "kv_heads" and "head_dim" (`nn.get_partition_spec` reads them;
  `nn.meta.unbox` strips them).

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
      instead (flash_layers/decoding.py). Self-attention only.
    cache_layout: "flax" (`cached_key`/`cached_value` [batch, slots, kv_heads, head_dim], flax's) or
      "heads_first" ([batch, kv_heads, slots, head_dim]: what flash_pallas's decode kernel reads on a
      TPU without copying the cache each step; docs/kernels.md).
    qkv_features, broadcast_dropout, deterministic, normalize_qk, out_kernel_init, out_bias_init: flax's
      `MultiHeadDotProductAttention` fields: the q/k/v projections' total width (num_heads * head_dim);
      one dropout mask for every batch row and head (default False here, True in flax); the default of
      the call's `deterministic` (None: True); LayerNorms "query_ln"/"key_ln" (no bias) on each head of
      the projected queries and keys; the out projection's initializers (None: kernel_init, bias_init).
    force_fp32_for_softmax: the softmax is float32 in every impl whatever it says; it sets the dtype of
      sown weights as in flax (float32, else the computation dtype).
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  head_dim_v: int | None = None
  out_features: int | None = None
  impl: str = dispatch.AUTO
  causal: bool = False
  window: int | tuple[int, int] | None = None
  global_tokens: int = 0
  softcap: float | None = None
  scale: float | None = None
  block_sizes: Any = None
  rope_theta: float | None = None
  mesh: Any = None
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
  # flax's MultiHeadDotProductAttention fields, with flax's meaning:
  qkv_features: int | None = None
  broadcast_dropout: bool = False
  deterministic: bool | None = None
  normalize_qk: bool = False
  out_kernel_init: Callable | None = None
  out_bias_init: Callable | None = None
  force_fp32_for_softmax: bool = False

  def __post_init__(self):
    check_fields(self)
    super().__post_init__()

  def _dense(self, name: str, features, axis, kernel_axes, bias_axes) -> _Projection:
    out = name == "out"
    return _Projection(
        features=tuple(features) if isinstance(features, tuple) else (features,),
        num_contract=len(axis) if isinstance(axis, tuple) else 1, kernel_axes=kernel_axes,
        bias_axes=bias_axes, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        kernel_init=(out and self.out_kernel_init) or self.kernel_init,
        bias_init=(out and self.out_bias_init) or self.bias_init, name=name)

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, inputs_k: jax.Array | None = None,
               segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool | None = None, mod_operands: tuple | None = None,
               block_mask: Any = None, mask: jax.Array | None = None, dropout_rng: jax.Array | None = None,
               sow_weights: bool = False) -> jax.Array:
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
    intermediates/attention_weights; for impls in SOWS_WEIGHTS, UnsupportedError otherwise).
    Returns [batch, q_len, out_features].
    """
    inputs_kv, inputs_v, self_attention = key_value_inputs(inputs_q, inputs_kv, inputs_k, inputs_v)
    batch_shape, flat = flatten_batch_dims(inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids,
                                         positions, kv_positions, mask)
    inputs_q, inputs_kv, inputs_v, segment_ids, kv_segment_ids, positions, kv_positions, mask = flat
    dims = head_dims(self, inputs_q, inputs_kv)
    check_decode_inputs(self.decode, inputs_q, inputs_kv)
    decoding_now = self.decode and self.has_variable("cache", "cached_key")
    if self.decode and not decoding_now:  # the init call: an empty cache sized by this input
      batch, length = inputs_q.shape[:2]
      layout = decoding.layout(self, length)
      for name, value in decoding.init_values(batch, layout, dims.num_kv_heads, dims.head_dim,
                                              dims.head_dim_v, self.dtype or inputs_q.dtype,
                                              self.cache_layout).items():
        self.variable("cache", name, lambda value=value: value)
    if decoding_now and self.rope_theta is not None:
      positions, kv_positions = decoding.rotary_positions(self.get_variable("cache", "cache_index"),
                                                          *inputs_q.shape[:2], positions, kv_positions)
    query = self._dense("query", (dims.num_heads, dims.head_dim), -1,
                        QUERY_KERNEL_AXES, QUERY_KERNEL_AXES[1:])(inputs_q)
    key = self._dense("key", (dims.num_kv_heads, dims.head_dim), -1,
                      KV_KERNEL_AXES, KV_KERNEL_AXES[1:])(inputs_kv)
    value = self._dense("value", (dims.num_kv_heads, dims.head_dim_v), -1,
                        KV_KERNEL_AXES, KV_KERNEL_AXES[1:])(inputs_v)
    if self.normalize_qk:  # flax's names and LayerNorm: no bias, over each head's features
      norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
      query, key = norm(name="query_ln")(query), norm(name="key_ln")(key)
    query, key = rotate_heads(self, query, key, positions, kv_positions, self_attention)
    deterministic = resolve_deterministic(self, deterministic)
    if not needs_dropout_rng(self, deterministic):
      dropout_rng = None
    elif dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    sinks = (self.param("sinks", self.sinks_init, (dims.num_heads,), jnp.float32) if self.use_sinks
             else None)
    if sow_weights:
      self.sow("intermediates", "attention_weights",
               attention_weights(self, batch_shape, query, key, value, segment_ids, kv_segment_ids,
                                 dropout_rng, sinks, mod_operands, mask))
    if decoding_now:
      cache = {name: self.get_variable("cache", name) for name in decoding.CACHE_NAMES}
      out, cache = decode_step(self, cache, query, key, value, segment_ids, kv_segment_ids, dropout_rng,
                               sinks, mod_operands, block_mask, mask)
      for name, value in cache.items():
        self.put_variable("cache", name, value)
    else:
      out = attend_heads(self, query, key, value, segment_ids, kv_segment_ids, dropout_rng, sinks,
                         mod_operands, block_mask, mask=mask)
    out = self._dense("out", dims.out_features, (-2, -1), OUT_KERNEL_AXES, OUT_BIAS_AXES)(out)
    return out.reshape(batch_shape + out.shape[1:])


class MultiHeadDotProductAttention(MultiHeadAttention):
  """`MultiHeadAttention` under flax's class name. Swapped in for `nn.MultiHeadDotProductAttention`, it keeps
  a model's auto-named parameter paths (`MultiHeadDotProductAttention_0`, ...), so its checkpoints load."""


# ----------------------------------------------------------------------------
# attention_fn: flash_layers inside flax's own attention modules
# ----------------------------------------------------------------------------

_FIXED_KWARGS = ("causal", "window", "scale", "softcap", "block_sizes", "mesh", "mask_mod", "score_mod",
                 "mod_operands")
# Keywords flax passes that change nothing here: our softmax is always float32 and
# dtype promotion is done below.
_HARMLESS_EXTRA = ("promote_dtype", "force_fp32_for_softmax")
# Keywords that ask for custom einsums (e.g. quantization); fine while None.
_EINSUM_EXTRA = ("qk_attn_weights_einsum", "attn_weights_value_einsum", "einsum_dot_general", "einsum")


def _flatten_batch(x, batch_shape):
  """[batch..., rest...] -> [batch, rest...] (x has len(batch_shape) leading axes)."""
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def _flatten_logits_operand(x, batch_shape):
  """A mask or bias [batch...|1, heads|1, q_len, kv_len] -> [batch|1, heads|1, q_len, kv_len].

  One shared over every batch dim stays shared (not broadcast to the batch).
  """
  x = jnp.asarray(x)
  if x.ndim < 3:
    x = x.reshape((1,) * (3 - x.ndim) + x.shape)
  lead = x.shape[:-3]
  if math.prod(lead) == 1:
    return x.reshape((1,) + x.shape[-3:])
  return _flatten_batch(jnp.broadcast_to(x, batch_shape + x.shape[-3:]), batch_shape)


def _sow(module, weights) -> None:
  """Sow attention weights into a flax module as flax's own attention does (linen or nnx)."""
  if isinstance(module, flax_nnx.Module):
    module.sow(flax_nnx.Intermediate, "attention_weights", weights)
  else:
    module.sow("intermediates", "attention_weights", weights)


def attention_fn(impl: str = dispatch.AUTO, **fixed_kwargs: Any) -> Callable[..., jax.Array]:
  """An `attention_fn` for `flax.linen.MultiHeadDotProductAttention` / `flax.nnx.MultiHeadAttention`.

      layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=fl.attention_fn(impl="xla_chunked"))

  Args:
    impl: one of `fl.IMPLS` or "auto".
    **fixed_kwargs: `fl.attention` options applied to every call: causal, window,
      scale, softcap, block_sizes, mesh, mask_mod, score_mod, mod_operands (the mods' `b` is
      the index in the batch dims flattened to one).

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
  dispatch.check_impl(impl)
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
    query, key, value = dispatch.as_qkv(query, key, value)
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    q, k, v = (_flatten_batch(x, batch_shape) for x in (query, key, value))
    if mask is not None:
      mask = _flatten_logits_operand(mask, batch_shape)
    if bias is not None:
      bias = _flatten_logits_operand(bias, batch_shape)
    options = {**fixed_kwargs, "causal": causal, "dense_mask": mask, "bias": bias, "precision": precision,
               **dropout_kwargs}
    mesh = options.pop("mesh", None)
    if module is not None:
      weights = _weights(q, k, v, impl, mesh, None, options)
      _sow(module, weights.reshape(batch_shape + weights.shape[1:]))
    out = api.run(q, k, v, impl=impl, mesh=mesh, **options)
    return out.reshape(batch_shape + out.shape[1:])

  return fn
