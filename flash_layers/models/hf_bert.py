"""BERT, RoBERTa and XLM-RoBERTa checkpoints in Hugging Face layout -> `Bert` fields and tensor names.

RoBERTa (and XLM-RoBERTa, the same code) is BERT with two differences that matter here: its
position rows start at padding_idx + 1 (rows 0 .. padding_idx are never read by real tokens),
so `Bert.position_offset` = pad_token_id + 1; and one token type. Its tensors carry a
"roberta." prefix in RobertaFor* checkpoints and its masked-LM head is named "lm_head".
Positions restart per packed document here, where transformers counts non-padding tokens; the
two agree on a document of real tokens.
"""

from __future__ import annotations

from typing import Any

from flash_layers.models.hf_fields import ConfigFields

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
_PREFIXES = ("bert.", "roberta.")
# Tensors under these names belong to the encoder: one the model does not read means a mismatch.
ENCODER_PREFIXES = ("embeddings.", "encoder.")
UNREAD = ("embeddings.position_ids",)  # a buffer of 0, 1, ... that old checkpoints saved


def model_fields(fields: ConfigFields, model_type: str) -> dict[str, Any]:
  """`Bert` fields from the config (max_len here is the checkpoint's usable positions)."""
  offset = 0
  if model_type != "bert":
    pad = fields.get("pad_token_id", 1)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
      fields.fail(f"config field 'pad_token_id' must be an int >= 0 (RoBERTa's positions start after it); "
                  f"got {pad!r}")
    offset = pad + 1
  rows = fields.integer("max_position_embeddings", 512)
  if rows <= offset:
    fields.fail(f"config field max_position_embeddings={rows} leaves no position after the offset {offset}")
  fields.choice("position_embedding_type", ("absolute",), "absolute",
                "relative position embeddings are not implemented")
  fields.choice("hidden_act", ("gelu",), "gelu", "the MLP uses the exact (erf) GELU")
  fields.choice("is_decoder", (False,), False, "an encoder only")
  fields.choice("add_cross_attention", (False,), False, "an encoder only")
  fields.choice("tie_word_embeddings", (True,), True, "the masked-LM decoder is tied to the word embeddings")
  fields.choice("pruned_heads", ({},), {}, "pruned heads are not supported")
  fields.choice("classifier_dropout", (None,), None,
                "the classifier uses hidden_dropout_prob (override with dropout_rate=)")
  attention_dropout = fields.number("attention_probs_dropout_prob", 0.1)
  dropout = fields.number("hidden_dropout_prob", 0.1)
  for name, rate in (("hidden_dropout_prob", dropout), ("attention_probs_dropout_prob", attention_dropout)):
    if not 0 <= rate < 1:
      fields.fail(f"config field {name}={rate} must be in [0, 1)")
  return dict(
      vocab_size=fields.integer("vocab_size"), hidden_size=fields.integer("hidden_size"),
      num_layers=fields.integer("num_hidden_layers"), num_heads=fields.integer("num_attention_heads"),
      mlp_dim=fields.integer("intermediate_size"),
      type_vocab_size=fields.integer("type_vocab_size", 2 if model_type == "bert" else 1),
      layer_norm_eps=fields.number("layer_norm_eps", 1e-12),
      initializer_range=fields.number("initializer_range", 0.02),
      dropout_rate=dropout, attention_dropout_rate=attention_dropout, max_len=rows - offset,
      position_offset=offset)


# RobertaForSequenceClassification's head is our pooler (dense + tanh on the first token) and
# classifier under other names; it has no "roberta.pooler", and its head is the one it classifies with.
_ROBERTA_HEAD = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}


def normalize_names(tensors: dict) -> dict:
  """Drop a "bert."/"roberta." prefix (BertFor*/RobertaFor* checkpoints), map the old
  LayerNorm gamma/beta names and RoBERTa's classification head onto BERT's pooler + classifier."""
  out, head = {}, {}
  for name, value in tensors.items():
    for prefix in _PREFIXES:
      if name.startswith(prefix):
        name = name[len(prefix):]
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    for theirs, ours in _ROBERTA_HEAD.items():
      if name.startswith(theirs):
        head[ours + name[len(theirs):]] = value
        break
    else:
      out[name] = value
  return {**out, **head}


def tensor_names(num_layers: int, model_type: str) -> dict[tuple[str, ...], str]:
  """Our param path -> the checkpoint's tensor name (after `normalize_names`)."""
  names = {
      ("word_embeddings", "embedding"): "embeddings.word_embeddings.weight",
      ("position_embeddings", "embedding"): "embeddings.position_embeddings.weight",
      ("token_type_embeddings", "embedding"): "embeddings.token_type_embeddings.weight",
      ("embeddings_norm", "scale"): "embeddings.LayerNorm.weight",
      ("embeddings_norm", "bias"): "embeddings.LayerNorm.bias",
      ("pooler", "kernel"): "pooler.dense.weight",
      ("pooler", "bias"): "pooler.dense.bias",
      ("classifier", "kernel"): "classifier.weight",
      ("classifier", "bias"): "classifier.bias",
  }
  for i in range(num_layers):
    ours, theirs = f"layers_{i}", f"encoder.layer.{i}"
    for proj in ("query", "key", "value"):
      names[(ours, "attention", proj, "kernel")] = f"{theirs}.attention.self.{proj}.weight"
      names[(ours, "attention", proj, "bias")] = f"{theirs}.attention.self.{proj}.bias"
    for kind in ("kernel", "bias"):
      hf = "weight" if kind == "kernel" else "bias"
      names[(ours, "attention", "out", kind)] = f"{theirs}.attention.output.dense.{hf}"
      names[(ours, "mlp_in", kind)] = f"{theirs}.intermediate.dense.{hf}"
      names[(ours, "mlp_out", kind)] = f"{theirs}.output.dense.{hf}"
    for norm, hf in (("attention_norm", "attention.output.LayerNorm"), ("mlp_norm", "output.LayerNorm")):
      names[(ours, norm, "scale")] = f"{theirs}.{hf}.weight"
      names[(ours, norm, "bias")] = f"{theirs}.{hf}.bias"
  if model_type == "bert":
    head = {"transform": "cls.predictions.transform.dense", "norm": "cls.predictions.transform.LayerNorm",
            "bias": "cls.predictions.bias"}
  else:
    head = {"transform": "lm_head.dense", "norm": "lm_head.layer_norm", "bias": "lm_head.bias"}
  names.update({
      ("mlm_transform", "kernel"): head["transform"] + ".weight",
      ("mlm_transform", "bias"): head["transform"] + ".bias",
      ("mlm_norm", "scale"): head["norm"] + ".weight",
      ("mlm_norm", "bias"): head["norm"] + ".bias",
      ("mlm_bias",): head["bias"],
  })
  return names


def optional(path: tuple[str, ...]) -> bool:
  """Heads a checkpoint may lack (they then start from the model's init)."""
  return path[0] in ("pooler", "classifier") or path[0].startswith("mlm")
