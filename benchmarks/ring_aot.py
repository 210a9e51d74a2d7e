"""`python -m benchmarks.ring_aot`: compile ring attention for a TPU slice; memory per chip.

    python -m benchmarks.ring_aot --topology v5p:2x2x2 --seq-len 32768

Needs libtpu, no TPU: `jax.experimental.topologies` describes the slice's chips,
a mesh is built over them (all on "sequence" unless --tensor/--data say
otherwise), and forward+backward of `fl.attention(..., mesh=mesh)` (flash_pallas
by default: the Mosaic kernels inside shard_map) is compiled ahead of time. It
prints XLA's per-chip memory (arguments, outputs, temporaries) next to the
size of one full-sequence K/V -- what a chip would hold if the ring gathered
it -- and the collectives in the compiled program. Per-chip memory must shrink
with the number of sequence shards: nothing holds the whole sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from benchmarks import tpu_aot

COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce")


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.ring_aot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--topology", default="v5p:2x2x2", help="TPU slice, e.g. v5p:2x2x2, v5e:4x4")
  tpu_aot.add_problem_args(parser, heads=8, head_dim=128,
                           masks=("causal", "full", "packed", "causal+packed"))
  parser.add_argument("--data", type=int, default=1)
  parser.add_argument("--tensor", type=int, default=1)
  parser.add_argument("--context-parallel", default="ring",
                      help="strategy over the sequence axis: ring, ulysses, all_gather, ulysses_ring, auto")
  return parser.parse_args(argv)


def compile_ring(args) -> dict:
  """Lower and compile forward+backward for the slice; returns what `main` prints."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flash_layers as fl
  from flash_layers import host, parallel

  try:
    with host.quiet_libtpu():
      devices = topologies.get_topology_desc(args.topology, "tpu").devices
  except Exception as e:  # libtpu missing, or an unknown slice name
    raise SystemExit(f"--topology {args.topology!r}: cannot describe this TPU slice "
                     f"(is libtpu installed? e.g. v5p:2x2x2, v5e:4x4): {e}") from None
  mesh = parallel.make_mesh(data=args.data, tensor=args.tensor, sequence=-1, devices=devices)
  kv_heads = args.kv_heads or args.heads
  dtype = jnp.dtype(args.dtype)
  q = jax.ShapeDtypeStruct((args.batch, args.seq_len, args.heads, args.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq_len, kv_heads, args.head_dim), dtype)
  seg = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
  tokens = NamedSharding(mesh, P(parallel.BATCH_AXES, "sequence"))
  heads = NamedSharding(mesh, P(parallel.BATCH_AXES, "sequence", "tensor"))
  kv_sharding = heads if kv_heads % args.tensor == 0 else tokens

  def loss(q, k, v, segment_ids):
    out = fl.attention(q, k, v, impl=args.impl, causal="causal" in args.mask,
                       segment_ids=segment_ids if "packed" in args.mask else None, mesh=mesh,
                       context_parallel=args.context_parallel)
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)),
                 in_shardings=(heads, kv_sharding, kv_sharding, tokens),
                 out_shardings=(NamedSharding(mesh, P()), (heads, kv_sharding, kv_sharding)))
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # jax 0.10 / later renames
  with set_mesh(mesh):
    # Under the mesh the kernels see the chip generation (their tile sizes follow it).
    compiled = step.lower(q, kv, kv, seg).compile()
  # Outside the mesh: explain's block counts run eagerly, on this host.
  sharding = fl.explain(q, kv, kv, impl=args.impl, causal="causal" in args.mask, mesh=mesh,
                         context_parallel=args.context_parallel).sharding
  memory = compiled.memory_analysis()
  text = compiled.as_text()
  full_kv_bytes = args.batch * args.seq_len * kv_heads * args.head_dim * dtype.itemsize
  return {
      "topology": args.topology, "chips": len(devices), "device_kind": devices[0].device_kind,
      "mesh": {a: int(s) for a, s in mesh.shape.items()},
      "shape": {"batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
                "kv_heads": kv_heads, "head_dim": args.head_dim, "dtype": args.dtype},
      "impl": args.impl, "mask": args.mask, "sharding": sharding,
      "per_chip_bytes": {"arguments": memory.argument_size_in_bytes,
                         "outputs": memory.output_size_in_bytes,
                         "temporaries": memory.temp_size_in_bytes,
                         "code": memory.generated_code_size_in_bytes},
      "full_sequence_k_bytes": full_kv_bytes,
      "collectives": {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in COLLECTIVES},
      # Any array with a dimension of the full length would be a gathered sequence.
      "full_length_shapes": sorted(set(re.findall(rf"\w+\[[0-9,]*\b{args.seq_len}\b[0-9,]*\]", text)))[:10],
      "mosaic_kernels": text.count("tpu_custom_call"),
  }


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f} MiB"


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  result = compile_ring(args)
  if args.json:
    print(json.dumps(result))
    return 0
  mem = result["per_chip_bytes"]
  print(f"{result['topology']} ({result['chips']} x {result['device_kind']}), mesh {result['mesh']}")
  print(f"{result['impl']} {result['mask']} forward+backward, {result['shape']}")
  print(f"  {result['sharding']}")
  print(f"per chip: arguments {_mib(mem['arguments'])}, outputs {_mib(mem['outputs'])}, "
        f"temporaries {_mib(mem['temporaries'])}, code {_mib(mem['code'])}")
  print(f"one full-sequence K would be {_mib(result['full_sequence_k_bytes'])}")
  print(f"collectives: {result['collectives']}; Mosaic kernel calls: {result['mosaic_kernels']}; "
        f"arrays as long as the sequence: {result['full_length_shapes'] or 'none'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
