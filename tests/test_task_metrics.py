"""Document-task metrics (flash_layers/training/task_metrics.py) against values computed by hand.

Each expected value is worked out in the comments next to it. None comes from running the code. The
module is loaded from its file, not through `import flash_layers`: the package's __init__ imports jax,
and these tests need only NumPy (the whole file takes about a second).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import pathlib
import warnings

import numpy as np
import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "flash_layers" / "training" / "task_metrics.py"
_spec = importlib.util.spec_from_file_location("task_metrics_under_test", PATH)
tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tm)

approx = pytest.approx


def test_the_module_is_numpy_only():
  imported = set()
  for node in ast.walk(ast.parse(PATH.read_text())):
    if isinstance(node, ast.Import):
      imported |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add((node.module or "").split(".")[0])
  assert imported <= {"__future__", "collections", "numpy"}, imported


# ----------------------------------------------------------------------------
# multi_label_scores
# ----------------------------------------------------------------------------

def test_multi_label_scores_with_empty_sets_and_a_label_never_used():
  gold = np.array([[1, 1, 0, 0],
                   [0, 1, 0, 0],
                   [0, 0, 0, 0]])   # document 2: no gold label
  predicted = np.array([[1, 0, 1, 0],
                        [0, 0, 0, 0],   # document 1: nothing predicted
                        [0, 0, 0, 0]])  # document 2: both sets empty; label 3: never gold, never predicted
  # tp = (0, 0); fp = (0, 2); fn = (0, 1), (1, 1).
  # precision 1/2, recall 1/3, micro F1 = 2*1 / (2*1 + 1 + 2) = 2/5.
  # Per label: F1 = 1 (label 0), 0 (label 1: two fn), 0 (label 2: one fp), 0 (label 3: nothing),
  #   so macro = 1/4.
  # Per document: 2*1 / (2 + 1 + 1) = 1/2 (doc 0), 0 (doc 1), 0 (doc 2, both empty), so samples = 1/6.
  scores = tm.multi_label_scores(gold, predicted)
  assert scores == approx({"micro_f1": 2 / 5, "micro_precision": 1 / 2, "micro_recall": 1 / 3,
                           "macro_f1": 1 / 4, "samples_f1": 1 / 6})
  assert all(type(v) is float for v in scores.values())
  # Booleans give the same.
  assert tm.multi_label_scores(gold.astype(bool), predicted.astype(bool)) == approx(scores)


def test_multi_label_scores_all_empty_predictions_score_zero():
  gold = np.array([[1, 0], [0, 1]])
  # tp = 0 and fp = 0: precision 0/0 -> 0, recall 0/2 = 0, every F1 0.
  assert tm.multi_label_scores(gold, np.zeros_like(gold)) == {
    "micro_f1": 0.0, "micro_precision": 0.0, "micro_recall": 0.0, "macro_f1": 0.0, "samples_f1": 0.0}
  # Nothing gold and nothing predicted: every denominator is 0, every value 0 (not nan, not 1).
  empty = np.zeros((3, 2), bool)
  assert set(tm.multi_label_scores(empty, empty).values()) == {0.0}


def test_macro_counts_a_label_never_gold_never_predicted_as_zero():
  gold = np.array([[1, 0], [1, 0]])
  # Label 0 is perfect (F1 1). Label 1 has tp = fp = fn = 0: F1 0, so macro = (1 + 0) / 2.
  # micro and samples are perfect: every document has tp = 1, fp = fn = 0.
  assert tm.multi_label_scores(gold, gold) == {
    "micro_f1": 1.0, "micro_precision": 1.0, "micro_recall": 1.0, "macro_f1": 0.5, "samples_f1": 1.0}


def test_multi_label_scores_of_no_document_are_nan():
  scores = tm.multi_label_scores(np.zeros((0, 3)), np.zeros((0, 3)))
  assert len(scores) == 5 and all(math.isnan(v) for v in scores.values())


@pytest.mark.parametrize("gold, predicted, match", [
  (np.zeros((2, 3)), np.zeros((2, 2)), "predicted has shape"),
  (np.zeros(3), np.zeros(3), "gold must be a 2-D"),
  (np.zeros((2, 3)), np.full((2, 3), 2), "predicted must hold booleans or 0/1"),
  (np.zeros((2, 3)), np.full((2, 3), np.nan), "predicted must hold"),
  (np.zeros((2, 0)), np.zeros((2, 0)), "at least one label"),
])
def test_multi_label_scores_checks_its_inputs(gold, predicted, match):
  with pytest.raises(ValueError, match=match):
    tm.multi_label_scores(gold, predicted)


# ----------------------------------------------------------------------------
# average_precision, mean_average_precision
# ----------------------------------------------------------------------------

def test_average_precision_of_scikit_learns_example():
  # Descending scores 0.8 (pos), 0.4 (neg), 0.35 (pos), 0.1 (neg).
  # Steps: t=0.8 P=1 R=1/2; t=0.4 P=1/2 R=1/2; t=0.35 P=2/3 R=1; t=0.1 R stays 1.
  # AP = (1/2)(1) + 0 + (1/2)(2/3) = 5/6.
  assert tm.average_precision(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == approx(5 / 6)


def test_average_precision_takes_tied_scores_as_one_step():
  gold = np.array([1, 1, 0, 0, 1])
  scores = np.array([0.9, 0.8, 0.8, 0.3, 0.1])
  # t=0.9: {0}, tp 1: P=1, R=1/3.
  # t=0.8: {0, 1, 2} as one step, tp 2: P=2/3, R=2/3.
  # t=0.3: tp 2: R unchanged, adds 0.
  # t=0.1: all five, tp 3: P=3/5, R=1.
  # AP = (1/3)(1) + (1/3)(2/3) + (1/3)(3/5) = 15/45 + 10/45 + 9/45 = 34/45.
  # Splitting the tie with the positive first would give P=1 at R=2/3 instead: 39/45.
  assert tm.average_precision(gold, scores) == approx(34 / 45)
  # All scores tied: one step with P = 2/4 and R = 1, so AP = 1/2.
  assert tm.average_precision(np.array([1, 0, 0, 1]), np.full(4, 0.5)) == approx(0.5)
  # Scores need not be probabilities.
  assert tm.average_precision(gold, 10 * scores - 3) == approx(34 / 45)


def test_average_precision_without_a_positive_is_nan():
  assert math.isnan(tm.average_precision(np.zeros(3), np.array([0.1, 0.2, 0.3])))
  assert math.isnan(tm.average_precision(np.zeros(0), np.zeros(0)))


def test_mean_average_precision_skips_a_label_without_a_positive():
  gold = np.array([[0, 0, 1],
                   [0, 0, 0],
                   [1, 0, 0],
                   [1, 0, 0]])
  scores = np.array([[0.1, 0.9, 0.2],
                     [0.4, 0.8, 0.9],
                     [0.35, 0.7, 0.1],
                     [0.8, 0.6, 0.3]])
  # Label 0 is scikit-learn's example: 5/6. Label 1 has no positive and is skipped.
  # Label 2: descending 0.9 (neg), 0.3 (neg), 0.2 (pos), 0.1 (neg). The only recall step is at t=0.2,
  #   where P = 1/3: AP = 1/3.
  # mAP = (5/6 + 1/3) / 2 = 7/12. Counting label 1 as 0 would give 7/18.
  assert tm.mean_average_precision(gold, scores) == approx(7 / 12)
  assert math.isnan(tm.mean_average_precision(np.zeros((3, 2)), np.ones((3, 2))))


@pytest.mark.parametrize("call, match", [
  (lambda: tm.average_precision(np.zeros(3), np.zeros(4)), "scores has shape"),
  (lambda: tm.average_precision(np.zeros((3, 1)), np.zeros((3, 1))), "gold must be a 1-D"),
  (lambda: tm.average_precision(np.ones(2), np.array([0.5, np.inf])), "scores must be finite"),
  (lambda: tm.mean_average_precision(np.zeros(3), np.zeros(3)), "gold must be a 2-D"),
  (lambda: tm.mean_average_precision(np.zeros((3, 2)), np.zeros((3, 1))), "scores has shape"),
])
def test_average_precision_checks_its_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ----------------------------------------------------------------------------
# tune_thresholds
# ----------------------------------------------------------------------------

def _f1(gold: np.ndarray, predicted: np.ndarray) -> float:
  tp = np.sum(gold & predicted)
  denominator = gold.sum() + predicted.sum()
  return 2 * tp / denominator if denominator else 0.0


# Label A: 3 positives. Label B: 2 positives.
GOLD_A, SCORES_A = np.array([1, 1, 0, 1, 0], bool), np.array([0.9, 0.7, 0.6, 0.4, 0.2])
GOLD_B, SCORES_B = np.array([0, 1, 0, 0, 1], bool), np.array([0.3, 0.8, 0.85, 0.1, 0.6])


def test_per_label_thresholds_maximize_each_labels_f1():
  # Any threshold predicts the top k of a label's scores, so enumerating k = 0..5 covers every split.
  # Label A, descending 0.9+ 0.7+ 0.6- 0.4+ 0.2-, F1 = 2 tp / (k + 3):
  #   k=0: 0, k=1: 2/4, k=2: 4/5, k=3: 4/6, k=4: 6/7, k=5: 6/8.
  #   The best is k=4, so the threshold lies in (0.2, 0.4]; the candidate is 0.4.
  # Label B, descending 0.85- 0.8+ 0.6+ 0.3- 0.1-, F1 = 2 tp / (k + 2):
  #   k=1: 0, k=2: 2/4, k=3: 4/5, k=4: 4/6, k=5: 4/7.
  #   The best is k=3, reached by the candidates 0.6 and 0.5. 0.5 is nearer 0.5, so it wins.
  # Label C has no positive and its largest score is 0.95: the next float above 0.95.
  # Label D has no positive and its largest score is 0.3: max(0.5, just above 0.3) = 0.5.
  gold = np.stack([GOLD_A, GOLD_B, np.zeros(5, bool), np.zeros(5, bool)], axis=1)
  scores = np.stack([SCORES_A, SCORES_B, [0.1, 0.7, 0.2, 0.3, 0.95], [0.3, 0.0, 0.1, 0.2, 0.25]], axis=1)
  thresholds = tm.tune_thresholds(gold, scores, "tune_per_label")
  assert thresholds.dtype == np.float64 and thresholds.shape == (4,)
  assert thresholds.tolist() == [0.4, 0.5, np.nextafter(0.95, 1.0), 0.5]
  predicted = scores >= thresholds
  assert _f1(gold[:, 0], predicted[:, 0]) == approx(6 / 7)
  assert _f1(gold[:, 1], predicted[:, 1]) == approx(4 / 5)
  assert not predicted[:, 2:].any()


def test_the_global_threshold_maximizes_micro_f1():
  gold = np.stack([GOLD_A, GOLD_B], axis=1)
  scores = np.stack([SCORES_A, SCORES_B], axis=1)
  # All ten scores with 5 positives, descending: 0.9+ 0.85- 0.8+ 0.7+ 0.6- 0.6+ 0.4+ 0.3- 0.2- 0.1-.
  # Micro F1 = 2 tp / (predicted + 5) at each distinct threshold:
  #   0.9: 2/6; 0.85: 2/7; 0.8: 4/8; 0.7: 6/9; 0.6 (and 0.5, the same split): 8/11;
  #   0.4: 10/12; 0.3: 10/13; 0.2: 10/14; 0.1: 10/15.
  # 0.4 is the only best (10/12 > 8/11 > 10/13). The per-label thresholds were 0.4 and 0.5.
  assert tm.tune_thresholds(gold, scores, "tune").tolist() == [0.4, 0.4]
  assert tm.tune_thresholds(gold, scores, "tune_per_label").tolist() == [0.4, 0.5]


def test_equally_good_thresholds_equally_near_one_half_go_to_the_smaller():
  gold = np.array([[1], [0], [0], [1], [0]], bool)
  scores = np.array([[0.75], [0.6], [0.4], [0.25], [0.1]])
  # 2 positives; F1 = 2 tp / (k + 2) for the top k:
  #   t=0.75 (k=1, tp 1): 2/3; t=0.6 and t=0.5 (k=2, tp 1): 2/4; t=0.4 (k=3, tp 1): 2/5;
  #   t=0.25 (k=4, tp 2): 4/6 = 2/3; t=0.1 (k=5, tp 2): 4/7.
  # 0.75 and 0.25 tie at 2/3, both exactly 0.25 from 0.5: the smaller, 0.25, wins.
  assert tm.tune_thresholds(gold, scores, "tune_per_label").tolist() == [0.25]
  assert tm.tune_thresholds(gold, scores, "tune").tolist() == [0.25]


def test_tuning_without_any_positive_predicts_nothing():
  scores = np.array([[0.2, 1.0], [0.9, 0.1]])
  # No positive anywhere: every threshold gives F1 0, so "tune" moves just above the largest score (1.0).
  above_one = np.nextafter(1.0, 2.0)
  assert tm.tune_thresholds(np.zeros((2, 2)), scores, "tune").tolist() == [above_one, above_one]
  assert tm.tune_thresholds(np.zeros((2, 2)), scores, "tune_per_label").tolist() == [
    np.nextafter(0.9, 1.0), above_one]
  assert tm.tune_thresholds(np.zeros((0, 3)), np.zeros((0, 3)), "tune_per_label").tolist() == [0.5] * 3


def _brute_force_threshold(gold: np.ndarray, scores: np.ndarray) -> float:
  """The module doc's rule, computed directly: every candidate scored one by one (O(N^2))."""
  if not gold.any():
    return max(0.5, float(np.nextafter(scores.max(), np.inf)))
  candidates = sorted(set(scores.tolist()) | {0.5})
  return min(candidates, key=lambda t: (-_f1(gold, scores >= t), abs(t - 0.5), t))


def test_tuned_thresholds_match_a_brute_force_search():
  rng = np.random.default_rng(0)
  gold = rng.random((40, 6)) < 0.3
  gold[:, 5] = False
  scores = np.round(rng.random((40, 6)), 1)  # few distinct values: many ties
  per_label = tm.tune_thresholds(gold, scores, "tune_per_label")
  assert per_label.tolist() == [_brute_force_threshold(gold[:, j], scores[:, j]) for j in range(6)]
  assert tm.tune_thresholds(gold, scores, "tune").tolist() == [
    _brute_force_threshold(gold.ravel(), scores.ravel())] * 6
  # No threshold on a fine grid beats a tuned one.
  for j in range(5):
    best = _f1(gold[:, j], scores[:, j] >= per_label[j])
    assert all(_f1(gold[:, j], scores[:, j] >= t) <= best for t in np.linspace(0, 1.01, 203))


def test_tuning_a_large_problem_sorts_instead_of_looping():
  rng = np.random.default_rng(1)
  gold = rng.random((10_000, 100)) < 0.05
  scores = np.clip(gold * 0.3 + rng.random(gold.shape) * 0.7, 0, 1)
  for mode in ("tune", "tune_per_label"):  # well under a second each; an O(N^2) search would take minutes
    assert tm.tune_thresholds(gold, scores, mode).shape == (100,)


@pytest.mark.parametrize("gold, scores, mode, match", [
  (np.zeros((2, 2)), np.zeros((2, 2)), "best", "mode must be"),
  (np.zeros((2, 2)), np.full((2, 2), 1.5), "tune", r"scores must lie in \[0, 1\]"),
  (np.zeros((2, 2)), np.full((2, 2), np.nan), "tune", "scores must be finite"),
  (np.zeros((2, 2)), np.zeros((2, 3)), "tune_per_label", "scores has shape"),
  (np.zeros(2), np.zeros(2), "tune", "gold must be a 2-D"),
])
def test_tune_thresholds_checks_its_inputs(gold, scores, mode, match):
  with pytest.raises(ValueError, match=match):
    tm.tune_thresholds(gold, scores, mode)


# ----------------------------------------------------------------------------
# regression_scores
# ----------------------------------------------------------------------------

def test_regression_scores_with_ties_for_spearman():
  gold = np.array([[1, 1], [2, 2], [3, 2], [4, 5]], float)
  predicted = np.array([[1, 0], [3, 2], [2, 3], [4, 7]], float)
  # Errors: column 0: 0, 1, -1, 0; column 1: -1, 0, 1, 2.
  #   mse = (0+1+1+0+1+0+1+4)/8 = 1 and mae = (0+1+1+0+1+0+1+2)/8 = 3/4.
  # Pearson, column 0: centered gold -1.5 -.5 .5 1.5, centered prediction -1.5 .5 -.5 1.5.
  #   dot 2.25 - .25 - .25 + 2.25 = 4; both norms sqrt(5): r = 4/5.
  # Pearson, column 1: centered gold -1.5 -.5 -.5 2.5 (norm 3), centered prediction -3 -1 0 4
  #   (norm sqrt(26)). dot 4.5 + .5 + 0 + 10 = 15: r = 15 / (3 sqrt(26)) = 5 / sqrt(26).
  # Spearman, column 0: the ranks equal the values: 4/5.
  # Spearman, column 1: gold ranks 1 2.5 2.5 4 (the tied 2s share ranks 2 and 3), prediction ranks
  #   1 2 3 4. Centered: -1.5 0 0 1.5 (norm sqrt(4.5)) and -1.5 -.5 .5 1.5 (norm sqrt(5)).
  #   dot 4.5: r = 4.5 / sqrt(4.5 * 5) = sqrt(0.9).
  scores = tm.regression_scores(gold, predicted)
  assert scores == approx({"mse": 1.0, "mae": 0.75, "pearson": (0.8 + 5 / math.sqrt(26)) / 2,
                           "spearman": (0.8 + math.sqrt(0.9)) / 2})
  assert all(type(v) is float for v in scores.values())


def test_a_constant_column_is_left_out_of_the_correlations():
  gold = np.array([[1, 7], [2, 7], [3, 7], [4, 7]], float)
  predicted = np.array([[1, 1], [3, 2], [2, 3], [4, 4]], float)
  # Column 1's gold is constant: its correlations are nan, so the means are column 0's (4/5, as above).
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nanmean semantics without its RuntimeWarning
    scores = tm.regression_scores(gold, predicted)
    assert scores["pearson"] == approx(0.8) and scores["spearman"] == approx(0.8)
    # Every column constant (here the prediction): both nan.
    scores = tm.regression_scores(gold[:, :1], np.full((4, 1), 2.0))
    assert math.isnan(scores["pearson"]) and math.isnan(scores["spearman"])
    # Errors 1, 0, 1, 2: mse (1+0+1+4)/4 = 3/2, mae 4/4 = 1.
    assert scores["mse"] == approx(1.5) and scores["mae"] == approx(1.0)
    # One document: every column constant. No document: everything nan.
    assert math.isnan(tm.regression_scores(np.ones((1, 2)), np.zeros((1, 2)))["pearson"])
    assert all(math.isnan(v) for v in tm.regression_scores(np.zeros(0), np.zeros(0)).values())


def test_regression_scores_take_1d_inputs_as_one_column():
  # Column 0 of the first test: errors 0 1 -1 0 (mse 2/4, mae 2/4), pearson = spearman = 4/5.
  assert tm.regression_scores([1, 2, 3, 4], [1, 3, 2, 4]) == approx(
    {"mse": 0.5, "mae": 0.5, "pearson": 0.8, "spearman": 0.8})
  # A reversed order: -1 both ways. Spearman uses only the order: the same for any increasing map of x.
  scores = tm.regression_scores([1, 2, 3], [3, 2, 1])
  assert scores["pearson"] == approx(-1.0) and scores["spearman"] == approx(-1.0)
  assert tm.regression_scores([1, 2, 3], [1, 10, 1000])["spearman"] == approx(1.0)


@pytest.mark.parametrize("gold, predicted, match", [
  (np.zeros((3, 2)), np.zeros((3, 1)), "predicted has shape"),
  (np.zeros((3, 2, 1)), np.zeros((3, 2, 1)), "gold must be a 1 or 2-D"),
  (np.zeros(3), np.array([0.0, np.nan, 1.0]), "predicted must be finite"),
  (np.zeros((3, 0)), np.zeros((3, 0)), "at least one column"),
  (["a", "b"], [1, 2], "gold must be a numeric array"),
])
def test_regression_scores_check_their_inputs(gold, predicted, match):
  with pytest.raises(ValueError, match=match):
    tm.regression_scores(gold, predicted)


# ----------------------------------------------------------------------------
# entity_scores
# ----------------------------------------------------------------------------

def _assert_entity_scores(scores: dict, expected: dict) -> None:
  """scores == expected up to rounding; per_type (a nested dict, which approx does not take) apart."""
  assert list(scores) == list(expected)
  assert list(scores["per_type"]) == sorted(expected["per_type"])
  assert scores["per_type"] == approx(expected["per_type"])
  assert {k: v for k, v in scores.items() if k != "per_type"} == approx(
    {k: v for k, v in expected.items() if k != "per_type"})


def test_default_and_strict_differ_on_a_chunk_without_its_b():
  gold = [["B-PER", "I-PER", "O", "B-LOC"]]
  predicted = [["I-PER", "I-PER", "O", "B-LOC"]]
  # default: an I- at the start of a sentence starts a chunk. The predicted chunks are PER 0-2 and
  #   LOC 3-4, the same as gold: everything 1. Tags equal at 3 of 4 positions.
  _assert_entity_scores(tm.entity_scores(gold, predicted), {
    "precision": 1.0, "recall": 1.0, "f1": 1.0, "token_accuracy": 0.75, "per_type": {"LOC": 1.0, "PER": 1.0}})
  # strict (IOB2): I-PER without a B-PER is no entity, so only LOC is predicted.
  #   1 correct of 1 predicted and 2 gold: precision 1, recall 1/2, F1 = 2(1)(1/2) / (3/2) = 2/3.
  #   PER: 0 correct, 0 predicted, 1 gold: F1 0.
  _assert_entity_scores(tm.entity_scores(gold, predicted, mode="strict"), {
    "precision": 1.0, "recall": 0.5, "f1": 2 / 3, "token_accuracy": 0.75,
    "per_type": {"LOC": 1.0, "PER": 0.0}})


def test_an_i_after_o_starts_a_chunk_only_in_default_mode():
  gold = [["O", "B-ORG", "I-ORG", "O"]]
  predicted = [["O", "I-ORG", "I-ORG", "O"]]
  # default: ORG 1-3 in both. strict: no predicted entity, so precision 0/0 -> 0, recall 0/1, F1 0.
  assert tm.entity_scores(gold, predicted)["f1"] == 1.0
  _assert_entity_scores(tm.entity_scores(gold, predicted, "strict"), {
    "precision": 0.0, "recall": 0.0, "f1": 0.0, "token_accuracy": 0.75, "per_type": {"ORG": 0.0}})


def test_chunk_boundaries_at_a_change_of_type():
  # default: B-PER I-PER I-LOC I-LOC -> PER 0-2, then I-LOC after another type starts LOC 2-4.
  # strict: PER 0-2 only; the I-LOCs follow no B-LOC.
  gold = [["B-PER", "I-PER", "B-LOC", "I-LOC"]]
  predicted = [["B-PER", "I-PER", "I-LOC", "I-LOC"]]
  assert tm.entity_scores(gold, predicted)["f1"] == 1.0
  # strict: 1 correct of 1 predicted and 2 gold: F1 2/3.
  assert tm.entity_scores(gold, predicted, "strict")["f1"] == approx(2 / 3)
  # B-X B-X is two entities in both modes. The prediction's X 0-2 matches neither gold X 0-1 nor X 1-2.
  for mode in ("default", "strict"):
    _assert_entity_scores(tm.entity_scores([["B-X", "B-X"]], [["B-X", "I-X"]], mode), {
      "precision": 0.0, "recall": 0.0, "f1": 0.0, "token_accuracy": 0.5, "per_type": {"X": 0.0}})


def test_entity_scores_are_micro_over_types_and_sentences():
  gold = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["B-ORG", "O", "B-PER"]]
  predicted = [["B-PER", "O", "O", "B-LOC", "I-LOC"], ["B-ORG", "O", "B-PER"]]
  # Gold: PER (0, 0-2), LOC (0, 3-4), ORG (1, 0-1), PER (1, 2-3).
  # Predicted: PER (0, 0-1), LOC (0, 3-5), ORG (1, 0-1), PER (1, 2-3).
  # Correct: ORG and PER of sentence 1. Precision = recall = F1 = 2/4.
  # PER: 1 correct, 2 predicted, 2 gold: 1/2. LOC: 0 of 1 and 1: 0. ORG: 1 of 1 and 1: 1.
  # Equal tags: 3 of 5, then 3 of 3: 6/8.
  expected = {"precision": 0.5, "recall": 0.5, "f1": 0.5, "token_accuracy": 0.75,
              "per_type": {"LOC": 0.0, "ORG": 1.0, "PER": 0.5}}
  _assert_entity_scores(tm.entity_scores(gold, predicted), expected)
  _assert_entity_scores(tm.entity_scores(gold, predicted, "strict"), expected)
  # The same span in another sentence is another entity: nothing correct.
  assert tm.entity_scores([["B-PER"], ["O"]], [["O"], ["B-PER"]])["f1"] == 0.0


def test_entity_scores_without_entities_or_tokens():
  # No entity anywhere: every ratio is 0/0 -> 0. All tags equal.
  assert tm.entity_scores([["O", "O"]], [["O", "O"]]) == {
    "precision": 0.0, "recall": 0.0, "f1": 0.0, "token_accuracy": 1.0, "per_type": {}}
  scores = tm.entity_scores([], [])
  assert math.isnan(scores["token_accuracy"]) and scores["f1"] == 0.0 and scores["per_type"] == {}
  # Gold entities, none predicted: precision 0/0 -> 0, recall 0/1.
  assert tm.entity_scores([["B-A", "O"]], [["O", "O"]])["per_type"] == {"A": 0.0}


def test_default_mode_reads_iobes_and_bare_prefixes_like_seqeval():
  # S-PER is one chunk. B-LOC E-LOC is one chunk. After E-, an I- starts a new chunk.
  # Bare B, I: type "_".
  gold = [["S-PER", "B-LOC", "E-LOC", "I-LOC"], ["B", "I", "O"]]
  predicted = [["S-PER", "B-LOC", "I-LOC", "I-LOC"], ["B", "I", "O"]]
  # Gold: PER 0-1, LOC 1-3, LOC 3-4, _ 0-2. Predicted: PER 0-1, LOC 1-4, _ 0-2.
  # 2 correct of 3 predicted and 4 gold: p 2/3, r 1/2, F1 = 2(1/3) / (7/6) = 4/7.
  # LOC: 0 correct: 0. Equal tags: 6 of 7.
  _assert_entity_scores(tm.entity_scores(gold, predicted), {
    "precision": 2 / 3, "recall": 0.5, "f1": 4 / 7, "token_accuracy": 6 / 7,
    "per_type": {"LOC": 0.0, "PER": 1.0, "_": 1.0}})
  # Strict IOB2 takes no E- or S- tag (seqeval raises too).
  with pytest.raises(ValueError, match=r"gold_tags\[0\]\[0\] = 'S-PER'"):
    tm.entity_scores(gold, predicted, "strict")


@pytest.mark.parametrize("gold, predicted, mode, match", [
  ([["O"], ["O", "O"]], [["O"], ["O"]], "default", "sentence 1: gold_tags has 2 tags but predicted_tags"),
  ([["O"]], [["O"], ["O"]], "default", "gold_tags has 1 sentences but predicted_tags has 2"),
  ([["O", "PER"]], [["O", "O"]], "default", r"gold_tags\[0\]\[1\] = 'PER'"),  # a bare type
  ([["O"]], [["ORG"]], "strict", r"predicted_tags\[0\]\[0\] = 'ORG'"),  # seqeval would read it as O
  ([["O"]], [["B_PER"]], "default", "B_PER"),
  (["B-PER"], ["B-PER"], "default", "must be a list of tags"),
  ([["O"]], [["O"]], "lenient", "mode must be"),
])
def test_entity_scores_check_their_inputs(gold, predicted, mode, match):
  with pytest.raises(ValueError, match=match):
    tm.entity_scores(gold, predicted, mode)


def test_every_function_returns_python_floats():
  gold, scores = np.array([[1, 0], [0, 1]]), np.array([[0.9, 0.2], [0.3, 0.8]])
  results = [tm.average_precision(gold[:, 0], scores[:, 0]), tm.mean_average_precision(gold, scores),
             *tm.multi_label_scores(gold, gold).values(), *tm.regression_scores(gold, scores).values()]
  assert all(type(v) is float for v in results)
  # Flattened: 0.9+ 0.8+ 0.3- 0.2-. t=0.8 and t=0.5 both predict exactly the positives (F1 1): 0.5 is
  # nearer 0.5.
  assert tm.tune_thresholds(gold, scores, "tune").tolist() == [0.5, 0.5]
