"""`python -m benchmarks.tpu_aot`: compile one forward+backward for a TPU chip; memory and FLOPs.

    python -m benchmarks.tpu_aot --generation v5e --seq-len 32768

    # impls side by side (every impl x length x mask): temporaries per chip in one table
    python -m benchmarks.tpu_aot --generation v5e --heads 8 --head-dim 128 \
        --impls flash_pallas,jax_splash --seq-lens 8192,32768 --masks causal,full --out rows.json

Needs libtpu, no TPU: `jax.experimental.topologies` describes one chip of the chosen
generation, and `jax.grad` of `fl.attention(..., impl="flash_pallas")` is compiled for it ahead
of time by the real Mosaic compiler (under `jax.sharding.set_mesh`, so the generation's block
sizes apply). It prints XLA's per-chip memory (arguments, outputs, temporaries, code), the
FLOPs XLA's cost analysis reports next to the analytic count of the visible pairs, and the
Mosaic kernels in the compiled program.
"""

from __future__ import annotations

import argparse
import json
import os
import re

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.tpu_aot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--generation", default="v5e", choices=sorted(TOPOLOGIES))
  add_problem_args(parser, heads=12, head_dim=64, masks=MASKS)
  parser.add_argument("--impls", type=_csv, help="comma-separated impls to compile side by side "
                      "(default: --impl)")
  parser.add_argument("--seq-lens", type=lambda text: tuple(int(n) for n in _csv(text)),
                      help="comma-separated lengths (default: --seq-len)")
  parser.add_argument("--masks", type=_csv, help=f"comma-separated, of {', '.join(MASKS)} "
                      "(default: --mask)")
  parser.add_argument("--out", metavar="PATH", help="write every compiled cell as a JSON list")
  args = parser.parse_args(argv)
  bad = [m for m in args.masks or () if m not in MASKS]
  if bad:
    parser.error(f"--masks: {bad} not in {MASKS}")
  return args


MASKS = ("causal", "full", "packed", "causal+packed")


def _csv(text: str) -> tuple[str, ...]:
  return tuple(v for v in text.split(",") if v)


def cells(args) -> list[argparse.Namespace]:
  """One namespace per (mask, length, impl) of the grid options; just `args` without them."""
  return [argparse.Namespace(**{**vars(args), "impl": impl, "seq_len": n, "mask": mask})
          for mask in args.masks or (args.mask,) for n in args.seq_lens or (args.seq_len,)
          for impl in args.impls or (args.impl,)]


def side_by_side(results: list[dict]) -> str:
  """Markdown: per-chip temporaries (MiB) of each impl, one row per (mask, length), and each
  impl's temporaries over the first impl's."""
  impls = list(dict.fromkeys(r["impl"] for r in results))
  temp = {(r["shape"]["mask"], r["shape"]["seq_len"], r["impl"]): r["memory_bytes"]["temp"]
          for r in results}
  rows = list(dict.fromkeys((r["shape"]["mask"], r["shape"]["seq_len"]) for r in results))
  first, others = impls[0], impls[1:]
  head = (["mask", "tokens"] + [f"{i} temp (MiB)" for i in impls]
          + [f"{o} / {first}" for o in others])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for mask, n in rows:
    cells_ = [mask, f"{n:,}"] + [f"{temp[(mask, n, i)] / 2**20:,.2f}" for i in impls]
    for o in others:
      base = temp[(mask, n, first)]
      cells_.append(f"{temp[(mask, n, o)] / base:.2f}x" if base else "-")
    lines.append("| " + " | ".join(cells_) + " |")
  return "\n".join(lines)


def add_problem_args(parser: argparse.ArgumentParser, *, heads: int, head_dim: int,
                     masks: tuple[str, ...]) -> None:
  """The attention problem both AOT commands compile (this one and `cp_aot`)."""
  parser.add_argument("--seq-len", type=int, default=32768)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=heads)
  parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  parser.add_argument("--head-dim", type=int, default=head_dim)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--mask", default="causal", choices=masks,
                      help="packed: segment ids (values unknown at compile time)")
  parser.add_argument("--impl", default="flash_pallas", help="any of fl.IMPLS, to compare")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def compile_step(args) -> dict:
  """Compile forward+backward for one chip of `args.generation`; returns what `main` prints."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies

  import flash_layers as fl
  from flash_layers import host, validate
  from flash_layers.contract import mask_rules
  from flash_layers.impls import jax_splash
  from flash_layers.impls.flash_pallas import tpu_config

  try:
    with host.quiet_libtpu():
      device = topologies.get_topology_desc(TOPOLOGIES[args.generation], "tpu").devices[0]
  except Exception as e:  # libtpu missing
    raise SystemExit(f"--generation {args.generation}: cannot describe this TPU (is libtpu "
                     f"installed? pip install -e .[tpu-aot]): {e}") from None
  placed = jax.sharding.SingleDeviceSharding(device)
  kv_heads = args.kv_heads or args.heads
  dtype = jnp.dtype(args.dtype)
  q = jax.ShapeDtypeStruct((args.batch, args.seq_len, args.heads, args.head_dim), dtype, sharding=placed)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq_len, kv_heads, args.head_dim), dtype, sharding=placed)
  seg = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32, sharding=placed)
  causal = "causal" in args.mask

  def loss(q, k, v, segment_ids):
    out = fl.attention(q, k, v, impl=args.impl, causal=causal,
                       segment_ids=segment_ids if "packed" in args.mask else None)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.set_mesh(jax.sharding.Mesh([device], ("chip",))):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg)
    compiled = lowered.compile()
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  pairs = mask_rules.count_visible(args.seq_len, args.seq_len, mask_rules.MaskSpec(causal=causal))
  d = args.head_dim
  if args.impl == "jax_splash":
    request, _ = validate.prepare(q, kv, kv, causal=causal)
    block_sizes = f"splash {jax_splash.splash_block_sizes(request)}"
  else:
    block_sizes = str(tpu_config.default_block_sizes(args.generation))
  # Each Mosaic kernel's own CostEstimate of the HBM bytes it moves (in the lowered module).
  estimates = {name: int(nbytes) for nbytes, name in re.findall(
      r'bytes_accessed\\22:(\d+)[^\n]*?kernel_name = "(\w+)"', lowered.as_text())}
  sizes = {name: int(getattr(memory, f"{name}_size_in_bytes")) for name in
           ("argument", "output", "temp", "generated_code")}
  try:
    kernels = re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", compiled.as_text())
  except jax.errors.JaxRuntimeError:
    # Printing some compiled v5p/v6e modules trips an XLA check (async-update arity); the
    # lowered module names the same Mosaic calls.
    kernels = re.findall(r"tpu_custom_call[^\n]*kernel_name = \"(\w+)\"", lowered.as_text())
  return {
      "generation": args.generation, "device_kind": device.device_kind, "impl": args.impl,
      "shape": {"batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
                "kv_heads": kv_heads, "head_dim": d, "dtype": args.dtype, "mask": args.mask},
      "block_sizes": block_sizes,
      "memory_bytes": {**sizes, "total": sum(sizes.values())},
      "flops_compiled": float(cost.get("flops", float("nan"))),
      # forward 4d, dK/dV 8d, dQ 6d per visible pair and head (mask without segment ids)
      "flops_analytic": float(pairs * args.batch * args.heads * 18 * d),
      "mosaic_kernels": sorted(re.sub(r"\.\d+$", "", k) for k in kernels),
      "kernel_bytes_accessed": estimates,
  }


def main(argv=None):
  args = _parse(argv)
  grid = cells(args)
  if len(grid) > 1 or args.out:
    results = []
    for cell in grid:
      results.append(compile_step(cell))
      if args.out:  # a long run that is stopped keeps what it compiled
        with open(args.out, "w") as f:
          json.dump(results, f, indent=1)
    print(json.dumps(results) if args.json else side_by_side(results))
    return
  result = compile_step(args)
  if args.json:
    print(json.dumps(result))
    return
  mib = {k: v / 2**20 for k, v in result["memory_bytes"].items()}
  s = result["shape"]
  print(f"{result['impl']} forward+backward on one {result['device_kind']} ({result['generation']}), "
        f"{s['dtype']}[batch {s['batch']}, {s['seq_len']} tokens, heads {s['heads']}/{s['kv_heads']}, "
        f"head_dim {s['head_dim']}], mask {s['mask']}")
  print(f"  block sizes        {result['block_sizes']}")
  print(f"  memory per chip    {mib['total']:.1f} MiB = arguments {mib['argument']:.1f} + outputs "
        f"{mib['output']:.1f} + temporaries {mib['temp']:.1f} + code {mib['generated_code']:.1f}")
  print(f"  FLOPs (compiled)   {result['flops_compiled']:.4g}   (XLA counts a while loop's body once)")
  print(f"  FLOPs (analytic)   {result['flops_analytic']:.4g}   visible pairs x 18 x head_dim x heads")
  print(f"  Mosaic kernels     {', '.join(result['mosaic_kernels']) or 'none'}")


if __name__ == "__main__":
  main()
