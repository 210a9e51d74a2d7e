"""`python -m flash_layers.bench`: every impl x length x mask x dtype, forward and forward+backward.

    python -m flash_layers.bench --quick                      # tiny grid, seconds
    python -m flash_layers.bench --json bench/results/cpu.json --plots docs/img
    python -m flash_layers.bench --tpu-aot v5e                # TPU memory/FLOPs without a TPU

Prints a markdown table; see `harness.py` for what is measured and when a cell is not run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import flash_layers as fl
from flash_layers.bench import cases, harness, report


def _csv(kind, allowed=None):
  def parse(text: str):
    values = tuple(kind(v) for v in text.split(",") if v)
    if allowed is not None:
      bad = [v for v in values if v not in allowed]
      if bad:
        raise argparse.ArgumentTypeError(f"{bad} not in {allowed}")
    return values
  return parse


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m flash_layers.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="tiny grid (lengths 128,256; float32; 2 heads of 32) that runs in seconds")
  p.add_argument("--impls", type=_csv(str, fl.IMPLS + ("auto",)), help="comma-separated impls")
  p.add_argument("--lengths", type=_csv(int), help=f"default {','.join(map(str, harness.LENGTHS))}")
  p.add_argument("--masks", type=_csv(str, cases.MASK_KINDS), help="full,causal,packed,window")
  p.add_argument("--dtypes", type=_csv(str, ("float32", "bfloat16", "float16")),
                 help="default float32,bfloat16")
  p.add_argument("--passes", type=_csv(str, cases.PASSES), help="fwd,fwd+bwd")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5, help="timed runs per cell at most")
  p.add_argument("--max-run-seconds", type=float, default=15.0,
                 help="skip a cell whose predicted time per run is longer")
  p.add_argument("--mem-limit-gb", type=float,
                 help="skip running a cell whose compiled memory is larger (default: a quarter of "
                      "the memory available, at most 8)")
  p.add_argument("--interpret-max-len", type=int, default=1024,
                 help="longest length for flash_pallas in interpret mode (TPU kernels on a CPU)")
  p.add_argument("--tpu-aot", metavar="CHIP",
                 help="compile for this TPU (e.g. v5e, v5e:1x1, v4:2x2x1) instead of running: "
                      "reports compiled memory and FLOPs; needs libtpu")
  p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
  p.add_argument("--plots", metavar="DIR", help="write PNG plots of time and memory vs length")
  return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> harness.Config:
  if args.quick:
    defaults = dict(lengths=(128, 256), dtypes=("float32",), shape=cases.Shape(1, 2, 32),
                    repeats=3, interpret_max_len=256)
  else:
    defaults = dict(lengths=harness.LENGTHS, dtypes=("float32", "bfloat16"),
                    shape=cases.Shape(args.batch, args.heads, args.head_dim),
                    repeats=args.repeats, interpret_max_len=args.interpret_max_len)
  mem = args.mem_limit_gb
  return harness.Config(
      impls=args.impls or tuple(fl.IMPLS), lengths=args.lengths or defaults["lengths"],
      masks=args.masks or cases.MASK_KINDS, dtypes=args.dtypes or defaults["dtypes"],
      passes=args.passes or cases.PASSES, shape=defaults["shape"], repeats=defaults["repeats"],
      max_run_seconds=args.max_run_seconds, interpret_max_len=defaults["interpret_max_len"],
      mem_limit_bytes=int(mem * 2**30) if mem else harness.default_mem_limit())


def main(argv=None) -> int:
  args = parse_args(argv)
  config = config_from(args)
  target = harness.tpu_aot_target(args.tpu_aot) if args.tpu_aot else harness.local_target()
  start = time.time()
  print(f"# flash_layers.bench on {target.label}: shape batch={config.shape.batch} "
        f"heads={config.shape.heads} head_dim={config.shape.head_dim}; mem limit "
        f"{config.mem_limit_bytes / 2**30:.1f} GiB; {os.cpu_count()} CPUs", file=sys.stderr)

  def progress(row):
    took = f"{row['time_s'] * 1e3:.1f} ms" if row.get("time_s") else row.get("reason", "")
    print(f"  [{time.time() - start:6.0f}s] {row['impl']:12s} {row['mask']:7s} {row['dtype']:8s} "
          f"{row['pass']:7s} {row['seq_len']:6d} {row['status']:11s} {took}", file=sys.stderr,
          flush=True)

  rows = harness.run_grid(config, target, progress)
  print(report.markdown(rows))
  if args.json:
    report.write_json(rows, args.json)
  if args.plots:
    prefix = "tpu-aot-" if args.tpu_aot else ""
    for path in report.plot(rows, args.plots, prefix=prefix):
      print(f"wrote {path}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
