"""ModernBERT (Warner et al. 2024) in flax.linen, its attention `fl.MultiHeadAttention`.

Architecture as Hugging Face transformers' ModernBERT, so its checkpoints load unchanged
(`flash_layers.models.from_pretrained`): token embeddings and a LayerNorm (no position table);
pre-LN blocks (the first block's attention reads the embeddings without a norm) of self-attention
with rotary embeddings on queries and keys, then a GeGLU MLP (act(x W_in) * (x W_gate) W_out);
a final LayerNorm. Layers alternate between global attention and local attention over a sliding
window of `local_attention` tokens (local_attention // 2 on each side, our `window`, so
flash_pallas skips every tile outside the band), each kind with its own rotary base. Norms,
attention, MLP and head projections have biases only where the config's flags ask.

Documents are told apart by segment ids as in `Bert` (1, 2, ... per packed document, 0 for
padding): attention never crosses a document and rotary positions restart at 0 in each one.
The prediction head (dense, activation, LayerNorm) serves both the classifier, over each
document's first token ("cls") or mean ("mean"), and the masked-LM decoder (tied to the token
embeddings). Dropout (`dropout_rate`) follows the embeddings, the GeGLU product and the head;
attention-probability dropout is not supported.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flash_layers.layers.linen import MultiHeadAttention
from flash_layers.models.bert import (
    ACTIVATION_AXES,
    CHUNK_POOLINGS,
    POOLINGS,
    REMAT_POLICIES,
    Encoder,
    check_inputs,
    pool_documents,
    positions_from_segments,
)

# Activations a config may name (transformers' ACT2FN names).
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _init(stddev: float, cutoff: float, axes: tuple):
  """transformers' ModernBERT init: a normal truncated at +-cutoff standard deviations."""
  base = nn.initializers.truncated_normal(stddev, lower=-cutoff, upper=cutoff)
  return nn.with_logical_partitioning(base, axes)


def _constant(value: float, axes: tuple):
  return nn.with_logical_partitioning(nn.initializers.constant(value), axes)


def _layer_norm(eps: float, use_bias: bool, dtype, param_dtype, name: str | None = None) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=eps, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                      scale_init=_constant(1.0, ("embed",)), bias_init=_constant(0.0, ("embed",)), name=name)


class Block(nn.Module):
  """x += Attn(LN(x)) (no LN in the first block); x += MLP(LN(x)), MLP a GeGLU."""

  num_heads: int
  mlp_dim: int
  first: bool
  window: int | None
  rope_theta: float
  impl: str
  context_parallel: str
  norm_eps: float
  norm_bias: bool
  attention_bias: bool
  mlp_bias: bool
  activation: str
  dropout_rate: float
  init_std: float
  out_std: float
  cutoff: float
  dtype: Any
  param_dtype: Any

  def _norm(self, name):
    return _layer_norm(self.norm_eps, self.norm_bias, self.dtype, self.param_dtype, name=name)

  def _dense(self, name, features, axes, std):
    return nn.Dense(features, use_bias=self.mlp_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=_init(std, self.cutoff, axes), bias_init=_constant(0.0, axes[1:]),
                    name=name)

  @nn.compact
  def __call__(self, x, segment_ids, positions, deterministic: bool):
    hidden = x.shape[-1]
    y = x if self.first else self._norm("attention_norm")(x)
    attn = MultiHeadAttention(
        num_heads=self.num_heads, impl=self.impl, window=self.window, rope_theta=self.rope_theta,
        context_parallel=self.context_parallel,
        dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.attention_bias,
        kernel_init=nn.initializers.truncated_normal(self.init_std, lower=-self.cutoff, upper=self.cutoff),
        name="attention")
    x = x + attn(y, segment_ids=segment_ids, positions=positions, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    y = self._norm("mlp_norm")(x)
    act = ACTIVATIONS[self.activation]
    gated = (act(self._dense("mlp_in", self.mlp_dim, ("embed", "mlp"), self.init_std)(y))
             * self._dense("mlp_gate", self.mlp_dim, ("embed", "mlp"), self.init_std)(y))
    gated = nn.Dropout(self.dropout_rate)(gated, deterministic=deterministic)
    x = x + self._dense("mlp_out", hidden, ("mlp", "embed"), self.out_std)(gated)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


class ModernBert(Encoder):
  """ModernBERT encoder with document-classification and masked-LM heads.

  Attributes:
    vocab_size, hidden_size, num_layers, num_heads, mlp_dim (intermediate_size), local_attention,
      global_rope_theta, local_rope_theta, norm_eps, norm_bias, attention_bias, mlp_bias,
      classifier_bias, decoder_bias, initializer_range, initializer_cutoff_factor: as
      transformers' ModernBertConfig.
    layer_types: "full_attention" or "sliding_attention" per layer; None: every
      `global_attn_every_n_layers`-th layer (from layer 0) global, the others local.
    activation: of the MLP (hidden_activation); classifier_activation: of the head. Names in
      ACTIVATIONS.
    max_len: the longest input (rotary embeddings have no table; beyond the pretraining context
      positions extrapolate).
    num_labels: classes of the classification head; None for no head.
    pooling: "cls" (each document's first token) or "mean", then the prediction head.
    impl, context_parallel, dropout_rate, dtype, param_dtype, remat, remat_policy, mlm_head: as `Bert`.
  """

  vocab_size: int
  hidden_size: int = 768
  num_layers: int = 22
  num_heads: int = 12
  mlp_dim: int = 1152
  layer_types: tuple[str, ...] | None = None
  global_attn_every_n_layers: int = 3
  local_attention: int = 128
  global_rope_theta: float = 160_000.0
  local_rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  norm_bias: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  classifier_bias: bool = False
  decoder_bias: bool = True
  activation: str = "gelu"
  classifier_activation: str = "gelu"
  initializer_range: float = 0.02
  initializer_cutoff_factor: float = 2.0
  max_len: int = 8192
  num_labels: int | None = None
  pooling: str = "cls"
  impl: str = "auto"
  context_parallel: str = "auto"
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False
  remat_policy: str = "nothing_saveable"
  mlm_head: bool = False
  chunk_pooling: str = "mean"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim", "max_len",
                 "global_attn_every_n_layers", "local_attention"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
      raise ValueError(f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) times an "
                       "even head size (rotary embeddings rotate feature pairs)")
    if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                         or set(self.layer_types) - set(LAYER_TYPES)):
      raise ValueError(f"layer_types must list one of {LAYER_TYPES} for each of the {self.num_layers} "
                       f"layers; got {self.layer_types!r}")
    for name in ("activation", "classifier_activation"):
      if getattr(self, name) not in ACTIVATIONS:
        raise ValueError(f"{name} must be one of {tuple(ACTIVATIONS)}; got {getattr(self, name)!r}")
    if self.num_labels is not None and (isinstance(self.num_labels, bool) or
                                        not isinstance(self.num_labels, int) or self.num_labels < 1):
      raise ValueError(f"num_labels must be a positive int or None; got {self.num_labels!r}")
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}; got {self.pooling!r}")
    if self.chunk_pooling not in CHUNK_POOLINGS:
      raise ValueError(f"chunk_pooling must be one of {CHUNK_POOLINGS}; got {self.chunk_pooling!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy must be one of {tuple(REMAT_POLICIES)}; got {self.remat_policy!r}")
    if not 0 <= self.dropout_rate < 1:
      raise ValueError(f"dropout_rate must be in [0, 1); got {self.dropout_rate!r}")
    super().__post_init__()

  def resolved_layer_types(self) -> tuple[str, ...]:
    if self.layer_types is not None:
      return tuple(self.layer_types)
    every = self.global_attn_every_n_layers
    return tuple(LAYER_TYPES[0] if i % every == 0 else LAYER_TYPES[1] for i in range(self.num_layers))

  def setup(self):
    cutoff = self.initializer_cutoff_factor
    std = self.initializer_range
    out_std = std / math.sqrt(2.0 * self.num_layers)
    self.tok_embeddings = nn.Embed(self.vocab_size, self.hidden_size, dtype=self.dtype,
                                   param_dtype=self.param_dtype,
                                   embedding_init=_init(std, cutoff, ("vocab", "embed")))
    norm = lambda: _layer_norm(self.norm_eps, self.norm_bias, self.dtype, self.param_dtype)
    self.embeddings_norm = norm()
    block = Block
    if self.remat:
      # Argument 4 (counting self) is `deterministic`, a Python bool.
      block = nn.remat(Block, policy=REMAT_POLICIES[self.remat_policy], static_argnums=(4,))
    layers = []
    for i, kind in enumerate(self.resolved_layer_types()):
      local = kind == "sliding_attention"
      layers.append(block(
          num_heads=self.num_heads, mlp_dim=self.mlp_dim, first=i == 0,
          window=self.local_attention // 2 if local else None,
          rope_theta=self.local_rope_theta if local else self.global_rope_theta, impl=self.impl,
          context_parallel=self.context_parallel,
          norm_eps=self.norm_eps, norm_bias=self.norm_bias, attention_bias=self.attention_bias,
          mlp_bias=self.mlp_bias, activation=self.activation, dropout_rate=self.dropout_rate,
          init_std=std, out_std=out_std, cutoff=cutoff, dtype=self.dtype, param_dtype=self.param_dtype))
    self.layers = layers
    self.final_norm = norm()
    self.dropout = nn.Dropout(self.dropout_rate)
    if self.num_labels is not None or self.mlm_head:
      self.head_dense = nn.Dense(self.hidden_size, use_bias=self.classifier_bias, dtype=self.dtype,
                                 param_dtype=self.param_dtype,
                                 kernel_init=_init(out_std, cutoff, ("embed", None)),
                                 bias_init=_constant(0.0, (None,)))
      self.head_norm = norm()
    if self.num_labels is not None:
      self.classifier = nn.Dense(self.num_labels, dtype=self.dtype, param_dtype=self.param_dtype,
                                 kernel_init=_init(self.hidden_size ** -0.5, cutoff, ("embed", None)),
                                 bias_init=_constant(0.0, (None,)))
      if self.chunk_pooling == "attention":
        self.chunk_score = nn.Dense(1, dtype=self.dtype, param_dtype=self.param_dtype,
                                    kernel_init=_init(self.hidden_size ** -0.5, cutoff, ("embed", None)),
                                    bias_init=_constant(0.0, (None,)))
    if self.mlm_head and self.decoder_bias:
      self.mlm_bias = self.param("mlm_bias", _constant(0.0, ("vocab",)), (self.vocab_size,),
                                 self.param_dtype)

  def encode(self, input_ids: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, token_type_ids: jax.Array | None = None,
             deterministic: bool = True) -> jax.Array:
    """Last hidden states [batch, len, hidden_size] (after the final norm).

    segment_ids: [batch, len], documents 1, 2, ..., padding 0; None = one document per row.
    positions: [batch, len] rotary positions; None = from segment_ids. token_type_ids: must be
    None (ModernBERT has no token types; the argument keeps `Bert`'s signature).
    """
    check_inputs(self.max_len, input_ids, segment_ids, positions, token_type_ids)
    if token_type_ids is not None:
      raise ValueError("token_type_ids: ModernBERT has no token type embeddings; pass None")
    if segment_ids is None:
      segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if positions is None:
      positions = positions_from_segments(segment_ids)
    x = self.embeddings_norm(self.tok_embeddings(input_ids))
    x = self.dropout(x, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    for layer in self.layers:
      x = layer(x, segment_ids, positions, deterministic)
    return self.final_norm(x)

  def _head(self, x):
    return self.head_norm(ACTIVATIONS[self.classifier_activation](self.head_dense(x)))

  def pool(self, hidden: jax.Array, segment_ids: jax.Array, max_docs: int) -> jax.Array:
    """One vector per document through the prediction head: [batch, max_docs, hidden_size]
    (zeros for absent documents)."""
    pooled, present = pool_documents(hidden, segment_ids, max_docs, self.pooling)
    return jnp.where(present, self._head(pooled), 0)

  def token_head(self, hidden: jax.Array) -> jax.Array:
    """ModernBERT's token classifier reads each token through the prediction head (dense, act, norm)."""
    return self._head(hidden)

  def mlm_hidden(self, hidden: jax.Array) -> jax.Array:
    """`mlm` from the encoder's output."""
    logits = self.tok_embeddings.attend(self._head(hidden))
    if self.decoder_bias:
      logits = logits + self.mlm_bias
    return logits.astype(jnp.float32)

