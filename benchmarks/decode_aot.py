"""`python -m benchmarks.decode_aot`: compile a decoding step of flash_pallas for TPUs, lower it for CUDA.

    python -m benchmarks.decode_aot --out benchmarks/results/decode-aot-<date>.json

Needs libtpu, no TPU or GPU. One attention call of a decoding step -- 1 query per row against an 8,192-slot
cache with ragged valid lengths (segment ids), traced q_offset, causal, GQA 32 query heads on 8 kv heads,
head_dim 128, bfloat16, batch 4 -- is compiled ahead of time for v4, v5e, v5p and v6e chips (the real
Mosaic compiler) and lowered for CUDA (Pallas to Triton). For each it records the kernels in the program
and, for the TPUs, XLA's temporaries, in two cache layouts:

* ``flax``: the cache as flax's decoding modules keep it, ``[batch, slots, kv_heads, head_dim]``, passed
  as is. The kernel reads a head-major cache, and on a TPU (whose HBM tiles the last two dimensions by
  8 x 128) the transpose to it is a copy of the cache.
* ``heads_first``: the cache kept ``[batch, kv_heads, slots, head_dim]`` and passed as
  ``k.swapaxes(1, 2)``: XLA cancels that transpose against the kernel's, and no copy is made.

The same for a whole decoding step of `fl.MultiHeadAttention(decode=True, cache_layout=...)` (the same
sizes, 4,096 features, bfloat16 parameters, the cache donated so it is updated in place): "layer" rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
BATCH, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 4, 32, 8, 128, 8192


def _step(layout: str):
  import jax.numpy as jnp

  import flash_layers as fl

  def step(q, k, v, q_seg, kv_seg, offset):
    if layout == "heads_first":
      k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    return fl.attention(q, k, v, impl="flash_pallas", causal=True, segment_ids=q_seg,
                        kv_segment_ids=kv_seg, q_offset=offset).astype(jnp.bfloat16)
  return step


def _specs(layout: str, sharding=None):
  import jax
  import jax.numpy as jnp

  cache = ((BATCH, KV_HEADS, SLOTS, HEAD_DIM) if layout == "heads_first"
           else (BATCH, SLOTS, KV_HEADS, HEAD_DIM))
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
  return (spec((BATCH, 1, HEADS, HEAD_DIM), jnp.bfloat16), spec(cache, jnp.bfloat16),
          spec(cache, jnp.bfloat16), spec((BATCH, 1), jnp.int32), spec((BATCH, SLOTS), jnp.int32),
          spec((), jnp.int32))


def _layer_step(layout: str, sharding) -> dict:
  """Compile one decoding step of the layer with `cache_layout=layout`: its kernels and temporaries."""
  import jax
  import jax.numpy as jnp

  import flash_layers as fl

  layer = fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, causal=True,
                                rope_theta=1e4, impl="flash_pallas", decode=True, dtype=jnp.bfloat16,
                                param_dtype=jnp.bfloat16, cache_layout=layout)
  features = HEADS * HEAD_DIM
  shapes = jax.eval_shape(layer.init, jax.random.key(0),
                          jax.ShapeDtypeStruct((BATCH, SLOTS, features), jnp.bfloat16))
  placed = lambda tree: jax.tree.map(  # noqa: E731
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)

  def step(params, cache, x):
    y, updated = layer.apply({"params": params, "cache": cache}, x, mutable=["cache"])
    return y, updated["cache"]

  compiled = jax.jit(step, donate_argnums=1).lower(
      placed(shapes["params"]), placed(shapes["cache"]),
      jax.ShapeDtypeStruct((BATCH, 1, features), jnp.bfloat16, sharding=sharding)).compile()
  return {"kernels": sorted(set(re.findall(r"%(flash_layers_\w+?)(?:\.\d+)? = ", compiled.as_text()))),
          "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20}


def run() -> dict:
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax
  from jax.experimental import topologies

  cache_mib = BATCH * SLOTS * KV_HEADS * HEAD_DIM * 2 / 2**20
  result = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "problem": {"batch": BATCH, "q_len": 1, "heads": HEADS, "kv_heads": KV_HEADS,
                        "head_dim": HEAD_DIM, "slots": SLOTS, "dtype": "bfloat16",
                        "one_cache_tensor_mib": cache_mib},
            "tpu": [], "layer": [], "cuda": []}
  for generation, topology in GENERATIONS.items():
    device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    for layout in ("flax", "heads_first"):
      compiled = jax.jit(_step(layout)).lower(
          *_specs(layout, jax.sharding.SingleDeviceSharding(device))).compile()
      text = compiled.as_text()
      kernels = sorted(set(re.findall(r"%(flash_layers_\w+?)(?:\.\d+)? = ", text)))
      memory = compiled.memory_analysis()
      result["tpu"].append({"generation": generation, "layout": layout, "kernels": kernels,
                            "temp_mib": memory.temp_size_in_bytes / 2**20})
      result["layer"].append({"generation": generation, "layout": layout,
                              **_layer_step(layout, jax.sharding.SingleDeviceSharding(device))})
  for layout in ("flax", "heads_first"):
    text = jax.jit(_step(layout)).trace(*_specs(layout)).lower(lowering_platforms=("cuda",)).as_text()
    result["cuda"].append({"layout": layout,
                           "kernels": sorted(set(re.findall(r'name = "(flash_pallas_gpu_\w+)"', text)))})
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_aot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="write the JSON result here")
  args = parser.parse_args(argv)
  result = run()
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
