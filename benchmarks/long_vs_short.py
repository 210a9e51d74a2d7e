"""The long-versus-short study (docs/training.md): does reading the whole document beat truncating it?

    python -m benchmarks.long_vs_short --dataset DIR --out benchmarks/results/long-vs-short-DATE select
    python -m benchmarks.long_vs_short --dataset DIR --out benchmarks/results/long-vs-short-DATE run
    python -m benchmarks.long_vs_short --dataset DIR --out benchmarks/results/long-vs-short-DATE report

DIR holds train/dev/test JSONL files of {"text": ..., "label": ...} (a list of labels: multi-label,
`--task multi_label_classification`). Five arms, every one from all-MiniLM-L6-v2 (the Longformer and
LexGLUE comparisons), and a probe:

  a  truncate      the first --short tokens (512)
  b  hierarchical  up to --long / --short chunks of --short tokens, pooled by a learned attention
  c  long          the whole document up to --long tokens, the position table copied (Longformer's repeat)
  d  mlm_short     masked-LM at --short on the training split's text, then (a) from that encoder
  e  mlm_long      masked-LM at --short (it trains MiniLM's missing MLM head), the positions copied and
                   masked-LM continued at --long, then (c) from that encoder
  f  long_steps    (c) with as many steps as (a), so --long / --short times its tokens: a probe, outside
                   the equal budget, of whether (c) loses to (a) by its context or by its fewer updates

Every fine-tuning run sees the same number of tokens (--budget-tokens: steps = budget / (batch x
tokens per row), so an arm at 2,048 takes a quarter of the steps of one at 512) and the same
learning-rate grid. The masked-LM runs are extra compute for (d) and (e), one per study (seed 0),
sized by --mlm-short-steps and --mlm-long-steps; the report states both budgets.

Stages (each resumable: a run whose record exists is not redone):
  select   every arm x every --lrs at seed 0, scored on dev (the test split is not read); (f) takes
           (c)'s rate
  run      every arm at its best dev learning rate x every --seeds, then one prediction of the test
           split per run (the test labels are read here and only here)
  all      select then run, one arm at a time (an arm's seed-0 workdirs are freed before the next
           arm starts; each finished arm is final, so a study can span several sittings)
  report   mean +- std per arm over seeds, and per seed paired bootstrap intervals (--bootstrap
           resamples of the test documents) of each arm's metric minus arm (a)'s; the summary goes to
           OUT/summary.json

Each run is `python train.py --config configs/quickstart.py --workdir W --config...` (then eval.py),
exactly as a user runs it; its record (overrides, wall and CPU seconds, dev metrics, per-document test
predictions) goes to OUT/runs/<name>.json.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

import numpy as np

from benchmarks import cpu_dense
from benchmarks.machine import children_cpu
from flash_layers.training import metrics as metrics_lib
from flash_layers.training import task_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
ARMS = ("a", "b", "c", "d", "e", "f")
ARM_NAMES = {"a": "truncate", "b": "hierarchical", "c": "long", "d": "mlm_short", "e": "mlm_long",
             "f": "long_steps"}
PRIMARY = {"classification": "macro_f1", "multi_label_classification": "micro_f1"}


def _run(script: str, workdir: pathlib.Path, overrides: list[str], extra: list[str] = ()) -> dict:
  """One train.py / eval.py process; its wall and CPU seconds."""
  command = [sys.executable, script, "--config", "configs/quickstart.py", "--workdir", str(workdir),
             *overrides, *extra]
  cpu, wall = children_cpu(), time.perf_counter()
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "FLASH_LAYERS_CACHE": str(workdir.parent / "cache")})
  if result.returncode:
    raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
  return {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(children_cpu() - cpu, 1)}


class Study:
  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.out = args.out
    self.runs = args.out / "runs"
    self.work = args.work
    self.runs.mkdir(parents=True, exist_ok=True)
    self.work.mkdir(parents=True, exist_ok=True)

  # -- configurations ---------------------------------------------------------------------------

  def _common(self, seed: int) -> list[str]:
    a = self.args
    return [f"--config.seed={seed}", f"--config.data.dataset={a.dataset}",
            f"--config.train.batch_size={a.batch}", "--config.data.eval_split=dev",
            "--config.data.eval_batch_size=8", "--config.train.log_every=10",
            "--config.checkpoint.every_steps=1000000"]

  def _steps(self, row_tokens: int) -> int:
    return max(1, self.args.budget_tokens // (self.args.batch * row_tokens))

  def arm_overrides(self, arm: str, lr: float, seed: int) -> list[str]:
    a = self.args
    long_arm = arm in ("c", "e", "f")
    row = a.long if arm in ("b", "c", "e") else a.short  # f: (a)'s steps at (c)'s length
    steps = self._steps(row)
    o = [*self._common(seed), f"--config.task={a.task}", f"--config.train.learning_rate={lr}",
         f"--config.train.num_steps={steps}", f"--config.train.warmup_steps={max(1, steps // 10)}",
         f"--config.train.eval_every={steps}", f"--config.model.max_len={a.long if long_arm else a.short}",
         f"--config.model.pooling={a.pooling}", "--config.data.packing=False"]
    if a.task == "multi_label_classification":
      o += ["--config.eval.threshold=tune", "--config.checkpoint.best_metric=micro_f1"]
    if arm == "b":
      o += ["--config.data.long_documents=hierarchical", f"--config.data.max_chunks={a.long // a.short}",
            "--config.model.chunk_pooling=attention"]
    if arm == "d":
      o.append(f"--config.model.init_from={self._mlm_workdir('short')}")
    if arm == "e":
      o.append(f"--config.model.init_from={self._mlm_workdir('long')}")
    return o

  def _mlm_workdir(self, which: str) -> pathlib.Path:
    return self.work / f"mlm_{which}"

  def _mlm_overrides(self, which: str) -> list[str]:
    a = self.args
    steps = a.mlm_short_steps if which == "short" else a.mlm_long_steps
    length = a.short if which == "short" else a.long
    o = [*self._common(0), "--config.task=masked_lm", f"--config.model.max_len={length}",
         f"--config.train.num_steps={steps}", f"--config.train.warmup_steps={max(1, steps // 10)}",
         f"--config.train.eval_every={steps}", f"--config.train.learning_rate={a.mlm_lr}",
         "--config.data.packing=True", "--config.data.max_docs_per_row=8",
         "--config.checkpoint.best_metric=mlm_loss"]
    if which == "long":
      o.append(f"--config.model.init_from={self._mlm_workdir('short')}")
    return o

  # -- runs -------------------------------------------------------------------------------------

  def _record_path(self, name: str) -> pathlib.Path:
    return self.runs / f"{name}.json"

  def mlm(self, which: str) -> dict:
    path = self._record_path(f"mlm_{which}")
    if path.exists() and self._mlm_workdir(which).exists():
      return json.loads(path.read_text())
    if which == "long":
      self.mlm("short")
    workdir = self._mlm_workdir(which)
    shutil.rmtree(workdir, ignore_errors=True)
    overrides = self._mlm_overrides(which)
    record = {"name": f"mlm_{which}", "overrides": overrides, "train": _run("train.py", workdir, overrides)}
    record["dev"] = json.loads((workdir / "train_summary.json").read_text())["dev"]
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record

  def finetune(self, arm: str, lr: float, seed: int, test: bool) -> dict:
    name = f"{arm}-lr{lr:g}-seed{seed}"
    path = self._record_path(name)
    workdir = self.work / name
    record = json.loads(path.read_text()) if path.exists() else None
    if record is not None and (not test or "test" in record):
      return record
    if record is None or not workdir.exists():  # (a select run's workdir is kept for its test prediction)
      if arm == "d":
        self.mlm("short")
      if arm == "e":
        self.mlm("long")
      shutil.rmtree(workdir, ignore_errors=True)
      overrides = self.arm_overrides(arm, lr, seed)
      record = {"name": name, "arm": arm, "lr": lr, "seed": seed, "overrides": overrides,
                "train": _run("train.py", workdir, overrides)}
      _run("eval.py", workdir, overrides)  # the full dev split
      record["dev"] = _metrics_only(json.loads((workdir / "eval_metrics.json").read_text()))
      path.write_text(json.dumps(record) + "\n")
    overrides = record["overrides"]
    if test:
      out = workdir / "test_predictions.jsonl"
      record["predict"] = _run("eval.py", workdir, overrides,
                               [f"--predict={self.args.dataset}/test.jsonl", f"--predictions_out={out}"])
      record["test"] = [_prediction(json.loads(line)) for line in out.read_text().splitlines()]
      path.write_text(json.dumps(record) + "\n")
      shutil.rmtree(workdir, ignore_errors=True)
    return record

  # -- stages -----------------------------------------------------------------------------------

  def select_arm(self, arm: str) -> float:
    """The arm's learning rate with the best dev metric at seed 0 (ties: the smaller); selected.json.
    Probe arm (f) is (c) with more steps, not an arm to tune: it takes (c)'s rate."""
    primary = PRIMARY[self.args.task]
    if arm == "f":
      best = self.select_arm("c")
      print(f"arm f ({ARM_NAMES['f']}): arm c's learning rate {best:g}", flush=True)
    else:
      scores = {lr: self.finetune(arm, lr, 0, test=False)["dev"][primary] for lr in self.args.lrs}
      best = max(scores, key=lambda lr: (scores[lr], -lr))
      print(f"arm {arm} ({ARM_NAMES[arm]}): dev {primary} by lr {scores} -> {best:g}", flush=True)
    path = self.out / "selected.json"
    selected = json.loads(path.read_text()) if path.exists() else {}
    selected[arm] = best
    path.write_text(json.dumps(selected, indent=1, sort_keys=True) + "\n")
    return best

  def select(self) -> dict:
    return {arm: self.select_arm(arm) for arm in self.args.arms}

  def run_all(self) -> None:
    for arm in self.args.arms:
      best = self.select_arm(arm)
      for seed in self.args.seeds:
        self.finetune(arm, best, seed, test=True)
      for lr in self.args.lrs:  # the unselected seed-0 runs' workdirs
        shutil.rmtree(self.work / f"{arm}-lr{lr:g}-seed0", ignore_errors=True)

  def run(self) -> None:
    path = self.out / "selected.json"
    if not path.exists():
      raise SystemExit(f"{path} is missing: run the select stage first")
    best = json.loads(path.read_text())
    for arm in self.args.arms:
      if arm not in best:
        raise SystemExit(f"{path} has no learning rate for arm {arm}: run its select stage first")
      for seed in self.args.seeds:
        self.finetune(arm, best[arm], seed, test=True)

  def probe(self, gold: list, score, records: dict) -> dict:
    """Where the arms differ: each one's metrics (mean over seeds) on the test documents that fit in
    --short tokens, where truncation loses nothing, and on the longer ones, with the split's lengths."""
    lengths = np.array(_lengths(self.args.dataset / "test.jsonl", self.args.tokenizer))
    buckets = {f"<= {self.args.short}": np.flatnonzero(lengths <= self.args.short),
               f"> {self.args.short}": np.flatnonzero(lengths > self.args.short)}
    a = self.args
    out = {"tokens": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                      "max": int(lengths.max()),
                      **{f"share_above_{n}": float((lengths > n).mean()) for n in (a.short, a.long)}},
           "documents": {name: len(idx) for name, idx in buckets.items()}, "arms": {}}
    for arm, runs in records.items():
      per_bucket = {}
      for name, idx in buckets.items():
        if len(idx):
          scores = [score([r["test"][i] for i in idx], idx) for r in runs]
          per_bucket[name] = {key: float(np.mean([x[key] for x in scores])) for key in scores[0]}
      out["arms"][arm] = per_bucket
    return out

  def report(self) -> dict:
    best = json.loads((self.out / "selected.json").read_text())
    gold = _gold(self.args.dataset / "test.jsonl")
    score = _scorer(self.args.task, gold)
    primary = PRIMARY[self.args.task]
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(gold), size=(self.args.bootstrap, len(gold)))
    arms, records = {}, {}
    for arm in self.args.arms:
      records[arm] = [json.loads(self._record_path(f"{arm}-lr{best[arm]:g}-seed{s}").read_text())
                      for s in self.args.seeds]
      values = [score(r["test"])[primary] for r in records[arm]]
      arms[arm] = {"name": ARM_NAMES[arm], "lr": best[arm], "values": values, "mean": float(np.mean(values)),
                   "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                   "train_wall_s": [r["train"]["wall_s"] for r in records[arm]],
                   "train_cpu_s": [r["train"]["cpu_s"] for r in records[arm]]}
    for arm in self.args.arms:
      if arm == "a" or "a" not in records:
        continue
      deltas = []
      for mine, base in zip(records[arm], records["a"], strict=True):
        on = lambda run, idx: score([run["test"][i] for i in idx], idx)[primary]  # noqa: E731
        diff = [on(mine, idx) - on(base, idx) for idx in draws]
        delta = score(mine["test"])[primary] - score(base["test"])[primary]
        deltas.append({"seed": mine["seed"], "delta": delta,
                       "ci95": [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))]})
      arms[arm]["paired_vs_a"] = deltas
    # The data by name and content, not by where it lay on the machine that ran the study.
    summary = {"date": datetime.date.today().isoformat(), "dataset": self.args.dataset.name,
               "dataset_sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                                  for f in sorted(self.args.dataset.glob("*.jsonl"))},
               "pooling": self.args.pooling, "mlm_lr": self.args.mlm_lr,
               "task": self.args.task, "metric": primary, "test_documents": len(gold),
               "budget_tokens": self.args.budget_tokens,
               "short": self.args.short, "long": self.args.long, "batch": self.args.batch,
               "lrs": self.args.lrs, "seeds": self.args.seeds, "bootstrap": self.args.bootstrap, "arms": arms,
               "mlm": {w: json.loads(self._record_path(f"mlm_{w}").read_text().replace(
                           str(self.args.dataset), self.args.dataset.name))
                       for w in ("short", "long") if self._record_path(f"mlm_{w}").exists()},
               "probe": self.probe(gold, score, records),
               "cpu_model": cpu_dense.cpu_model(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for arm, row in arms.items():
      print(f"{arm} {row['name']:>12}: {primary} {row['mean']:.4f} +- {row['std']:.4f} (lr {row['lr']:g})",
            *(f"vs a: {d['delta']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
              for d in row.get("paired_vs_a", [])))
    return summary


def _lengths(path: pathlib.Path, tokenizer: str | None) -> list[int]:
  """Each document's word-pieces (specials excluded, nothing truncated), by `tokenizer` (a tokenizer.json;
  MiniLM's when None)."""
  from tokenizers import Tokenizer  # noqa: PLC0415

  from flash_layers.models import assets  # noqa: PLC0415
  tok = Tokenizer.from_file(tokenizer or str(assets.minilm_dir() / "tokenizer.json"))
  tok.no_truncation()
  tok.no_padding()
  texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
  return [len(e.ids) - 2 for e in tok.encode_batch(texts)]  # less [CLS] and [SEP]


def _metrics_only(report: dict) -> dict:
  return {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _prediction(row: dict):
  """What a run predicted for one test document: a class, or a set of labels."""
  return row["prediction"] if "prediction" in row else sorted(row["labels"])


def _gold(path: pathlib.Path) -> list:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [sorted(map(str, r["label"])) if isinstance(r["label"], list) else str(r["label"]) for r in rows]


def _scorer(task: str, gold: list):
  """score(predictions, index=None): the task's metrics of `predictions` against gold[index]."""
  if task == "classification":
    def score(predicted, index=None):
      g = gold if index is None else [gold[i] for i in index]
      p = [str(x) for x in predicted]
      # The classes of these gold and predicted labels, as scikit-learn's macro average takes them: a
      # class predicted but never gold scores an F1 of 0.
      position = {n: i for i, n in enumerate(sorted({*g, *p}))}
      confusion = np.zeros((len(position), len(position)))
      np.add.at(confusion, ([position[x] for x in g], [position[x] for x in p]), 1)
      return {"accuracy": float(np.mean([x == w for x, w in zip(p, g, strict=True)])),
              "macro_f1": metrics_lib.macro_f1(confusion)}
    return score
  names = sorted({n for labels in gold for n in labels})
  position = {n: i for i, n in enumerate(names)}

  def hot(sets):
    out = np.zeros((len(sets), len(names)), bool)
    for row, labels in enumerate(sets):
      for n in labels:
        if n in position:
          out[row, position[n]] = True
    return out

  def score(predicted, index=None):
    g = gold if index is None else [gold[i] for i in index]
    return task_metrics.multi_label_scores(hot(g), hot(predicted))
  return score


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("stage", choices=("select", "run", "all", "report"))
  parser.add_argument("--dataset", type=pathlib.Path, required=True, help="a folder of train/dev/test.jsonl")
  parser.add_argument("--task", default="classification", choices=tuple(PRIMARY))
  parser.add_argument("--out", type=pathlib.Path, required=True, help="results folder (runs/, summary.json)")
  parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/fl-long-vs-short"),
                      help="workdirs (a run's is deleted once its test predictions are recorded)")
  parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  parser.add_argument("--short", type=int, default=512)
  parser.add_argument("--long", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--pooling", default="mean", choices=("mean", "cls"),
                      help="the document (or chunk) vector: all-MiniLM-L6-v2 was trained with mean pooling")
  parser.add_argument("--budget-tokens", type=int, default=1_048_576, help="tokens per fine-tuning run")
  parser.add_argument("--lrs", type=float, nargs="+", default=[5e-5, 1e-4, 2e-4])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--mlm-short-steps", type=int, default=200)
  parser.add_argument("--mlm-long-steps", type=int, default=100)
  parser.add_argument("--mlm-lr", type=float, default=1e-4)
  parser.add_argument("--bootstrap", type=int, default=1000)
  parser.add_argument("--tokenizer", default=None, help="tokenizer.json for the probe's lengths (MiniLM's)")
  args = parser.parse_args(argv)
  if args.long % args.short:
    parser.error(f"--long ({args.long}) must be a multiple of --short ({args.short}): arm b's chunks")
  if args.stage == "report" and len(args.seeds) < 2:
    parser.error("--seeds: the report's std needs at least 2 seeds")
  study = Study(args)
  getattr(study, {"all": "run_all"}.get(args.stage, args.stage))()


if __name__ == "__main__":
  main()
