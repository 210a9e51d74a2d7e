"""Attention on the CPU: flax's `nn.dot_product_attention` beside our impls, fwd+bwd or forward only.

    python -m benchmarks.cpu_dense                          # [4,512,12,32] and [8,512,12,64], float32
    python -m benchmarks.cpu_dense --shapes 1x2048x12x32 --variants xla_dense,xla_chunked --masks causal
    python -m benchmarks.cpu_dense --passes fwd,fwd+bwd --variants xla_chunked,xla_chunked@whole
    python -m benchmarks.cpu_dense --json benchmarks/results/cpu-dense.json

Each variant is one jitted function returning dq, dk, dv of ``sum(attention(q, k, v) * dout)``
(pass "fwd+bwd") or the output alone (pass "fwd"). ``<impl>@whole`` runs an impl's own computation on
the whole call, the layout it lowers on TPU and GPU, instead of one batch row and kv head at a time
as on a CPU (flash_layers/impls/cpu_loop.py): the before/after of that loop.
The variants run interleaved, round after round, so a change in the machine's load hits them
all alike; the table reports the median over rounds of the process CPU time per call (all
threads; steadier than wall time on a shared machine), the wall time beside it, and the ratio
to flax's CPU time. Masks: "none"; "segments" (one document per row, as the encoder passes
segment ids; flax gets the equivalent `nn.make_attention_mask`); "causal".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import flash_layers as fl
from benchmarks.machine import cpu_model  # noqa: F401  (re-exported: benchmarks call cpu_dense.cpu_model)
from flash_layers import validate
from flash_layers.impls import REGISTRY

FLAX = "flax"
DEFAULT_SHAPES = ((4, 512, 12, 32), (8, 512, 12, 64))
DEFAULT_VARIANTS = (FLAX, "xla_dense", "xla_native", "xla_chunked")
MASKS = ("none", "segments", "causal")
PASSES = ("fwd+bwd", "fwd")
WHOLE = "@whole"  # suffix: the impl's computation on the whole call, not looped per row and kv head
LOOPED = ("xla_dense", "xla_chunked")


def attention_fn(variant: str, mask_kind: str, batch: int, length: int) -> Callable:
  """(q, k, v) -> out for one variant and mask kind."""
  seg = jnp.ones((batch, length), jnp.int32)
  if variant == FLAX:
    mask = None
    if mask_kind == "segments":
      mask = nn.make_attention_mask(seg, seg, pairwise_fn=jnp.equal)
    elif mask_kind == "causal":
      mask = nn.make_causal_mask(seg)
    return lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask)
  kwargs = {"segment_ids": seg} if mask_kind == "segments" else {"causal": mask_kind == "causal"}
  if variant.endswith(WHOLE):
    impl = REGISTRY[variant[:-len(WHOLE)]]

    def whole(q, k, v):
      request, args = validate.prepare(q, k, v, **kwargs)
      return impl._attend(q, k, v, request=request, args=args)[0]
    return whole
  return lambda q, k, v: fl.attention(q, k, v, impl=variant, **kwargs)


def fwd_bwd(fn: Callable) -> Callable:
  def loss(q, k, v, dout):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def forward(fn: Callable) -> Callable:
  return jax.jit(lambda q, k, v, dout: fn(q, k, v))


def measure(shape, variants, mask_kind: str, dtype: str, rounds: int, progress=None,
            pass_: str = "fwd+bwd") -> list[dict]:
  batch, length, heads, head_dim = shape
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, dout = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  wrap = fwd_bwd if pass_ == "fwd+bwd" else forward
  steps = {name: wrap(attention_fn(name, mask_kind, batch, length)) for name in variants}
  for step in steps.values():  # compile and warm up every variant before timing any
    jax.block_until_ready(step(q, k, v, dout))
  cpu = {name: [] for name in variants}
  wall = {name: [] for name in variants}
  load = [os.getloadavg()[0]]
  for _ in range(rounds):
    for name, step in steps.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(step(q, k, v, dout))
      cpu[name].append(time.process_time() - start_cpu)
      wall[name].append(time.perf_counter() - start)
    load.append(os.getloadavg()[0])
    if progress:
      progress(shape, mask_kind, {n: cpu[n][-1] for n in variants})
  seg = jnp.ones((batch, length), jnp.int32)
  chosen = fl.explain(q, k, v, impl="auto", **({"segment_ids": seg} if mask_kind == "segments" else
                                                {"causal": mask_kind == "causal"}))
  rows = []
  base = statistics.median(cpu[FLAX]) if FLAX in cpu else None
  for name in variants:
    row = {"variant": name, "shape": list(shape), "mask": mask_kind, "dtype": dtype, "pass": pass_,
           "rounds": rounds, "cpu_ms": 1e3 * statistics.median(cpu[name]),
           "cpu_ms_min": 1e3 * min(cpu[name]), "wall_ms": 1e3 * statistics.median(wall[name]),
           "load_avg_1min": [round(x, 2) for x in (min(load), max(load))]}
    row["auto_picks"] = chosen.impl
    if base:
      row["flax_cpu_over_ours"] = base / statistics.median(cpu[name])
    rows.append(row)
  return rows


def markdown(rows: list[dict]) -> str:
  lines = ["| shape [b, t, h, d] | mask | pass | variant | CPU ms (median) | CPU ms (min) | wall ms "
           "| x flax (CPU) |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    name = r["variant"] + (f" ({r['auto_picks']})" if r["variant"] == "auto" else "")
    ratio = f"{r['flax_cpu_over_ours']:.2f}" if r.get("flax_cpu_over_ours") else ""
    lines.append(f"| {r['shape']} | {r['mask']} | {r['pass']} | {name} | {r['cpu_ms']:.0f} | "
                 f"{r['cpu_ms_min']:.0f} | {r['wall_ms']:.0f} | {ratio} |")
  return "\n".join(lines)


def _shape(text: str) -> tuple[int, int, int, int]:
  try:
    dims = tuple(int(x) for x in text.lower().split("x"))
  except ValueError:
    dims = ()
  if len(dims) != 4 or min(dims) <= 0:
    raise argparse.ArgumentTypeError(
        f"a shape is BxTxHxD with positive ints (e.g. 4x512x12x32); got {text!r}")
  return dims


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_dense", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SHAPES),
                 help="comma-separated BxTxHxD query shapes (keys and values alike)")
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                 help=f"comma-separated, among {(FLAX,) + fl.IMPLS + ('auto',)}")
  p.add_argument("--masks", default="none,segments", help=f"comma-separated, among {MASKS}")
  p.add_argument("--passes", default="fwd+bwd", help=f"comma-separated, among {PASSES}")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--rounds", type=int, default=5, help="timed rounds (every variant once per round)")
  p.add_argument("--json", metavar="PATH", help="write the rows, with the machine and date, as JSON")
  args = p.parse_args(argv)
  try:
    args.shapes = [_shape(s) for s in args.shapes.split(",") if s]
  except argparse.ArgumentTypeError as e:
    p.error(f"--shapes: {e}")
  args.variants = tuple(v for v in args.variants.split(",") if v)
  args.masks = tuple(m for m in args.masks.split(",") if m)
  args.passes = tuple(x for x in args.passes.split(",") if x)
  allowed = (FLAX,) + fl.IMPLS + ("auto",) + tuple(name + WHOLE for name in LOOPED)
  for name, values, ok in (("--variants", args.variants, allowed), ("--masks", args.masks, MASKS),
                           ("--passes", args.passes, PASSES)):
    bad = [x for x in values if x not in ok]
    if bad:
      p.error(f"{name}: {bad} not among {ok}")
  if args.rounds < 1:
    p.error(f"--rounds must be >= 1; got {args.rounds}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)

  def progress(shape, mask_kind, times):
    print(f"  {shape} {mask_kind}: " + ", ".join(f"{n} {t * 1e3:.0f}" for n, t in times.items()) + " CPU ms",
          file=sys.stderr, flush=True)

  rows = []
  for shape in args.shapes:
    for pass_ in args.passes:
      for mask_kind in args.masks:
        rows += measure(shape, args.variants, mask_kind, args.dtype, args.rounds, progress, pass_)
  print(markdown(rows))
  if args.json:
    meta = {"date": datetime.date.today().isoformat(), "machine": cpu_model(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "measure": "median over rounds of process CPU time per call (all threads)"}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
