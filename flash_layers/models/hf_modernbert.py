"""ModernBERT checkpoints in Hugging Face layout -> `ModernBert` fields and tensor names.

Both config formats are read: the original one (global_attn_every_n_layers, global_rope_theta,
local_rope_theta) and transformers 5's (layer_types, rope_parameters per layer type). The fused
projections are split on loading: Wqkv into query / key / value, the GeGLU's Wi into its input
and gate halves (separate params shard cleanly over the "heads" and "mlp" axes).
"""

from __future__ import annotations

from typing import Any

from flash_layers.models.hf_fields import ConfigFields
from flash_layers.models.modernbert import ACTIVATIONS, LAYER_TYPES

MODEL_TYPES = ("modernbert",)
# Tensors under these names belong to the encoder: one the model does not read means a
# mismatch (e.g. biases the config says are absent), which loading refuses.
ENCODER_PREFIXES = ("embeddings.", "layers.", "final_norm.")
UNREAD = ()
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
_LEGACY_THETA = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


def _rope_thetas(fields: ConfigFields) -> dict[str, float]:
  """The rotary base of each layer type; only the default (unscaled) rotary is implemented."""
  fields.choice("rope_scaling", (None,), None, "scaled rotary embeddings are not implemented")
  params = fields.get("rope_parameters", None) or {}
  if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
    fields.fail(f"config field rope_parameters must map {LAYER_TYPES} to their parameters; got {params!r}")
  thetas = {}
  for kind in LAYER_TYPES:
    legacy = fields.number(_LEGACY_THETA[kind], _DEFAULT_THETA[kind])
    entry = params.get(kind) or {}
    unknown = sorted(set(entry) - {"rope_type", "rope_theta"})
    if unknown:
      fields.fail(f"config field rope_parameters.{kind} has unsupported key(s) {unknown}")
    if entry.get("rope_type", "default") != "default":
      fields.fail(f"config field rope_parameters.{kind}.rope_type={entry['rope_type']!r} is not supported "
                  "(supported: 'default')")
    theta = entry.get("rope_theta", legacy)
    if fields.has(_LEGACY_THETA[kind]) and "rope_theta" in entry and theta != legacy:
      fields.fail(f"config fields rope_parameters.{kind}.rope_theta={theta} and "
                  f"{_LEGACY_THETA[kind]}={legacy} disagree")
    thetas[kind] = float(theta)
  return thetas


def _dropout(fields: ConfigFields) -> float:
  """One hidden dropout rate: the embedding, MLP and classifier dropouts must agree."""
  fields.choice("attention_dropout", (0, 0.0), 0.0,
                "dropout on attention probabilities is not supported by flash_layers")
  rates = {name: fields.number(name, 0.0) for name in ("embedding_dropout", "mlp_dropout",
                                                       "classifier_dropout")}
  if len(set(rates.values())) > 1:
    fields.fail(f"config fields {rates} differ; the model has one dropout rate (set them equal, or "
                "override with dropout_rate=)")
  rate = next(iter(rates.values()))
  if not 0 <= rate < 1:
    fields.fail(f"config dropout {rate} must be in [0, 1)")
  return rate


def model_fields(fields: ConfigFields, model_type: str) -> dict[str, Any]:
  """`ModernBert` fields from the config (max_len = max_position_embeddings)."""
  del model_type
  hidden, heads = fields.integer("hidden_size"), fields.integer("num_attention_heads")
  num_layers = fields.integer("num_hidden_layers")
  head_dim = fields.get("head_dim", None)
  if head_dim is not None and head_dim * heads != hidden:
    fields.fail(f"config field head_dim={head_dim} must be hidden_size / num_attention_heads = "
                f"{hidden // heads}")
  every = fields.integer("global_attn_every_n_layers", 3)
  layer_types = fields.get("layer_types", None)
  if layer_types is None:
    layer_types = [LAYER_TYPES[0] if i % every == 0 else LAYER_TYPES[1] for i in range(num_layers)]
  if (not isinstance(layer_types, list) or len(layer_types) != num_layers
      or set(layer_types) - set(LAYER_TYPES)):
    fields.fail(f"config field layer_types must list one of {LAYER_TYPES} per layer ({num_layers}); "
                f"got {layer_types!r}")
  norm_eps = fields.number("norm_eps", 1e-5)
  # transformers' ModernBERT reads norm_eps only; some checkpoints also carry layer_norm_eps.
  if fields.has("layer_norm_eps") and fields.number("layer_norm_eps") != norm_eps:
    fields.fail(f"config field layer_norm_eps={fields.config['layer_norm_eps']} differs from "
                f"norm_eps={norm_eps}, which transformers uses; make them equal")
  activations = {}
  for name in ("hidden_activation", "classifier_activation"):
    activations[name] = fields.choice(name, tuple(ACTIVATIONS), "gelu")
  fields.choice("tie_word_embeddings", (True,), True, "the masked-LM decoder is tied to the token embeddings")
  fields.choice("is_decoder", (False,), False, "an encoder only")
  thetas = _rope_thetas(fields)
  # Read by transformers only for unpadding, sparse MLM losses, flash-attn determinism, torch.compile,
  # or not at all (position_embedding_type: ModernBERT is rotary whatever it says).
  fields.ignore("sparse_prediction", "sparse_pred_ignore_index", "deterministic_flash_attn",
                "reference_compile", "repad_logits_with_grad", "position_embedding_type")
  return dict(
      vocab_size=fields.integer("vocab_size"), hidden_size=hidden, num_layers=num_layers,
      num_heads=heads, mlp_dim=fields.integer("intermediate_size"), layer_types=tuple(layer_types),
      global_attn_every_n_layers=every, local_attention=fields.integer("local_attention", 128),
      global_rope_theta=thetas["full_attention"], local_rope_theta=thetas["sliding_attention"],
      norm_eps=norm_eps, norm_bias=fields.flag("norm_bias", False),
      attention_bias=fields.flag("attention_bias", False), mlp_bias=fields.flag("mlp_bias", False),
      classifier_bias=fields.flag("classifier_bias", False), decoder_bias=fields.flag("decoder_bias", True),
      activation=activations["hidden_activation"], classifier_activation=activations["classifier_activation"],
      initializer_range=fields.number("initializer_range", 0.02),
      initializer_cutoff_factor=fields.number("initializer_cutoff_factor", 2.0),
      pooling=fields.choice("classifier_pooling", ("cls", "mean"), "cls"),
      dropout_rate=_dropout(fields), max_len=fields.integer("max_position_embeddings", 8192))


def normalize_names(tensors: dict) -> dict:
  """Drop the "model." prefix of ModernBertFor* checkpoints."""
  return {name[len("model."):] if name.startswith("model.") else name: value
          for name, value in tensors.items()}


def tensor_names(num_layers: int, hidden: int, mlp_dim: int) -> dict[tuple, tuple[str, tuple | None]]:
  """Our param path -> (checkpoint tensor name, None, or (start, stop, total): the rows of a fused
  tensor of `total` rows that hold this param)."""
  names: dict[tuple, tuple[str, tuple | None]] = {
      ("tok_embeddings", "embedding"): ("embeddings.tok_embeddings.weight", None),
      ("mlm_bias",): ("decoder.bias", None),
      ("classifier", "kernel"): ("classifier.weight", None),
      ("classifier", "bias"): ("classifier.bias", None),
  }
  for ours, theirs in (("embeddings_norm", "embeddings.norm"), ("final_norm", "final_norm"),
                       ("head_norm", "head.norm")):
    names[(ours, "scale")] = (theirs + ".weight", None)
    names[(ours, "bias")] = (theirs + ".bias", None)
  for kind, hf in (("kernel", "weight"), ("bias", "bias")):
    names[("head_dense", kind)] = (f"head.dense.{hf}", None)
    for i in range(num_layers):
      ours, theirs = f"layers_{i}", f"layers.{i}"
      for j, proj in enumerate(("query", "key", "value")):
        names[(ours, "attention", proj, kind)] = (f"{theirs}.attn.Wqkv.{hf}",
                                                (j * hidden, (j + 1) * hidden, 3 * hidden))
      names[(ours, "attention", "out", kind)] = (f"{theirs}.attn.Wo.{hf}", None)
      names[(ours, "mlp_in", kind)] = (f"{theirs}.mlp.Wi.{hf}", (0, mlp_dim, 2 * mlp_dim))
      names[(ours, "mlp_gate", kind)] = (f"{theirs}.mlp.Wi.{hf}", (mlp_dim, 2 * mlp_dim, 2 * mlp_dim))
      names[(ours, "mlp_out", kind)] = (f"{theirs}.mlp.Wo.{hf}", None)
  for i in range(1, num_layers):  # the first block has no attention norm
    for kind, hf in (("scale", "weight"), ("bias", "bias")):
      names[(f"layers_{i}", "attention_norm", kind)] = (f"layers.{i}.attn_norm.{hf}", None)
      names[(f"layers_{i}", "mlp_norm", kind)] = (f"layers.{i}.mlp_norm.{hf}", None)
  for kind, hf in (("scale", "weight"), ("bias", "bias")):
    names[("layers_0", "mlp_norm", kind)] = (f"layers.0.mlp_norm.{hf}", None)
  return names


def optional(path: tuple[str, ...]) -> bool:
  """Heads a checkpoint may lack: the prediction head (a bare ModernBertModel has none), the
  classifier and the decoder bias."""
  return path[0] in ("head_dense", "head_norm", "classifier", "mlm_bias")
