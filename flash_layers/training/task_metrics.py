"""Host-side metrics of document tasks, in NumPy: multi-label, ranking, thresholds, regression, entities.

Each function checks its inputs and raises a ValueError naming the argument. It returns Python floats
(or a float64 array, from `tune_thresholds`). The definitions follow scikit-learn (>= 1.3, with
``zero_division=0``), SciPy and seqeval. A ratio whose denominator is 0 is 0, not nan, unless
stated otherwise.

multi_label_scores(gold, predicted), both 0/1 arrays [N, L]. tp, fp and fn count (document, label)
pairs:
  micro_precision = tp / (tp + fp), 0 when tp + fp == 0
  micro_recall = tp / (tp + fn), 0 when tp + fn == 0
  micro_f1 = 2 tp / (2 tp + fp + fn), 0 when tp + fp + fn == 0
  macro_f1 = the unweighted mean over all L labels of label l's F1 = 2 tp_l / (2 tp_l + fp_l + fn_l).
    A label that is never gold and never predicted scores 0 and still counts in the mean.
  samples_f1 = the mean over the N documents of the F1 between a document's gold set and its predicted
    set. A document whose two sets are both empty scores 0.
  N == 0 makes every value nan. L must be at least 1.

average_precision(gold [N], scores [N]) is scikit-learn's average_precision_score:
  AP = sum_k (R_k - R_{k-1}) P_k. Here t_1 > t_2 > ... are the distinct scores, P_k and R_k are the
  precision and recall of `scores >= t_k`, and R_0 = 0. Tied scores form one step, and there is no
  interpolation. AP is nan when gold has no positive.
mean_average_precision(gold [N, L], scores [N, L]) = the mean of AP over the labels that have at least
  one gold positive; nan if no label has one.

tune_thresholds(gold [N, L], scores [N, L] in [0, 1], mode) returns thresholds [L]. The predictions are
`scores >= threshold`.
  "tune": one threshold, repeated L times, that maximizes micro_f1.
  "tune_per_label": label l's threshold maximizes label l's F1.
  The candidates are the distinct scores (so every split by score can be made) and 0.5. When candidates
  tie on F1, the one nearest 0.5 wins (distance |t - 0.5| in float64), then the smaller one. If a
  label (or, for "tune", every label) has no gold positive, F1 is 0 at every threshold. Its threshold
  is then max(0.5, the next float above its largest score), so it predicts nothing. Each label takes
  one sort: O(N L log N) in all; "tune" sorts the N L scores once.

regression_scores(gold [N, K], predicted [N, K]); 1-D inputs are treated as [N, 1]:
  mse, mae = the mean squared and mean absolute error over all N K values.
  pearson = the Pearson correlation of each column, averaged over the columns.
  spearman = the same for the columns' average ranks: tied values share the mean of their ranks, as
    in scipy.stats.spearmanr.
  A column is nan when its gold or its prediction is constant (so always when N < 2). The average
  skips nan columns, and is nan only when every column is nan. N == 0 makes every value nan.

entity_scores(gold_tags, predicted_tags, mode) gives seqeval's entity-level scores. Entities are
(sentence, type, start, end) tuples. A predicted entity is correct when an identical gold entity
exists. The scores are micro over types: precision = correct / predicted, recall = correct / gold,
f1 = 2 p r / (p + r), each 0 when its denominator is 0. per_type holds the same f1 for each type that
occurs in gold or predicted. token_accuracy is the fraction of positions whose tags are equal (nan
when there are no tokens).
  mode "default" is seqeval's default: conlleval-style chunks, as in
    seqeval.metrics.sequence_labeling.get_entities. A chunk starts at B-X or S-X, or at I-X or E-X
    that follows O, E-, S- or a different type (so an I- after O starts a chunk). It ends before B-,
    S-, O or a different type, and after E- or S-. Allowed tags are O, B-X, I-X, E-X and S-X, plus the bare
    prefixes B, I, E and S (type "_"); these are exactly the tags seqeval takes without a warning.
  mode "strict" is seqeval's mode="strict" with scheme=IOB2. An entity is B-X followed by the longest
    run of I-X of the same type. An I-X that does not continue a B-X or I-X of type X belongs to no
    entity. Allowed tags are O, B-X and I-X (and bare B and I).
  Any other tag raises a ValueError, naming the sentence and the position. This includes a bare type
  such as "PER". seqeval would instead split it into prefix "P" and type "ER" (with a warning), and it
  would read "ORG" as an O tag.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

_NAN = float("nan")


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------

def _binary(name: str, x: np.ndarray, ndim: int) -> np.ndarray:
  """x as a bool array of `ndim` dimensions; it must hold only booleans or 0/1."""
  try:
    x = np.asarray(x)
  except ValueError as e:  # ragged nested lists
    raise ValueError(f"{name} must be an array: {e}") from None
  if x.ndim != ndim:
    raise ValueError(f"{name} must be a {ndim}-D array, got shape {x.shape}")
  if x.dtype != bool:
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)) \
        or not np.isin(x, (0, 1)).all():
      raise ValueError(f"{name} must hold booleans or 0/1 values only")
    x = x != 0
  return x


def _real(name: str, x: np.ndarray, ndim: int | tuple[int, ...], unit: bool = False) -> np.ndarray:
  """x as a finite float64 array of `ndim` dimensions (one of them); in [0, 1] if `unit`."""
  try:
    x = np.asarray(x, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be a numeric array: {e}") from None
  dims = (ndim,) if isinstance(ndim, int) else ndim
  if x.ndim not in dims:
    raise ValueError(f"{name} must be a {' or '.join(map(str, dims))}-D array, got shape {x.shape}")
  if not np.isfinite(x).all():
    raise ValueError(f"{name} must be finite (no nan or inf)")
  if unit and x.size and (x.min() < 0 or x.max() > 1):
    raise ValueError(f"{name} must lie in [0, 1], got values in [{x.min()}, {x.max()}]")
  return x


def _same_shape(name: str, x: np.ndarray, gold: np.ndarray) -> None:
  if x.shape != gold.shape:
    raise ValueError(f"{name} has shape {x.shape} but gold has shape {gold.shape}: they must match")


def _ratios(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
  """numerator / denominator elementwise, 0 where the denominator is 0."""
  numerator = np.asarray(numerator, np.float64)
  denominator = np.asarray(denominator, np.float64)
  return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def _ratio(numerator: float, denominator: float) -> float:
  return float(numerator / denominator) if denominator else 0.0


# ----------------------------------------------------------------------------
# Multi-label classification
# ----------------------------------------------------------------------------

def multi_label_scores(gold: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
  """micro_f1, micro_precision, micro_recall, macro_f1, samples_f1 of 0/1 arrays [N, L] (module doc)."""
  gold = _binary("gold", gold, 2)
  predicted = _binary("predicted", predicted, 2)
  _same_shape("predicted", predicted, gold)
  if gold.shape[1] == 0:
    raise ValueError("gold must have at least one label (shape [N, L] with L >= 1)")
  keys = ("micro_f1", "micro_precision", "micro_recall", "macro_f1", "samples_f1")
  if gold.shape[0] == 0:
    return dict.fromkeys(keys, _NAN)
  tp = gold & predicted
  fp = ~gold & predicted
  fn = gold & ~predicted
  tp_sum, fp_sum, fn_sum = int(tp.sum()), int(fp.sum()), int(fn.sum())
  per_label = _ratios(2 * tp.sum(0), 2 * tp.sum(0) + fp.sum(0) + fn.sum(0))
  per_document = _ratios(2 * tp.sum(1), 2 * tp.sum(1) + fp.sum(1) + fn.sum(1))
  return {
    "micro_f1": _ratio(2 * tp_sum, 2 * tp_sum + fp_sum + fn_sum),
    "micro_precision": _ratio(tp_sum, tp_sum + fp_sum),
    "micro_recall": _ratio(tp_sum, tp_sum + fn_sum),
    "macro_f1": float(per_label.mean()),
    "samples_f1": float(per_document.mean()),
  }


# ----------------------------------------------------------------------------
# Ranking
# ----------------------------------------------------------------------------

def _threshold_steps(gold: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """For the distinct scores t_1 > t_2 > ...: (t_k, the true positives of `scores >= t_k`, its size)."""
  order = np.argsort(-scores, kind="stable")
  sorted_scores = scores[order]
  last = np.append(np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]), scores.size - 1)
  true_positives = np.cumsum(gold[order], dtype=np.int64)[last]
  return sorted_scores[last], true_positives, last + 1


def _average_precision(gold: np.ndarray, scores: np.ndarray) -> float:
  positives = int(gold.sum())
  if positives == 0:
    return _NAN
  _, true_positives, predicted = _threshold_steps(gold, scores)
  precision = true_positives / predicted
  recall = true_positives / positives
  return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def average_precision(gold: np.ndarray, scores: np.ndarray) -> float:
  """scikit-learn's average_precision_score of one label: gold 0/1 [N], scores [N]; nan without positives."""
  gold = _binary("gold", gold, 1)
  scores = _real("scores", scores, 1)
  _same_shape("scores", scores, gold)
  return _average_precision(gold, scores)


def mean_average_precision(gold: np.ndarray, scores: np.ndarray) -> float:
  """The mean of average_precision over the labels (columns of [N, L]) with a gold positive; nan if none."""
  gold = _binary("gold", gold, 2)
  scores = _real("scores", scores, 2)
  _same_shape("scores", scores, gold)
  values = [_average_precision(gold[:, j], scores[:, j]) for j in np.flatnonzero(gold.any(axis=0))]
  return float(np.mean(values)) if values else _NAN


# ----------------------------------------------------------------------------
# Decision thresholds
# ----------------------------------------------------------------------------

def _best_threshold(gold: np.ndarray, scores: np.ndarray) -> float:
  """The threshold t maximizing the F1 of `scores >= t` against gold (1-D), ties as in the module doc."""
  positives = int(gold.sum())
  if positives == 0:  # F1 is 0 at every threshold: predict nothing
    return max(0.5, float(np.nextafter(scores.max(), np.inf))) if scores.size else 0.5
  values, true_positives, predicted = _threshold_steps(gold, scores)
  at_half = scores >= 0.5
  candidates = np.append(values, 0.5)
  true_positives = np.append(true_positives, np.count_nonzero(gold & at_half))
  predicted = np.append(predicted, np.count_nonzero(at_half))
  f1 = 2 * true_positives / (predicted + positives)  # = 2 tp / (2 tp + fp + fn)
  best = np.lexsort((candidates, np.abs(candidates - 0.5), -f1))[0]
  return float(candidates[best])


def tune_thresholds(gold: np.ndarray, scores: np.ndarray, mode: str) -> np.ndarray:
  """Decision thresholds [L] maximizing F1 of `scores >= t`: mode "tune" (one global, micro F1) or
  "tune_per_label" (each label's own F1). Candidates and tie-breaking: module doc."""
  if mode not in ("tune", "tune_per_label"):
    raise ValueError(f"mode must be 'tune' or 'tune_per_label', got {mode!r}")
  gold = _binary("gold", gold, 2)
  scores = _real("scores", scores, 2, unit=True)
  _same_shape("scores", scores, gold)
  num_labels = gold.shape[1]
  if mode == "tune":
    return np.full(num_labels, _best_threshold(gold.ravel(), scores.ravel()), np.float64)
  return np.array([_best_threshold(gold[:, j], scores[:, j]) for j in range(num_labels)], np.float64)


# ----------------------------------------------------------------------------
# Regression
# ----------------------------------------------------------------------------

def _regression_input(name: str, x: np.ndarray) -> np.ndarray:
  x = _real(name, x, (1, 2))
  x = x[:, None] if x.ndim == 1 else x
  if x.shape[1] == 0:
    raise ValueError(f"{name} must have at least one column, got shape {x.shape}")
  return x


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson's r of two vectors (as scipy.stats.pearsonr); nan if either is constant."""
  if x.size < 2 or (x == x[0]).all() or (y == y[0]).all():
    return _NAN
  x = x - x.mean()
  y = y - y.mean()
  r = np.dot(x / np.linalg.norm(x), y / np.linalg.norm(y))
  return float(np.clip(r, -1.0, 1.0))


def _average_ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks of x, ties sharing the mean of their ranks (scipy.stats.rankdata's "average")."""
  order = np.argsort(x, kind="stable")
  sorted_x = x[order]
  starts = np.append(0, np.flatnonzero(sorted_x[1:] != sorted_x[:-1]) + 1)
  ends = np.append(starts[1:], x.size)
  ranks = np.empty(x.size, np.float64)
  ranks[order] = np.repeat((starts + 1 + ends) / 2, ends - starts)
  return ranks


def _mean_skipping_nan(values: list[float]) -> float:
  kept = [v for v in values if not np.isnan(v)]
  return float(np.mean(kept)) if kept else _NAN


def regression_scores(gold: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
  """mse, mae, pearson, spearman of [N, K] (or [N]) arrays; correlations per column, averaged (module doc)."""
  gold = _regression_input("gold", gold)
  predicted = _regression_input("predicted", predicted)
  _same_shape("predicted", predicted, gold)
  if gold.shape[0] == 0:
    return dict.fromkeys(("mse", "mae", "pearson", "spearman"), _NAN)
  error = predicted - gold
  columns = range(gold.shape[1])
  return {
    "mse": float(np.mean(error ** 2)),
    "mae": float(np.mean(np.abs(error))),
    "pearson": _mean_skipping_nan([_pearson(gold[:, k], predicted[:, k]) for k in columns]),
    "spearman": _mean_skipping_nan([_pearson(_average_ranks(gold[:, k]), _average_ranks(predicted[:, k]))
                                    for k in columns]),
  }


# ----------------------------------------------------------------------------
# Entities (seqeval)
# ----------------------------------------------------------------------------

def _parse_tags(tags: Sequence[str], mode: str, name: str, sentence: int) -> tuple[list[str], list[str]]:
  """(prefixes, types) of one sentence's tags; O is ("O", "_"), as in seqeval; see the module doc."""
  allowed = "BIES" if mode == "default" else "BI"
  prefixes, types = [], []
  for position, tag in enumerate(tags):
    if tag == "O":
      prefixes.append("O")
      types.append("_")
    elif isinstance(tag, str) and tag[:1] and tag[0] in allowed and tag[1:2] in ("", "-"):
      prefixes.append(tag[0])
      # seqeval's two readings of the type, which differ only for tags like "B-X-" or "B--X".
      types.append((tag[1:].split("-", 1)[-1] if mode == "default" else tag[1:].strip("-")) or "_")
    else:
      raise ValueError(f"{name}[{sentence}][{position}] = {tag!r} is not a tag of mode {mode!r}: expected "
                       f"'O' or a prefix in {'/'.join(allowed)} followed by '-TYPE'")
  return prefixes, types


def _chunk_ends(prev_prefix: str, prefix: str, prev_type: str, type_: str) -> bool:
  """seqeval's end_of_chunk: a chunk ended just before the current tag."""
  return (prev_prefix in ("E", "S") or (prev_prefix in ("B", "I") and prefix in ("B", "S", "O"))
          or (prev_prefix != "O" and prev_type != type_))


def _chunk_starts(prev_prefix: str, prefix: str, prev_type: str, type_: str) -> bool:
  """seqeval's start_of_chunk: a chunk starts at the current tag."""
  return (prefix in ("B", "S") or (prev_prefix in ("E", "S", "O") and prefix in ("E", "I"))
          or (prefix != "O" and prev_type != type_))


def _entities(prefixes: list[str], types: list[str], mode: str) -> list[tuple[str, int, int]]:
  """(type, start, end) of one sentence's entities, `end` exclusive."""
  entities = []
  if mode == "default":  # seqeval's get_entities, the sentence followed by an O
    prev_prefix, prev_type, begin = "O", "", 0
    for i, (prefix, type_) in enumerate(zip([*prefixes, "O"], [*types, "_"], strict=True)):
      if _chunk_ends(prev_prefix, prefix, prev_type, type_):
        entities.append((prev_type, begin, i))
      if _chunk_starts(prev_prefix, prefix, prev_type, type_):
        begin = i
      prev_prefix, prev_type = prefix, type_
    return entities
  i = 0  # strict IOB2: B-X, then the longest run of I-X
  while i < len(prefixes):
    end = i + 1
    if prefixes[i] == "B":
      while end < len(prefixes) and prefixes[end] == "I" and types[end] == types[i]:
        end += 1
      entities.append((types[i], i, end))
    i = end
  return entities


def _precision_recall_f1(correct: int, predicted: int, gold: int) -> tuple[float, float, float]:
  """As seqeval with zero_division=0: f1 = 2 p r / (p + r)."""
  precision, recall = _ratio(correct, predicted), _ratio(correct, gold)
  return precision, recall, _ratio(2 * precision * recall, precision + recall)


def entity_scores(gold_tags: Sequence[Sequence[str]], predicted_tags: Sequence[Sequence[str]],
                  mode: str = "default") -> dict:
  """seqeval's entity precision, recall, f1 (micro over types) and per_type f1, plus token_accuracy.

  mode "default" (seqeval's lenient chunks) or "strict" (seqeval's strict IOB2): see the module doc.
  """
  if mode not in ("default", "strict"):
    raise ValueError(f"mode must be 'default' or 'strict', got {mode!r}")
  if len(gold_tags) != len(predicted_tags):
    raise ValueError(f"gold_tags has {len(gold_tags)} sentences but predicted_tags has {len(predicted_tags)}")
  gold_entities, predicted_entities = set(), set()
  equal_tags = num_tags = 0
  for sentence, (gold, predicted) in enumerate(zip(gold_tags, predicted_tags, strict=True)):
    for name, tags in (("gold_tags", gold), ("predicted_tags", predicted)):
      if isinstance(tags, str):
        raise ValueError(f"{name}[{sentence}] must be a list of tags, got the string {tags!r}")
    if len(gold) != len(predicted):
      raise ValueError(f"sentence {sentence}: gold_tags has {len(gold)} tags but predicted_tags has "
                       f"{len(predicted)}")
    for name, tags, found in (("gold_tags", gold, gold_entities),
                              ("predicted_tags", predicted, predicted_entities)):
      prefixes, types = _parse_tags(tags, mode, name, sentence)
      found.update((sentence, *entity) for entity in _entities(prefixes, types, mode))
    equal_tags += sum(g == p for g, p in zip(gold, predicted, strict=True))
    num_tags += len(gold)
  correct = gold_entities & predicted_entities
  gold_count, predicted_count, correct_count = (Counter(type_ for _, type_, _, _ in entities)
                                                for entities in (gold_entities, predicted_entities, correct))
  precision, recall, f1 = _precision_recall_f1(len(correct), len(predicted_entities), len(gold_entities))
  per_type = {type_: _precision_recall_f1(correct_count[type_], predicted_count[type_], gold_count[type_])[2]
              for type_ in sorted(gold_count.keys() | predicted_count.keys())}
  return {"precision": precision, "recall": recall, "f1": f1,
          "token_accuracy": equal_tags / num_tags if num_tags else _NAN, "per_type": per_type}
