"""Evaluation cost vs max_len: BBC News's test split scored at 512 and 4,096 tokens.

    python -m benchmarks.eval_cost --json benchmarks/results/eval-cost-cpu.json
    python -m benchmarks.eval_cost --max-lens 512 --batch-size 4      # quicker
    python -m benchmarks.eval_cost --e2e --json benchmarks/results/eval-cost-e2e-cpu.json

The model is all-MiniLM-L6-v2's shape (hidden 384, 12 heads, MLP 1,536, `--layers` of 6; random
weights: the cost does not depend on them) with a 5-class head and a position table of max_len rows,
impl "auto", float32, run through the training stack's own evaluation (`training.evaluate.evaluate`
over `data.eval_batches`) on MiniLM's tokenization of the split. Each case:

  packed:  the default: documents packed into rows bucketed by length (data.eval_plan);
  padded:  one document per row, every row padded to max_len (evaluation before packing).

A batch of rows longer than 512 tokens holds proportionally fewer rows (`eval_plan.rows_per_batch`),
so `batch_shapes` lists [rows, length] per distinct batch shape.

The time is process CPU time (all of XLA's threads), not wall time, so a busy machine changes it
less. Each case first runs one batch of every row shape (compiles; reported apart); then, round
after round (`--rounds`, 3), every case evaluates the whole split once, so a change in the
machine's load falls on all cases alike; the median round counts (every round is in the JSON).
Also reported: the real-token fraction of the evaluated rows, the number of batches and of
distinct row lengths.

`--e2e` measures what a user runs instead: `python eval.py --config configs/quickstart.py` (MiniLM, 6
layers, pooling "mean", eval batch 16 rows, packed) with --config.model.max_len at each length, as a
child process, timed by its CPU time (getrusage(RUSAGE_CHILDREN): every thread, compiles, imports, data
and checkpoint loading included) and wall time. Each length gets a checkpoint first (`--e2e-workdir`,
made once by train.py: one step, batch 1; its weights do not change the cost). Per round and length:
a *cold* run with an empty compilation cache (config.compilation_cache_dir), then a *warm* run with the
cache the cold run filled; rounds interleave the lengths (`--rounds`). Every run is kept with the load
average before and after it; the ratios are of the medians (and per round). The warm run must score
exactly what the cold run did (eval_metrics.json), or the benchmark fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from benchmarks.machine import children_cpu, cpu_model
from flash_layers import data, models
from flash_layers.data import eval_plan
from flash_layers.parallel.mesh import make_mesh
from flash_layers.training import compile_cache, objectives
from flash_layers.training import evaluate as evaluate_lib
from flash_layers.training import steps as steps_lib

MINILM = dict(vocab_size=30522, hidden_size=384, num_heads=12, mlp_dim=1536)  # all-MiniLM-L6-v2's shape


def prepare_case(max_len: int, mode: str, batch_size: int, max_docs: int, num_layers: int, texts,
                 labels) -> tuple[dict, Callable[[], tuple[float, float]]]:
  """(the case's record without times, a function that evaluates the split once -> (CPU s, wall s)).
  Compiles every row shape first (one batch of each), timing that as warmup_cpu_s."""
  model = models.Bert(**MINILM, num_layers=num_layers, max_len=max_len, num_labels=5, impl="auto",
                      pooling="mean", dropout_rate=0.0)
  params = models.init_params(model, jax.random.key(0))
  tokenizer = data.TextTokenizer("minilm", max_len=max_len)
  packed = mode == "packed"
  batches = data.eval_batches(texts, labels, tokenizer, batch_size=batch_size, max_docs_per_row=max_docs,
                              pack=packed, buckets=None if packed else (max_len,))

  def logits_fn(p, batch, *, train, rng):
    return model.apply({"params": p}, batch["input_ids"], batch["segment_ids"], batch["positions"],
                       max_docs=batch["labels"].shape[1], method=model.classify)

  step = jax.jit(steps_lib.make_eval_step(logits_fn))
  mesh = make_mesh(data=1, devices=jax.devices()[:1])
  warm = {}
  for b in batches:  # one batch per row shape: compile outside the timed pass
    warm.setdefault(b["input_ids"].shape, b)
  start = time.process_time()
  evaluate_lib.evaluate(step, params, iter(warm.values()), len(warm), mesh,
                        objective=objectives.build("classification", range(5)))
  compile_s = time.process_time() - start
  record = {"max_len": max_len, "mode": mode, "num_layers": num_layers, "batch_size": batch_size,
            "max_docs_per_row": max_docs, "documents": None, "batches": len(batches),
            "row_lengths": sorted({int(b["input_ids"].shape[1]) for b in batches}),
            "batch_shapes": sorted({tuple(map(int, b["input_ids"].shape)) for b in batches},
                                   key=lambda s: s[::-1]),
            "real_tokens": int(sum(np.count_nonzero(b["segment_ids"]) for b in batches)),
            "real_token_fraction": round(eval_plan.real_token_fraction(batches), 4),
            "warmup_cpu_s": round(compile_s, 2)}

  def timed_pass() -> tuple[float, float]:
    start, wall = time.process_time(), time.perf_counter()
    result = evaluate_lib.evaluate(step, params, iter(batches), len(batches), mesh,
                        objective=objectives.build("classification", range(5)))
    record["documents"] = result["count"]
    return time.process_time() - start, time.perf_counter() - wall

  return record, timed_pass


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.eval_cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--max-lens", default="512,4096")
  p.add_argument("--modes", default="packed,padded",
                 help="packed and/or padded; padded runs at the smallest max_len only")
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--max-docs", type=int, default=8)
  p.add_argument("--layers", type=int, default=6,
                 help="encoder layers (MiniLM: 6; all alike, so the 512/4,096 ratio does not depend on it)")
  p.add_argument("--rounds", type=int, default=3,
                 help="timed passes per case, interleaved; the median counts")
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--e2e", action="store_true", help="time eval.py end to end, cold and warm cache (above)")
  p.add_argument("--e2e-workdir", default="runs/eval_cost",
                 help="--e2e: where the checkpoints (one per length) are made once and kept")
  p.add_argument("--e2e-config", default="configs/quickstart.py")
  compile_cache.add_argument(p)
  args = p.parse_args(argv)
  if args.e2e:  # each eval.py run gets a cache directory of its own (above)
    return e2e_main(args)
  compile_cache.enable(args.compilation_cache_dir)
  records = data.load("bbc_news", split="test")
  texts, labels = [r["text"] for r in records], [r["label"] for r in records]
  lengths = sorted(int(x) for x in args.max_lens.split(","))
  cases = [(n, "packed") for n in lengths if "packed" in args.modes]
  if "padded" in args.modes:
    cases.insert(0, (lengths[0], "padded"))
  prepared = [prepare_case(max_len, mode, args.batch_size, args.max_docs, args.layers, texts, labels)
              for max_len, mode in cases]
  # Round after round, every case once: a change of the machine's load hits all cases alike.
  times = [[timed() for _, timed in prepared] for _ in range(args.rounds)]
  rows = []
  for i, (record, _) in enumerate(prepared):
    cpu, wall = [t[i][0] for t in times], [t[i][1] for t in times]
    record.update(eval_cpu_s=round(statistics.median(cpu), 2), eval_wall_s=round(statistics.median(wall), 2),
                  eval_cpu_s_rounds=[round(x, 2) for x in cpu])
    rows.append(record)
    print(json.dumps(record), flush=True)
  packed = {r["max_len"]: r for r in rows if r["mode"] == "packed"}
  summary = {}
  if len(packed) >= 2:
    lo, hi = packed[min(packed)], packed[max(packed)]
    summary = {"ratio_eval_cpu": round(hi["eval_cpu_s"] / lo["eval_cpu_s"], 3),
               "ratio_eval_cpu_rounds": [round(a / b, 3) for a, b in zip(
                   hi["eval_cpu_s_rounds"], lo["eval_cpu_s_rounds"], strict=True)],
               "ratio_with_warmup": round((hi["eval_cpu_s"] + hi["warmup_cpu_s"])
                                          / (lo["eval_cpu_s"] + lo["warmup_cpu_s"]), 3),
               "ratio_real_tokens": round(hi["real_tokens"] / lo["real_tokens"], 3)}
    print(json.dumps(summary))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": jax.devices()[0].device_kind, "cases": rows, "summary": summary}, f, indent=1)


# ----------------------------------------------------------------------------
# End to end: eval.py as a user runs it
# ----------------------------------------------------------------------------

REPO = pathlib.Path(__file__).resolve().parents[1]
SCORE_FIELDS = ("accuracy", "macro_f1", "loss", "num_examples", "confusion_matrix")


def _run_timed(command: list[str]) -> dict:
  """Run `command` from the repository root; its CPU and wall seconds, and the load around it."""
  load_before, cpu0, wall0 = os.getloadavg()[0], children_cpu(), time.perf_counter()
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  out = {"cpu_s": round(children_cpu() - cpu0, 2), "wall_s": round(time.perf_counter() - wall0, 2),
         "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
  if proc.returncode:
    raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
  return out


def _length_flags(args, max_len: int) -> list[str]:
  return ["--config", args.e2e_config, f"--config.model.max_len={max_len}"]


def make_checkpoint(args, max_len: int) -> pathlib.Path:
  """A workdir holding a checkpoint at max_len (train.py, one step of batch 1), made once."""
  workdir = pathlib.Path(args.e2e_workdir) / f"max_len_{max_len}"
  if not (workdir / "checkpoints").is_dir():
    shutil.rmtree(workdir, ignore_errors=True)
    _run_timed([sys.executable, "train.py", *_length_flags(args, max_len), f"--workdir={workdir}",
                "--config.train.num_steps=1", "--config.train.batch_size=1", "--config.train.warmup_steps=0",
                "--config.train.eval_max_batches=1", "--config.compilation_cache_dir="])
  return workdir


def _cache_entries(directory: pathlib.Path) -> int:
  return sum(1 for p in directory.iterdir() if not p.name.endswith("-atime")) if directory.is_dir() else 0


def eval_run(args, max_len: int, workdir: pathlib.Path, cache: pathlib.Path) -> tuple[dict, dict]:
  """(timing record, eval_metrics.json) of one eval.py run with `cache` as its compilation cache."""
  before = _cache_entries(cache)
  record = _run_timed([sys.executable, "eval.py", *_length_flags(args, max_len), f"--workdir={workdir}",
                       f"--config.compilation_cache_dir={cache}"])
  record.update(cache_entries_before=before, cache_entries_after=_cache_entries(cache))
  with open(workdir / "eval_metrics.json", encoding="utf-8") as f:
    return record, json.load(f)


def e2e_main(args) -> dict:
  lengths = sorted(int(x) for x in args.max_lens.split(","))
  workdirs = {n: make_checkpoint(args, n) for n in lengths}
  runs = {n: {"cold": [], "warm": []} for n in lengths}
  scores = {}
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="eval-cost-cache-"))
  try:
    for r in range(args.rounds):
      # Alternate which length goes first, so a drift in the machine's load falls on both alike.
      for n in (lengths if r % 2 == 0 else lengths[::-1]):
        cache = scratch / f"round{r}-{n}"
        for kind in ("cold", "warm"):
          record, metrics = eval_run(args, n, workdirs[n], cache)
          score = {k: metrics[k] for k in SCORE_FIELDS}
          if scores.setdefault(n, score) != score:
            raise AssertionError(f"max_len {n}, round {r}, {kind}: scored {score}, before {scores[n]}")
          runs[n][kind].append(record)
          print(json.dumps({"round": r, "max_len": n, "cache": kind, **record}), flush=True)
          if args.json:  # every run as it ends: a stopped benchmark keeps what it measured
            _write_e2e(args, lengths, runs, scores)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  result = _write_e2e(args, lengths, runs, scores)
  print(json.dumps(result["summary"]), flush=True)
  return result


def _write_e2e(args, lengths, runs, scores) -> dict:
  """The e2e result from the runs so far (medians over the rounds done), written to --json."""
  cases = []
  for n in lengths:
    for kind in ("cold", "warm"):
      if not runs[n][kind]:
        continue
      cpu = [x["cpu_s"] for x in runs[n][kind]]
      wall = [x["wall_s"] for x in runs[n][kind]]
      cases.append({"max_len": n, "cache": kind, "cpu_s": round(statistics.median(cpu), 2),
                    "wall_s": round(statistics.median(wall), 2), "runs": runs[n][kind]})
  summary = {}
  done = {(c["max_len"], c["cache"]) for c in cases}
  ends = (lengths[0], lengths[-1])
  if len(lengths) >= 2 and all((n, kind) in done for n in ends for kind in ("cold", "warm")):
    lo, hi = lengths[0], lengths[-1]
    for kind in ("cold", "warm"):
      a, b = (next(c for c in cases if c["max_len"] == n and c["cache"] == kind) for n in (hi, lo))
      summary[f"ratio_cpu_{kind}"] = round(a["cpu_s"] / b["cpu_s"], 3)
      summary[f"ratio_cpu_{kind}_rounds"] = [round(x["cpu_s"] / y["cpu_s"], 3) for x, y in zip(
          a["runs"], b["runs"], strict=False)]  # the rounds both lengths finished
  result = {"benchmark": "eval.py end to end", "date": datetime.date.today().isoformat(),
            "hardware": f"{os.cpu_count()}-core {cpu_model()} VM, CPU only",
            "command": f"python eval.py --config {args.e2e_config} --config.model.max_len=N "
                       "--workdir=... --config.compilation_cache_dir=...",
            "rounds": args.rounds, "rounds_done": min(len(runs[n]["warm"]) for n in lengths),
            "load_average_at_end": list(os.getloadavg()), "scores": {str(n): s for n, s in scores.items()},
            "cases": cases, "summary": summary}
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
