"""One decoding step on a CPU: `fl.MultiHeadAttention(decode=True)` against flax's own decoding module.

    python -m benchmarks.decode_cpu --json benchmarks/results/decode-cpu.json
    python -m benchmarks.decode_cpu --cache-lens 2048 --steps 20          # quicker

Both layers: self-attention over [batch, 1, features] inputs with a KV cache of `cache_len` entries,
`--fill` of it written (default half: the average over a generation that fills the cache), float32.
flax's step attends to every slot and masks the unwritten ones, so its cost does not depend on the fill;
ours, on a CPU, reads only the chunks of slots written so far (xla_dense's decoding forward), so
`--fill 1` is the case where it has nothing to skip.
Ours: `fl.MultiHeadAttention(num_heads, causal=True, decode=True)`, impl "auto" (on a CPU, xla_dense for
up to 16 queries: cpu_loop.FEW_QUERIES), or `--impl`.
flax's: `nn.MultiHeadDotProductAttention(num_heads, decode=True)` with its default attention. Each
step is one jitted `apply(..., mutable=["cache"])` with the cache donated (updated in place, as a
generation loop runs it). `--num-kv-heads` below num_heads makes ours a GQA layer with a cache that
many times smaller; the default compares like with like (MHA, the same cache size).

Times: per step, the median over `--steps` steps after `--warmup` steps (first call compiles), process
CPU time (every XLA thread) and wall time, interleaved between the two layers round by round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import flash_layers as fl
from benchmarks.cpu_dense import cpu_model


def _step_fn(module, params):
  def step(cache, x):
    y, updated = module.apply({"params": params, "cache": cache}, x, mutable=["cache"])
    return y, updated["cache"]
  return jax.jit(step, donate_argnums=0)


def _filled(cache, cache_len: int, index: int):
  """The cache with random keys/values and its index at `index` (every slot written before it)."""
  out = {}
  for i, (name, x) in enumerate(sorted(cache.items())):
    if name == "cache_index":
      out[name] = jnp.array(index, jnp.int32)
    elif name == "cached_segment_ids":
      out[name] = jnp.where(jnp.arange(cache_len) < index, 1, -1)[None].repeat(x.shape[0], 0)
    else:
      out[name] = jax.random.normal(jax.random.key(i), x.shape, x.dtype)
  return out


def start_index(cache_len: int, fill: float, steps: int) -> int:
  """The cache index before the first step: `fill` of the cache, leaving room for every step's token."""
  return min(int(fill * cache_len), cache_len - steps - 1)


def make_case(kind: str, *, batch: int, cache_len: int, features: int, num_heads: int, num_kv_heads: int,
              impl: str, index: int):
  """(step function, its starting cache, one token's input)."""
  if kind == "flash_layers":
    module = fl.MultiHeadAttention(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True, impl=impl,
                                   decode=True)
  else:
    module = nn.MultiHeadDotProductAttention(num_heads=num_heads, qkv_features=features, decode=True)
  x = jax.random.normal(jax.random.key(1), (batch, 1, features), jnp.float32)
  params = module.init(jax.random.key(0), x)["params"]  # the same for any length
  # The cache's shapes only: initialising on a whole cache_len input would run flax's dense attention
  # over it ([batch, heads, cache_len, cache_len] logits: 13 GB at 8,192 tokens).
  full = jax.ShapeDtypeStruct((batch, cache_len, features), jnp.float32)
  cache = jax.eval_shape(module.init, jax.random.key(0), full)["cache"]
  return _step_fn(module, params), _filled(cache, cache_len, index), x


def _what_runs(args, cache_len: int) -> str:
  """`fl.explain`'s one line for our layer's attention in a decoding step at this cache length."""
  head_dim = args.features // args.num_heads
  q = jax.ShapeDtypeStruct((args.batch, 1, args.num_heads, head_dim), jnp.float32)
  kv_heads = args.num_kv_heads or args.num_heads
  kv = jax.ShapeDtypeStruct((args.batch, cache_len, kv_heads, head_dim), jnp.float32)
  seg = jax.ShapeDtypeStruct((args.batch, 1), jnp.int32)
  kv_seg = jax.ShapeDtypeStruct((args.batch, cache_len), jnp.int32)
  return str(fl.explain(q, kv, kv, impl=args.impl, causal=True, segment_ids=seg, kv_segment_ids=kv_seg,
                        q_offset=start_index(cache_len, args.fill, args.warmup + args.steps)))


def measure(args) -> list[dict]:
  rows = []
  for cache_len in (int(n) for n in args.cache_lens.split(",")):
    cases = {}
    index = start_index(cache_len, args.fill, args.warmup + args.steps)
    for kind in ("flash_layers", "flax"):
      step, cache, x = make_case(kind, batch=args.batch, cache_len=cache_len, features=args.features,
                                 num_heads=args.num_heads, num_kv_heads=args.num_kv_heads or args.num_heads,
                                 impl=args.impl, index=index)
      for _ in range(args.warmup):
        y, cache = step(cache, x)
      jax.block_until_ready(y)
      cases[kind] = {"step": step, "cache": cache, "x": x, "cpu": [], "wall": []}
    for _ in range(args.steps):  # interleaved: a change of the machine's load hits both alike
      for case in cases.values():
        cpu, wall = time.process_time(), time.perf_counter()
        y, case["cache"] = case["step"](case["cache"], case["x"])
        jax.block_until_ready(y)
        case["cpu"].append(time.process_time() - cpu)
        case["wall"].append(time.perf_counter() - wall)
    medians = {kind: {"cpu_ms": round(1e3 * statistics.median(c["cpu"]), 3),
                      "wall_ms": round(1e3 * statistics.median(c["wall"]), 3)} for kind, c in cases.items()}
    row = {"cache_len": cache_len, "first_index": index, "ours_runs": _what_runs(args, cache_len), **medians,
           "ratio_cpu": round(medians["flash_layers"]["cpu_ms"] / medians["flax"]["cpu_ms"], 3),
           "ratio_wall": round(medians["flash_layers"]["wall_ms"] / medians["flax"]["wall_ms"], 3)}
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m benchmarks.decode_cpu", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cache-lens", default="2048,8192")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--features", type=int, default=768)
  p.add_argument("--num-heads", type=int, default=12)
  p.add_argument("--num-kv-heads", type=int, default=None, help="ours only (GQA); default num_heads")
  p.add_argument("--impl", default="auto")
  p.add_argument("--fill", type=float, default=0.5, help="written fraction of the cache at the first step")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args(argv)
  result = {"benchmark": "one decoding step, fl.MultiHeadAttention(decode=True) vs flax "
                         "nn.MultiHeadDotProductAttention(decode=True)",
            "date": datetime.date.today().isoformat(), "hardware": f"{cpu_model()}, CPU only",
            "jax": jax.__version__, "python": platform.python_version(),
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": measure(args)}
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
