"""`python -m benchmarks.mask_mod_cpu [--json F]`: what a mask_mod costs on the CPU (xla_chunked).

Per shape: the forward and forward+backward process CPU time of `causal=True` ("builtin_causal": the
built-in rule, its arithmetic block plan) against the same mask as `mask_mod=fl.masks.causal()`
("mask_mod_causal": evaluated per tile, its block flags from `block_info.tile_flags`), and two masks only a
mask_mod can express: a prefix-LM with a per-row prefix operand of length/4 ("mask_mod_prefix_lm") and
Llama-4 style chunked causal with chunks of 1,024 ("mask_mod_chunked_causal"). Rounds interleave the
variants; each cell is the minimum over rounds of the per-call CPU time. Also the CPU time of
building a mask_mod's tile flags alone (the block plan) for a 32k-token row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from flash_layers.contract import block_info


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _variants(batch: int, length: int) -> dict:
  prefix = np.full((batch,), length // 4, np.int32)
  return {
      "builtin_causal": dict(causal=True),
      "mask_mod_causal": dict(mask_mod=fl.masks.causal()),
      "mask_mod_prefix_lm": dict(mask_mod=fl.masks.prefix_lm(operand=0),
                                                mod_operands=(prefix,)),
      "mask_mod_chunked_causal": dict(mask_mod=fl.masks.chunked_causal(1024)),
  }


def _timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  best = float("inf")
  for _ in range(repeats):
    start = _cpu()
    jax.block_until_ready(fn(*args))
    best = min(best, _cpu() - start)
  return best


def run(shapes, rounds: int) -> dict:
  rows = []
  for shape in shapes:
    b, t, h, d = shape
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    variants = _variants(b, t)
    fns = {}
    for name, options in variants.items():
      def fwd(q, k, v, options=options):
        return fl.attention(q, k, v, impl="xla_chunked", **options)

      def fwd_bwd(q, k, v, fwd=fwd):
        return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))(q, k, v)

      fns[(name, "fwd")], fns[(name, "fwd+bwd")] = jax.jit(fwd), jax.jit(fwd_bwd)
    times = {key: [] for key in fns}
    for _ in range(rounds):
      for key, fn in fns.items():
        times[key].append(_timed(fn, (q, k, v), 1))
    for (name, pass_), ts in times.items():
      ex = fl.explain(q, k, v, impl="xla_chunked", **variants[name])
      rows.append({"shape": "x".join(map(str, shape)), "variant": name, "pass": pass_, "cpu_s": min(ts),
                   "cpu_s_rounds": ts, "blocks_visited": ex.blocks_visited, "blocks_total": ex.blocks_total})
  for row in rows:
    base = next(r for r in rows if r["shape"] == row["shape"] and r["pass"] == row["pass"]
                and r["variant"] == "builtin_causal")
    row["vs_builtin_causal"] = row["cpu_s"] / base["cpu_s"]
  return {"rows": rows, "tile_flags": _tile_flag_cost()}


def _tile_flag_cost() -> list[dict]:
  """CPU seconds to build a mask_mod's tile flags for one 32k-token row (512 x 512 tiles)."""
  out = []
  length, block = 32768, 512
  n = length // block
  for name, mod, operands in (("causal", fl.masks.causal(), ()),
                              ("prefix_lm", fl.masks.prefix_lm(operand=0), (np.array([8192], np.int32),)),
                              ("chunked_causal", fl.masks.chunked_causal(8192), ())):
    build = jax.jit(lambda ops, mod=mod: block_info.tile_flags(
        mod, ops, batch=1, heads=jnp.arange(1), batch_offset=0, q_offset=0, kv_offset=0, q_len=length,
        kv_len=length, block_q=block, block_kv=block, num_q_blocks=n, num_kv_blocks=n))
    seconds = _timed(build, (operands,), 3)
    flags = build(operands)
    out.append({"mask_mod": name, "length": length, "block": block, "cpu_s": seconds,
                "tiles_nonempty": int(flags[0].sum()), "tiles_full": int(flags[1].sum()), "tiles": n * n,
                "flag_bytes": 2 * n * n})
  return out


def _hardware() -> str:
  model = platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"{os.cpu_count()}-core {model}, CPU only"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.mask_mod_cpu", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--json", help="write the results here")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--quick", action="store_true", help="one small shape, one round (a smoke test)")
  args = p.parse_args(argv)
  shapes = [(1, 1024, 2, 32)] if args.quick else [(2, 4096, 12, 32), (1, 8192, 4, 64)]
  start = time.time()
  result = {"benchmark": "mask_mod on the CPU (xla_chunked)", "date": datetime.date.today().isoformat(),
            "hardware": _hardware(), "jax": jax.__version__,
            "command": "python -m benchmarks.mask_mod_cpu" + (" --quick" if args.quick else ""),
            **run(shapes, 1 if args.quick else args.rounds)}
  result["wall_s"] = time.time() - start
  for row in result["rows"]:
    print(f"{row['shape']} {row['pass']:8s} {row['variant']:24s} {row['cpu_s']:.3f} CPU-s "
          f"({row['vs_builtin_causal']:.2f}x causal=True), "
          f"blocks {row['blocks_visited']}/{row['blocks_total']}")
  for row in result["tile_flags"]:
    print(f"tile flags {row['mask_mod']} at {row['length']}: {row['cpu_s']:.3f} CPU-s, "
          f"{row['tiles_nonempty']}/{row['tiles']} tiles non-empty")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
