"""A BERT-compatible document encoder in flax.linen whose attention is `fl.MultiHeadAttention`.

Architecture as BERT (Devlin et al. 2019), so Hugging Face BERT, RoBERTa and XLM-RoBERTa
checkpoints load unchanged (`flash_layers.models.from_pretrained`; RoBERTa is BERT whose position
rows start at `position_offset` = padding_idx + 1): word + position + token-type embeddings and a LayerNorm;
post-LN blocks of self-attention and an exact-erf GELU MLP; hidden dropout after the embeddings,
the attention output and the MLP, and attention-probability dropout (BERT's
attention_probs_dropout_prob) inside `fl.attention`, whose mask is the same under every impl.

Documents are told apart by segment ids, [batch, len] ints: 1, 2, ... for the documents packed
into a row and 0 for padding. Attention never crosses a document boundary, positions restart at
0 for each document (derived from the segment ids unless given), and the classifier pools and
predicts per document: logits [batch, max_docs, num_labels], where document d of a row is the
tokens with segment id d + 1.

One `impl` field reaches every attention layer. Parameters carry logical axis names ("vocab",
"embed", "mlp", "heads", "kv_heads", "head_dim"); activations are constrained to
("batch", "length", "embed").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flash_layers.layers.linen import MultiHeadAttention

POOLINGS = ("cls", "mean")
# How a hierarchical document's chunk vectors become one (`Encoder.classify_chunks`).
CHUNK_POOLINGS = ("mean", "max", "attention")
# Compute dtypes a config may name (parameters stay float32).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES: dict[str, Callable | None] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
ACTIVATION_AXES = ("batch", "length", "embed")


def _init(stddev: float, axes: tuple):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev), axes)


def _constant(value: float, axes: tuple):
  return nn.with_logical_partitioning(nn.initializers.constant(value), axes)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
  """Position of each token within its document: 0 where the segment id changes, then counting."""
  length = segment_ids.shape[-1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return index - start_index


def document_mask(segment_ids: jax.Array, max_docs: int) -> jax.Array:
  """[batch, max_docs, len] bool: token l belongs to document d (segment id d + 1)."""
  docs = jnp.arange(1, max_docs + 1, dtype=segment_ids.dtype)
  return segment_ids[:, None, :] == docs[None, :, None]


def pool_documents(hidden: jax.Array, segment_ids: jax.Array, max_docs: int,
                   pooling: str) -> tuple[jax.Array, jax.Array]:
  """(pooled [batch, max_docs, hidden], present [batch, max_docs, 1] bool), before any head.

  "cls": each document's first token; "mean": the mean of its hidden states. Absent documents
  pool to zeros.
  """
  mask = document_mask(segment_ids.astype(jnp.int32), max_docs)
  present = mask.any(axis=-1, keepdims=True)
  if pooling == "mean":
    weights = mask.astype(jnp.float32)
    total = jnp.einsum("bdl,blh->bdh", weights, hidden.astype(jnp.float32))
    pooled = total / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
  else:
    first = jnp.argmax(mask, axis=-1)  # index of each document's first token, its [CLS]
    pooled = jnp.take_along_axis(hidden, first[..., None], axis=1)
  return jnp.where(present, pooled, 0).astype(hidden.dtype), present


def check_inputs(max_len: int, input_ids, segment_ids, positions, token_type_ids) -> None:
  """Shapes and dtypes of an encoder call, with errors naming the argument."""
  if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
    raise ValueError(f"input_ids must be an int array [batch, len]; got {input_ids.dtype}{input_ids.shape}")
  if input_ids.shape[1] > max_len:
    raise ValueError(f"input length {input_ids.shape[1]} exceeds max_len={max_len}; load or build the "
                     "model with a larger max_len")
  for name, x in (("segment_ids", segment_ids), ("positions", positions),
                  ("token_type_ids", token_type_ids)):
    if x is not None and tuple(x.shape) != tuple(input_ids.shape):
      raise ValueError(f"{name} must have the shape of input_ids {tuple(input_ids.shape)}; "
                       f"got {tuple(x.shape)}")


class Block(nn.Module):
  """A post-LN transformer block: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

  num_heads: int
  mlp_dim: int
  impl: str
  context_parallel: str
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_eps: float
  initializer_range: float
  dtype: Any
  param_dtype: Any
  window: int | None = None
  global_tokens: int = 0

  def _norm(self, name):
    return nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype,
                        scale_init=_constant(1.0, ("embed",)), bias_init=_constant(0.0, ("embed",)),
                        name=name)

  def _dense(self, name, features, axes):
    return nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=_init(self.initializer_range, axes),
                    bias_init=_constant(0.0, axes[1:]), name=name)

  @nn.compact
  def __call__(self, x, segment_ids, deterministic: bool):
    hidden = x.shape[-1]
    attn = MultiHeadAttention(num_heads=self.num_heads, impl=self.impl, dtype=self.dtype,
                              context_parallel=self.context_parallel,
                              param_dtype=self.param_dtype, use_bias=True,
                              dropout_rate=self.attention_dropout_rate,
                              kernel_init=nn.initializers.normal(self.initializer_range),
                              window=self.window, global_tokens=self.global_tokens, name="attention")
    y = attn(x, segment_ids=segment_ids, deterministic=deterministic)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    x = self._norm("attention_norm")(x + y)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    y = self._dense("mlp_in", self.mlp_dim, ("embed", "mlp"))(x)
    y = jax.nn.gelu(y, approximate=False)
    y = self._dense("mlp_out", hidden, ("mlp", "embed"))(y)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    x = self._norm("mlp_norm")(x + y)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


class Encoder(nn.Module):
  """The heads' entry points every encoder family shares.

  A subclass provides `encode(input_ids, segment_ids, positions, token_type_ids, deterministic)`,
  `pool(hidden, segment_ids, max_docs)`, `token_head(hidden)` (what its family runs on each token
  before a token classifier), `mlm_hidden(hidden)`, the submodules `dropout` and `classifier`, and the
  fields `num_labels` and `mlm_head`.
  """

  def classify(self, input_ids: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, token_type_ids: jax.Array | None = None, *,
               max_docs: int = 1, deterministic: bool = True) -> jax.Array:
    """Logits [batch, max_docs, num_labels]; document d of a row is segment id d + 1."""
    if self.num_labels is None:
      raise ValueError("this model has no classification head; build it with num_labels=")
    hidden = self.encode(input_ids, segment_ids, positions, token_type_ids, deterministic)
    if segment_ids is None:
      segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    return self.classify_hidden(hidden, segment_ids, max_docs=max_docs, deterministic=deterministic)

  def classify_hidden(self, hidden: jax.Array, segment_ids: jax.Array, *, max_docs: int = 1,
                      deterministic: bool = True) -> jax.Array:
    """`classify` from the encoder's output (e.g. to run several heads on one encoding)."""
    pooled = self.dropout(self.pool(hidden, segment_ids, max_docs), deterministic=deterministic)
    return self.classifier(pooled).astype(jnp.float32)

  def classify_chunks(self, input_ids: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
                      max_chunks: int, deterministic: bool = True) -> jax.Array:
    """Logits [batch, 1, num_labels] of one document per row, read as chunks (hierarchical documents):
    chunk c of a row is segment id c + 1, attends only to itself, and its positions restart at 0.
    Each chunk is pooled as a document is (`pool`), the chunk vectors are combined by
    `chunk_pooling` ("mean" or elementwise "max" over the row's chunks, or "attention": a softmax
    over a learned score of each chunk vector), and the classifier reads the result."""
    if self.num_labels is None:
      raise ValueError("this model has no classification head; build it with num_labels=")
    hidden = self.encode(input_ids, segment_ids, positions, None, deterministic)
    chunks = self.pool(hidden, segment_ids.astype(jnp.int32), max_chunks)
    present = document_mask(segment_ids.astype(jnp.int32), max_chunks).any(-1)  # [batch, chunks]
    document = self.combine_chunks(chunks, present)
    document = self.dropout(document, deterministic=deterministic)
    return self.classifier(document[:, None, :]).astype(jnp.float32)

  def combine_chunks(self, chunks: jax.Array, present: jax.Array) -> jax.Array:
    """[batch, chunks, hidden] and [batch, chunks] bool -> [batch, hidden] (`classify_chunks`)."""
    chunks = chunks.astype(jnp.float32)
    if self.chunk_pooling == "max":
      return jnp.max(jnp.where(present[..., None], chunks, -jnp.inf), axis=1)
    if self.chunk_pooling == "attention":
      scores = jnp.where(present, self.chunk_score(chunks)[..., 0].astype(jnp.float32), -jnp.inf)
      weights = jax.nn.softmax(scores, axis=-1)
    else:
      weights = present / jnp.maximum(present.sum(-1, keepdims=True), 1)
    return jnp.einsum("bc,bch->bh", weights, chunks)

  def tag(self, input_ids: jax.Array, segment_ids: jax.Array | None = None,
          positions: jax.Array | None = None, token_type_ids: jax.Array | None = None, *,
          deterministic: bool = True) -> jax.Array:
    """Per-token logits [batch, len, num_labels] (token classification), in the family's layout as
    transformers' *ForTokenClassification: BERT's classifier reads the hidden states, ModernBERT's
    reads them through its prediction head."""
    if self.num_labels is None:
      raise ValueError("this model has no classification head; build it with num_labels=")
    hidden = self.encode(input_ids, segment_ids, positions, token_type_ids, deterministic)
    return self.tag_hidden(hidden, deterministic=deterministic)

  def tag_hidden(self, hidden: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """`tag` from the encoder's output."""
    x = self.dropout(self.token_head(hidden), deterministic=deterministic)
    return self.classifier(x).astype(jnp.float32)

  def mlm(self, input_ids: jax.Array, segment_ids: jax.Array | None = None,
          positions: jax.Array | None = None, token_type_ids: jax.Array | None = None, *,
          deterministic: bool = True) -> jax.Array:
    """Masked-LM logits [batch, len, vocab_size] (decoder tied to the word embeddings)."""
    if not self.mlm_head:
      raise ValueError("this model has no masked-LM head; build it with mlm_head=True")
    return self.mlm_hidden(self.encode(input_ids, segment_ids, positions, token_type_ids, deterministic))

  def __call__(self, input_ids, segment_ids=None, positions=None, token_type_ids=None, *,
               max_docs: int = 1, deterministic: bool = True):
    return self.classify(input_ids, segment_ids, positions, token_type_ids, max_docs=max_docs,
                         deterministic=deterministic)

  def init_everything(self, input_ids):
    """For `init`: touches every parameter (encoder and whichever heads the model has), encoding once."""
    hidden = self.encode(input_ids)
    outs = [hidden]
    if self.num_labels is not None:
      outs.append(self.classify_hidden(hidden, jnp.ones(input_ids.shape, jnp.int32)))
      if self.chunk_pooling == "attention":
        outs.append(self.chunk_score(hidden))
    if self.mlm_head:
      outs.append(self.mlm_hidden(hidden))
    return outs


class Bert(Encoder):
  """BERT encoder with document-classification and masked-LM heads.

  Attributes:
    vocab_size, hidden_size, num_layers, num_heads, mlp_dim, type_vocab_size, layer_norm_eps,
      initializer_range: as BERT's config (intermediate_size is mlp_dim).
    max_len: the longest input; the learned position table has max_len + position_offset rows.
    position_offset: position p reads row p + position_offset (RoBERTa: padding_idx + 1 = 2; the
      rows below are never read).
    num_labels: classes of the classification head; None for no head.
    pooling: "cls" ([CLS] token of each document through BERT's tanh pooler) or "mean" (mean of
      each document's hidden states, as sentence-transformers).
    impl: attention implementation of every layer: "auto" or one of `fl.IMPLS`.
    context_parallel: every layer's strategy over a mesh's sequence axis (`fl.attention`'s).
    dropout_rate: hidden dropout (BERT's hidden_dropout_prob); active when deterministic=False.
    attention_dropout_rate: attention-probability dropout (BERT's attention_probs_dropout_prob;
      `from_pretrained` sets the checkpoint's); active when deterministic=False. xla_native does
      not serve it ("auto" then picks an impl that does).
    dtype: compute dtype (e.g. jnp.bfloat16); param_dtype: of the parameters.
    remat: rematerialize each block in the backward pass, saving what `remat_policy` (a name in
      REMAT_POLICIES) allows.
    mlm_head: build the masked-LM head (transform + LayerNorm + output bias, decoder tied to the
      word embeddings).
    attention_window: None (full attention) or w: each token sees w // 2 tokens on either side
      (Longformer's and ModernBERT's convention), so flash_pallas skips the tiles outside the band.
    global_tokens: with attention_window, the first g tokens of each document (its [CLS] for
      g = 1) attend and are attended by the whole document (Longformer's global attention).
  """

  vocab_size: int
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_len: int = 512
  position_offset: int = 0
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  initializer_range: float = 0.02
  num_labels: int | None = None
  pooling: str = "cls"
  impl: str = "auto"
  context_parallel: str = "auto"
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False
  remat_policy: str = "nothing_saveable"
  mlm_head: bool = False
  attention_window: int | None = None
  global_tokens: int = 0
  chunk_pooling: str = "mean"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim", "max_len",
                 "type_vocab_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    if isinstance(self.position_offset, bool) or not isinstance(self.position_offset, int) \
        or self.position_offset < 0:
      raise ValueError(f"position_offset must be an int >= 0; got {self.position_offset!r}")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                       f"({self.num_heads})")
    if self.num_labels is not None and (isinstance(self.num_labels, bool) or
                                        not isinstance(self.num_labels, int) or self.num_labels < 1):
      raise ValueError(f"num_labels must be a positive int or None; got {self.num_labels!r}")
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}; got {self.pooling!r}")
    if self.chunk_pooling not in CHUNK_POOLINGS:
      raise ValueError(f"chunk_pooling must be one of {CHUNK_POOLINGS}; got {self.chunk_pooling!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy must be one of {tuple(REMAT_POLICIES)}; got {self.remat_policy!r}")
    for name in ("dropout_rate", "attention_dropout_rate"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"{name} must be in [0, 1); got {getattr(self, name)!r}")
    window = self.attention_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
      raise ValueError(f"attention_window must be None or an int >= 2; got {window!r}")
    if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int) or \
        self.global_tokens < 0 or (self.global_tokens and window is None):
      raise ValueError(f"global_tokens must be an int >= 0, and > 0 only with attention_window; got "
                       f"{self.global_tokens!r} (attention_window={window!r})")
    super().__post_init__()

  def setup(self):
    emb = lambda n, axes, name: nn.Embed(n, self.hidden_size, dtype=self.dtype,
                                         param_dtype=self.param_dtype,
                                         embedding_init=_init(self.initializer_range, axes), name=name)
    self.word_embeddings = emb(self.vocab_size, ("vocab", "embed"), "word_embeddings")
    self.position_embeddings = emb(self.max_len + self.position_offset, (None, "embed"),
                                   "position_embeddings")
    self.token_type_embeddings = emb(self.type_vocab_size, (None, "embed"), "token_type_embeddings")
    self.embeddings_norm = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype,
                                        param_dtype=self.param_dtype,
                                        scale_init=_constant(1.0, ("embed",)),
                                        bias_init=_constant(0.0, ("embed",)))
    block = Block
    if self.remat:
      # Argument 3 (counting self) is `deterministic`, a Python bool.
      block = nn.remat(Block, policy=REMAT_POLICIES[self.remat_policy], static_argnums=(3,))
    self.layers = [block(num_heads=self.num_heads, mlp_dim=self.mlp_dim, impl=self.impl,
                         context_parallel=self.context_parallel,
                         dropout_rate=self.dropout_rate,
                         attention_dropout_rate=self.attention_dropout_rate,
                         layer_norm_eps=self.layer_norm_eps,
                         initializer_range=self.initializer_range, dtype=self.dtype,
                         param_dtype=self.param_dtype, global_tokens=self.global_tokens,
                         window=None if self.attention_window is None else self.attention_window // 2)
                   for _ in range(self.num_layers)]
    self.dropout = nn.Dropout(self.dropout_rate)
    dense = lambda n, axes: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype,
                                     kernel_init=_init(self.initializer_range, axes),
                                     bias_init=_constant(0.0, axes[1:]))
    if self.num_labels is not None:
      if self.pooling == "cls":
        self.pooler = dense(self.hidden_size, ("embed", None))
      self.classifier = dense(self.num_labels, ("embed", None))
      if self.chunk_pooling == "attention":
        self.chunk_score = dense(1, ("embed", None))
    if self.mlm_head:
      self.mlm_transform = dense(self.hidden_size, ("embed", None))
      self.mlm_norm = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype,
                                   param_dtype=self.param_dtype,
                                   scale_init=_constant(1.0, ("embed",)),
                                   bias_init=_constant(0.0, ("embed",)))
      self.mlm_bias = self.param("mlm_bias", _constant(0.0, ("vocab",)), (self.vocab_size,),
                                 self.param_dtype)

  def encode(self, input_ids: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, token_type_ids: jax.Array | None = None,
             deterministic: bool = True) -> jax.Array:
    """Last hidden states [batch, len, hidden_size].

    segment_ids: [batch, len], documents 1, 2, ..., padding 0; None = one document per row, no
      padding. positions: [batch, len]; None = from segment_ids. token_type_ids: None = zeros.
    """
    check_inputs(self.max_len, input_ids, segment_ids, positions, token_type_ids)
    if segment_ids is None:
      segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if positions is None:
      positions = positions_from_segments(segment_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
         + self.token_type_embeddings(token_type_ids))
    x = self.embeddings_norm(x)
    x = self.dropout(x, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    for layer in self.layers:
      x = layer(x, segment_ids, deterministic)
    return x

  def pool(self, hidden: jax.Array, segment_ids: jax.Array, max_docs: int) -> jax.Array:
    """One vector per document: [batch, max_docs, hidden_size] (zeros for absent documents)."""
    pooled, present = pool_documents(hidden, segment_ids, max_docs, self.pooling)
    if self.pooling == "mean":
      return pooled
    return jnp.where(present, jnp.tanh(self.pooler(pooled)), 0)

  def token_head(self, hidden: jax.Array) -> jax.Array:
    """BERT's token classifier reads the hidden states as they are."""
    return hidden

  def mlm_hidden(self, hidden: jax.Array) -> jax.Array:
    """`mlm` from the encoder's output."""
    x = self.mlm_norm(jax.nn.gelu(self.mlm_transform(hidden), approximate=False))
    return (self.word_embeddings.attend(x) + self.mlm_bias).astype(jnp.float32)


def init_params(model: Bert, rng: jax.Array, *, boxed: bool = False):
  """Random parameters for `model` (every head included); `boxed` keeps the logical-axis boxes."""
  variables = model.init(rng, jnp.zeros((1, 8), jnp.int32), method=model.init_everything)
  params = variables["params"]
  return params if boxed else nn.meta.unbox(params)


def param_axes(model: Bert):
  """The parameters' logical axis names, as a tree of `jax.sharding.PartitionSpec` (no compute)."""
  boxed = jax.eval_shape(lambda r: init_params(model, r, boxed=True), jax.random.key(0))
  return nn.get_partition_spec(boxed)
