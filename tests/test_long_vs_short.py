"""The long-versus-short study's report (benchmarks/long_vs_short.py): its scores, means and paired
bootstrap intervals, against a hand count of each class's F1 on made-up predictions."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from benchmarks import long_vs_short


def _macro_f1_by_hand(gold: list[str], predicted: list[str]) -> float:
  """scikit-learn's macro F1 over the classes of gold and predicted (zero_division=0), written out."""
  scores = []
  pairs = list(zip(gold, predicted, strict=True))
  for c in sorted(set(gold) | set(predicted)):
    tp = sum(g == c and p == c for g, p in pairs)
    fp = sum(g != c and p == c for g, p in pairs)
    fn = sum(g == c and p != c for g, p in pairs)
    scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
  return sum(scores) / len(scores)


def test_report_scores_means_and_paired_intervals(tmp_path):
  rng = np.random.default_rng(1)
  gold = [str(x) for x in rng.choice(["x", "y", "z"], size=60)]
  data = tmp_path / "data"
  data.mkdir()
  texts = ["news " * 600 if i < 20 else "short news" for i in range(len(gold))]  # 20 above 512 tokens
  rows = [json.dumps({"text": t, "label": g}) + "\n" for t, g in zip(texts, gold, strict=True)]
  (data / "test.jsonl").write_text("".join(rows))
  out = tmp_path / "out"
  (out / "runs").mkdir(parents=True)
  (out / "selected.json").write_text(json.dumps({"a": 1e-4, "b": 2e-4, "c": 3e-4}))

  def noisy(flip: float, seed: int) -> list[str]:
    r = np.random.default_rng(seed)  # "w" is a class no test document has: an F1 of 0 that counts
    return [str(r.choice(["x", "y", "z", "w"])) if r.random() < flip else g for g in gold]

  predictions = {"a": [noisy(0.7, 10), noisy(0.7, 11)], "c": [noisy(0.1, 20), noisy(0.1, 21)]}
  predictions["b"] = predictions["a"]  # the same predictions as arm a: a difference of exactly 0
  for arm, lr in (("a", 1e-4), ("b", 2e-4), ("c", 3e-4)):
    for seed, test in enumerate(predictions[arm]):
      record = {"name": f"{arm}-lr{lr:g}-seed{seed}", "arm": arm, "lr": lr, "seed": seed,
                "train": {"wall_s": 1.0, "cpu_s": 2.0}, "test": test}
      (out / "runs" / f"{arm}-lr{lr:g}-seed{seed}.json").write_text(json.dumps(record))
  long_vs_short.main(["report", "--dataset", str(data), "--out", str(out), "--arms", "a", "b", "c",
                      "--seeds", "0", "1", "--bootstrap", "300", "--work", str(tmp_path / "work")])
  summary = json.loads((out / "summary.json").read_text())
  assert summary["metric"] == "macro_f1" and summary["test_documents"] == 60
  assert summary["dataset"] == data.name and str(tmp_path) not in json.dumps(summary)  # no local path
  test_sha = hashlib.sha256((data / "test.jsonl").read_bytes()).hexdigest()
  assert summary["dataset_sha256"]["test.jsonl"] == test_sha
  for arm in ("a", "c"):
    by_hand = [_macro_f1_by_hand(gold, p) for p in predictions[arm]]
    row = summary["arms"][arm]
    assert row["values"] == pytest.approx(by_hand, abs=1e-12)
    assert row["mean"] == pytest.approx(np.mean(by_hand))
    assert row["std"] == pytest.approx(np.std(by_hand, ddof=1))
  for seed, paired in enumerate(summary["arms"]["c"]["paired_vs_a"]):
    delta = _macro_f1_by_hand(gold, predictions["c"][seed]) - _macro_f1_by_hand(gold, predictions["a"][seed])
    assert paired["delta"] == pytest.approx(delta, abs=1e-12) and delta > 0.1
    low, high = paired["ci95"]
    assert 0 < low < delta < high < 1  # 60 documents: wide, but c's large gain is outside chance
  assert all(p["delta"] == 0 and p["ci95"] == [0, 0] for p in summary["arms"]["b"]["paired_vs_a"])
  # The probe: each arm's metrics on the documents that fit in 512 tokens and on the longer ones.
  probe = summary["probe"]
  assert probe["documents"] == {"<= 512": 40, "> 512": 20} and probe["tokens"]["max"] == 600
  assert probe["tokens"]["share_above_512"] == pytest.approx(1 / 3)
  for name, rows in (("> 512", range(20)), ("<= 512", range(20, 60))):
    by_hand = np.mean([_macro_f1_by_hand([gold[i] for i in rows], [p[i] for i in rows])
                       for p in predictions["c"]])
    assert probe["arms"]["c"][name]["macro_f1"] == pytest.approx(by_hand, abs=1e-12)


def test_probe_arm_f_takes_arm_cs_learning_rate(tmp_path, monkeypatch):
  # (f) is (c) with more steps: selecting it selects (c) (on dev, at seed 0) and trains no run of its own.
  runs = []

  def finetune(self, arm, lr, seed, test):
    runs.append((arm, lr, seed, test))
    return {"dev": {"macro_f1": {1e-4: 0.2, 3e-4: 0.6, 1e-3: 0.4}[lr]}}

  monkeypatch.setattr(long_vs_short.Study, "finetune", finetune)
  out = tmp_path / "out"
  long_vs_short.main(["select", "--dataset", str(tmp_path), "--out", str(out), "--arms", "f",
                      "--lrs", "1e-4", "3e-4", "1e-3", "--work", str(tmp_path / "work")])
  assert sorted(runs) == [("c", lr, 0, False) for lr in (1e-4, 3e-4, 1e-3)]
  assert json.loads((out / "selected.json").read_text()) == {"c": 3e-4, "f": 3e-4}
