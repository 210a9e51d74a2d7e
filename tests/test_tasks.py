"""The document tasks beyond single-label classification: multi-label, regression and token
classification, from the files on disk to the batches, the loss, the metrics, eval.py's predictions and
the export.

References are independent of the code under test: NumPy re-derivations of each loss, metrics
recomputed from the written predictions with the hand-checked functions of training/task_metrics.py
(tests/test_task_metrics.py), the data files written here, and the exported model read back by our
own importer. The command-line runs of configs/multi_label.py, regression.py and
token_classification.py (shrunk) are second tier.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_training import FILLER, TOPICS, _env, _wait_for_step

from flash_layers import data as data_lib
from flash_layers import export, models
from flash_layers.data import bbc
from flash_layers.training import checkpoint as checkpoint_lib
from flash_layers.training import config as config_lib
from flash_layers.training import evaluate as evaluate_lib
from flash_layers.training import loop, objectives, task_metrics
from flash_layers.training import metrics as metrics_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
NAMES = sorted(TOPICS)  # food, sport, tech


# ----------------------------------------------------------------------------
# Data: labels as files hold them
# ----------------------------------------------------------------------------

def _lines(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_multi_label_sets_from_jsonl_lists_and_csv_cells(tmp_path):
  _lines(tmp_path / "train.jsonl", [{"text": "a", "label": ["tech", "sport"]}, {"text": "b", "label": []},
                                    {"text": "c", "label": ["food"]},
                                    {"text": "d", "label": ["sport", "sport"]}])
  train = data_lib.load(tmp_path, label_kind="multi")
  assert train.vocab.names == ("food", "sport", "tech")
  assert [r["label"] for r in train] == [(1, 2), (), (0,), (1,)]
  (tmp_path / "dev.csv").write_text('text,label\nx,"tech; food"\ny,\nz,sport\n')
  dev = data_lib.load(tmp_path, split="dev", label_kind="multi")
  assert [r["label"] for r in dev] == [(0, 2), (), (1,)]
  (tmp_path / "test.tsv").write_text("text\tlabel\nx\tsport;tech\n")
  assert [r["label"] for r in data_lib.load(tmp_path, split="test", label_kind="multi")] == [(1, 2)]
  spec = train.label_spec
  assert (spec.kind, spec.size, spec.shape) == ("multi", 3, (3,))
  np.testing.assert_array_equal(spec.encode((1, 2)), [0, 1, 1])
  np.testing.assert_array_equal(spec.encode(()), [0, 0, 0])  # a document with no label is a label
  np.testing.assert_array_equal(spec.empty(2), [[-1] * 3] * 2)  # no document


def test_unseen_labels_are_an_error_or_ignored_and_counted(tmp_path):
  _lines(tmp_path / "train.jsonl", [{"text": "a", "label": ["x"]}, {"text": "b", "label": ["y"]}])
  _lines(tmp_path / "dev.jsonl", [{"text": "c", "label": ["x", "new"]},
                                  {"text": "d", "label": ["new", "newer"]}])
  with pytest.raises(data_lib.DataError, match=r"dev.jsonl:1: field 'label': label 'new' was not seen"):
    data_lib.load(tmp_path, split="dev", label_kind="multi")
  dev = data_lib.load(tmp_path, split="dev", label_kind="multi", unseen_labels="ignore")
  assert [r["label"] for r in dev] == [(0,), ()] and dev.unseen == {"new": 2, "newer": 1}
  # Single-label: a document whose class is unseen cannot be scored; "ignore" drops it, counted.
  _lines(tmp_path / "train.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
  _lines(tmp_path / "dev.jsonl", [{"text": "c", "label": "x"}, {"text": "d", "label": "new"}])
  dev = data_lib.load(tmp_path, split="dev", unseen_labels="ignore")
  assert [r["label"] for r in dev] == [0] and dev.unseen == {"new": 1}


def test_regression_targets_from_numbers_lists_and_cells(tmp_path):
  _lines(tmp_path / "a.jsonl", [{"text": "a", "label": 2}, {"text": "b", "label": -0.5}])
  records = data_lib.load(tmp_path / "a.jsonl", label_kind="values")
  assert [r["label"] for r in records] == [(2.0,), (-0.5,)] and records.vocab.names == ("label",)
  _lines(tmp_path / "b.jsonl", [{"text": "a", "y": [1, 2.5]}, {"text": "b", "y": [0, 0]}])
  records = data_lib.load(tmp_path / "b.jsonl", label_kind="values", label_column="y")
  assert records.vocab.names == ("y[0]", "y[1]") and records[0]["label"] == (1.0, 2.5)
  np.testing.assert_array_equal(records.label_spec.empty(1), [[np.nan, np.nan]])
  (tmp_path / "c.csv").write_text("text,label\nx,0.25\ny,1e-3\n")
  assert [r["label"] for r in data_lib.load(tmp_path / "c.csv", label_kind="values")] == [(0.25,), (0.001,)]


@pytest.mark.parametrize("name,content,kind,match", [
  ("r.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": "4.5"}\n', "values",
   r"r.jsonl:2: field 'label' must be a number or a non-empty list of numbers for regression; got str '4.5'"),
  ("r.jsonl", '{"text": "a", "label": true}\n', "values", r"r.jsonl:1: field 'label' must be a number"),
  ("r.jsonl", '{"text": "a", "label": [1, 2]}\n{"text": "b", "label": [1]}\n', "values",
   r"r.jsonl:2: field 'label' has 1 values; the documents before it have 2"),
  ("r.jsonl", '{"text": "a", "label": NaN}\n', "values", r"r.jsonl:1: field 'label': regression targets must "
   "be finite"),
  ("r.csv", "text,label\na,1\nb,high\n", "values", r"r.csv:3: field 'label' must hold a number"),
  ("m.jsonl", '{"text": "a", "label": "x"}\n', "multi", r"m.jsonl:1: field 'label' must be a list of labels"),
  ("m.jsonl", '{"text": "a", "label": [["x"]]}\n', "multi", r"m.jsonl:1: field 'label': a label must be a "
   "string or an integer; got list"),
])
def test_unreadable_labels_name_the_document_and_the_field(tmp_path, name, content, kind, match):
  (tmp_path / name).write_text(content)
  with pytest.raises(data_lib.DataError, match=match):
    data_lib.load(tmp_path / name, label_kind=kind)


def test_a_class_folder_tree_has_one_label_per_document(tmp_path):
  (tmp_path / "x").mkdir()
  (tmp_path / "x" / "1.txt").write_text("words")
  with pytest.raises(data_lib.DataError, match="one label per document; 'multi' labels need a JSONL"):
    data_lib.load(tmp_path, label_kind="multi")


def test_batches_hold_multi_hot_and_target_slots():
  tok = data_lib.TextTokenizer("listops", max_len=16)
  multi = data_lib.Records([{"text": "1 2", "label": (0, 2)}, {"text": "3", "label": ()},
                            {"text": "4 5 6", "label": (1,)}],
                           vocab=data_lib.LabelVocab(NAMES), source="t", split="train", label_kind="multi")
  batch = next(data_lib.make_batches(multi, tok, batch_size=2, pack=True, max_docs_per_row=2, shuffle=False))
  np.testing.assert_array_equal(batch["labels"], [[[1, 0, 1], [0, 0, 0]], [[0, 1, 0], [-1, -1, -1]]])
  values = data_lib.Records([{"text": "1", "label": (0.5, -1.0)}], vocab=data_lib.LabelVocab(("a", "b")),
                            source="t", split="train", label_kind="values")
  planned = data_lib.eval_batches([r["text"] for r in values], [r["label"] for r in values], tok,
                                  batch_size=2, max_docs_per_row=2, label_spec=values.label_spec)
  np.testing.assert_array_equal(planned[0]["labels"][0], [[0.5, -1.0], [np.nan, np.nan]])
  assert planned[0]["labels"].dtype == np.float32 and np.isnan(planned[0]["labels"][1]).all()


# ----------------------------------------------------------------------------
# Objectives: the loss on device, the metrics and predictions on the host
# ----------------------------------------------------------------------------

def _bce(x, y):
  return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0) - x * y


def test_multi_label_loss_is_the_mean_binary_cross_entropy_of_real_documents():
  rng = np.random.default_rng(0)
  objective = objectives.build("multi_label_classification", NAMES)
  logits = rng.normal(0, 2, (2, 3, 3)).astype(np.float32)
  labels = np.array([[[1, 0, 1], [0, 0, 0], [-1, -1, -1]], [[0, 1, 1], [-1, -1, -1], [-1, -1, -1]]], np.int32)
  sums = jax.jit(objective.loss_sums)(jnp.asarray(logits), jnp.asarray(labels))
  real = labels[..., 0] >= 0
  expected = _bce(logits[real].astype(np.float64), labels[real]).mean(axis=-1).sum()
  assert float(sums["count"]) == 3 and float(sums["loss_sum"]) == pytest.approx(expected, rel=1e-5)
  predicted = logits[real] >= 0
  gold = labels[real] > 0
  np.testing.assert_array_equal(sums["stats"]["true_pos"], (predicted & gold).sum(0))
  np.testing.assert_array_equal(sums["stats"]["false_pos"], (predicted & ~gold).sum(0))
  np.testing.assert_array_equal(sums["stats"]["false_neg"], (~predicted & gold).sum(0))


def test_regression_loss_is_on_standardized_targets_and_metrics_in_their_units():
  rng = np.random.default_rng(1)
  targets = rng.normal([3.0, -10.0], [2.0, 0.5], (50, 2))
  objective = objectives.build("regression", ("a", "b"), train_targets=targets, standardize=True)
  np.testing.assert_allclose(objective.mean, targets.mean(0))
  np.testing.assert_allclose(objective.std, targets.std(0))
  logits = rng.normal(0, 1, (2, 2, 2)).astype(np.float32)
  labels = np.array([[[4.0, -9.5], [np.nan, np.nan]], [[1.0, -10.0], [2.0, -11.0]]], np.float32)
  sums = jax.jit(objective.loss_sums)(jnp.asarray(logits), jnp.asarray(labels))
  real = np.isfinite(labels[..., 0])
  standardized = (labels[real] - targets.mean(0)) / targets.std(0)
  assert float(sums["count"]) == 3
  expected = np.square(logits[real] - standardized).mean(-1).sum()
  assert float(sums["loss_sum"]) == pytest.approx(expected, rel=1e-5)
  values = logits[real] * targets.std(0) + targets.mean(0)
  window = objective.window_summary(jax.device_get(sums["stats"]))
  assert window["mse"] == pytest.approx(np.square(values - labels[real]).mean(), rel=1e-5)
  assert window["mae"] == pytest.approx(np.abs(values - labels[real]).mean(), rel=1e-5)
  scored = objective.score(logits[real], labels[real])
  assert scored["mse"] == pytest.approx(np.square(values - labels[real]).mean(), rel=1e-6)
  assert [p["values"]["b"] for p in objective.predict(logits[real])] == pytest.approx(values[:, 1], abs=1e-5)
  # Unstandardized: the model predicts the targets themselves.
  plain = objectives.build("regression", ("a",))
  assert plain.predict(np.array([[2.5]])) == [{"value": 2.5}]


def test_multi_label_scores_predictions_and_tuned_thresholds():
  rng = np.random.default_rng(2)
  gold = rng.random((40, 3)) < [0.5, 0.2, 0.05]
  logits = np.where(gold, 0.4, -0.4) + rng.normal(0, 0.8, gold.shape)
  fixed = objectives.build("multi_label_classification", NAMES, threshold=0.6)
  probabilities = 1 / (1 + np.exp(-logits))
  scored = fixed.score(logits, gold.astype(np.int32))
  expected = task_metrics.multi_label_scores(gold, probabilities >= 0.6)
  for key in ("micro_f1", "macro_f1", "samples_f1"):
    assert scored[key] == pytest.approx(expected[key])
  expected_map = task_metrics.mean_average_precision(gold, probabilities)
  assert scored["mean_average_precision"] == pytest.approx(expected_map)
  assert scored["loss"] == pytest.approx(_bce(logits, gold).mean())
  predicted = fixed.predict(logits[:4])
  for p, probs in zip(predicted, probabilities[:4], strict=True):
    assert p["labels"] == [n for n, q in zip(NAMES, probs, strict=True) if q >= 0.6]
    assert list(p["scores"]) == NAMES
  # "tune": one threshold, no worse on these documents than any fixed one; "tune_per_label": one each.
  tuned = objectives.build("multi_label_classification", NAMES, threshold="tune").tune(logits, gold)
  assert len(set(tuned.thresholds)) == 1
  best = tuned.score(logits, gold.astype(np.int32))["micro_f1"]
  for t in (0.3, 0.5, 0.6, 0.7):
    assert best >= task_metrics.multi_label_scores(gold, probabilities >= t)["micro_f1"] - 1e-12
  per_label = objectives.build("multi_label_classification", NAMES, threshold="tune_per_label")
  per_label = per_label.tune(logits, gold)
  assert per_label.score(logits, gold)["macro_f1"] >= tuned.score(logits, gold)["macro_f1"] - 1e-12
  restored = objectives.build("multi_label_classification", NAMES).with_head(per_label.head())
  assert restored.thresholds == per_label.thresholds


def test_task_fields_are_validated_naming_the_field():
  config = config_lib.default_config()
  config.task = "ranking"
  with pytest.raises(config_lib.ConfigError, match=r"config.task: must be one of \('classification'"):
    config_lib.validate(config, num_devices=1, check_data=False)
  config.task = "regression"
  with pytest.raises(config_lib.ConfigError, match="config.data.dataset: the built-in 'bbc_news' is a "
                     "'classification' dataset; config.task='regression' takes 'bbc_news_quotes' or"):
    config_lib.validate(config, num_devices=1, check_data=False)
  config.data.dataset = "bbc_news_quotes"
  config.train.label_smoothing = 0.1
  with pytest.raises(config_lib.ConfigError,
                     match="config.train.label_smoothing: is for task 'classification'"):
    config_lib.validate(config, num_devices=1, check_data=False)
  config.train.label_smoothing = 0.0
  config.checkpoint.best_metric = "accuracy"
  with pytest.raises(config_lib.ConfigError, match=r"config.checkpoint.best_metric: must be one of \('mse'"):
    config_lib.validate(config, num_devices=1, check_data=False)
  config.checkpoint.best_metric = None
  assert config_lib.best_metric(config) == "mse"
  config.task, config.data.dataset = "multi_label_classification", "bbc_news_regions"
  for bad in (1.0, 0, "tuned", True):
    config.eval.threshold = bad
    with pytest.raises(config_lib.ConfigError, match="config.eval.threshold: must be"):
      config_lib.validate(config, num_devices=1, check_data=False)


def test_derived_bbc_labels_follow_their_rules():
  assert bbc.regions("Talks in London and Brussels; the US said") == ["britain", "america", "europe"]
  assert bbc.regions("USB sticks and Parisians") == []  # whole words only
  assert bbc.quote_share('He said "yes". Then nothing. "No," she said.') == pytest.approx(2 / 3)
  records = data_lib.load("bbc_news_regions", split="dev")
  assert records.label_kind == "multi" and len(records) == 212
  assert all(tuple(records.vocab.index(n) for n in bbc.regions(r["text"])) == r["label"] for r in records)


# ----------------------------------------------------------------------------
# End to end: train, evaluate, predict and export each task (in-process; the CLI is second tier)
# ----------------------------------------------------------------------------

def _write_multi_label(root: pathlib.Path, sizes=(160, 40, 40)) -> pathlib.Path:
  """Documents with any subset of the topics (none included), worded from those topics."""
  rng = random.Random(3)
  root.mkdir(parents=True, exist_ok=True)
  for split, n in zip(("train", "dev", "test"), sizes, strict=True):
    rows = []
    for _ in range(n):
      labels = [t for t in NAMES if rng.random() < 0.4]
      pool = [w for t in labels for w in TOPICS[t]]
      words = [rng.choice(pool) if pool and rng.random() < 0.4 else rng.choice(FILLER)
               for _ in range(rng.randint(6, 40))]
      rows.append({"text": " ".join(words), "label": labels})
    _lines(root / f"{split}.jsonl", rows)
  return root


def _write_regression(root: pathlib.Path, sizes=(160, 40, 40)) -> pathlib.Path:
  """Two targets: how many sport words, and how many tech words, a document holds (as [a, b])."""
  rng = random.Random(4)
  root.mkdir(parents=True, exist_ok=True)
  for split, n in zip(("train", "dev", "test"), sizes, strict=True):
    rows = []
    for _ in range(n):
      words = [rng.choice(TOPICS[rng.choice(NAMES)]) if rng.random() < 0.5 else rng.choice(FILLER)
               for _ in range(rng.randint(6, 30))]
      rows.append({"text": " ".join(words), "score": [sum(w in TOPICS["sport"] for w in words),
                                                     sum(w in TOPICS["tech"] for w in words)]})
    _lines(root / f"{split}.jsonl", rows)
  return root


def _tiny(dataset, **fields):
  sys.path.insert(0, str(REPO))
  try:
    from configs import tiny
  finally:
    sys.path.remove(str(REPO))
  config = tiny.get_config()
  config.data.dataset = str(dataset)
  config.data.eval_split = "test"
  config.train.num_steps, config.train.eval_every, config.checkpoint.every_steps = 24, 12, 12
  config.compilation_cache_dir = ""
  for field, value in fields.items():
    section, _, leaf = field.rpartition("__")
    (config[section] if section else config)[leaf] = value
  return config


@pytest.fixture(scope="module")
def multi_label_run(tmp_path_factory):
  dataset = _write_multi_label(tmp_path_factory.mktemp("multi"))
  workdir = tmp_path_factory.mktemp("multi_run")
  config = _tiny(dataset, task="multi_label_classification", eval__threshold="tune", model__pooling="cls")
  result = loop.train_and_evaluate(config, str(workdir))
  return config, workdir, dataset, result


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
  dataset = _write_regression(tmp_path_factory.mktemp("regression"))
  workdir = tmp_path_factory.mktemp("regression_run")
  config = _tiny(dataset, task="regression", data__label_field="score", data__standardize_targets=True,
                 model__pooling="cls")
  result = loop.train_and_evaluate(config, str(workdir))
  return config, workdir, dataset, result


def _texts(dataset, split="test"):
  return [json.loads(line) for line in (pathlib.Path(dataset) / f"{split}.jsonl").read_text().splitlines()]


def test_multi_label_trains_evaluates_predicts_and_exports(multi_label_run, tmp_path):
  config, workdir, dataset, result = multi_label_run
  windows = metrics_lib.read_metrics(str(workdir), "train_window")
  assert all(0.0 <= w["micro_f1"] <= 1.0 for w in windows)
  dev = metrics_lib.read_metrics(str(workdir), "dev")
  assert [r["step"] for r in dev] == [12, 24]
  assert all(0.0 <= r[k] <= 1.0 for r in dev for k in ("micro_f1", "macro_f1", "samples_f1",
                                                             "mean_average_precision"))
  # The threshold tuned at the last dev evaluation is saved with the last checkpoint, and eval.py,
  # --predict and export use it.
  rows = _texts(dataset)
  documents = tmp_path / "docs.jsonl"
  _lines(documents, [{"id": i, "text": r["text"]} for i, r in enumerate(rows)])
  report = evaluate_lib.evaluate_checkpoint(config, str(workdir), checkpoint="latest", predict=str(documents))
  thresholds = report["thresholds"]
  assert len(set(thresholds)) == 1 and thresholds == result["dev"].get("thresholds", thresholds)
  predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").read_text().splitlines()]
  assert [p["id"] for p in predictions] == list(range(len(rows)))
  for p in predictions:
    assert p["labels"] == [n for n in NAMES if p["scores"][n] >= thresholds[NAMES.index(n)]]
  # The test metrics from the written predictions, scored independently, are eval.py's.
  gold = np.array([[n in r["label"] for n in NAMES] for r in rows])
  predicted = np.array([[n in p["labels"] for n in NAMES] for p in predictions])
  expected = task_metrics.multi_label_scores(gold, predicted)
  assert report["num_examples"] == len(rows) and report["task"] == "multi_label_classification"
  for key in ("micro_f1", "macro_f1", "samples_f1"):
    assert report[key] == pytest.approx(expected[key], abs=1e-9), key
  scores = np.array([[p["scores"][n] for n in NAMES] for p in predictions])
  assert report["mean_average_precision"] == pytest.approx(task_metrics.mean_average_precision(gold, scores),
                                                           abs=1e-4)
  # Export: problem_type and the thresholds in config.json; our importer reads back the same logits.
  out = export.export_to_transformers(str(workdir), tmp_path / "hf", checkpoint="latest")
  hf = json.loads((out / "config.json").read_text())
  assert hf["problem_type"] == "multi_label_classification" and hf["thresholds"] == thresholds
  assert hf["id2label"] == {str(i): n for i, n in enumerate(NAMES)}
  _same_logits_after_export(workdir, out, scale=None)


def test_regression_trains_evaluates_predicts_and_exports_in_target_units(regression_run, tmp_path):
  config, workdir, dataset, result = regression_run
  assert all(np.isfinite(w["mse"]) for w in metrics_lib.read_metrics(str(workdir), "train_window"))
  rows = _texts(dataset)
  documents = tmp_path / "docs.jsonl"
  _lines(documents, [{"text": r["text"]} for r in rows])
  report = evaluate_lib.evaluate_checkpoint(config, str(workdir), checkpoint="latest", predict=str(documents))
  targets = np.array([r["score"] for r in _texts(dataset, "train")], np.float64)
  np.testing.assert_allclose(report["target_mean"], targets.mean(0))
  np.testing.assert_allclose(report["target_std"], targets.std(0))
  predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").read_text().splitlines()]
  values = np.array([[p["values"]["score[0]"], p["values"]["score[1]"]] for p in predictions])
  gold = np.array([r["score"] for r in rows], np.float64)
  expected = task_metrics.regression_scores(gold, values)
  for key in ("mse", "mae", "pearson", "spearman"):
    assert report[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
  # Export folds the standardization into the head: the reloaded model outputs target units.
  out = export.export_to_transformers(str(workdir), tmp_path / "hf", checkpoint="latest")
  hf = json.loads((out / "config.json").read_text())
  assert hf["problem_type"] == "regression" and hf["num_labels"] == 2
  _same_logits_after_export(workdir, out, scale=(report["target_mean"], report["target_std"]))


def _same_logits_after_export(workdir, out, scale):
  run = export.restore_run(str(workdir), checkpoint="latest")
  model, params = run["model"], run["params"]
  reloaded, reloaded_params = models.from_pretrained(str(out), num_labels=model.num_labels, impl="reference",
                                                     pooling="cls", dropout_rate=0.0)
  ids = np.array([[101, 2000, 2001, 2002, 102, 0]], np.int32)
  seg = np.array([[1, 1, 1, 1, 1, 0]], np.int32)
  ours = np.asarray(model.clone(impl="reference").apply({"params": params}, ids, seg), np.float64)
  if scale is not None:
    ours = ours * np.asarray(scale[1]) + np.asarray(scale[0])
  theirs = np.asarray(reloaded.apply({"params": reloaded_params}, ids, seg), np.float64)
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# The command line: each shipped task config, shrunk, through train.py, eval.py and export
# ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["multi_label", "regression", "token_classification"])
def test_task_configs_train_evaluate_predict_and_export_from_the_command_line(name, tmp_path):
  shrink = ["--config.train.num_steps=4", "--config.train.eval_every=2", "--config.train.eval_max_batches=1",
            "--config.model.max_len=64", "--config.train.batch_size=4", "--config.data.eval_batch_size=4",
            "--config.checkpoint.every_steps=2"]
  if name == "token_classification":  # its windows share 64 tokens: fewer than the shrunk row holds
    shrink.append("--config.data.window_stride=16")
  common = ["--config", str(REPO / f"configs/{name}.py"), "--workdir", str(tmp_path / "run"), *shrink]
  run = lambda *args: subprocess.run([sys.executable, *args], env=_env(), cwd=REPO, capture_output=True,
                                     text=True, timeout=900)
  result = run(str(REPO / "train.py"), *common)
  assert result.returncode == 0, result.stderr[-4000:]
  texts = ["Talks in London on the EU budget.", '"We won," the coach said.']
  field = "tokens" if name == "token_classification" else "text"
  documents = _lines(tmp_path / "docs.jsonl", [{field: t.split() if field == "tokens" else t} for t in texts])
  result = run(str(REPO / "eval.py"), *common, "--config.data.eval_split=dev", f"--predict={documents}")
  assert result.returncode == 0, result.stderr[-4000:]
  report = json.loads((tmp_path / "run" / "eval_metrics.json").read_text())
  predictions = [json.loads(line)
                 for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
  assert len(predictions) == 2 and report["num_examples"] == 212
  if name == "multi_label":
    assert np.isfinite(report["micro_f1"]) and all("labels" in p and "scores" in p for p in predictions)
  elif name == "regression":
    assert np.isfinite(report["mse"]) and all(isinstance(p["value"], float) for p in predictions)
  else:
    assert np.isfinite(report["entity_f1"]) and [len(p["tags"]) for p in predictions] == [7, 5]
  result = run("-m", "flash_layers.export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}",
               "--checkpoint=latest")
  assert result.returncode == 0, result.stderr[-4000:]
  hf = json.loads((tmp_path / "hf" / "config.json").read_text())
  problem = {"multi_label": "multi_label_classification", "regression": "regression"}.get(name)
  assert hf.get("problem_type") == problem and hf["architectures"][0].endswith(
      "TokenClassification" if name == "token_classification" else "SequenceClassification")


# ----------------------------------------------------------------------------
# Token classification
# ----------------------------------------------------------------------------

def test_tagged_words_are_read_and_checked(tmp_path):
  _lines(tmp_path / "train.jsonl", [{"tokens": ["John", "lives", "in", "New", "York"],
                                     "tags": ["B-PER", "O", "O", "B-LOC", "I-LOC"]}])
  records = data_lib.load(tmp_path, label_kind="tags", text_column="tokens", label_column="tags")
  assert records.vocab.names == ("B-LOC", "B-PER", "I-LOC", "O")
  assert records[0] == {"text": ("John", "lives", "in", "New", "York"), "label": (1, 3, 3, 0, 2)}
  bad = {"short.jsonl": ({"tokens": ["a", "b"], "tags": ["O"]},
                         r"short.jsonl:1: field 'tags' has 1 tags but the document has 2 words"),
         "type.jsonl": ({"tokens": ["a"], "tags": ["PER"]}, r"type.jsonl:1: field 'tags': tag 0 is 'PER'"),
         "text.jsonl": ({"tokens": "a b", "tags": ["O"]},
                        r"text.jsonl:1: field 'tokens' must be a list of words")}
  for name, (row, match) in bad.items():
    _lines(tmp_path / name, [row])
    with pytest.raises(data_lib.DataError, match=match):
      data_lib.load(tmp_path / name, label_kind="tags", text_column="tokens", label_column="tags")
  (tmp_path / "t.csv").write_text("tokens,tags\na,O\n")
  with pytest.raises(data_lib.DataError, match="token classification data is JSONL"):
    data_lib.load(tmp_path / "t.csv", label_kind="tags", text_column="tokens", label_column="tags")


@pytest.mark.parametrize("max_len,stride", [(8, 2), (12, 0), (16, 5)])
def test_each_word_is_predicted_once_from_the_window_where_it_is_most_central(max_len, stride):
  rng = random.Random(max_len)
  vocabulary = [w for ws in TOPICS.values() for w in ws] + FILLER + ["unbelievably", "xylophones"]
  documents = [[rng.choice(vocabulary) for _ in range(rng.randint(1, 30))] for _ in range(12)]
  tok = data_lib.TextTokenizer("minilm", max_len=max_len, long_docs="windows", stride=stride)
  alone = lambda w: tok.tokenizer.encode([w], is_pretokenized=True).ids[1:-1]  # [CLS] w [SEP], unframed
  for words, windows in zip(documents, tok.encode_words(documents), strict=True):
    # Independently: a word's pieces are those it has alone; the document is their concatenation.
    pieces = [alone(w) for w in words]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    content = max_len - 2
    covered, central = [], []
    for k, window in enumerate(windows):
      assert len(window.ids) <= max_len and window.ids[0] == 101 and window.ids[-1] == 102
      offset = k * (content - stride)
      np.testing.assert_array_equal(window.ids[1:-1], [i for p in pieces for i in p][offset:offset + content])
      for position in np.flatnonzero(window.first_word >= 0):
        assert starts[window.first_word[position]] == offset + position - 1  # a word's first piece
      covered += [offset, offset + len(window.ids) - 2]
      central += window.central_word[window.central_word >= 0].tolist()
    assert sorted(central) == list(range(len(words)))  # each word exactly once
    for w in range(len(words)):  # ... from the window where its first piece is farthest from an edge
      spans = [(k * (content - stride), k * (content - stride) + len(win.ids) - 2)
               for k, win in enumerate(windows)]
      margins = [min(starts[w] - a, b - 1 - starts[w]) if a <= starts[w] < b else -1 for a, b in spans]
      chosen = next(k for k, win in enumerate(windows) if w in win.central_word)
      assert margins[chosen] == max(margins) and chosen == margins.index(max(margins))
  tags = [[rng.randint(0, 3) for _ in d] for d in documents]
  planned = data_lib.eval_plan.token_eval_batches(documents, tags, tok, batch_size=4)
  word_ids = np.concatenate([b["word_ids"][b["word_ids"] >= 0] for b in planned])
  assert sorted(word_ids.tolist()) == list(range(sum(map(len, documents))))
  assert planned.num_windows == sum(int(np.sum(b["doc_ids"] >= 0)) for b in planned)  # each window once
  gold = np.concatenate(tags)
  for b in planned:
    np.testing.assert_array_equal(b["labels"][b["word_ids"] >= 0], gold[b["word_ids"][b["word_ids"] >= 0]])
    assert (b["labels"][b["word_ids"] < 0] == -1).all()


def test_token_loss_and_word_scores():
  names = ("B-LOC", "B-PER", "I-PER", "O")
  objective = objectives.build("token_classification", names)
  rng = np.random.default_rng(5)
  logits = rng.normal(0, 2, (2, 6, 4)).astype(np.float32)
  labels = np.array([[-1, 1, 2, 3, -1, -1], [-1, 0, -1, 3, 3, -1]], np.int32)
  sums = jax.jit(objective.loss_sums)(jnp.asarray(logits), jnp.asarray(labels))
  tagged = labels >= 0
  log_probs = logits[tagged] - np.log(np.exp(logits[tagged].astype(np.float64)).sum(-1, keepdims=True))
  assert float(sums["count"]) == 6
  assert float(sums["loss_sum"]) == pytest.approx(-log_probs[np.arange(6), labels[tagged]].sum(), rel=1e-5)
  assert float(sums["stats"]["correct"]) == (logits[tagged].argmax(-1) == labels[tagged]).sum()
  # Two documents of 3 and 2 words; the last word was in no window: predicted "O".
  onehot = lambda t: np.eye(4)[t] * 5
  word_logits = np.stack([onehot(1), onehot(2), onehot(3), onehot(0), onehot(0)])
  seen = np.array([True, True, True, True, False])
  gold = [np.array([1, 2, 3]), np.array([0, 0])]  # B-PER I-PER O | B-LOC B-LOC
  scored = objective.score_words(word_logits, seen, [3, 2], gold)
  # Gold entities: PER(0-1), LOC(0), LOC(1); predicted: PER(0-1), LOC(0). Hand count: 2 of 3 found.
  assert (scored["entity_precision"], scored["entity_recall"]) == (1.0, pytest.approx(2 / 3))
  assert scored["entity_f1"] == pytest.approx(0.8) and scored["token_accuracy"] == pytest.approx(4 / 5)
  assert objective.predict_words(word_logits, seen, [3, 2]) == [{"tags": ["B-PER", "I-PER", "O"]},
                                                                 {"tags": ["B-LOC", "O"]}]


def _write_tagged(root: pathlib.Path, sizes=(120, 30, 30)) -> pathlib.Path:
  """Sentences whose topic words are entities of their topic: a run of them is B- then I-."""
  rng = random.Random(6)
  root.mkdir(parents=True, exist_ok=True)
  for split, n in zip(("train", "dev", "test"), sizes, strict=True):
    rows = []
    for _ in range(n):
      words, tags = [], []
      for _ in range(rng.randint(4, 40)):
        topic = rng.choice(NAMES) if rng.random() < 0.3 else None
        words.append(rng.choice(TOPICS[topic]) if topic else rng.choice(FILLER))
        inside = topic and tags and tags[-1] != "O" and tags[-1][2:] == topic.upper()
        tags.append("O" if not topic else ("I-" if inside else "B-") + topic.upper())
      rows.append({"tokens": words, "tags": tags})
    _lines(root / f"{split}.jsonl", rows)
  return root


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
  dataset = _write_tagged(tmp_path_factory.mktemp("tagged"))
  workdir = tmp_path_factory.mktemp("token_run")
  config = _tiny(dataset, task="token_classification", data__long_documents="windows", data__window_stride=4,
                 data__packing=True, data__max_docs_per_row=4)
  config.train.num_steps, config.train.learning_rate = 36, 1e-2
  result = loop.train_and_evaluate(config, str(workdir))
  return config, workdir, dataset, result


def test_token_classification_trains_evaluates_predicts_and_exports(token_run, tmp_path):
  config, workdir, dataset, result = token_run
  windows = metrics_lib.read_metrics(str(workdir), "train_window")
  assert windows[-1]["token_accuracy"] > 0.8  # most words are "O"; the test below scores entities
  rows = _texts(dataset)
  assert max(len(r["tokens"]) for r in rows) > 32  # longer than a window: split, each word once
  documents = _lines(tmp_path / "docs.jsonl", [{"id": i, "tokens": r["tokens"]} for i, r in enumerate(rows)])
  report = evaluate_lib.evaluate_checkpoint(config, str(workdir), checkpoint="latest", predict=str(documents))
  predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").read_text().splitlines()]
  assert [len(p["tags"]) for p in predictions] == [len(r["tokens"]) for r in rows]
  assert [p["tokens"] for p in predictions] == [r["tokens"] for r in rows]
  gold = [r["tags"] for r in rows]
  for mode, suffix in (("default", ""), ("strict", "_strict")):
    expected = task_metrics.entity_scores(gold, [p["tags"] for p in predictions], mode)
    assert report[f"entity_f1{suffix}"] == pytest.approx(expected["f1"], abs=1e-12)
    assert report[f"entity_recall{suffix}"] == pytest.approx(expected["recall"], abs=1e-12)
  assert report["token_accuracy"] == pytest.approx(expected["token_accuracy"])
  assert report["entity_f1"] > 0.5 and report["words_scored"] == sum(len(g) for g in gold)
  # Windows, not words: each document is cut into at least one, the long ones into several.
  assert len(rows) < report["num_windows"] < report["words_scored"]
  out = export.export_to_transformers(str(workdir), tmp_path / "hf", checkpoint="latest")
  hf = json.loads((out / "config.json").read_text())
  assert hf["architectures"] == ["BertForTokenClassification"] and "problem_type" not in hf
  run = export.restore_run(str(workdir), checkpoint="latest")
  reloaded, params = models.from_pretrained(str(out), num_labels=run["model"].num_labels, impl="reference",
                                            pooling="mean", dropout_rate=0.0)
  ids = np.array([[101, 2000, 2001, 2002, 102, 0]], np.int32)
  seg = np.array([[1, 1, 1, 1, 1, 0]], np.int32)
  ours = run["model"].clone(impl="reference").apply({"params": run["params"]}, ids, seg, method="tag")
  theirs = reloaded.apply({"params": params}, ids, seg, method="tag")
  np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# Masked-LM continued pretraining
# ----------------------------------------------------------------------------

def _mlm_batch(rows=4, length=40, seed=0):
  """Rows of two packed documents each: [CLS] pieces [SEP], padding after; every third piece continues
  the word before it."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1000, 2000, (rows, length)).astype(np.int32)
  starts = np.broadcast_to((np.arange(length) % 3 != 2).astype(np.int32), (rows, length))
  table = np.stack([ids, starts], -1)
  seg = np.zeros((rows, length), np.int32)
  pos = np.zeros((rows, length), np.int32)
  for r in range(rows):
    a, b = 12 + r, 30 + r  # two documents, then padding
    seg[r, :a], seg[r, a:b] = 1, 2
    pos[r, :a], pos[r, a:b] = np.arange(a), np.arange(b - a)
    for start, end in ((0, a), (a, b)):
      ids[r, start], ids[r, end - 1] = 101, 102  # specials
      table[r, start, 0], table[r, end - 1, 0] = -1, -1
    ids[r, b:], table[r, b:, 0] = 0, -1
  table[..., 1] *= table[..., 0] >= 0
  return {"input_ids": ids, "segment_ids": seg, "positions": pos, "labels": table}


@pytest.mark.parametrize("whole_word", [False, True])
def test_masking_statistics_over_many_draws(whole_word):
  objective = objectives.build("masked_lm", (), mlm={"vocab_size": 30522, "mask_id": 103,
                                                      "whole_word": whole_word})
  batch = _mlm_batch()
  draws = 300
  device = {k: jnp.asarray(v) for k, v in batch.items()}
  prepare = jax.jit(jax.vmap(lambda key: objective.prepare(device, key)))
  out = jax.device_get(prepare(jax.random.split(jax.random.key(7), draws)))
  maskable = batch["labels"][..., 0] >= 0
  masked = out["labels"][..., 0] >= 0
  assert not masked[:, ~maskable].any()  # specials and padding never
  n = draws * maskable.sum()
  rate = masked.sum() / n
  assert abs(rate - 0.15) < 4 * np.sqrt(0.15 * 0.85 / (n / (1.5 if whole_word else 1)))
  given = np.broadcast_to(batch["input_ids"], masked.shape)
  np.testing.assert_array_equal(out["labels"][..., 0][masked], given[masked])
  ids = out["input_ids"][masked]
  original = np.broadcast_to(batch["input_ids"], masked.shape)[masked]
  k = masked.sum()
  for share, observed in ((0.8, np.mean(ids == 103)), (0.1, np.mean(ids == original))):
    assert abs(observed - share) < 4 * np.sqrt(share * (1 - share) / k), (share, observed)
  np.testing.assert_array_equal(out["input_ids"][~masked], given[~masked])
  if whole_word:  # a word's pieces go together: a continuation is masked exactly when its word's start is
    starts = batch["labels"][..., 1] > 0
    for r in range(batch["input_ids"].shape[0]):
      for t in range(1, batch["input_ids"].shape[1]):
        if maskable[r, t] and maskable[r, t - 1] and not starts[r, t]:
          np.testing.assert_array_equal(masked[:, r, t], masked[:, r, t - 1])
  # Redrawn per key, repeatable per key; the position split is where the positions say.
  again = jax.device_get(prepare(jax.random.split(jax.random.key(7), draws)))
  np.testing.assert_array_equal(again["input_ids"], out["input_ids"])
  assert (masked[0] != masked[1]).any()
  far = dict(batch, positions=batch["positions"] + 500)
  labels = objective.prepare({k: jnp.asarray(v) for k, v in far.items()}, jax.random.key(1))["labels"]
  labels = jax.device_get(labels)
  np.testing.assert_array_equal(labels[..., 1], (far["positions"] >= 512).astype(np.int32))


def test_masked_lm_loss_splits_at_position_512():
  objective = objectives.build("masked_lm", (), mlm={"vocab_size": 7, "mask_id": 6})
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 1, (1, 5, 7)).astype(np.float32)
  labels = np.array([[[2, 0], [-1, 0], [4, 1], [5, 1], [0, 0]]], np.int32)
  stats = jax.device_get(objective.loss_sums(jnp.asarray(logits), jnp.asarray(labels))["stats"])
  log_probs = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum(-1, keepdims=True))
  nll = -log_probs[[0, 2, 3, 4], [2, 4, 5, 0]]
  np.testing.assert_allclose(stats["loss"], [nll[0] + nll[3], nll[1] + nll[2]], rtol=1e-5)
  summary = objective.summarize(stats)
  assert summary["mlm_loss_below_512"] == pytest.approx((nll[0] + nll[3]) / 2, rel=1e-5)
  assert summary["perplexity_from_512"] == pytest.approx(np.exp((nll[1] + nll[2]) / 2), rel=1e-5)
  assert summary["masked_tokens"] == 4


def _write_texts(path: pathlib.Path, n: int = 80) -> pathlib.Path:
  rng = random.Random(8)
  words = lambda: [rng.choice(TOPICS[rng.choice(NAMES)] + FILLER) for _ in range(rng.randint(8, 60))]
  _lines(path, [{"text": " ".join(words())} for _ in range(n)])
  return path


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
  texts = _write_texts(tmp_path_factory.mktemp("texts") / "texts.jsonl")
  workdir = tmp_path_factory.mktemp("mlm_run")
  config = _tiny(texts, task="masked_lm", data__eval_split="dev", data__packing=True,
                 data__max_docs_per_row=4, data__whole_word_masking=True)
  config.train.num_steps, config.train.eval_every, config.checkpoint.every_steps = 12, 6, 6
  loop.train_and_evaluate(config, str(workdir))
  return config, workdir, texts


def test_masked_lm_trains_evaluates_and_resumes_bitwise(mlm_run, tmp_path):
  config, workdir, texts = mlm_run
  losses = {r["step"]: r["loss"] for r in metrics_lib.read_metrics(str(workdir), "train")}
  assert sorted(losses) == list(range(1, 13)) and all(np.isfinite(list(losses.values())))
  dev = metrics_lib.read_metrics(str(workdir), "dev")[-1]
  assert dev["masked_tokens"] > 0 and dev["perplexity"] == pytest.approx(np.exp(dev["mlm_loss"]), rel=1e-6)
  assert dev["masked_tokens_from_512"] == 0  # rows of 32 tokens
  report = evaluate_lib.evaluate_checkpoint(config, str(workdir), checkpoint="latest")
  again = evaluate_lib.evaluate_checkpoint(config, str(workdir), checkpoint="latest")
  assert report["mlm_loss"] == again["mlm_loss"] and report["task"] == "masked_lm"  # evaluation masks alike
  # Resume from the step-6 checkpoint in a copy of the run: steps 7-12 repeat bit for bit (masks included).
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  shutil.rmtree(copy / "checkpoints" / "12")
  shutil.rmtree(copy / "best", ignore_errors=True)
  loop.train_and_evaluate(config, str(copy))
  resumed = {r["step"]: r["loss"] for r in metrics_lib.read_metrics(str(copy), "train")}
  assert resumed == losses
  with pytest.raises(Exception, match="--predict: task 'masked_lm' predicts no labels"):
    evaluate_lib.evaluate_checkpoint(config, str(workdir), predict=str(texts))
  # Export: transformers' BertForMaskedLM, read back by our importer with the same masked-LM logits.
  out = export.export_to_transformers(str(workdir), tmp_path / "hf", checkpoint="latest")
  hf = json.loads((out / "config.json").read_text())
  assert hf["architectures"] == ["BertForMaskedLM"] and "num_labels" not in hf
  run = export.restore_run(str(workdir), checkpoint="latest")
  reloaded, params = models.from_pretrained(str(out), impl="reference", mlm_head=True, dropout_rate=0.0)
  ids = np.array([[101, 2000, 103, 2002, 102, 0]], np.int32)
  seg = np.array([[1, 1, 1, 1, 1, 0]], np.int32)
  ours = run["model"].clone(impl="reference").apply({"params": run["params"]}, ids, seg, method="mlm")
  theirs = reloaded.apply({"params": params}, ids, seg, method="mlm")
  np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_masked_lm_run_killed_then_resumed_repeats_every_loss(tmp_path):
  """train.py SIGKILLed mid-run (possibly mid-save), then run again: every step's loss, masks
  included, equals the uninterrupted run's, bit for bit (as test_training's classification test)."""
  texts = _write_texts(tmp_path / "texts.jsonl", n=120)
  flags = [f"--config.data.dataset={texts}", "--config.task=masked_lm", "--config.data.eval_split=dev",
           "--config.data.packing=True", "--config.data.max_docs_per_row=4", "--config.train.num_steps=60",
           "--config.train.log_every=2", "--config.train.eval_every=30", "--config.checkpoint.every_steps=10"]
  tiny = str(REPO / "configs/tiny.py")
  command = lambda workdir: [sys.executable, str(REPO / "train.py"), "--config", tiny,
                             "--workdir", str(workdir), *flags]
  run = lambda workdir: subprocess.run(command(workdir), env=_env(), cwd=REPO, capture_output=True, text=True,
                                       timeout=900)
  reference = run(tmp_path / "reference")
  assert reference.returncode == 0, reference.stderr[-3000:]
  process = subprocess.Popen(command(tmp_path / "killed"), env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  _wait_for_step(process, tmp_path / "killed", 25)
  process.kill()
  process.communicate(timeout=60)
  resumed = run(tmp_path / "killed")
  assert resumed.returncode == 0 and "resumed from checkpoint step" in resumed.stderr, resumed.stderr[-3000:]
  losses = lambda w: {r["step"]: r["loss"] for r in metrics_lib.read_metrics(str(w), "train")}
  assert sorted(losses(tmp_path / "killed")) == list(range(1, 61))
  assert losses(tmp_path / "killed") == losses(tmp_path / "reference")


def test_init_from_starts_a_task_from_a_masked_lm_run_with_its_positions_extended(mlm_run, tmp_path):
  config, workdir, _ = mlm_run
  _, source = checkpoint_lib.read_params(str(workdir))
  dataset = _write_multi_label(tmp_path / "data", sizes=(16, 8, 8))
  classify = _tiny(dataset, task="multi_label_classification", model__init_from=str(workdir),
                   model__max_len=64)
  from flash_layers.training import task as task_lib
  task = task_lib.build_task(classify, None)
  params = task.pretrained_params
  kernel = lambda p: p["layers_1"]["mlp_in"]["kernel"]
  np.testing.assert_array_equal(kernel(params), kernel(source))
  table = source["position_embeddings"]["embedding"]
  assert table.shape[0] == 32 and params["position_embeddings"]["embedding"].shape[0] == 64
  np.testing.assert_array_equal(params["position_embeddings"]["embedding"], np.concatenate([table, table]))
  assert "classifier" not in source and params["classifier"]["kernel"].shape == (32, 3)
  classify.model.init_from = str(tmp_path)
  with pytest.raises(config_lib.ConfigError,
                     match="config.model.init_from: .* is not a training run's workdir"):
    config_lib.validate(classify, num_devices=1)


# ----------------------------------------------------------------------------
# Hierarchical documents
# ----------------------------------------------------------------------------

def test_a_hierarchical_row_is_one_documents_chunks():
  tok = data_lib.TextTokenizer("minilm", max_len=8, long_docs="windows")
  text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
  windows = tok.encode([text])[0]
  assert len(windows) == 3
  [batch] = data_lib.eval_batches([text, "short"], [1, 0], tok, batch_size=2, chunks=2)
  row = np.flatnonzero(batch["doc_ids"][:, 0] == 0)[0]
  np.testing.assert_array_equal(batch["input_ids"][row, :16], np.concatenate(windows[:2]))  # the first 2
  np.testing.assert_array_equal(batch["segment_ids"][row], [1] * 8 + [2] * 8)
  np.testing.assert_array_equal(batch["positions"][row], list(range(8)) * 2)
  assert batch["labels"].tolist()[row] == [1] and batch["input_ids"].shape[1] == 16
  records = data_lib.Records([{"text": text, "label": 1}], vocab=data_lib.LabelVocab(("a", "b")), source="t",
                             split="train")
  train = next(data_lib.make_batches(records, tok, batch_size=1, chunks=3, shuffle=False))
  np.testing.assert_array_equal(train["segment_ids"][0][:sum(map(len, windows))],
                                np.repeat([1, 2, 3], [len(w) for w in windows]))
  with pytest.raises(ValueError, match="chunks .* needs pack=False"):
    data_lib.make_batches(records, tok, batch_size=1, chunks=3, pack=True)


@pytest.mark.parametrize("chunk_pooling", ["mean", "max", "attention"])
def test_chunk_vectors_are_combined_as_documented(chunk_pooling):
  model = models.Bert(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=24,
                      num_labels=3, pooling="mean", impl="reference", chunk_pooling=chunk_pooling)
  params = models.init_params(model, jax.random.key(0))
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 50, (2, 24)).astype(np.int32)
  seg = np.array([[1] * 8 + [2] * 8 + [3] * 8, [1] * 8 + [2] * 4 + [0] * 12], np.int32)
  pos = np.array([list(range(8)) * 3, list(range(8)) + list(range(4)) + [0] * 12], np.int32)
  logits = model.apply({"params": params}, ids, seg, pos, max_chunks=3, method=model.classify_chunks)
  logits = np.asarray(logits)
  # Independently: each chunk encoded on its own (positions from 0), mean-pooled, then combined.
  chunk_vectors = []
  for r in range(2):
    vectors = []
    for c in (1, 2, 3):
      keep = seg[r] == c
      if keep.any():
        hidden = model.apply({"params": params}, ids[r:r + 1, keep], method=model.encode)
        vectors.append(np.asarray(hidden[0], np.float64).mean(0))
    chunk_vectors.append(np.stack(vectors))
  for r, vectors in enumerate(chunk_vectors):
    if chunk_pooling == "mean":
      document = vectors.mean(0)
    elif chunk_pooling == "max":
      document = vectors.max(0)
    else:
      score = params["chunk_score"]
      s = vectors @ np.asarray(score["kernel"], np.float64)[:, 0] + float(score["bias"][0])
      document = (np.exp(s - s.max()) / np.exp(s - s.max()).sum()) @ vectors
    head = params["classifier"]
    expected = document @ np.asarray(head["kernel"]) + np.asarray(head["bias"])
    np.testing.assert_allclose(logits[r, 0], expected, rtol=1e-4, atol=1e-5)


def test_hierarchical_documents_train_evaluate_and_predict(tmp_path):
  dataset = _write_multi_label(tmp_path / "data", sizes=(48, 16, 16))
  config = _tiny(dataset, task="multi_label_classification", data__long_documents="hierarchical",
                 data__max_chunks=3, model__chunk_pooling="attention", model__max_len=16)
  config.train.num_steps, config.train.eval_every, config.checkpoint.every_steps = 6, 6, 6
  loop.train_and_evaluate(config, str(tmp_path / "run"))
  rows = _texts(dataset)
  documents = _lines(tmp_path / "docs.jsonl", [{"text": r["text"]} for r in rows])
  report = evaluate_lib.evaluate_checkpoint(config, str(tmp_path / "run"), checkpoint="latest",
                                            predict=str(documents))
  written = (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()
  predictions = [json.loads(line) for line in written]
  gold = np.array([[n in r["label"] for n in NAMES] for r in rows])
  predicted = np.array([[n in p["labels"] for n in NAMES] for p in predictions])
  assert report["micro_f1"] == pytest.approx(task_metrics.multi_label_scores(gold, predicted)["micro_f1"])
  assert report["num_examples"] == len(rows) == len(predictions)
  with pytest.raises(export.ExportError, match="'hierarchical' cannot be exported"):
    export.export_to_transformers(str(tmp_path / "run"), tmp_path / "hf", checkpoint="latest")


@pytest.mark.slow
def test_hierarchical_run_scores_alike_on_a_sequence_sharded_mesh(tmp_path):
  dataset = _write_multi_label(tmp_path / "data", sizes=(48, 16, 16))
  common = ["--config", str(REPO / "configs/tiny.py"), "--workdir", str(tmp_path / "run"),
            f"--config.data.dataset={dataset}", "--config.task=classification",
            "--config.data.long_documents=hierarchical", "--config.data.max_chunks=2",
            "--config.model.max_len=16", "--config.train.num_steps=4", "--config.data.eval_split=test"]
  _lines(dataset / "train.jsonl", [{"text": r["text"], "label": (r["label"] or ["none"])[0]}
                                   for r in _texts(dataset, "train")])
  for split in ("dev", "test"):
    _lines(dataset / f"{split}.jsonl", [{"text": r["text"], "label": (r["label"] or ["none"])[0]}
                                        for r in _texts(dataset, split)])
  run = lambda script, *flags, devices=1: subprocess.run(
      [sys.executable, str(REPO / script), *common, *flags], env=_env(devices), cwd=REPO, capture_output=True,
      text=True, timeout=900)
  result = run("train.py")
  assert result.returncode == 0, result.stderr[-4000:]
  reports = []
  for devices, mesh in ((1, []), (2, ["--config.mesh.data=1", "--config.mesh.sequence=2"])):
    result = run("eval.py", *mesh, devices=devices)
    assert result.returncode == 0, result.stderr[-4000:]
    reports.append(json.loads((tmp_path / "run" / "eval_metrics.json").read_text()))
  assert reports[0]["confusion_matrix"] == reports[1]["confusion_matrix"]
  assert reports[0]["loss"] == pytest.approx(reports[1]["loss"], rel=1e-5)
