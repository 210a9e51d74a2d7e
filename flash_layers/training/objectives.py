"""What each `config.task` predicts, and how it is trained, scored and written out.

One `Objective` per task. The loop, evaluation, prediction and export ask it and know no task:

  classification
    a label slot (batch["labels"][b, d]): an int class id, -1 = none
    loss: softmax cross-entropy; metrics: accuracy, macro_f1
  multi_label_classification
    a slot: a multi-hot row [L], all -1 = none
    loss: sigmoid binary cross-entropy, the mean over the L labels
    metrics: micro_f1, macro_f1, samples_f1 at the threshold(s); mean_average_precision
  regression
    a slot: float targets [K], NaN = none
    loss: squared error, the mean over the K targets
    metrics: mse, mae, pearson, spearman (per target, then averaged)
  token_classification
    labels per token ([batch, length]): a word's tag id at its first piece, -1 elsewhere
    loss: softmax cross-entropy over the tagged tokens
    metrics: entity_f1, entity_precision, entity_recall (seqeval's default chunking), the same with
    _strict (seqeval's strict IOB2), token_accuracy; over words, each predicted once
  masked_lm
    per token: (id or -1, starts a word); `prepare` masks the batch on device, redrawn every step
    loss: softmax cross-entropy over the vocabulary at the masked tokens
    metrics: mlm_loss, mlm_accuracy, perplexity, and the same for positions < 512 and >= 512

The model's logits are [batch, max_docs, C] (C = classes, labels or targets); a document is the
mean (or max) of its windows' logits (data.eval_plan.aggregate_logits) before it is scored.

Each objective also has a small JSON `head` stored with every checkpoint (checkpoint.py) and read
back by eval.py, prediction and export: the multi-label decision thresholds (fixed, or tuned on dev
at each dev evaluation with config.eval.threshold = "tune" / "tune_per_label"), and the regression
targets' mean and std (from the training split, when data.standardize_targets: the model then
learns standardized targets, and its outputs are mapped back; export folds the map into the head).
The metrics' definitions are in training/task_metrics.py and docs/training.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flash_layers.data.readers import LabelSpec
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import task_metrics

TASKS = ("classification", "multi_label_classification", "regression", "token_classification", "masked_lm")
# Which reader label kind each task reads (data.readers.LABEL_KINDS).
LABEL_KINDS = {"classification": "single", "multi_label_classification": "multi", "regression": "values",
               "token_classification": "tags", "masked_lm": "none"}
# transformers' config.problem_type for each task (export writes it; token classification has none).
PROBLEM_TYPES = {"classification": "single_label_classification",
                 "multi_label_classification": "multi_label_classification", "regression": "regression",
                 "token_classification": None, "masked_lm": None}
# Dev metrics a best checkpoint may be chosen by, the task's default first.
BEST_METRICS = {"classification": ("accuracy", "macro_f1", "loss"),
                "multi_label_classification": ("micro_f1", "macro_f1", "samples_f1", "mean_average_precision",
                                               "loss"),
                "regression": ("mse", "mae", "pearson", "spearman", "loss"),
                "token_classification": ("entity_f1", "entity_f1_strict", "token_accuracy", "loss"),
                "masked_lm": ("mlm_loss", "mlm_accuracy", "loss")}
LOWER_IS_BETTER = frozenset({"loss", "mse", "mae", "mlm_loss"})
THRESHOLD_MODES = ("tune", "tune_per_label")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
  shifted = logits - logits.max(axis=-1, keepdims=True) if logits.size else logits
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


@dataclasses.dataclass(frozen=True)
class Objective:
  """The interface; see the module doc. `names`: the class, label or target names, in id order."""

  task: str
  names: tuple

  @property
  def num_outputs(self) -> int:
    return len(self.names)

  @property
  def label_spec(self) -> LabelSpec:
    return LabelSpec(LABEL_KINDS[self.task], self.num_outputs)

  @property
  def problem_type(self) -> str:
    return PROBLEM_TYPES[self.task]

  @property
  def per_token(self) -> bool:
    return self.label_spec.per_token

  @property
  def headline(self) -> tuple[str, ...]:
    """The metrics the console shows."""
    return BEST_METRICS[self.task][:2]

  # -- on device, inside the train step ---------------------------------------

  def prepare(self, batch: dict, rng: jax.Array) -> dict:
    """The batch the model sees (masked-LM masks it with `rng`); the others leave it as it is."""
    return batch

  def weights(self, labels: jax.Array) -> jax.Array:
    """[batch, max_docs] float32: 1 for a slot holding a labelled document."""
    raise NotImplementedError

  def loss_sums(self, logits: jax.Array, labels: jax.Array) -> dict:
    """{"loss_sum", "count", "stats": {...}}: sums over the slots, so micro-batches and shards add."""
    raise NotImplementedError

  # -- on the host ------------------------------------------------------------

  def window_summary(self, stats: dict) -> dict:
    """Training metrics of a log window from its summed `stats`."""
    raise NotImplementedError

  def present(self, labels: np.ndarray) -> np.ndarray:
    """[n] bool: which of n document labels ([n, *label_spec.shape]) are labels, not empty."""
    raise NotImplementedError

  def head(self) -> dict:
    """The JSON head stored with a checkpoint (module doc)."""
    return {}

  def with_head(self, head: dict | None) -> Objective:
    """This objective with a checkpoint's head (None: unchanged)."""
    return self

  def tune(self, logits: np.ndarray, labels: np.ndarray) -> Objective:
    """This objective with its head tuned on dev documents' logits and labels (multi-label only)."""
    return self

  def score(self, logits: np.ndarray, labels: np.ndarray) -> dict:
    """Loss and metrics of documents' logits [n, C] against their labels (all present)."""
    raise NotImplementedError

  def predict(self, logits: np.ndarray) -> list[dict]:
    """One JSON-ready record per document's logits [n, C]."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Classification(Objective):
  label_smoothing: float = 0.0

  def weights(self, labels):
    return (labels >= 0).astype(jnp.float32)

  def loss_sums(self, logits, labels):
    weights = self.weights(labels)
    targets = jax.nn.one_hot(jnp.maximum(labels, 0), self.num_outputs)
    if self.label_smoothing:
      targets = optax.smooth_labels(targets, self.label_smoothing)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    confusion = metrics_lib.confusion_matrix(jnp.argmax(logits, axis=-1), labels, weights, self.num_outputs)
    return {"loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights),
            "stats": {"confusion": confusion}}

  def window_summary(self, stats):
    return metrics_lib.summarize(np.asarray(stats["confusion"], np.int64))

  def present(self, labels):
    return np.asarray(labels) >= 0

  def score(self, logits, labels):
    log_probs = _log_softmax(np.asarray(logits, np.float64))
    truth = np.asarray(labels, np.int64)
    confusion = np.zeros((self.num_outputs, self.num_outputs), np.int64)
    np.add.at(confusion, (truth, np.argmax(log_probs, axis=-1)), 1)
    count = len(truth)
    loss = float(-log_probs[np.arange(count), truth].sum() / max(count, 1))
    return {"loss": loss, **metrics_lib.summarize(confusion), "confusion_matrix": confusion}

  def predict(self, logits):
    probabilities = np.exp(_log_softmax(np.asarray(logits, np.float64)))
    return [{"prediction": self.names[int(np.argmax(p))],
             "probabilities": {str(n): round(float(v), 6) for n, v in zip(self.names, p, strict=True)}}
            for p in probabilities]


@dataclasses.dataclass(frozen=True)
class MultiLabel(Objective):
  """Sigmoid outputs; a label is predicted when its probability is >= its threshold."""

  thresholds: tuple[float, ...] = ()
  threshold_mode: str | float = 0.5  # config.eval.threshold: a number, "tune" or "tune_per_label"

  def __post_init__(self):
    if not self.thresholds:
      fixed = 0.5 if isinstance(self.threshold_mode, str) else float(self.threshold_mode)
      object.__setattr__(self, "thresholds", (fixed,) * self.num_outputs)
    if len(self.thresholds) != self.num_outputs:
      raise ValueError(f"{len(self.thresholds)} thresholds for {self.num_outputs} labels")

  def weights(self, labels):
    return (labels[..., 0] >= 0).astype(jnp.float32)

  def loss_sums(self, logits, labels):
    weights = self.weights(labels)
    logits = logits.astype(jnp.float32)
    targets = jnp.maximum(labels, 0).astype(jnp.float32)
    losses = optax.sigmoid_binary_cross_entropy(logits, targets).mean(axis=-1)
    predicted = (logits >= 0).astype(jnp.int32) * weights[..., None].astype(jnp.int32)
    gold = jnp.maximum(labels, 0) * weights[..., None].astype(jnp.int32)
    flat = lambda x: x.reshape(-1, self.num_outputs).sum(axis=0)
    stats = {"true_pos": flat(predicted * gold), "false_pos": flat(predicted * (1 - gold)),
             "false_neg": flat((1 - predicted) * gold)}
    return {"loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights), "stats": stats}

  def window_summary(self, stats):
    tp, fp, fn = (int(np.sum(stats[k])) for k in ("true_pos", "false_pos", "false_neg"))
    return {"micro_f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0}

  def present(self, labels):
    return np.asarray(labels)[:, 0] >= 0

  def head(self):
    return {"thresholds": [float(t) for t in self.thresholds]}

  def with_head(self, head):
    if not head or "thresholds" not in head:
      return self
    return dataclasses.replace(self, thresholds=tuple(float(t) for t in head["thresholds"]))

  def tune(self, logits, labels):
    if self.threshold_mode not in THRESHOLD_MODES or len(labels) == 0:
      return self
    probabilities = _sigmoid(np.asarray(logits, np.float64))
    thresholds = task_metrics.tune_thresholds(np.asarray(labels) > 0, probabilities, self.threshold_mode)
    return dataclasses.replace(self, thresholds=tuple(float(t) for t in thresholds))

  def score(self, logits, labels):
    logits = np.asarray(logits, np.float64)
    gold = np.asarray(labels) > 0
    probabilities = _sigmoid(logits)
    # Binary cross-entropy from logits, stably: max(x, 0) - x * y + log(1 + exp(-|x|)).
    bce = np.maximum(logits, 0) - logits * gold + np.log1p(np.exp(-np.abs(logits)))
    predicted = probabilities >= np.asarray(self.thresholds)[None, :]
    return {"loss": float(bce.mean()) if bce.size else float("nan"),
            **task_metrics.multi_label_scores(gold, predicted),
            "mean_average_precision": task_metrics.mean_average_precision(gold, probabilities),
            "thresholds": list(self.thresholds)}

  def predict(self, logits):
    probabilities = _sigmoid(np.asarray(logits, np.float64))
    thresholds = np.asarray(self.thresholds)
    return [{"labels": [self.names[i] for i in np.flatnonzero(p >= thresholds)],
             "scores": {str(n): float(v) for n, v in zip(self.names, p, strict=True)}}
            for p in probabilities]


@dataclasses.dataclass(frozen=True)
class Regression(Objective):
  """The model predicts (target - mean) / std; with standardization off, mean 0 and std 1."""

  mean: tuple[float, ...] = ()
  std: tuple[float, ...] = ()

  def __post_init__(self):
    if not self.mean:
      object.__setattr__(self, "mean", (0.0,) * self.num_outputs)
      object.__setattr__(self, "std", (1.0,) * self.num_outputs)

  @classmethod
  def from_targets(cls, names: Sequence, targets: np.ndarray, standardize: bool) -> Regression:
    """Mean and std of the training targets [n, K] (std 1 where a target is constant)."""
    if not standardize:
      return cls("regression", tuple(names))
    targets = np.asarray(targets, np.float64).reshape(len(targets), len(names))
    std = targets.std(axis=0)
    return cls("regression", tuple(names), mean=tuple(float(m) for m in targets.mean(axis=0)),
               std=tuple(float(s) if s > 0 else 1.0 for s in std))

  def weights(self, labels):
    return jnp.isfinite(labels[..., 0]).astype(jnp.float32)

  def loss_sums(self, logits, labels):
    weights = self.weights(labels)
    mean, std = jnp.asarray(self.mean, jnp.float32), jnp.asarray(self.std, jnp.float32)
    logits = logits.astype(jnp.float32)
    targets = jnp.where(weights[..., None] > 0, labels, 0.0)
    losses = jnp.mean(jnp.square(logits - (targets - mean) / std), axis=-1)
    error = (logits * std + mean - targets) * weights[..., None]
    stats = {"squared_error": jnp.sum(jnp.square(error)), "absolute_error": jnp.sum(jnp.abs(error)),
             "values": jnp.sum(weights) * self.num_outputs}
    return {"loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights), "stats": stats}

  def window_summary(self, stats):
    values = max(float(np.sum(stats["values"])), 1.0)
    return {"mse": float(np.sum(stats["squared_error"])) / values,
            "mae": float(np.sum(stats["absolute_error"])) / values}

  def present(self, labels):
    return np.isfinite(np.asarray(labels, np.float64)[:, 0])

  def head(self):
    return {"target_mean": list(self.mean), "target_std": list(self.std)}

  def with_head(self, head):
    if not head or "target_mean" not in head:
      return self
    return dataclasses.replace(self, mean=tuple(head["target_mean"]), std=tuple(head["target_std"]))

  def values(self, logits: np.ndarray) -> np.ndarray:
    """The model's outputs [n, K] in the targets' units."""
    return np.asarray(logits, np.float64) * np.asarray(self.std) + np.asarray(self.mean)

  def score(self, logits, labels):
    labels = np.asarray(labels, np.float64)
    standardized = (labels - np.asarray(self.mean)) / np.asarray(self.std)
    errors = np.asarray(logits, np.float64) - standardized
    loss = float(np.mean(np.square(errors))) if labels.size else float("nan")
    return {"loss": loss, **task_metrics.regression_scores(labels, self.values(logits))}

  def predict(self, logits):
    values = self.values(logits)
    if self.num_outputs == 1:
      return [{"value": float(v[0])} for v in values]
    return [{"values": {str(n): float(x) for n, x in zip(self.names, v, strict=True)}}
            for v in values]


@dataclasses.dataclass(frozen=True)
class TokenClassification(Objective):
  """A tag per word, from its first word-piece; evaluation scores each word once (data.eval_plan)."""

  def weights(self, labels):
    return (labels >= 0).astype(jnp.float32)

  def loss_sums(self, logits, labels):
    weights = self.weights(labels)
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32) * weights
    return {"loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights),
            "stats": {"correct": jnp.sum(correct), "tokens": jnp.sum(weights)}}

  def window_summary(self, stats):
    return {"token_accuracy": float(np.sum(stats["correct"])) / max(float(np.sum(stats["tokens"])), 1.0)}

  def predicted_tags(self, word_logits: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Tag ids [W]: the argmax where a word was scored, "O" where it was in no window."""
    outside = self.names.index("O") if "O" in self.names else 0
    return np.where(seen, np.argmax(word_logits, axis=-1) if len(word_logits) else outside, outside)

  def _split(self, flat: np.ndarray, doc_words: Sequence[int]) -> list[list[str]]:
    bounds = np.cumsum([0, *doc_words])
    return [[self.names[t] for t in flat[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

  def score_words(self, word_logits: np.ndarray, seen: np.ndarray, doc_words: Sequence[int],
                  doc_tags: Sequence[np.ndarray]) -> dict:
    """Metrics over every word of the documents; `word_logits` [W, L] where `seen`."""
    gold = np.concatenate([np.asarray(t, np.int64) for t in doc_tags]) if doc_tags else np.zeros(0, np.int64)
    log_probs = _log_softmax(np.asarray(word_logits[seen], np.float64))
    loss = float(-log_probs[np.arange(len(log_probs)), gold[seen]].mean()) if len(log_probs) else float("nan")
    predicted, golden = (self._split(x, doc_words) for x in (self.predicted_tags(word_logits, seen), gold))
    lenient = task_metrics.entity_scores(golden, predicted, "default")
    strict = task_metrics.entity_scores(golden, predicted, "strict")
    return {"loss": loss, "entity_f1": lenient["f1"], "entity_precision": lenient["precision"],
            "entity_recall": lenient["recall"], "entity_f1_strict": strict["f1"],
            "entity_precision_strict": strict["precision"], "entity_recall_strict": strict["recall"],
            "token_accuracy": lenient["token_accuracy"], "words_scored": int(seen.sum())}

  def predict_words(self, word_logits: np.ndarray, seen: np.ndarray, doc_words: Sequence[int]) -> list[dict]:
    return [{"tags": tags} for tags in self._split(self.predicted_tags(word_logits, seen), doc_words)]


# Positions at and past this one are beyond a 512-row checkpoint's position table: masked-LM
# reports its loss on either side (Longformer's check of copied positions).
POSITION_SPLIT = 512


@dataclasses.dataclass(frozen=True)
class MaskedLM(Objective):
  """Dynamic masking (BERT's recipe): each maskable token (not special, not padding), or with
  `whole_word` each word, is chosen with `probability`; a chosen token becomes mask_id 80% of the
  time, a uniformly random id 10%, and stays 10%. Drawn on device from the step's key, so every
  step (and a resumed run) draws its own masks, the same for any number of devices."""

  vocab_size: int = 0
  mask_id: int = 0
  probability: float = 0.15
  whole_word: bool = False

  @property
  def num_outputs(self) -> int:
    return self.vocab_size

  @property
  def label_spec(self) -> LabelSpec:
    return LabelSpec("none")

  @property
  def headline(self) -> tuple[str, ...]:
    return ("mlm_accuracy", "perplexity")

  def prepare(self, batch, rng):
    table = batch["labels"]  # [b, t, 2]: id or -1, word start
    original, starts = table[..., 0], table[..., 1] > 0
    maskable = original >= 0
    choose, action, replacement = jax.random.split(rng, 3)
    draw = jax.random.uniform(choose, original.shape)
    if self.whole_word:  # every piece of a word takes its first piece's draw
      index = jnp.broadcast_to(jnp.arange(original.shape[1]), original.shape)
      first = jax.lax.cummax(jnp.where(starts | ~maskable, index, 0), axis=1)
      draw = jnp.take_along_axis(draw, first, axis=1)
    masked = maskable & (draw < self.probability)
    how = jax.random.uniform(action, original.shape)
    random_ids = jax.random.randint(replacement, original.shape, 0, self.vocab_size, jnp.int32)
    ids = jnp.where(masked & (how < 0.8), self.mask_id,
                    jnp.where(masked & (how >= 0.8) & (how < 0.9), random_ids, batch["input_ids"]))
    targets = jnp.where(masked, original, -1)
    far = (batch["positions"] >= POSITION_SPLIT).astype(jnp.int32)
    return {**batch, "input_ids": ids.astype(batch["input_ids"].dtype),
            "labels": jnp.stack([targets, far], -1)}

  def weights(self, labels):
    return (labels[..., 0] >= 0).astype(jnp.float32)

  def loss_sums(self, logits, labels):
    targets, far = labels[..., 0], labels[..., 1] > 0
    weights = self.weights(labels)
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0)) * weights
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weights
    split = lambda x: jnp.stack([jnp.sum(jnp.where(far, 0, x)), jnp.sum(jnp.where(far, x, 0))])
    return {"loss_sum": jnp.sum(losses), "count": jnp.sum(weights),
            "stats": {"loss": split(losses), "correct": split(correct), "count": split(weights)}}

  def window_summary(self, stats):
    return self.summarize(stats)

  def summarize(self, stats: dict) -> dict:
    """mlm_loss, mlm_accuracy, perplexity over all masked tokens and on either side of POSITION_SPLIT."""
    loss, correct, count = (np.asarray(stats[k], np.float64).reshape(-1, 2).sum(0)
                            for k in ("loss", "correct", "count"))
    out = {}
    for suffix, part in (("", slice(None)), (f"_below_{POSITION_SPLIT}", 0), (f"_from_{POSITION_SPLIT}", 1)):
      n = float(np.sum(count[part]))
      mean = float(np.sum(loss[part])) / n if n else float("nan")
      out[f"mlm_loss{suffix}"] = mean
      out[f"mlm_accuracy{suffix}"] = float(np.sum(correct[part])) / n if n else float("nan")
      out[f"perplexity{suffix}"] = float(np.exp(mean)) if n else float("nan")
      out[f"masked_tokens{suffix}"] = int(n)
    return out


def build(task: str, names: Sequence, *, label_smoothing: float = 0.0, threshold: float | str = 0.5,
          train_targets: np.ndarray | None = None, standardize: bool = False,
          mlm: dict | None = None) -> Objective:
  """The objective of `task` over `names` (classes, labels or targets); `mlm`: MaskedLM's fields."""
  names = tuple(names)
  if task == "classification":
    return Classification(task, names, label_smoothing=label_smoothing)
  if task == "multi_label_classification":
    return MultiLabel(task, names, threshold_mode=threshold)
  if task == "regression":
    targets = np.zeros((0, len(names))) if train_targets is None else train_targets
    return Regression.from_targets(names, targets, standardize)
  if task == "token_classification":
    return TokenClassification(task, names)
  if task == "masked_lm":
    return MaskedLM(task, (), **(mlm or {}))
  raise ValueError(f"task must be one of {TASKS}; got {task!r}")


def head_json(objective: Objective) -> str:
  return json.dumps({"task": objective.task, **objective.head()})
