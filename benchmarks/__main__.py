"""`python -m benchmarks`: every impl x length x mask x dtype, forward and forward+backward.

    python -m benchmarks --quick                      # tiny grid, seconds
    python -m benchmarks --json benchmarks/results/cpu.json --plots docs/img
    python -m benchmarks --tpu-aot v5e                # TPU memory/FLOPs without a TPU

Prints a markdown table; see `harness.py` for what is measured and when a cell is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import flash_layers as fl
from benchmarks import cases, harness, report


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
  p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="tiny grid (lengths 128,256; causal and packed; float32; 2 heads of 32)")
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
  p.add_argument("--max-run-seconds", type=float, default=8.0,
                 help="skip a cell whose predicted time per run is longer")
  p.add_argument("--mem-limit-gb", type=float,
                 help="skip running a cell whose compiled memory is larger (default: a quarter of "
                      "the memory available, at most 8)")
  p.add_argument("--interpret-max-len", type=int, default=2048,
                 help="longest length for flash_pallas in interpret mode (TPU kernels on a CPU)")
  p.add_argument("--tpu-aot", metavar="CHIP",
                 help="compile for this TPU (e.g. v5e, v5e:1x1, v4:2x2x1) instead of running: "
                      "reports compiled memory and FLOPs; needs libtpu")
  p.add_argument("--summary", action="store_true",
                 help="print impl x length tables per mask, dtype and pass instead of one row per cell")
  p.add_argument("--targets", action="store_true",
                 help="also print the targets: memory vs reference, packed-document blocks")
  p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list (rewritten as rows finish)")
  p.add_argument("--from-json", metavar="PATH", nargs="+",
                 help="run nothing: merge these JSON row lists (a later row replaces an earlier one of "
                      "the same cell) and print/plot/write them")
  p.add_argument("--plots", metavar="DIR", help="write PNG plots of time and memory vs length")
  return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> harness.Config:
  if args.quick:
    # Causal and packed cover both the position-only and the segment-id paths of every impl. One
    # timed run per cell (after the warm-up): the quick grid checks that every cell runs, it is
    # not a measurement to publish.
    defaults = dict(lengths=(128, 256), masks=("causal", "packed"), dtypes=("float32",),
                    shape=cases.Shape(1, 2, 32), repeats=1, interpret_max_len=256)
  else:
    defaults = dict(lengths=harness.LENGTHS, masks=cases.MASK_KINDS, dtypes=("float32", "bfloat16"),
                    shape=cases.Shape(args.batch, args.heads, args.head_dim),
                    repeats=args.repeats, interpret_max_len=args.interpret_max_len)
  mem = args.mem_limit_gb
  return harness.Config(
      impls=args.impls or tuple(fl.IMPLS), lengths=args.lengths or defaults["lengths"],
      masks=args.masks or defaults["masks"], dtypes=args.dtypes or defaults["dtypes"],
      passes=args.passes or cases.PASSES, shape=defaults["shape"], repeats=defaults["repeats"],
      max_run_seconds=args.max_run_seconds, interpret_max_len=defaults["interpret_max_len"],
      mem_limit_bytes=int(mem * 2**30) if mem else harness.default_mem_limit())


def merge(paths: list[str]) -> list[dict]:
  """Rows of several JSON files, one per cell (and target): a later row replaces an earlier one,
  except that a measured ("ok") row is not replaced by one that did not run."""
  cells: dict[tuple, dict] = {}
  for path in paths:
    with open(path) as f:
      for row in json.load(f):
        key = tuple(row.get(k) for k in ("impl", "seq_len", "mask", "dtype", "pass", "target"))
        if not (cells.get(key, {}).get("status") == "ok" and row["status"] != "ok"):
          cells[key] = row
  return list(cells.values())


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.from_json:
    rows = merge(args.from_json)
    prefix = "tpu-aot-" if any(r.get("target", "").startswith("tpu-aot") for r in rows) else ""
  else:
    rows = run(args)
    prefix = "tpu-aot-" if args.tpu_aot else ""
  print(report.summary(rows) if args.summary else report.markdown(rows))
  if args.targets:
    print("\n" + report.targets(rows))
  if args.json:
    report.write_json(rows, args.json)
  if args.plots:
    for path in report.plot(rows, args.plots, prefix=prefix):
      print(f"wrote {path}", file=sys.stderr)
  return 0


def run(args: argparse.Namespace) -> list[dict]:
  config = config_from(args)
  target = harness.tpu_aot_target(args.tpu_aot) if args.tpu_aot else harness.local_target()
  start = time.time()
  print(f"# benchmarks on {target.label}: shape batch={config.shape.batch} "
        f"heads={config.shape.heads} head_dim={config.shape.head_dim}; mem limit "
        f"{config.mem_limit_bytes / 2**30:.1f} GiB; {os.cpu_count()} CPUs", file=sys.stderr)
  done = []

  def progress(row):
    took = f"{row['time_s'] * 1e3:.1f} ms" if row.get("time_s") else row.get("reason", "")
    print(f"  [{time.time() - start:6.0f}s] {row['impl']:12s} {row['mask']:7s} {row['dtype']:8s} "
          f"{row['pass']:7s} {row['seq_len']:6d} {row['status']:11s} {took}", file=sys.stderr,
          flush=True)
    done.append(row)
    if args.json:  # a long run that is stopped keeps what it measured
      report.write_json(done, args.json)

  return harness.run_grid(config, target, progress)


if __name__ == "__main__":
  sys.exit(main())
