"""The framework-neutral core of the attention layers: what the linen, NNX and Haiku layers and
`attention_fn` share, none of it tied to a module system.

A layer hands its attention fields to this module as one `AttentionFields` (a frozen dataclass,
built by `AttentionFields.of(layer)`), not as itself: the functions here read named fields with
their defaults, so a field one framework lacks (Haiku has no `deterministic`) is the dataclass's
default instead of a `getattr` fallback scattered through the code. This module imports no flax
(flash_layers/layers/haiku.py builds on it; tests/test_layers_package.py checks the imports).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import api, auto, lowering, validate
from flash_layers.contract import alibi as alibi_lib
from flash_layers.impls import UnsupportedError, registry
from flash_layers.impls import reference as reference_impl
from flash_layers.layers import kv_cache, paged_cache, rotary
from flash_layers.parallel import sharded

# Logical axis names of the parameters; sharding rules map them to mesh axes.
QUERY_KERNEL_AXES = ("embed", "heads", "head_dim")
KV_KERNEL_AXES = ("embed", "kv_heads", "head_dim")
OUT_KERNEL_AXES = ("heads", "head_dim", "embed")
OUT_BIAS_AXES = ("embed",)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionFields:
  """The fields of a layer that decide its attention (not its projections' initializers or dtypes).

  Defaults are the linen layer's; a framework without a field (Haiku: no `qkv_features`,
  `deterministic`, `decode`, ...) gets the default. eq=False: `alibi` may be an array.
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  head_dim_v: int | None = None
  out_features: int | None = None
  qkv_features: int | None = None
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
  precision: Any = None
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False
  deterministic: bool | None = None
  normalize_qk: bool = False
  force_fp32_for_softmax: bool = False
  alibi: Any = False
  use_sinks: bool = False
  mask_mod: Any = None
  score_mod: Any = None
  decode: bool = False
  cache_layout: str = "flax"
  cache: str = "contiguous"
  num_pages: int | None = None
  page_size: int | None = None
  kv_cache_dtype: str | None = None

  @classmethod
  def of(cls, layer: Any) -> AttentionFields:
    """The fields of a layer object (linen, NNX or Haiku): each attribute it has by a field's name.

    The one place a layer is read by name; everything else in this module takes the dataclass.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{name: getattr(layer, name) for name in names if hasattr(layer, name)})


# ----------------------------------------------------------------------------
# Field checks and head sizes
# ----------------------------------------------------------------------------

def _check_positive_int(name: str, value, *, optional: bool):
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}; got {value!r}")


def check_fields(fields: AttentionFields) -> None:
  """Validate a layer's fields at construction (everything that does not need the inputs)."""
  validate.check_impl(fields.impl)
  _check_positive_int("num_heads", fields.num_heads, optional=False)
  for name in ("num_kv_heads", "head_dim", "head_dim_v", "out_features", "qkv_features"):
    _check_positive_int(name, getattr(fields, name), optional=True)
  _check_bool(fields, "broadcast_dropout", "normalize_qk", "force_fp32_for_softmax")
  if fields.deterministic is not None and not isinstance(fields.deterministic, bool):
    raise TypeError(f"deterministic must be a bool or None; got {fields.deterministic!r}")
  if fields.num_kv_heads is not None and fields.num_heads % fields.num_kv_heads:
    raise ValueError(f"num_heads ({fields.num_heads}) must be a multiple of num_kv_heads "
                     f"({fields.num_kv_heads})")
  _check_bool(fields, "causal")
  rate = fields.dropout_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
    raise ValueError(f"dropout_rate must be a float in [0, 1); got {rate!r}")
  _check_alibi(fields.alibi, fields.num_heads)
  _check_bool(fields, "use_sinks")
  for name in ("mask_mod", "score_mod"):
    fn = getattr(fields, name)
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be a callable (contract/mods.py) or None; got {type(fn).__name__}")
  validate.normalize_precision(fields.precision)
  rotary.check_theta(fields.rope_theta)
  _check_bool(fields, "decode")
  kv_cache.check_cache_layout(fields.cache_layout)
  paged_cache.check_fields(fields)
  if fields.decode and fields.global_tokens:
    raise ValueError("decode=True with global_tokens is not supported: a document's global tokens are "
                     "found from the segment ids of the whole sequence, which a decoding call does not see")


def _check_bool(fields: AttentionFields, *names: str) -> None:
  for name in names:
    if not isinstance(getattr(fields, name), bool):
      raise TypeError(f"{name} must be a bool; got {getattr(fields, name)!r}")


def _check_alibi(alibi, num_heads: int) -> None:
  if alibi is None or isinstance(alibi, bool):
    return
  slopes = np.asarray(alibi)
  if slopes.shape != (num_heads,) or not np.issubdtype(slopes.dtype, np.floating):
    raise ValueError(f"alibi must be a bool or float slopes [num_heads]=({num_heads},); "
                     f"got {slopes.dtype}{slopes.shape}")


def alibi_slopes(fields: AttentionFields) -> jax.Array | None:
  """The slopes `fl.attention` gets: None, the standard ones (alibi=True) or the layer's own."""
  if fields.alibi is None or fields.alibi is False:
    return None
  if fields.alibi is True:
    return alibi_lib.alibi_slopes(fields.num_heads)
  return jnp.asarray(fields.alibi, jnp.float32)


@dataclasses.dataclass(frozen=True)
class HeadDims:
  """The resolved sizes of one layer call."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  head_dim_v: int
  out_features: int


def head_dims(fields: AttentionFields, inputs_q, inputs_kv) -> HeadDims:
  """Resolve the defaults (num_kv_heads = num_heads, head_dim = features // num_heads, ...)."""
  for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
    if not hasattr(x, "shape") or x.ndim != 3:
      raise ValueError(f"{name} must have shape [batch, length, features]; "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  if inputs_q.shape[0] != inputs_kv.shape[0]:
    raise ValueError(f"inputs_q and inputs_kv batch sizes differ: {inputs_q.shape[0]} vs "
                     f"{inputs_kv.shape[0]}")
  return resolve_dims(fields, inputs_q.shape[-1])


def resolve_dims(fields: AttentionFields, features: int) -> HeadDims:
  """head_dims for query inputs of `features` features (the NNX layer knows them at construction)."""
  head_dim = fields.head_dim
  qkv_features = fields.qkv_features
  if qkv_features is not None:  # flax's field: the width of the q/k/v projections, all heads together
    if qkv_features % fields.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be a multiple of num_heads ({fields.num_heads})")
    if head_dim is not None and head_dim * fields.num_heads != qkv_features:
      raise ValueError(f"head_dim ({head_dim}) and qkv_features ({qkv_features}) disagree: qkv_features is "
                       "num_heads * head_dim; give one of them")
    head_dim = qkv_features // fields.num_heads
  if head_dim is None:
    if features % fields.num_heads:
      raise ValueError(f"features of inputs_q ({features}) must be a multiple of num_heads "
                       f"({fields.num_heads}) when head_dim is not given")
    head_dim = features // fields.num_heads
  return HeadDims(
      num_heads=fields.num_heads,
      num_kv_heads=fields.num_kv_heads or fields.num_heads,
      head_dim=head_dim,
      head_dim_v=fields.head_dim_v or head_dim,
      out_features=fields.out_features or features)


def needs_dropout_rng(fields: AttentionFields, deterministic: bool) -> bool:
  return bool(fields.dropout_rate) and not deterministic


def resolve_deterministic(fields: AttentionFields, deterministic: bool | None) -> bool:
  """The call's `deterministic`, else the layer's field, else True (no dropout), as flax's merge."""
  if deterministic is not None:
    return bool(deterministic)
  field = fields.deterministic
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
    return flatten_batch(x, batch_shape)

  flat = (rows(inputs_q, 2), rows(inputs_kv, 2), rows(inputs_v, 2), rows(segment_ids, 1),
          rows(kv_segment_ids, 1), rows(positions, 1), rows(kv_positions, 1),
          None if mask is None else flatten_logits_operand(mask, batch_shape))
  return batch_shape, flat


def attention_weights(fields: AttentionFields, batch_shape, query, key, value, segment_ids, kv_segment_ids,
                      dropout_rng=None, sinks=None, mod_operands=None, mask=None) -> jax.Array:
  """The probabilities [batch..., heads, q_len, kv_len] of the call `attend_heads` makes, for flax's
  `sow_weights`: served when that call runs an impl that materialises them (capability
  "sow_weights"), unsharded.
  Their dtype is flax's: float32 with force_fp32_for_softmax, else the queries'."""
  options = _options(fields, segment_ids, kv_segment_ids, dropout_rng, mod_operands, None, 0, 0, mask)
  weights = probabilities(query, key, value, fields.impl, fields.mesh, sinks, options)
  weights = weights.astype(jnp.float32 if fields.force_fp32_for_softmax else query.dtype)
  return weights.reshape(tuple(batch_shape) + weights.shape[1:])


def probabilities(query, key, value, impl: str, mesh, sinks, options: dict) -> jax.Array:
  """The probabilities [batch, heads, q_len, kv_len] of `api.run(query, key, value, impl=impl, **options)`."""
  if sharded.resolve_mesh(mesh) is not None:
    raise UnsupportedError("sow_weights on a mesh: the probabilities are not gathered; call without a mesh")
  sharding = ("context_parallel", "mesh_axes", "mod_operand_axes")  # no mesh here: nothing to split
  options = {k: v for k, v in options.items() if k not in sharding}
  request, args = validate.prepare(query, key, value, **options)
  name = auto.choose(impl, request, lowering.default_platform())[0]
  if not registry.impl_has(name, "sow_weights"):
    raise UnsupportedError(f"sow_weights with impl {name!r}, which never materialises the attention "
                           f"probabilities; use impl= one of {registry.impls_with('sow_weights')}")
  return reference_impl.weights(query, key, request=request, args=args, sinks=sinks)


def rotate_heads(fields: AttentionFields, query, key, positions, kv_positions, self_attention: bool):
  """The rotary embeddings of query/key [batch, len, heads, dim] when fields.rope_theta is set.

  positions [batch, q_len] / kv_positions [batch, kv_len]: None for 0, 1, ...; kv_positions
  default to positions in self-attention. Without rope_theta, positions are an error (they would
  be ignored).
  """
  theta = fields.rope_theta
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


def attend_heads(fields: AttentionFields, query, key, value, segment_ids, kv_segment_ids, dropout_rng=None,
                 sinks=None, mod_operands=None, block_mask=None, q_offset=0, kv_offset=0, mask=None):
  """`fl.attention` with the layer's attention fields; dropout applies when given a key; `sinks`:
  the layer's sink logits [num_heads] (use_sinks) or None; `mod_operands`: the call's, for the
  layer's mask_mod / score_mod; `block_mask`: a prebuilt `fl.block_mask` of that mask_mod;
  q_offset / kv_offset: positions of the first query and key (a decoding call's cache index);
  `mask`: flax's boolean mask, broadcastable to [batch, heads, q_len, kv_len] (True: attend)."""
  return api.run(query, key, value, impl=fields.impl, mesh=fields.mesh, sinks=sinks,
                 context_parallel=fields.context_parallel, mesh_axes=fields.mesh_axes,
                 mod_operand_axes=fields.mod_operand_axes,
                 **_options(fields, segment_ids, kv_segment_ids, dropout_rng, mod_operands, block_mask,
                            q_offset, kv_offset, mask))


def _options(fields: AttentionFields, segment_ids, kv_segment_ids, dropout_rng, mod_operands, block_mask,
             q_offset, kv_offset, mask):
  """`validate.prepare`'s keywords for a layer's call."""
  return dict(causal=fields.causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
              window=fields.window,
              global_tokens=fields.global_tokens, scale=fields.scale, softcap=fields.softcap,
              dropout_rate=fields.dropout_rate if dropout_rng is not None else 0.0, dropout_rng=dropout_rng,
              dropout_broadcast=fields.broadcast_dropout, alibi_slopes=alibi_slopes(fields),
              precision=fields.precision, block_sizes=fields.block_sizes, mask_mod=fields.mask_mod,
              score_mod=fields.score_mod, mod_operands=mod_operands, block_mask=block_mask, q_offset=q_offset,
              kv_offset=kv_offset, dense_mask=mask)


# ----------------------------------------------------------------------------
# Decoding: the glue between a layer and its KV cache (kv_cache.py owns the cache)
# ----------------------------------------------------------------------------

def cache_init_values(fields: AttentionFields, dims: HeadDims, batch: int, max_length: int,
                      dtype) -> dict[str, jax.Array]:
  """The empty cache variables of a layer for inputs of [batch, max_length] tokens: a ring buffer of
  the window for a causal layer with a sliding window, else max_length slots."""
  return kv_cache.init_values(batch, kv_cache.layout(fields, max_length), dims.num_kv_heads, dims.head_dim,
                              dims.head_dim_v, dtype, fields.cache_layout)


def decode_step(fields: AttentionFields, cache: dict, query, key, value, segment_ids, kv_segment_ids,
                dropout_rng, sinks, mod_operands, block_mask, mask):
  """A decoding call of a layer with decode=True (flash_layers/layers/kv_cache.py): (output, new cache)."""
  if kv_segment_ids is not None or block_mask is not None:
    raise ValueError("a decoding call takes segment_ids for its new tokens only (the cache keeps the "
                     "keys' ids); kv_segment_ids and block_mask are not accepted")
  if mask is not None:
    raise ValueError("a decoding call takes no dense mask (the cache's positions and segment ids mask it)")
  batch, length = query.shape[:2]
  segment_ids = kv_cache.check_segment_ids(segment_ids, batch, length)
  ring = kv_cache.is_ring(fields, cache["cached_segment_ids"].shape[1])

  def attend(q, k, v, seg, kv_seg, q_offset, kv_offset):
    return attend_heads(fields, q, k, v, seg, kv_seg, dropout_rng, sinks, mod_operands, None, q_offset,
                        kv_offset)

  return kv_cache.step(cache, query, key, value, segment_ids, ring=ring, attend=attend,
                       cache_layout=fields.cache_layout)


def flatten_batch(x, batch_shape):
  """[batch..., rest...] -> [batch, rest...] (x has len(batch_shape) leading axes)."""
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def flatten_logits_operand(x, batch_shape):
  """A mask or bias [batch...|1, heads|1, q_len, kv_len] -> [batch|1, heads|1, q_len, kv_len].

  One shared over every batch dim stays shared (not broadcast to the batch).
  """
  x = jnp.asarray(x)
  if x.ndim < 3:
    x = x.reshape((1,) * (3 - x.ndim) + x.shape)
  lead = x.shape[:-3]
  if math.prod(lead) == 1:
    return x.reshape((1,) + x.shape[-3:])
  return flatten_batch(jnp.broadcast_to(x, batch_shape + x.shape[-3:]), batch_shape)
