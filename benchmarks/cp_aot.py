"""`python -m benchmarks.cp_aot`: context-parallel attention compiled for TPU pods; memory, traffic per chip.

    python -m benchmarks.cp_aot --topology v5p:2x2x2 --seq-len 32768 --context-parallel ulysses
    python -m benchmarks.cp_aot --sweep --out benchmarks/results/cp-aot-2026-12-06.json

Needs libtpu, no TPU: `jax.experimental.topologies` describes the slice's chips
(`--slices` of them, joined by DCN), a mesh is built over them ("sequence" and
"data" as --sequence/--data say; data spans the slices), and forward+backward of
`fl.attention(..., mesh=mesh, context_parallel=S)` (flash_pallas by default: the
Mosaic kernels inside shard_map) is compiled ahead of time. One case reports, per
chip: XLA's memory (arguments, outputs, temporaries), every collective of the
compiled program with its payload bytes per step (flash_layers.training.collectives:
loops multiplied out, ICI and DCN apart), the cost model's bytes for the same call
(parallel/cost.py), and what `fl.explain` says. A strategy that cannot serve the
call is recorded with its refusal.

`--sweep` compiles the table of docs/sharding.md: v5p:2x2x2 (sequence 8),
v5p:4x4x4 (data 4 x sequence 16) and two v5e:2x2 slices (data 2 over DCN x
sequence 4), at 32k and 128k tokens per sequence, bf16, 16 query heads, 4 kv heads,
head_dim 128, causal + packed documents, every strategy; and a prefix-LM mask_mod
(a per-row prefix length operand) on v5p:2x2x2 at 32k.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from benchmarks import tpu_aot

COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter")
STRATEGIES = ("ring", "ulysses", "all_gather", "ulysses_ring", "auto")
MASKS = ("causal", "full", "packed", "causal+packed", "prefix_lm")

# (topology, slices, data, sequence): the meshes of the sweep; batch = data (one sequence per row
# of the data axis), so each chip holds 1/sequence of one sequence.
SWEEP_MESHES = (("v5p:2x2x2", 1, 1, 8), ("v5p:4x4x4", 1, 4, 16), ("v5e:2x2", 2, 2, 4))
SWEEP_LENGTHS = (32768, 131072)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.cp_aot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--topology", default="v5p:2x2x2", help="TPU slice, e.g. v5p:2x2x2, v5e:4x4")
  parser.add_argument("--slices", type=int, default=1, help="slices of --topology, joined by DCN")
  tpu_aot.add_problem_args(parser, heads=8, head_dim=128, masks=MASKS)
  parser.add_argument("--data", type=int, default=1, help="data axis size (across all slices)")
  parser.add_argument("--tensor", type=int, default=1)
  parser.add_argument("--sequence", type=int, default=-1, help="-1: the devices data and tensor leave")
  parser.add_argument("--context-parallel", default="auto", choices=STRATEGIES)
  parser.add_argument("--sweep", action="store_true", help="compile the docs/sharding.md table")
  parser.add_argument("--sweep-mask", default=None, choices=MASKS,
                      help="--sweep only the cases with this mask (the --out file's others are kept)")
  parser.add_argument("--sweep-strategy", default=None, choices=STRATEGIES,
                      help="--sweep only the cases with this strategy (likewise)")
  parser.add_argument("--out", default=None, help="--sweep: write the results here (JSON)")
  parser.add_argument("--table", default=None, metavar="RESULTS",
                      help="print the docs table (markdown with docs_numbers markers) of a results file")
  return parser.parse_args(argv)


def _devices(topology: str, slices: int):
  from jax.experimental import topologies

  from flash_layers import host
  try:
    kwargs = {"num_slices": slices} if slices > 1 else {}
    with host.quiet_libtpu():
      return topologies.get_topology_desc(topology, "tpu", **kwargs).devices
  except Exception as e:  # libtpu missing, or an unknown slice name
    raise SystemExit(f"--topology {topology!r}: cannot describe this TPU slice "
                     f"(is libtpu installed? e.g. v5p:2x2x2, v5e:4x4): {e}") from None


def _mesh(args, devices):
  from flash_layers import parallel
  if args.slices > 1:  # data across the slices (DCN), the rest inside each
    per_slice_data = args.data // args.slices
    return parallel.make_mesh(data=per_slice_data, tensor=args.tensor, sequence=args.sequence,
                              devices=devices, dcn_data=args.slices, num_slices=args.slices)
  return parallel.make_mesh(data=args.data, tensor=args.tensor, sequence=args.sequence, devices=devices)


def _call_kwargs(args, prefix):
  """fl.attention's mask arguments for --mask (prefix: the per-row prefix operand, or None)."""
  import flash_layers as fl
  if args.mask == "prefix_lm":
    return {"mask_mod": fl.masks.prefix_lm(operand=0), "mod_operands": (prefix,),
            "mod_operand_axes": (("batch",),)}
  return {"causal": "causal" in args.mask}


def compile_case(args) -> dict:
  """Lower and compile forward+backward for one case; returns what `main` prints."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flash_layers as fl
  from flash_layers import parallel
  from flash_layers.training import collectives as collectives_lib

  devices = _devices(args.topology, args.slices)
  mesh = _mesh(args, devices)
  kv_heads = args.kv_heads or args.heads
  dtype = jnp.dtype(args.dtype)
  q = jax.ShapeDtypeStruct((args.batch, args.seq_len, args.heads, args.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq_len, kv_heads, args.head_dim), dtype)
  seg = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
  prefix = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
  tokens = NamedSharding(mesh, P(parallel.BATCH_AXES, "sequence"))
  heads = NamedSharding(mesh, P(parallel.BATCH_AXES, "sequence", "tensor"))
  rows = NamedSharding(mesh, P(parallel.BATCH_AXES))
  kv_sharding = heads if kv_heads % args.tensor == 0 else tokens
  packed = "packed" in args.mask
  common = dict(impl=args.impl, mesh=mesh, context_parallel=args.context_parallel)

  def loss(q, k, v, segment_ids, prefix):
    out = fl.attention(q, k, v, segment_ids=segment_ids if packed else None, **common,
                       **_call_kwargs(args, prefix))
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)),
                 in_shardings=(heads, kv_sharding, kv_sharding, tokens, rows),
                 out_shardings=(NamedSharding(mesh, P()), (heads, kv_sharding, kv_sharding)))
  result = {
      "topology": args.topology, "slices": args.slices, "chips": len(devices),
      "device_kind": devices[0].device_kind, "mesh": {a: int(s) for a, s in mesh.shape.items()},
      "shape": {"batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
                "kv_heads": kv_heads, "head_dim": args.head_dim, "dtype": args.dtype},
      "impl": args.impl, "mask": args.mask, "context_parallel": args.context_parallel,
  }
  try:
    result["sharding"] = fl.explain(q, kv, kv, **common, **_call_kwargs(args, prefix)).sharding
  except fl.UnsupportedError as e:
    return {**result, "refused": str(e).splitlines()[0]}
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # jax 0.10 / later renames
  start = time.perf_counter()
  try:
    with set_mesh(mesh):  # under the mesh the kernels see the chip generation (their tile sizes)
      compiled = step.lower(q, kv, kv, seg, prefix).compile()
  except fl.UnsupportedError as e:
    return {**result, "refused": str(e).splitlines()[0]}
  result["compile_seconds"] = round(time.perf_counter() - start, 1)
  memory = compiled.memory_analysis()
  text = compiled.as_text()
  found = collectives_lib.collectives(text, mesh)
  traffic = collectives_lib.summary(found)
  by_kind: dict[str, int] = {}
  for c in found:
    by_kind[c.kind] = by_kind.get(c.kind, 0) + c.bytes_per_step
  sent = [c.sent_bytes_per_step for c in found if c.network == "ici"]
  result.update({
      "per_chip_bytes": {"arguments": memory.argument_size_in_bytes,
                         "outputs": memory.output_size_in_bytes,
                         "temporaries": memory.temp_size_in_bytes,
                         "code": memory.generated_code_size_in_bytes},
      "full_sequence_k_bytes": args.batch * args.seq_len * kv_heads * args.head_dim * dtype.itemsize,
      "collectives": {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in COLLECTIVES},
      "collective_bytes_per_step_per_chip": traffic,
      "collective_bytes_by_kind": dict(sorted(by_kind.items())),
      # What the links carry, by each kind's textbook algorithm (Collective.sent_bytes_per_step):
      # comparable with the cost model's bytes sent per chip.
      "ici_sent_bytes_per_step_per_chip": None if None in sent else sum(sent),
      # Any array with a dimension of the full length would be a gathered sequence.
      "full_length_shapes": sorted(set(re.findall(rf"\w+\[[0-9,]*\b{args.seq_len}\b[0-9,]*\]", text)))[:10],
      "mosaic_kernels": text.count("tpu_custom_call"),
  })
  return result


def _sweep_cases() -> list[list[str]]:
  """The command lines of the docs/sharding.md table, in its row order."""
  cases = []
  for topology, slices, data, sequence in SWEEP_MESHES:
    for length in SWEEP_LENGTHS:
      for strategy in STRATEGIES:
        cases.append([f"--topology={topology}", f"--slices={slices}", f"--data={data}", f"--batch={data}",
                      f"--sequence={sequence}", f"--seq-len={length}", "--heads=16", "--kv-heads=4",
                      "--head-dim=128", "--mask=causal+packed", f"--context-parallel={strategy}"])
  for strategy in STRATEGIES:
    cases.append(["--topology=v5p:2x2x2", "--sequence=8", "--seq-len=32768", "--heads=16", "--kv-heads=4",
                  "--head-dim=128", "--mask=prefix_lm", f"--context-parallel={strategy}"])
  return cases


def _case_id(case: dict) -> tuple:
  """What tells a compiled case apart (the fields of `case_selector`)."""
  return (case["topology"], case["slices"], case["shape"]["seq_len"], case["mask"], case["context_parallel"])


def sweep(out: str | None, mask: str | None = None, strategy: str | None = None) -> list[dict]:
  """Compile every case of the table (`mask`, `strategy`: only the cases with that --mask and
  --context-parallel, the file's other cases kept), writing `out` after each."""
  commands = [_parse(argv) for argv in _sweep_cases()]
  order = {(a.topology, a.slices, a.seq_len, a.mask, a.context_parallel): i for i, a in enumerate(commands)}

  def chosen(m, s):
    return (mask is None or m == mask) and (strategy is None or s == strategy)

  results = []
  kept = []
  if out and (mask or strategy) and os.path.exists(out):
    with open(out) as f:
      kept = [c for c in json.load(f)["cases"] if not chosen(c["mask"], c["context_parallel"])]
  for args in commands:
    if not chosen(args.mask, args.context_parallel):
      continue
    case = compile_case(args)
    case["modelled"] = _modelled(case)
    results.append(case)
    print(_line(case), flush=True)
    if out:  # after every case: a long sweep keeps what it has
      cases = sorted(kept + results, key=lambda c: order[_case_id(c)])
      with open(out, "w") as f:
        json.dump({"command": "python -m benchmarks.cp_aot --sweep", "date": time.strftime("%Y-%m-%d"),
                   "versions": _versions(), "cases": cases}, f, indent=1)
  return results


def _modelled(case: dict) -> dict | None:
  """The cost model's bytes per chip per layer for the strategy the call ran (what auto compares)."""
  from flash_layers.parallel import cost
  found = re.search(r"strategy (\w+)", case.get("sharding") or "")
  if found is None or "refused" in case:
    return None
  strategy = found[1]
  group = re.search(r"groups of (\d+)", case["sharding"])
  s = case["shape"]
  request = cost.make_request(s["batch"] // case["mesh"].get("data", 1), s["seq_len"], s["heads"],
                              s["kv_heads"], s["head_dim"], causal="causal" in case["mask"],
                              dtype=s["dtype"])
  c = cost.strategy_cost(strategy, request, case["mesh"]["sequence"], int(group[1]) if group else 1,
                         cost.generation_of(case["device_kind"]))
  return {"strategy": strategy, "group": int(group[1]) if group else None, "bytes": c.bytes,
          "ici_bytes": c.ici_bytes, "dcn_bytes": c.dcn_bytes}


def _versions() -> dict:
  import importlib.metadata as md
  return {p: md.version(p) for p in ("jax", "jaxlib", "libtpu")}


def _topology_key(topology: str, slices: int) -> str:
  return topology if slices == 1 else f"{topology}@{slices}"


# Columns of the docs table: (header, docs_numbers key suffix, path in a case, scale, format).
TABLE_COLUMNS = (
    ("temporaries / chip (MiB)", "temp_mib", "per_chip_bytes.temporaries", 2**-20, ".1f"),
    ("ICI / chip / step (MiB)", "ici_mib", "collective_bytes_per_step_per_chip.ici_bytes_per_step_per_chip",
     2**-20, ".1f"),
    ("DCN / chip / step (MiB)", "dcn_mib", "collective_bytes_per_step_per_chip.dcn_bytes_per_step_per_chip",
     2**-20, ".1f"),
    ("ICI sent / chip / step (MiB)", "sent_mib", "ici_sent_bytes_per_step_per_chip", 2**-20, ".1f"),
    ("model: sent (MiB)", "model_mib", "modelled.bytes", 2**-20, ".1f"),
)


def case_selector(case: dict) -> str:
  """The docs_numbers path that selects `case` in the results file's `cases` list."""
  return (f"cases.[topology={case['topology']},slices={case['slices']},"
          f"shape/seq_len={case['shape']['seq_len']},mask={case['mask']},"
          f"context_parallel={case['context_parallel']}]")


def case_key(case: dict) -> str:
  return (f"cpaot.{_topology_key(case['topology'], case['slices'])}.{case['shape']['seq_len'] // 1024}k."
          f"{case['mask']}.{case['context_parallel']}")


def table(cases: list[dict]) -> str:
  """The markdown table of docs/sharding.md, its numbers as docs_numbers markers."""
  head = ["slice (mesh)", "tokens", "mask", "strategy", "collectives"] + [c[0] for c in TABLE_COLUMNS]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for case in cases:
    mesh = ", ".join(f"{a} {n}" for a, n in case["mesh"].items() if n > 1)
    where = f"{case['topology']}{' x 2 slices' if case['slices'] == 2 else ''} ({mesh})"
    strategy = case["context_parallel"]
    if strategy == "auto" and case.get("modelled"):
      strategy = f"auto: {case['modelled']['strategy']}"
    cells = [where, f"{case['shape']['seq_len'] // 1024}k", case["mask"], strategy]
    if "refused" in case:
      lines.append("| " + " | ".join(cells + [f"refused: {case['refused'][:90]}"] + [""] * len(TABLE_COLUMNS))
                   + " |")
      continue
    kinds = ", ".join(f"{k} {n}" for k, n in case["collectives"].items() if n)
    cells.append(kinds)
    cells += [f"<!--n:{case_key(case)}.{key}-->?<!--/n-->" for _, key, _, _, _ in TABLE_COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB"


def _line(case: dict) -> str:
  head = (f"{case['topology']} x{case['slices']} {case['mesh']} {case['shape']['seq_len']:,} "
          f"{case['mask']} {case['context_parallel']}")
  if "refused" in case:
    return f"{head}: refused ({case['refused'][:120]})"
  traffic = case["collective_bytes_per_step_per_chip"]
  return (f"{head}: temporaries {_mib(case['per_chip_bytes']['temporaries'])}, "
          f"ICI {_mib(traffic['ici_bytes_per_step_per_chip'])}, "
          f"DCN {_mib(traffic['dcn_bytes_per_step_per_chip'])} per chip per step; {case['sharding']}")


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  if args.table:
    with open(args.table) as f:
      print(table(json.load(f)["cases"]))
    return 0
  if args.sweep:
    sweep(args.out, args.sweep_mask, args.sweep_strategy)
    return 0
  result = compile_case(args)
  if args.json:
    print(json.dumps(result))
    return 0
  print(_line(result))
  if "refused" not in result:
    mem = result["per_chip_bytes"]
    print(f"per chip: arguments {_mib(mem['arguments'])}, outputs {_mib(mem['outputs'])}, "
          f"temporaries {_mib(mem['temporaries'])}, code {_mib(mem['code'])}; one full-sequence K "
          f"would be {_mib(result['full_sequence_k_bytes'])}")
    print(f"collectives: {result['collectives']}; bytes by kind: {result['collective_bytes_by_kind']}; "
          f"Mosaic kernel calls: {result['mosaic_kernels']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
