"""Continuous batching with a paged cache against static batches with the contiguous cache, on a CPU.

    python -m benchmarks.serving_cpu --json benchmarks/results/serving-cpu.json
    python -m benchmarks.serving_cpu --requests 8 --max-prompt 64        # quicker

The same model (`examples.decoder.CausalLM`, random weights, float32) and the same requests: prompts of
lengths drawn uniformly in [`--min-prompt`, `--max-prompt`], each wanting a number of greedy tokens drawn in
[`--min-new`, `--max-new`], arriving `--arrival-gap` steps apart.

* continuous (paged): `examples.serve.Server`: `--max-seqs` slots, a token budget per step
  (`--token-budget`; a step of fewer tokens runs in the smallest of `--token-buckets` that holds them),
  requests joining when a slot and their pages are free, leaving when done; a pool
  of pages sized for the largest concurrency the server admits. float32 pages, and `--int8` adds int8.
* static (contiguous): what the layers did before, the way `examples.decoder.generate` runs: requests in
  arrival order in batches of `--max-seqs`, each batch left-padded to the longest prompt of the whole
  run and decoded for the largest number of new tokens asked (one shape: one compile), every row's
  cache sized for that; a request's surplus tokens are computed and dropped.

Reported: generated tokens per second (the tokens the requests asked for, over the loop's wall time, the
median of `--rounds` rounds run interleaved, compile excluded: every case compiles before the clock
starts), the cache's bytes (every layer's K and V, scales
included), and for the paged server the peak of the pages in use against the tokens they hold (at most
one partial page per sequence by construction; the row states it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_dense import cpu_model
from examples import decoder, serve
from flash_layers.layers.page_allocator import pages_for


def make_requests(args) -> list[serve.Request]:
  rng = np.random.default_rng(args.seed)
  requests = []
  for i in range(args.requests):
    length = int(rng.integers(args.min_prompt, args.max_prompt + 1))
    requests.append(serve.Request(rng.integers(1, args.vocab, length).tolist(),
                                  int(rng.integers(args.min_new, args.max_new + 1)), i * args.arrival_gap))
  return requests


def _tree_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class PeakServer(serve.Server):
  """The example's server, also recording the peak of pages in use and of the tokens they hold."""

  peak_pages = 0
  peak_tokens = 0
  peak_sequences = 0

  def step(self, running, step):
    fed = super().step(running, step)
    alloc = self.allocator
    slots = alloc.active_slots
    tokens = sum(alloc.length(s) for s in slots)
    if alloc.pages_in_use > self.peak_pages:
      self.peak_pages, self.peak_tokens, self.peak_sequences = alloc.pages_in_use, tokens, len(slots)
    return fed


def continuous(model, params, requests, args, kv_cache_dtype=None):
  """A function serving fresh copies of `requests` with the paged server (compiled now): its result row."""
  longest = max(r.max_length for r in requests)
  pages_per_seq = pages_for(longest, args.page_size)
  # The pool: the pages of the max_seqs longest generations (what admission may promise at once).
  need = sorted((pages_for(r.max_length, args.page_size) for r in requests), reverse=True)
  num_pages = sum(need[: args.max_seqs])
  server = PeakServer(model, params, num_pages=num_pages, page_size=args.page_size, max_seqs=args.max_seqs,
                      pages_per_seq=pages_per_seq, token_budget=args.token_budget,
                      kv_cache_dtype=kv_cache_dtype,
                      token_buckets=[int(b) for b in args.token_buckets.split(",") if b])
  pool = [x for path, x in jax.tree_util.tree_leaves_with_path(server.cache)
          if getattr(path[-1], "key", None) in ("k_pages", "v_pages", "k_scales", "v_scales")]
  page_bytes = _tree_bytes(pool) // num_pages

  def run() -> dict:
    served = [dataclass_copy(r) for r in requests]
    stats = server.run(served)
    return {"seconds": stats["seconds"], "steps": stats["steps"], "generated": stats["generated"],
            "fed": stats["fed"], "traces": server.traces, "pool_pages": num_pages,
            "page_size": args.page_size,
            "cache_bytes": _tree_bytes(server.cache), "bytes_per_page_all_layers": page_bytes,
            "peak_pages_in_use": server.peak_pages, "peak_tokens_held": server.peak_tokens,
            "peak_sequences": server.peak_sequences, "peak_bytes_in_use": server.peak_pages * page_bytes,
            "peak_pages_bound": -(-server.peak_tokens // args.page_size) + server.peak_sequences,
            "tokens": [r.tokens for r in served]}
  return run


def static(model, params, requests, args):
  """A function running `requests` in static batches with the contiguous cache (compiled now)."""
  longest = max(len(r.prompt) for r in requests)
  steps = max(r.max_new_tokens for r in requests)
  dec = model.clone(decode=True)
  batch = args.max_seqs
  cache0 = dec.init(jax.random.key(0), jnp.zeros((batch, longest + steps), jnp.int32))["cache"]

  @jax.jit
  def feed(cache, tokens, segment_ids, positions):
    logits, updated = dec.apply({"params": params, "cache": cache}, tokens, segment_ids, positions,
                                mutable=["cache"])
    return logits[:, -1], updated["cache"]

  def run_batch(group):
    prompts = [r.prompt for r in group] + [[1]] * (batch - len(group))  # fixed batch: filler rows
    tokens = np.zeros((batch, longest), np.int32)
    seg = np.zeros((batch, longest), np.int32)
    pos = np.zeros((batch, longest), np.int32)
    for row, p in enumerate(prompts):
      tokens[row, longest - len(p):], seg[row, longest - len(p):] = p, 1
      pos[row, longest - len(p):] = np.arange(len(p))
    lengths = np.array([len(p) for p in prompts], np.int32)
    logits, cache = feed(cache0, tokens, seg, pos)
    out = []
    for step in range(steps):
      nxt = jnp.argmax(logits, -1).astype(jnp.int32)
      out.append(nxt)
      if step + 1 < steps:
        logits, cache = feed(cache, nxt[:, None], jnp.ones((batch, 1), jnp.int32),
                             jnp.asarray(lengths + step)[:, None])
    out = np.asarray(jnp.stack(out, 1))
    return [out[i, : r.max_new_tokens].tolist() for i, r in enumerate(group)]

  groups = [requests[i:i + batch] for i in range(0, len(requests), batch)]
  run_batch(groups[0])  # compile (the feed's two shapes)

  def run() -> dict:
    started = time.perf_counter()
    tokens = [t for g in groups for t in run_batch(g)]
    return {"seconds": time.perf_counter() - started, "generated": sum(r.max_new_tokens for r in requests),
            "computed_tokens": len(groups) * batch * steps, "cache_bytes": _tree_bytes(cache0),
            "slots_per_row": longest + steps, "tokens": tokens}
  return run


def measure(args) -> dict:
  model = decoder.CausalLM(vocab_size=args.vocab, features=args.features, num_heads=args.num_heads,
                           num_kv_heads=args.num_kv_heads, windows=(None, None), impl=args.impl)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  requests = make_requests(args)
  runners = {"static_contiguous": static(model, params, requests, args),
             "continuous_paged": continuous(model, params, requests, args)}
  if args.int8:
    runners["continuous_paged_int8"] = continuous(model, params, requests, args, kv_cache_dtype="int8")
  results = {name: [] for name in runners}
  for _ in range(args.rounds):  # interleaved: a change of the machine's load hits every case alike
    for name, run in runners.items():
      results[name].append(run())
  rows = {}
  for name, runs in results.items():
    row = dict(runs[-1])
    row["seconds"] = round(statistics.median(r["seconds"] for r in runs), 3)
    row["tokens_per_s"] = round(row["generated"] / row["seconds"], 2)
    rows[name] = row
  same = rows["static_contiguous"]["tokens"] == rows["continuous_paged"]["tokens"]
  for row in rows.values():
    row.pop("tokens")
  base = rows["static_contiguous"]
  for row in rows.values():
    row["tokens_per_s_vs_static"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    row["cache_bytes_vs_static"] = round(row["cache_bytes"] / base["cache_bytes"], 3)
  return {"requests": [{"prompt": len(r.prompt), "new": r.max_new_tokens, "arrival": r.arrival}
                       for r in requests],
          "same_tokens_paged_vs_contiguous": same, "rows": rows}


def dataclass_copy(r: serve.Request) -> serve.Request:
  return serve.Request(list(r.prompt), r.max_new_tokens, r.arrival)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m benchmarks.serving_cpu", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--requests", type=int, default=24)
  p.add_argument("--min-prompt", type=int, default=8)
  p.add_argument("--max-prompt", type=int, default=384)
  p.add_argument("--min-new", type=int, default=4)
  p.add_argument("--max-new", type=int, default=64)
  p.add_argument("--arrival-gap", type=int, default=2)
  p.add_argument("--max-seqs", type=int, default=8)
  p.add_argument("--token-budget", type=int, default=128)
  p.add_argument("--token-buckets", default="8,32", help="smaller step sizes (examples/serve.py)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--features", type=int, default=256)
  p.add_argument("--num-heads", type=int, default=8)
  p.add_argument("--num-kv-heads", type=int, default=2)
  p.add_argument("--int8", action="store_true")
  p.add_argument("--impl", default="auto")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rounds", type=int, default=3, help="interleaved runs of every case; the median")
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args(argv)
  result = {"benchmark": "continuous batching with a paged cache (examples/serve.py) vs static batches with "
                         "the contiguous cache, same model and requests",
            "date": datetime.date.today().isoformat(), "hardware": f"{cpu_model()}, CPU only",
            "jax": jax.__version__, "python": platform.python_version(),
            "config": {k: v for k, v in vars(args).items() if k != "json"}, **measure(args)}
  print(json.dumps(result["rows"], indent=1), "\nsame tokens:", result["same_tokens_paged_vs_contiguous"])
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
