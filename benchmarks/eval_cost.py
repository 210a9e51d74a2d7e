"""Evaluation cost vs max_len: BBC News's test split scored at 512 and 4,096 tokens.

    python -m benchmarks.eval_cost --json benchmarks/results/eval-cost-cpu.json
    python -m benchmarks.eval_cost --max-lens 512 --batch-size 4      # quicker

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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from flash_layers import data, models
from flash_layers.data import eval_plan
from flash_layers.parallel.mesh import make_mesh
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
  evaluate_lib.evaluate(step, params, iter(warm.values()), len(warm), mesh, num_labels=5)
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
    result = evaluate_lib.evaluate(step, params, iter(batches), len(batches), mesh, num_labels=5)
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
  args = p.parse_args(argv)
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


if __name__ == "__main__":
  main()
