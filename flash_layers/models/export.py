"""A document model out to Hugging Face transformers: `AutoModelForSequenceClassification` loads it.

`export_model(model, params, out_dir, ...)` writes a model and params in hand; a training run's
workdir goes out through `flash_layers.export` (`python -m flash_layers.export`, which rebuilds the
model from the config stored with the checkpoint and calls this). The directory written holds

  config.json        the family's model_type ("bert", "roberta", "xlm-roberta", "modernbert"), its
                     *ForSequenceClassification architecture, every size field, id2label/label2id from
                     the run's label names, ModernBERT's classifier_pooling, the task's problem_type
                     ("single_label_classification", "multi_label_classification" or "regression"),
                     and for multi-label the decision `thresholds` on each label's sigmoid probability
                     (a field of ours: transformers keeps it on the config, and leaves deciding to you);
  model.safetensors  float32 tensors under exactly the names and shapes transformers' class reads
                     (the inverse of the import mapping in flash_layers.models.hf_bert / hf_modernbert);
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
                     the run's tokenizer with padding and truncation left to the caller, and
                     model_max_length = the run's max_len (what it truncated documents to).

A regression run trained on standardized targets exports its head with the map back folded in
(kernel * std, bias * std + mean), so transformers' outputs are in the targets' units.

Only what transformers' class computes identically is exported. Its BERT and RoBERTa classifiers
always pool the first token through a dense + tanh layer, so a `Bert` with pooling="mean" (or with
a sliding attention window, which those classes do not have) is refused with a ValueError naming
the field, never written to give other logits. ModernBERT exports either pooling.
Checked outside the project, in a virtualenv with torch and transformers: benchmarks/hf_export_check.py.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from flash_layers.data.tokenize import load_tokenizer
from flash_layers.errors import UserError
from flash_layers.models import assets, hf_bert, hf_modernbert
from flash_layers.models.bert import Bert
from flash_layers.models.modernbert import ModernBert

ARCHITECTURES = {"bert": "BertForSequenceClassification", "roberta": "RobertaForSequenceClassification",
                 "xlm-roberta": "XLMRobertaForSequenceClassification",
                 "modernbert": "ModernBertForSequenceClassification"}
MODEL_TYPES = tuple(ARCHITECTURES)
# The encoder's tensors sit under the base model's attribute in *ForSequenceClassification.
_BASE_PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.", "modernbert": "model."}
# Each head of ours -> transformers' name in the family's classifier (RoBERTa's head holds the
# first-token dense + tanh that BERT calls its pooler).
_HEADS = {
    "bert": {"pooler": "bert.pooler.dense", "classifier": "classifier"},
    "roberta": {"pooler": "classifier.dense", "classifier": "classifier.out_proj"},
    "modernbert": {"head_dense": "head.dense", "head_norm": "head.norm", "classifier": "classifier"},
}
_HEADS["xlm-roberta"] = _HEADS["roberta"]
# Token classification (`export_model(..., problem_type="token_classification")`): transformers'
# *ForTokenClassification, whose classifier is a plain linear layer on every token (ModernBERT's on
# its prediction head), and whose BERT/RoBERTa base has no pooler (a Bert's pooler is not written).
TOKEN_ARCHITECTURES = {"bert": "BertForTokenClassification", "roberta": "RobertaForTokenClassification",
                       "xlm-roberta": "XLMRobertaForTokenClassification",
                       "modernbert": "ModernBertForTokenClassification"}
_TOKEN_HEADS = {"bert": {"classifier": "classifier"}, "roberta": {"classifier": "classifier"},
                "xlm-roberta": {"classifier": "classifier"}, "modernbert": _HEADS["modernbert"]}
TOKEN_CLASSIFICATION = "token_classification"
# Masked LM (`problem_type="masked_lm"`): transformers' *ForMaskedLM, the encoder (no pooler) and the
# masked-LM head, its decoder tied to the word embeddings.
MASKED_LM = "masked_lm"
MLM_ARCHITECTURES = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM",
                     "xlm-roberta": "XLMRobertaForMaskedLM", "modernbert": "ModernBertForMaskedLM"}
_MLM_HEADS = {"modernbert": {"head_dense": "head.dense", "head_norm": "head.norm"}}
_ARCHITECTURES = {"sequence": ARCHITECTURES, "token": TOKEN_ARCHITECTURES, "mlm": MLM_ARCHITECTURES}


def head_kind(problem_type: str) -> str:
  """Which transformers class a problem type exports to: "sequence", "token" or "mlm"."""
  return {TOKEN_CLASSIFICATION: "token", MASKED_LM: "mlm"}.get(problem_type, "sequence")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_COPIED_VOCAB = ("vocab.txt", "vocab.json", "merges.txt")  # slow-tokenizer files, copied when present
# Special tokens by role, in BERT's and RoBERTa's spellings, for a tokenizer with no tokenizer_config.
_SPECIALS = {"cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"), "pad_token": ("[PAD]", "<pad>"),
             "unk_token": ("[UNK]", "<unk>"), "mask_token": ("[MASK]", "<mask>"), "bos_token": ("<s>",),
             "eos_token": ("</s>",)}


class ExportError(UserError, ValueError):
  """A model transformers' class cannot express: names the field and what to use instead."""


def model_type_of(model: Bert | ModernBert, source_model_type: str | None = None) -> str:
  """The family transformers knows the model as: a `ModernBert` is "modernbert"; a `Bert` is "bert"
  without a position offset and "roberta" (or the source checkpoint's "xlm-roberta") with one."""
  if isinstance(model, ModernBert):
    return "modernbert"
  if not isinstance(model, Bert):
    raise TypeError(f"model must be a flash_layers.models Bert or ModernBert; got {type(model).__name__}")
  if model.position_offset == 0:
    return "bert"
  return source_model_type if source_model_type in ("roberta", "xlm-roberta") else "roberta"


def check_exportable(model: Bert | ModernBert, model_type: str, *, kind: str = "sequence") -> None:
  """ExportError (a ValueError) naming the field unless transformers' class for `model_type` computes
  what `model` does (`kind` "token": its *ForTokenClassification, which pools nothing; "mlm": its
  *ForMaskedLM)."""
  if model_type not in MODEL_TYPES:
    raise ExportError(f"model_type must be one of {MODEL_TYPES}; got {model_type!r}")
  if kind == "mlm" and not model.mlm_head:
    raise ExportError("the model has no masked-LM head (mlm_head=False): nothing for AutoModelForMaskedLM")
  if kind != "mlm" and model.num_labels is None:
    raise ExportError("the model has no classification head (num_labels=None): nothing for "
                     "AutoModelForSequenceClassification to load")
  if model_type == "modernbert":
    if not isinstance(model, ModernBert):
      raise ExportError(f"model_type 'modernbert' needs a ModernBert; got {type(model).__name__}")
    return
  if not isinstance(model, Bert):
    raise ExportError(f"model_type {model_type!r} needs a Bert; got {type(model).__name__}")
  if (model_type == "bert") != (model.position_offset == 0):
    raise ExportError(f"model_type {model_type!r} does not fit position_offset={model.position_offset} "
                     "(BERT reads positions from row 0; RoBERTa after its padding_idx)")
  if model.pooling != "cls" and kind == "sequence":
    raise ExportError(f"model.pooling={model.pooling!r} cannot be exported: transformers' "
                     f"{ARCHITECTURES[model_type]} always classifies the first token through a dense + tanh "
                     "pooler, so it would give other logits; train with model.pooling='cls' (ModernBERT "
                     "exports 'mean' as its classifier_pooling)")
  if model.attention_window is not None:
    raise ExportError(f"model.attention_window={model.attention_window} cannot be exported: transformers' "
                     f"{ARCHITECTURES[model_type]} attends over the whole document")


def _to_torch(path: tuple[str, ...], value: np.ndarray) -> np.ndarray:
  """Our param in PyTorch's layout: the inverse of models.pretrained._convert."""
  value = np.asarray(value, np.float32)
  if path[-1] == "bias":
    return value.reshape(-1)
  if path[-1] != "kernel":
    return value  # embeddings and LayerNorm: same layout
  if path[-2] == "out":  # [heads, head_dim, embed] -> torch [embed, heads * head_dim]
    return value.reshape(-1, value.shape[-1]).T
  return value.reshape(value.shape[0], -1).T  # [in, *out] -> torch [out, in]


def _leaves(params) -> dict[tuple[str, ...], np.ndarray]:
  out = {}

  def walk(node, path):
    if hasattr(node, "items"):
      for key, child in node.items():
        walk(child, path + (str(key),))
    else:
      out[path] = np.asarray(node)
  walk(params, ())
  return out


def hf_tensors(model: Bert | ModernBert, params, model_type: str, *,
               kind: str = "sequence") -> dict[str, np.ndarray]:
  """{transformers' tensor name: float32 array} of `model_type`'s *ForSequenceClassification
  (`kind` "token": *ForTokenClassification; "mlm": *ForMaskedLM).

  A classifier exports without the masked-LM head, a masked LM without the classifier and pooler."""
  check_exportable(model, model_type, kind=kind)
  if model_type == "modernbert":
    names = hf_modernbert.tensor_names(model.num_layers, model.hidden_size, model.mlp_dim)
    encoder_prefixes = hf_modernbert.ENCODER_PREFIXES
  else:
    names = {p: (n, None) for p, n in hf_bert.tensor_names(model.num_layers, model_type).items()}
    encoder_prefixes = hf_bert.ENCODER_PREFIXES
  heads = {"sequence": _HEADS, "token": _TOKEN_HEADS, "mlm": _MLM_HEADS}[kind].get(model_type, {})
  architecture = _ARCHITECTURES[kind][model_type]
  pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
  for path, value in _leaves(params).items():
    if kind == "mlm":
      if path[0] in ("pooler", "classifier", "chunk_score"):
        continue
      if path[0].startswith("mlm") and path in names:  # the head, under its checkpoint names
        pieces.setdefault(names[path][0], []).append((0, _to_torch(path, value)))
        continue
    elif path[0].startswith("mlm") or path[0] == "chunk_score" or (kind == "token" and path[0] == "pooler"):
      continue
    if path not in names:
      raise ValueError(f"param {'/'.join(path)} has no {model_type} tensor name")
    name, rows = names[path]
    if path[0] in heads:
      name = heads[path[0]] + name[name.rindex("."):]
    elif name.startswith(encoder_prefixes):
      name = _BASE_PREFIX[model_type] + name
    else:
      raise ValueError(f"param {'/'.join(path)} ({name}) has no place in {architecture}")
    pieces.setdefault(name, []).append((0 if rows is None else rows[0], _to_torch(path, value)))
  # Fused tensors (ModernBERT's Wqkv, the GeGLU's Wi) from their parts, in row order.
  return {name: np.ascontiguousarray(np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])])
                                     if len(parts) > 1 else parts[0][1])
          for name, parts in sorted(pieces.items())}


def _labels(label_names: Sequence, num_labels: int) -> tuple[dict, dict]:
  names = [str(n) for n in label_names]
  if len(names) != num_labels or len(set(names)) != len(names):
    raise ValueError(f"label_names must be {num_labels} distinct names (the classifier's outputs); "
                     f"got {names}")
  return {str(i): n for i, n in enumerate(names)}, {n: i for i, n in enumerate(names)}


PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression",
                 TOKEN_CLASSIFICATION, MASKED_LM)


def fold_standardization(params, mean: Sequence[float], std: Sequence[float]):
  """params whose classifier outputs `output * std + mean`: the regression head in target units."""
  mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
  head = dict(params["classifier"])
  head["kernel"] = (np.asarray(head["kernel"], np.float64) * std).astype(np.float32)
  head["bias"] = (np.asarray(head["bias"], np.float64) * std + mean).astype(np.float32)
  return {**params, "classifier": head}


def hf_config(model: Bert | ModernBert, model_type: str, label_names: Sequence,
              token_ids: dict[str, int] | None = None, *, problem_type: str = "single_label_classification",
              thresholds: Sequence[float] | None = None) -> dict[str, Any]:
  """config.json for `model_type`'s *ForSequenceClassification, every field our importer reads
  (flash_layers.models.hf_bert / hf_modernbert) and transformers' class honours."""
  kind = head_kind(problem_type)
  check_exportable(model, model_type, kind=kind)
  if problem_type not in PROBLEM_TYPES:
    raise ExportError(f"problem_type must be one of {PROBLEM_TYPES}; got {problem_type!r}")
  id2label, label2id = _labels(label_names, model.num_labels) if kind != "mlm" else ({}, {})
  ids = {f"{role[:-len('_token')]}_token_id": i for role, i in (token_ids or {}).items()}
  task_fields = {}
  if thresholds is not None:
    if problem_type != "multi_label_classification" or len(thresholds) != model.num_labels:
      raise ExportError(f"thresholds: one per label, for problem_type 'multi_label_classification' only; "
                        f"got {len(thresholds)} for {problem_type!r} with {model.num_labels} labels")
    task_fields["thresholds"] = [float(t) for t in thresholds]
  if kind == "sequence":
    task_fields["problem_type"] = problem_type  # transformers has none for tokens or masked LM
  if kind != "mlm":
    task_fields.update(id2label=id2label, label2id=label2id, num_labels=model.num_labels)
  architecture = _ARCHITECTURES[kind][model_type]
  common = {"architectures": [architecture], "model_type": model_type,
            **task_fields, "dtype": "float32",
            "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "intermediate_size": model.mlp_dim, "initializer_range": model.initializer_range,
            "is_decoder": False, "tie_word_embeddings": True}
  if model_type == "modernbert":
    # transformers' default special ids (50281-50283) lie outside a smaller vocabulary. Without a
    # tokenizer to say: pad 0 (the embedding row that gets no gradient; no output changes), others none.
    ids.setdefault("pad_token_id", 0)
    for role in ("bos", "eos", "cls", "sep"):
      ids.setdefault(f"{role}_token_id", None)
    kinds = model.resolved_layer_types()
    thetas = {"full_attention": model.global_rope_theta, "sliding_attention": model.local_rope_theta}
    return {**common, **ids,
            "max_position_embeddings": model.max_len, "layer_types": list(kinds),
            "global_attn_every_n_layers": model.global_attn_every_n_layers,
            "local_attention": model.local_attention,
            "rope_parameters": {kind: {"rope_theta": float(theta), "rope_type": "default"}
                                for kind, theta in thetas.items()},
            "norm_eps": model.norm_eps, "norm_bias": model.norm_bias, "attention_bias": model.attention_bias,
            "mlp_bias": model.mlp_bias, "classifier_bias": model.classifier_bias,
            "decoder_bias": model.decoder_bias, "hidden_activation": model.activation,
            "classifier_activation": model.classifier_activation,
            "initializer_cutoff_factor": model.initializer_cutoff_factor,
            "classifier_pooling": model.pooling, "attention_dropout": 0.0,
            "embedding_dropout": model.dropout_rate, "mlp_dropout": model.dropout_rate,
            "classifier_dropout": model.dropout_rate}
  if model_type != "bert":  # RoBERTa's positions start after padding_idx = pad_token_id
    pad = model.position_offset - 1
    if ids.get("pad_token_id", pad) != pad:
      raise ValueError(f"the tokenizer's pad token id {ids['pad_token_id']} differs from the padding_idx "
                       f"{pad} the model's position offset ({model.position_offset}) implies")
    ids["pad_token_id"] = pad
  return {**common, **ids,
          "max_position_embeddings": model.max_len + model.position_offset,
          "type_vocab_size": model.type_vocab_size, "layer_norm_eps": model.layer_norm_eps,
          "hidden_act": "gelu", "position_embedding_type": "absolute",
          "hidden_dropout_prob": model.dropout_rate,
          "attention_probs_dropout_prob": model.attention_dropout_rate,
          "classifier_dropout": None, "add_cross_attention": False}


def _tokenizer_source(tokenizer: str | pathlib.Path) -> tuple[Any, pathlib.Path | None]:
  """(tokenizers.Tokenizer, the directory its tokenizer_config.json would be in, or None)."""
  backend = load_tokenizer(tokenizer)
  if str(tokenizer) == "listops":
    return backend, None
  path = assets.checkpoint_dir(tokenizer)
  return backend, path if path.is_dir() else path.parent


def write_tokenizer(tokenizer: str | pathlib.Path, out_dir: str | pathlib.Path,
                    max_len: int) -> dict[str, int]:
  """The tokenizer files AutoTokenizer reads; returns the special tokens' ids ({"cls_token": 101, ...}).

  tokenizer.json is the run's tokenizer with padding and truncation turned off (a checkpoint's file
  may pad every text to 128, as all-MiniLM-L6-v2's does): callers ask for them per call, as
  `tokenizer(texts, truncation=True, max_length=...)`. tokenizer_config.json is the source's with
  model_max_length = max_len, or one derived from the tokenizer's special tokens."""
  out = pathlib.Path(out_dir)
  backend, source = _tokenizer_source(tokenizer)
  backend.no_padding()
  backend.no_truncation()
  backend.save(str(out / "tokenizer.json"))
  read = lambda name: (json.loads((source / name).read_text())
                       if source is not None and (source / name).is_file() else None)
  vocab = backend.get_vocab()
  specials = read("special_tokens_map.json")
  if specials is None:
    specials = {role: next(t for t in spellings if t in vocab)
                for role, spellings in _SPECIALS.items() if any(t in vocab for t in spellings)}
  token_config = read("tokenizer_config.json") or {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
  for key in ("name_or_path", "_name_or_path", "tokenizer_file", "auto_map"):
    token_config.pop(key, None)
  token_config["model_max_length"] = max_len
  (out / "tokenizer_config.json").write_text(json.dumps(token_config, indent=2) + "\n")
  (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
  for name in _COPIED_VOCAB:
    if source is not None and (source / name).is_file():
      shutil.copyfile(source / name, out / name)
  ids = {}
  for role, token in specials.items():
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and token in vocab:
      ids[role] = vocab[token]
  return ids


def export_model(model: Bert | ModernBert, params, out_dir: str | pathlib.Path, *, label_names: Sequence,
                 tokenizer: str | pathlib.Path | None, model_type: str | None = None,
                 max_tokens: int | None = None, problem_type: str = "single_label_classification",
                 thresholds: Sequence[float] | None = None,
                 standardization: tuple[Sequence[float], Sequence[float]] | None = None) -> pathlib.Path:
  """Write `model` + `params` as a transformers *ForSequenceClassification directory; returns it.

  Args:
    model, params: a classifier (num_labels set) and its params (host or device arrays).
    out_dir: created if absent; must not already hold a config.json (an export is never overwritten).
    label_names: the class names, in the classifier's output order (config.json's id2label).
    tokenizer: what the run tokenized with: "minilm", a checkpoint directory or a tokenizer.json
      (anything flash_layers.data.load_tokenizer takes); None writes no tokenizer files (the model
      alone, for a caller that supplies them).
    model_type: None = `model_type_of(model)`; "xlm-roberta" to name a RoBERTa-layout model so.
    max_tokens: the tokenizer's model_max_length, the length the run truncated documents to
      (config.model.max_len; the model may take more: a pretrained position table is never cut);
      None = the model's max_len.
    problem_type: transformers' ("single_label_classification", "multi_label_classification",
      "regression"), or "token_classification" for its *ForTokenClassification, "masked_lm" for its
      *ForMaskedLM (label_names then empty);
    thresholds: multi-label decision thresholds, one per label, written to config.json.
    standardization: (mean, std) per regression target, folded into the classifier (module doc).
  """
  model_type = model_type or model_type_of(model)
  kind = head_kind(problem_type)
  check_exportable(model, model_type, kind=kind)
  if standardization is not None:
    if problem_type != "regression":
      raise ExportError(f"standardization is for problem_type 'regression'; got {problem_type!r}")
    params = fold_standardization(params, *standardization)
  tensors = hf_tensors(model, params, model_type, kind=kind)
  out = pathlib.Path(out_dir)
  if (out / "config.json").exists():
    raise FileExistsError(f"{out} already holds an export (config.json); choose another directory")
  out.mkdir(parents=True, exist_ok=True)
  token_ids = write_tokenizer(tokenizer, out, max_tokens or model.max_len) if tokenizer is not None else {}
  config = hf_config(model, model_type, label_names, {r: i for r, i in token_ids.items()
                                                      if r in ("pad_token", "bos_token", "eos_token",
                                                               "cls_token", "sep_token")},
                     problem_type=problem_type, thresholds=thresholds)
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return out
