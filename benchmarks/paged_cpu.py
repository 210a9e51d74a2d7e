"""One decoding step of a ragged batch on a CPU: a paged KV pool against a contiguous cache.

    python -m benchmarks.paged_cpu --json benchmarks/results/paged-cpu.json
    python -m benchmarks.paged_cpu --batch 4 --max-len 2048 --steps 10          # quicker

`--batch` sequences with lengths drawn uniformly in [`--min-len`, `--max-len`] (seeded) each decode one
token: attention only, float32, `--num-heads` query heads over `--num-kv-heads` kv heads of `--head-dim`.

* contiguous: what a decoding layer's cache holds today, [batch, max_len, kv_heads, head_dim] per K and
  V, every row sized for the longest; one `fl.attention` call (impl "auto": on a CPU xla_dense's
  decoding forward) with the unwritten slots masked by kv segment ids, as layers/kv_cache.py does.
* paged: a pool holding only the pages in use (`--page-size` tokens each), the page table shuffled;
  one `fl.paged_attention` call (impl "auto": on a CPU xla_chunked, which walks each row's pages).
* paged int8: the same pool quantized (`fl.quantize_kv`), float32 scales per token and kv head.

Reported per case: the median step time over `--steps` interleaved rounds (process CPU and wall), and
the cache's bytes (K and V, scales included; the page table's int32s too).
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

import flash_layers as fl
from benchmarks.cpu_dense import cpu_model


def make_cases(args) -> tuple[dict, dict]:
  rng = np.random.default_rng(args.seed)
  b, h, kvh, d, ps = args.batch, args.num_heads, args.num_kv_heads, args.head_dim, args.page_size
  lens = rng.integers(args.min_len, args.max_len + 1, size=b).astype(np.int32)
  max_len = -(-args.max_len // ps) * ps
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
  k_cache = jnp.asarray(rng.standard_normal((b, max_len, kvh, d)), jnp.float32)
  v_cache = jnp.asarray(rng.standard_normal((b, max_len, kvh, d)), jnp.float32)
  written = jnp.where(jnp.arange(max_len)[None, :] < jnp.asarray(lens)[:, None], 1, -1).astype(jnp.int32)

  def contiguous(q, k, v, kv_seg):
    out = fl.attention(q[:, None], k, v, causal=True, segment_ids=jnp.ones((b, 1), jnp.int32),
                       kv_segment_ids=kv_seg, q_offset=max_len - 1)
    return out[:, 0]

  # The pool: the same keys, page by page, only the pages in use, in shuffled order.
  pages_per_seq = max_len // ps
  used = -(-lens // ps)
  num_pages = int(used.sum())
  order = rng.permutation(num_pages)
  table = np.zeros((b, pages_per_seq), np.int32)
  k_pages = np.zeros((num_pages, ps, kvh, d), np.float32)
  v_pages = np.zeros_like(k_pages)
  k_np, v_np = np.asarray(k_cache), np.asarray(v_cache)
  n = 0
  for s in range(b):
    for i in range(used[s]):
      table[s, i] = order[n]
      k_pages[order[n]] = k_np[s, i * ps:(i + 1) * ps]
      v_pages[order[n]] = v_np[s, i * ps:(i + 1) * ps]
      n += 1
  cu = np.arange(b + 1, dtype=np.int32)

  def paged(q, k, v, table, lens, k_scales=None, v_scales=None):
    return fl.paged_attention(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, k_scales=k_scales,
                              v_scales=v_scales, impl=args.impl)

  kq, ks = fl.quantize_kv(jnp.asarray(k_pages))
  vq, vs = fl.quantize_kv(jnp.asarray(v_pages))
  cases = {
      "contiguous": (jax.jit(contiguous), (q, k_cache, v_cache, written)),
      "paged": (jax.jit(paged), (q, jnp.asarray(k_pages), jnp.asarray(v_pages), table, lens)),
      "paged_int8": (jax.jit(paged), (q, kq, vq, table, lens, ks, vs)),
  }
  info = {"lengths": lens.tolist(), "pages_in_use": num_pages, "max_len": max_len}
  return cases, info


def _bytes(args_) -> int:
  return int(sum(np.asarray(x).nbytes for x in args_[1:]))  # everything but q: the cache and its tables


def measure(args) -> dict:
  cases, info = make_cases(args)
  reference = None
  timings = {}
  for name, (fn, fn_args) in cases.items():
    out = jax.block_until_ready(fn(*fn_args))
    reference = out if reference is None else reference
    err = float(jnp.abs(out - reference).max())
    timings[name] = {"cpu": [], "wall": [], "max_abs_diff_vs_contiguous": round(err, 6),
                     "cache_bytes": _bytes(fn_args)}
    for _ in range(args.warmup):
      jax.block_until_ready(fn(*fn_args))
  for _ in range(args.steps):
    for name, (fn, fn_args) in cases.items():
      cpu, wall = time.process_time(), time.perf_counter()
      jax.block_until_ready(fn(*fn_args))
      timings[name]["cpu"].append(time.process_time() - cpu)
      timings[name]["wall"].append(time.perf_counter() - wall)
  rows = {}
  for name, t in timings.items():
    rows[name] = {"cpu_ms": round(1e3 * statistics.median(t.pop("cpu")), 3),
                  "wall_ms": round(1e3 * statistics.median(t.pop("wall")), 3), **t}
  base = rows["contiguous"]
  for row in rows.values():
    row["wall_vs_contiguous"] = round(row["wall_ms"] / base["wall_ms"], 3)
    row["bytes_vs_contiguous"] = round(row["cache_bytes"] / base["cache_bytes"], 3)
  return {**info, "cases": rows}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m benchmarks.paged_cpu", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--min-len", type=int, default=128)
  p.add_argument("--max-len", type=int, default=8192)
  p.add_argument("--num-heads", type=int, default=16)
  p.add_argument("--num-kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--page-size", type=int, default=128)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--impl", default="auto", help="the paged cases' impl")
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args(argv)
  result = {"benchmark": "one decoding step of a ragged batch: fl.paged_attention over a paged pool vs "
                         "fl.attention over a contiguous cache",
            "date": datetime.date.today().isoformat(), "hardware": f"{cpu_model()}, CPU only",
            "jax": jax.__version__, "python": platform.python_version(),
            "config": {k: v for k, v in vars(args).items() if k != "json"}, **measure(args)}
  print(json.dumps(result["cases"], indent=1))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
