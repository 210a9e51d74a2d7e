"""From a config to a `Task`: the model, its initial params, the tokenizer and the batches.

This is the only place that knows about flash_layers.models and flash_layers.data;
the loop and eval only see the `Task` interface (loop.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from flash_layers import data as data_lib
from flash_layers import models
from flash_layers.data import eval_plan, readers
from flash_layers.parallel.mesh import BATCH_AXES
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import config as config_lib
from flash_layers.training import objectives
from flash_layers.training import steps as steps_lib
from flash_layers.training.config import ConfigError

log = logging.getLogger("flash_layers.training")

@dataclasses.dataclass
class Task:
  """What the loop needs from a model and a dataset (built by build_task)."""

  logits_fn: steps_lib.LogitsFn  # (params, batch, *, train, rng) -> logits
  init_params: Callable[[], Any]  # boxed params (traced only, or jitted with out_shardings)
  pretrained_params: Any | None  # host arrays replacing the initial params, or None
  label_names: list
  train_batches: Iterator[dict]  # endless, this process's rows; has get_state()/set_state()
  # (split, max_batches=None) -> (this process's batches, steps); each document once (data.eval_plan:
  # a list, or for token classification its TokenBatches, which also know each document's words)
  eval_batches: Callable[..., tuple[Iterator[dict], int]]
  predict_batches: Callable[[list[str]], list[dict]]  # texts -> this process's batches (labels -1)
  seq_len: int
  model: Any = None  # the flax module logits_fn applies (flash_layers.export writes it out)
  # What the task predicts and how it is scored (training/objectives.py); its head is the one built
  # from the config and the training data: a checkpoint's saved head replaces it (Objective.with_head).
  objective: objectives.Objective | None = None

  def __post_init__(self):
    if self.objective is None:  # a Task built by hand: single-label classification over its labels
      self.objective = objectives.build("classification", self.label_names)

  @property
  def num_labels(self) -> int:
    return len(self.label_names)


DEV_CARVE_SEED = 1234
EVAL_SHUFFLE_SEED = 0  # fixed: a capped dev evaluation scores the same sample for every training seed


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------

def _has_split(root: pathlib.Path, split: str) -> bool:
  if root.is_file():
    return False
  try:
    return readers.split_path(root, split) != root
  except (data_lib.DataError, FileNotFoundError):
    return False


def load_split(config: ml_collections.ConfigDict, split: str) -> data_lib.Records:
  """Records of one split; a dataset without a dev split on disk gets one carved out of train."""
  d = config.data
  if config.task == "masked_lm" and d.dataset in config_lib.BUILTIN_DATASETS:  # their text alone
    records = load_split(_with_task(config, config_lib.BUILTIN_TASKS[d.dataset]), split)
    text = lambda t: t if isinstance(t, str) else " ".join(t)  # a token task's words, joined
    return data_lib.Records([{"text": text(r["text"]), "label": None} for r in records],
                            vocab=data_lib.LabelVocab(()), source=records.source, split=split,
                            label_kind="none")
  if d.dataset == "bbc_news":
    return data_lib.load("bbc_news", split=split)
  if d.dataset == "listops":
    options = {} if d.num_examples is None else {"num_examples": d.num_examples}
    return data_lib.load("listops", split=split, **options)
  if d.dataset in data_lib.bbc.DERIVED:
    return data_lib.load(d.dataset, split=split)
  root = pathlib.Path(d.dataset)
  columns = {"text_column": text_field(config), "label_column": label_field(config),
             "label_kind": objectives.LABEL_KINDS[config.task], "unseen_labels": d.unseen_labels}
  if split == "test" or _has_split(root, "dev"):
    if split != "train" and not _has_split(root, split):
      raise data_lib.DataError(f"config.data.dataset {str(root)!r} has no {split!r} split (expected "
                               f"{split}.jsonl/.csv/.tsv or a {split}/ folder in it); set "
                               "config.data.eval_split='dev' to evaluate on dev")
    return data_lib.load(root, split=split, **columns)
  train = data_lib.load(root, split="train", **columns)
  order = np.random.default_rng(DEV_CARVE_SEED).permutation(len(train))
  num_dev = max(1, int(round(len(train) * d.dev_fraction)))
  chosen = sorted(order[:num_dev]) if split == "dev" else sorted(order[num_dev:])
  return data_lib.Records([train[i] for i in chosen], vocab=train.vocab, source=train.source, split=split,
                          label_kind=train.label_kind)


def _with_task(config: ml_collections.ConfigDict, task: str) -> ml_collections.ConfigDict:
  other = ml_collections.ConfigDict(config.to_dict())
  other.task = task
  return other


def text_field(config: ml_collections.ConfigDict) -> str:
  """The field holding a document: its text, or (token classification) its words."""
  return config.data.tokens_field if config.task == "token_classification" else config.data.text_field


def label_field(config: ml_collections.ConfigDict) -> str:
  return config.data.tags_field if config.task == "token_classification" else config.data.label_field


def tokenizer_path(config: ml_collections.ConfigDict) -> str:
  if config.data.tokenizer:
    return config.data.tokenizer
  if config.data.dataset == "listops":
    return "listops"
  if config.model.pretrained:
    return str(models.assets.checkpoint_dir(config.model.pretrained))
  raise ConfigError("config.data.tokenizer: needed when training from scratch on text "
                    "(model.pretrained is None); e.g. 'minilm' or a tokenizer.json")


def hierarchical_chunks(config) -> int | None:
  """data.max_chunks with data.long_documents="hierarchical", else None."""
  return config.data.max_chunks if config.data.long_documents == "hierarchical" else None


def make_tokenizer(config) -> data_lib.TextTokenizer:
  """max_len tokens per window; a hierarchical document's chunks are its windows."""
  long_docs = "windows" if hierarchical_chunks(config) else config.data.long_documents
  return data_lib.TextTokenizer(tokenizer_path(config), max_len=config.model.max_len,
                                long_docs=long_docs, stride=config.data.window_stride)


def local_batch_size(global_batch: int) -> int:
  if global_batch % jax.process_count():
    raise ConfigError(f"config.train.batch_size={global_batch} must divide over {jax.process_count()} "
                      "processes")
  return global_batch // jax.process_count()


def eval_batch_size(config) -> int:
  return config.data.eval_batch_size or config.train.batch_size // config.train.grad_accum_steps


def eval_granule(mesh: Mesh | None) -> int:
  """Bucket lengths are multiples of this: 128 tokens per shard of the sequence axis."""
  return 128 * (mesh.shape.get("sequence", 1) if mesh is not None else 1)


def planned_eval_batches(config, texts, labels, tokenizer, mesh: Mesh | None,
                         label_spec: data_lib.LabelSpec = readers.SINGLE) -> list[dict]:
  """This process's rows of the evaluation/prediction batches: every document once, packed and
  bucketed by length (data.eval_plan), or one per max_len row with data.eval_packing=False."""
  d = config.data
  row_len = tokenizer.max_len * (hierarchical_chunks(config) or 1)
  buckets = (eval_plan.length_buckets(row_len, eval_granule(mesh)) if d.eval_packing else (row_len,))
  # Rows of a batch are sharded over the mesh's batch axes, so a batch of fewer rows (long rows,
  # eval_plan.rows_per_batch) keeps a multiple of their size.
  batch_shards = math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES) if mesh is not None else 1
  batch_size = eval_batch_size(config)
  if batch_size % math.lcm(batch_shards, jax.process_count()):
    raise ConfigError(f"the evaluation batch ({batch_size} rows: data.eval_batch_size, else "
                      f"train.batch_size / grad_accum_steps) must divide over the data*fsdp={batch_shards} "
                      f"shards and {jax.process_count()} processes")
  return eval_plan.eval_batches(texts, labels, tokenizer, batch_size=batch_size,
                                max_docs_per_row=d.max_docs_per_row, pack=d.eval_packing, buckets=buckets,
                                row_tokens=eval_plan.ROW_TOKENS if d.eval_packing else None,
                                row_multiple=batch_shards, process_index=jax.process_index(),
                                process_count=jax.process_count(), label_spec=label_spec,
                                chunks=hierarchical_chunks(config))


def sample_documents(records, max_batches: int | None, global_batch: int) -> list[int]:
  """Which documents a capped evaluation scores: a seeded sample of about max_batches batches'
  worth (all of them without a cap), so a capped dev eval still sees every class."""
  if max_batches is None or max_batches * global_batch >= len(records):
    return list(range(len(records)))
  order = np.random.default_rng(EVAL_SHUFFLE_SEED).permutation(len(records))
  return sorted(order[:max_batches * global_batch].tolist())


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------



def build_model(config: ml_collections.ConfigDict, num_labels: int, vocab_size: int | None):
  """(model, pretrained params as host numpy arrays, or None when training from scratch)."""
  m = config.model
  common = dict(impl=m.impl, context_parallel=m.context_parallel, pooling=m.pooling,
                dropout_rate=m.dropout_rate, dtype=models.DTYPES[m.dtype], remat=m.remat,
                chunk_pooling=m.chunk_pooling)
  # A hierarchical row holds max_chunks windows of max_len tokens (positions restart in each).
  max_len = m.max_len * (hierarchical_chunks(config) or 1)
  if m.attention_window is not None:  # only BERT/RoBERTa take these (ModernBERT: its config's window)
    common.update(attention_window=m.attention_window, global_tokens=m.global_tokens)
  # The resolved rate goes to every model that has the field, 0.0 included (0.0 means off, not "the
  # checkpoint's"). ModernBERT has no attention-probability dropout: validation refuses a non-zero rate.
  attention_dropout = config_lib.attention_dropout(config)
  config_lib.check_attention_dropout(m, attention_dropout)
  if not m.pretrained or models.pretrained.has_attention_dropout(m.pretrained):
    common["attention_dropout_rate"] = attention_dropout
  if config.task == "masked_lm":  # the masked-LM head instead of a classifier
    num_labels = None
    common["mlm_head"] = True
  if m.pretrained:
    model, params = models.from_pretrained(m.pretrained, max_len=max_len, num_labels=num_labels,
                                           position_extension=m.position_extension, seed=config.seed,
                                           **common)
    return model, jax.tree.map(np.asarray, params)
  vocab_size = m.vocab_size or vocab_size
  if not vocab_size:
    raise ConfigError("config.model.vocab_size: needed to build a model from scratch without a tokenizer")
  model = models.Bert(vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                      num_heads=m.num_heads, mlp_dim=m.mlp_dim, max_len=max_len, num_labels=num_labels,
                      **common)
  return model, None


# Params a run started with config.model.init_from takes from its own init or checkpoint, never from
# the other run: its task's classifier.
NOT_INITIALIZED_FROM = ("classifier",)


def init_from_run(config: ml_collections.ConfigDict, model, params) -> dict:
  """`params` with every parameter of the run in config.model.init_from's latest checkpoint that this
  model has too, except the classifier (NOT_INITIALIZED_FROM): its encoder, with its (extended)
  position table, grown by model.position_extension if this model's max_len is longer; its
  prediction head (ModernBERT) and masked-LM head where both have them. Shapes must match."""
  step, source = checkpoint_lib.read_params(config.model.init_from)
  flat = dict(jax.tree_util.tree_flatten_with_path(source)[0])
  out, taken, kept = {}, 0, []

  def take(path, value):
    nonlocal taken
    name = tuple(getattr(k, "key", k) for k in path)
    given = flat.get(path)
    if given is None or name[0] in NOT_INITIALIZED_FROM:
      kept.append("/".join(map(str, name)))
      return value
    if name[0] == "position_embeddings" and given.shape[0] < value.shape[0]:
      offset = getattr(model, "position_offset", 0)
      given = np.concatenate([given[:offset], models.extend_positions(given[offset:], value.shape[0] - offset,
                                                                      config.model.position_extension)])
    if given.shape != value.shape:
      where = "/".join(map(str, name))
      raise ConfigError(f"config.model.init_from={config.model.init_from!r}: param {where} has shape "
                        f"{given.shape} there but {value.shape} here: not the same encoder")
    taken += 1
    return np.asarray(given, value.dtype)

  out = jax.tree_util.tree_map_with_path(take, params)
  log.info("initialized %d params from %s (step %d); from this run's own init or checkpoint: %s", taken,
           config.model.init_from, step, ", ".join(kept) or "none")
  return out


def make_logits_fn(model: models.Bert, *, per_token: bool = False, mlm: bool = False,
                   chunks: int | None = None):
  """Called under sharding.sharding_context (the mesh and logical rules are set by the caller).
  Logits per document slot [batch, docs, C], or with `per_token` per token [batch, length, C], or
  with `mlm` the masked-LM head's [batch, length, vocab], or with `chunks` one document per row read
  as that many chunks [batch, 1, C] (hierarchical)."""
  def logits_fn(params, batch, *, train: bool, rng):
    rngs = {"dropout": rng} if train else {}
    args = (batch["input_ids"], batch["segment_ids"], batch["positions"])
    if chunks:
      return model.apply({"params": params}, *args, max_chunks=chunks, deterministic=not train, rngs=rngs,
                         method=model.classify_chunks)
    if mlm:
      return model.apply({"params": params}, *args, deterministic=not train, rngs=rngs, method=model.mlm)
    if per_token:
      return model.apply({"params": params}, *args, deterministic=not train, rngs=rngs, method=model.tag)
    return model.apply({"params": params}, *args, max_docs=batch["labels"].shape[1], deterministic=not train,
                       rngs=rngs, method=model.classify)
  return logits_fn


def build_objective(config: ml_collections.ConfigDict, train_records: data_lib.Records,
                    tokenizer: data_lib.TextTokenizer | None = None) -> objectives.Objective:
  """The task's objective over the training data's labels (or regression targets); masked LM: over
  the tokenizer's vocabulary, masking with its mask token."""
  names = list(train_records.vocab.names)
  if config.task == "masked_lm":
    ids = [tokenizer.tokenizer.token_to_id(t) for t in ("[MASK]", "<mask>")]
    mask = next((i for i in ids if i is not None), None)
    if mask is None:
      raise ConfigError(f"config.task='masked_lm': the tokenizer {tokenizer_path(config)!r} has no mask "
                        "token ([MASK] or <mask>)")
    return objectives.build("masked_lm", (), mlm={
        "vocab_size": config.model.vocab_size or tokenizer.vocab_size, "mask_id": mask,
        "probability": config.data.mlm_probability, "whole_word": config.data.whole_word_masking})
  targets = None
  if config.task == "regression":
    targets = np.asarray([r["label"] for r in train_records], np.float64).reshape(len(train_records), -1)
  return objectives.build(config.task, names, label_smoothing=config.train.label_smoothing,
                          threshold=config.eval.threshold, train_targets=targets,
                          standardize=config.data.standardize_targets)


def _report_unseen(records: data_lib.Records) -> None:
  if records.unseen:
    shown = ", ".join(f"{label!r} ({n})" for label, n in sorted(records.unseen.items(), key=str)[:10])
    log.warning("%s: %d label(s) never seen in training were ignored (data.unseen_labels='ignore'): %s",
                records.source, len(records.unseen), shown)


def build_task(config: ml_collections.ConfigDict, mesh: Mesh | None, *, with_train_data: bool = True) -> Task:
  train_records = load_split(config, "train")
  tokenizer = make_tokenizer(config)
  label_names = list(train_records.vocab.names)
  if config.model.num_labels and config.model.num_labels != len(label_names):
    what = "regression targets" if config.task == "regression" else "labels"
    raise ConfigError(f"config.model.num_labels={config.model.num_labels} but the training data has "
                      f"{len(label_names)} {what} {label_names[:10]}; leave it unset to take the data's")
  objective = build_objective(config, train_records, tokenizer)
  model, pretrained = build_model(config, len(label_names), tokenizer.vocab_size)
  if config.task == "masked_lm":
    objective = dataclasses.replace(objective, vocab_size=model.vocab_size)
  if config.model.init_from:
    if pretrained is None:
      pretrained = jax.tree.map(np.asarray, models.init_params(model, jax.random.key(config.seed)))
    pretrained = init_from_run(config, model, pretrained)
  seq_len = config.model.max_len * (hierarchical_chunks(config) or 1)  # a row's tokens

  def init_params():
    return models.init_params(model, jax.random.key(config.seed), boxed=True)

  train_batches = None
  if with_train_data:
    d = config.data
    train_batches = data_lib.make_batches(
      train_records, tokenizer, batch_size=local_batch_size(config.train.batch_size), pack=d.packing,
      max_docs_per_row=d.max_docs_per_row if d.packing else None, shuffle=d.shuffle, seed=config.seed,
      num_epochs=None, num_workers=d.num_workers, chunks=hierarchical_chunks(config))

  # The split evaluated (dev while training, data.eval_split in eval.py) is read now: a mistake in
  # its file then stops the run before anything compiles, not at the first evaluation.
  records = {"train": train_records}
  first_eval = "dev" if with_train_data else config.data.eval_split
  records[first_eval] = load_split(config, first_eval)
  _report_unseen(records[first_eval])

  def eval_batches(split: str, max_batches: int | None = None):
    if split not in records:
      records[split] = load_split(config, split)
      _report_unseen(records[split])
    split_records = records[split]
    chosen = sample_documents(split_records, max_batches, eval_batch_size(config))
    batches = planned_eval_batches(config, [split_records[i]["text"] for i in chosen],
                                   [split_records[i]["label"] for i in chosen], tokenizer, mesh,
                                   objective.label_spec)
    return batches, len(batches)

  def predict_batches(texts: list[str]) -> list[dict]:
    return planned_eval_batches(config, texts, None, tokenizer, mesh, objective.label_spec)

  return Task(logits_fn=make_logits_fn(model, per_token=objective.per_token, mlm=config.task == "masked_lm",
                                       chunks=hierarchical_chunks(config)), init_params=init_params,
              pretrained_params=pretrained,
              label_names=label_names, train_batches=train_batches, eval_batches=eval_batches,
              predict_batches=predict_batches,
              seq_len=seq_len, model=model, objective=objective)

