"""`python -m benchmarks.paged_tpu`: our paged TPU kernel against jax's `ragged_paged_attention`, AOT.

    python -m benchmarks.paged_tpu --out benchmarks/results/paged-tpu-aot-<date>.json

Needs libtpu, no TPU: each call is compiled ahead of time by the real Mosaic compiler for the first chip
of a v5e:2x2 and a v6e:2x2 topology. Nothing runs, so there are no times.

The batch: 64 sequences of lengths drawn uniformly in [128, 32768] (seed 0), one decoding token each;
32 query heads on 8 kv heads, head_dim 128, bfloat16 queries, pages of 128 tokens (256 per sequence), the
page table a shuffled pool of exactly the pages in use. Three cases: bfloat16 pages; int8 pages (ours:
`fl.quantize_kv`'s float32 scales per token and kv head; jax's: int8 pages with scalar k_scale / v_scale);
bfloat16 pages with a sliding window of 4,096 keys (jax's ``sliding_window=4096``: a query at p sees keys
p - 4095 .. p; ours ``window=(4095, 0)``, the same keys).

* ours: `fl.paged_attention(layout="heads_first", impl="flash_pallas")`, pages
  ``[kv_heads, num_pages, page_size, d]``, lowered inside `lowering.lowered_only_for("tpu")`.
* jax: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, pages
  ``[num_pages, page_size, 2 * kv_heads, d]`` (K and V interleaved on the head axis). Its block sizes come
  from `get_tuned_block_sizes`, which reads `jax.devices()` (a CPU here) and has no entry for this key on
  "TPU v5" or "TPU v6" anyway, so its defaults (128 pages, 32 queries per block) are passed explicitly:
  the "default" rows. "kv4" rows pass 4 pages per block, which fits the default scoped VMEM.

Per (generation, kernel, config, case): whether it compiled (or the error), the kernels in the HLO, XLA's
temporaries (``memory_analysis().temp_size_in_bytes``), and two counts on the concrete batch:

* grid points that execute. Ours: `tpu_paged.grid_points` (kv_heads x the dynamic count of (q tile,
  chunk of pages) steps; tests/test_paged_tpu.py checks it equals the interpreter's recorder). jax's: its
  grid is static, ``(num_heads_blks, num_q_blks)`` from its source, and each grid step loops over its
  sequences and, per sequence, over kv blocks of ``num_kv_pages_per_block`` pages inside the step (a
  while loop), so "kv_block_iterations" is given beside it.
* bytes of K/V streamed from HBM per call. Ours: `fl.explain_paged(...).pages_touched` (pages holding a
  key some query sees; a window skips the pages left of it) x kv_heads x page bytes of K and of V (int8:
  plus the float32 scale rows). jax's is *modelled from source*: per heads block and sequence it copies kv
  blocks from position 0 while ``block * num_kv_pages_per_block * page_size < kv_len``, each block always
  ``num_kv_pages_per_block`` whole pages of all the block's combined K/V heads (slots past the sequence's
  last page re-copy its page 0: `MultiPageAsyncCopyDescriptor`), and a sliding window only masks logits
  (no page is skipped).

With ``--recorder``, the TPU interpreter's grid-point recorder is also run on a scaled-down batch (8
sequences up to 2,048 tokens, 1 kv head, 4 query heads, 128-token pages) for both kernels, against the
counts above.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

GENERATIONS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
BATCH, MIN_LEN, MAX_LEN, SEED = 64, 128, 32768, 0
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 128
WINDOW = 4096
CASES = {"bf16": ("bfloat16", None), "int8": ("int8", None), "bf16_window4096": ("bfloat16", WINDOW)}
# jax's configs: (num_kv_pages_per_block, num_queries_per_block).
JAX_CONFIGS = {"default": (128, 32), "kv4": (4, 32)}
HARDWARE = "AOT compile on a 2-core AMD EPYC CPU host (libtpu), no TPU"
KERNEL_RE = re.compile(r"%((?:flash_layers|ragged_paged)\w*?)(?:\.\d+)? = ")


class Batch:
  """The concrete ragged batch (numpy) and its pool's size."""

  def __init__(self, batch=BATCH, min_len=MIN_LEN, max_len=MAX_LEN, page_size=PAGE_SIZE, seed=SEED):
    rng = np.random.default_rng(seed)
    self.kv_lens = rng.integers(min_len, max_len + 1, size=batch).astype(np.int32)
    self.page_size = page_size
    self.pages_per_seq = -(-max_len // page_size)
    used = -(-self.kv_lens // page_size)
    self.num_pages = int(used.sum())
    order = rng.permutation(self.num_pages).astype(np.int32)
    self.page_table = np.zeros((batch, self.pages_per_seq), np.int32)
    start = 0
    for s, n in enumerate(used):
      self.page_table[s, :n] = order[start:start + n]
      start += n
    self.cu_q_lens = np.arange(batch + 1, dtype=np.int32)
    self.batch = batch


def _ours_fn(window):
  import flash_layers as fl

  def fn(q, k, v, table, lens, cu, n, k_scales=None, v_scales=None):
    return fl.paged_attention(q, k, v, page_table=table, kv_lens=lens, cu_q_lens=cu, num_seqs=n,
                              k_scales=k_scales, v_scales=v_scales, layout="heads_first",
                              window=None if window is None else (window - 1, 0), impl="flash_pallas")
  return fn


def _jax_fn(window, quantized, blocks):
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

  scale = 1.0 if quantized else None

  def fn(q, kv, lens, table, cu, n):
    return ragged_paged_attention(q, kv, lens, table, cu, n, sm_scale=HEAD_DIM ** -0.5, sliding_window=window,
                                  k_scale=scale, v_scale=scale, num_kv_pages_per_block=blocks[0],
                                  num_queries_per_block=blocks[1])
  return fn


def _compile(fn, args, device) -> dict:
  """Compile `fn` for `device`. It is also jax's default device while lowering: Mosaic's lowering of
  `sign` (in jax's kernel) asks the default device which TPU generation it is."""
  import jax

  from flash_layers import lowering

  try:
    with lowering.lowered_only_for("tpu"), jax.default_device(device):
      compiled = jax.jit(fn).lower(*args).compile()
  except Exception as e:  # noqa: BLE001 -- a refusal is a result
    return {"compiled": False, "error": f"{type(e).__name__}: {str(e).strip()[:600]}"}
  return {"compiled": True, "kernels": sorted(set(KERNEL_RE.findall(compiled.as_text()))),
          "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}


def ours_counts(b: Batch, kv_dtype: str, window, heads=HEADS, kv_heads=KV_HEADS) -> dict:
  """Executed grid points and K/V bytes streamed, from the concrete batch (flash_layers' own counts)."""
  import jax
  import jax.numpy as jnp

  import flash_layers as fl
  from flash_layers.contract import paged
  from flash_layers.impls.flash_pallas import tpu_paged

  sds = jax.ShapeDtypeStruct
  pages = sds((kv_heads, b.num_pages, b.page_size, HEAD_DIM), kv_dtype)
  scales = sds((kv_heads, b.num_pages, b.page_size), jnp.float32) if kv_dtype == "int8" else None
  kwargs = dict(page_table=jnp.asarray(b.page_table), kv_lens=jnp.asarray(b.kv_lens),
                cu_q_lens=jnp.asarray(b.cu_q_lens), num_seqs=b.batch, k_scales=scales, v_scales=scales,
                layout="heads_first", window=None if window is None else (window - 1, 0))
  q = sds((b.batch, heads, HEAD_DIM), jnp.bfloat16)
  explained = fl.explain_paged(q, pages, pages, impl="flash_pallas", platform="tpu", **kwargs)
  spec = paged.check(q, pages, pages, sinks=None, causal=True, softcap=None, scale=None,
                                 mask_mod=None, **kwargs)
  call = tpu_paged.make_call(spec, interpret=False)
  points = tpu_paged.grid_points(spec, b.page_table, b.kv_lens, b.cu_q_lens, b.batch)
  item = np.dtype(kv_dtype).itemsize
  page_bytes = b.page_size * HEAD_DIM * item + (4 * b.page_size if kv_dtype == "int8" else 0)
  return {"grid_points": points, "grid_points_explain": explained.grid_points,
          "static_grid_bound": kv_heads * tpu_paged.max_steps(call),
          "block_q": call.block_q, "pages_per_step": call.pages_per_step,
          "pages_touched_per_kv_head": explained.pages_touched, "pages_held": explained.pages_in_tables,
          "kv_bytes_streamed": 2 * explained.pages_touched * kv_heads * page_bytes,
          "kv_bytes_source": "flash_layers' count (explain_paged.pages_touched) x kv_heads x (K + V page "
                             "bytes, + float32 scale rows for int8)"}


def jax_counts(b: Batch, kv_dtype: str, blocks, heads=HEADS, kv_heads=KV_HEADS, tokens=None) -> dict:
  """jax's grid and K/V bytes, modelled from its source (kernel.py) on the concrete batch."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

  tokens = b.batch if tokens is None else tokens
  q_heads_blk, combined_blk = kernel.get_min_heads_per_blk(heads, 2 * kv_heads, jnp.bfloat16,
                                                           jnp.dtype(kv_dtype))
  kv_pages_blk = min(blocks[0], b.pages_per_seq)
  q_blk = min(blocks[1], tokens)
  heads_blks, q_blks = heads // q_heads_blk, -(-tokens // q_blk)
  keys_blk = kv_pages_blk * b.page_size
  kv_blocks = int(sum(-(-int(n) // keys_blk) for n in b.kv_lens))  # per heads block, window or not
  block_bytes = kv_pages_blk * b.page_size * combined_blk * HEAD_DIM * np.dtype(kv_dtype).itemsize
  return {"grid": [heads_blks, q_blks], "grid_points": heads_blks * q_blks,
          "kv_block_iterations": heads_blks * kv_blocks,
          "num_kv_pages_per_block": kv_pages_blk, "num_queries_per_block": q_blk,
          "heads_per_block": {"q": q_heads_blk, "combined_kv": combined_blk},
          "kv_vmem_double_buffer_bytes": 2 * block_bytes,
          "kv_bytes_streamed": heads_blks * kv_blocks * block_bytes,
          "kv_bytes_source": "modelled from source: per heads block and sequence, cdiv(kv_len, "
                             "num_kv_pages_per_block * page_size) blocks of num_kv_pages_per_block whole "
                             "pages of all combined K/V heads, from position 0; a sliding window only "
                             "masks"}


def _args(b: Batch, device, kernel: str, kv_dtype: str):
  import jax
  import jax.numpy as jnp

  shard = jax.sharding.SingleDeviceSharding(device)
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shard)  # noqa: E731
  q = sds((b.batch, HEADS, HEAD_DIM), jnp.bfloat16)
  table, lens, cu = (sds(x.shape, jnp.int32) for x in (b.page_table, b.kv_lens, b.cu_q_lens))
  if kernel == "ours":
    pages = sds((KV_HEADS, b.num_pages, b.page_size, HEAD_DIM), kv_dtype)
    extra = ((sds((KV_HEADS, b.num_pages, b.page_size), jnp.float32),) * 2 if kv_dtype == "int8" else ())
    return (q, pages, pages, table, lens, cu, sds((), jnp.int32), *extra)
  kv = sds((b.num_pages, b.page_size, 2 * KV_HEADS, HEAD_DIM), kv_dtype)
  return (q, kv, lens, table, cu, sds((1,), jnp.int32))


def recorder_check(budget_s: float = 120.0) -> dict:
  """Both kernels in the TPU interpreter on a scaled-down batch, with pltpu's grid-point recorder."""
  import time

  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

  import flash_layers as fl

  b = Batch(batch=8, min_len=128, max_len=2048, seed=SEED)
  heads, kv_heads = 4, 1
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((b.batch, heads, HEAD_DIM)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((kv_heads, b.num_pages, b.page_size, HEAD_DIM)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(k.shape), jnp.bfloat16)
  kv = jnp.stack([k[0], v[0]], axis=2)  # [num_pages, page_size, 2, d]: K, V interleaved
  result = {"problem": {"batch": b.batch, "kv_lens": b.kv_lens.tolist(), "heads": heads, "kv_heads": kv_heads,
                        "page_size": b.page_size, "dtype": "bfloat16"}}
  start = time.monotonic()
  for kernel in ("ours", "jax"):
    points = []

    def record(token, grid_point, core, points=points):
      points.append(tuple(int(c) for c in grid_point))
      return token

    params = pltpu.InterpretParams(grid_point_recorder=record)
    if kernel == "ours":
      with fl.interpret_as("tpu", params=params):
        jax.block_until_ready(fl.paged_attention(
            q, k, v, page_table=jnp.asarray(b.page_table), kv_lens=jnp.asarray(b.kv_lens),
            cu_q_lens=jnp.asarray(b.cu_q_lens), num_seqs=b.batch, layout="heads_first", impl="flash_pallas"))
      counted = ours_counts(b, "bfloat16", None, heads, kv_heads)["grid_points"]
    else:
      blocks = (8, 32)
      counted = jax_counts(b, "bfloat16", blocks, heads, kv_heads)["grid_points"]
      try:
        jax.block_until_ready(pl_interpret(ragged_paged_attention, params)(
            q, kv, jnp.asarray(b.kv_lens), jnp.asarray(b.page_table), jnp.asarray(b.cu_q_lens),
            jnp.asarray([b.batch], jnp.int32), sm_scale=HEAD_DIM ** -0.5, num_kv_pages_per_block=blocks[0],
            num_queries_per_block=blocks[1]))
      except Exception as e:  # noqa: BLE001 -- the interpreter's refusal is a result
        lines = [x for x in str(e).strip().splitlines() if x.strip()]
        result[kernel] = {"recorded_grid_points": None, "counted_grid_points": counted,
                          "interpreter_error": f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"}
        continue
    result[kernel] = {"recorded_grid_points": len(points), "counted_grid_points": counted}
    if time.monotonic() - start > budget_s:
      result["stopped"] = f"over {budget_s:.0f} s"
      break
  result["seconds"] = round(time.monotonic() - start, 1)
  return result


def pl_interpret(fn, params):
  """`fn` with every pallas_call in it interpreted as on a TPU with `params`."""
  from jax.experimental import pallas as pl

  original = pl.pallas_call

  def wrapped(*args, **kwargs):
    pl.pallas_call = lambda *a, **kw: original(*a, **{**kw, "interpret": params})
    try:
      return fn(*args, **kwargs)
    finally:
      pl.pallas_call = original
  return wrapped


def run(generations, recorder: bool) -> dict:
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax
  from jax.experimental import topologies

  b = Batch()
  result = {"date": "2026-12-06", "jax": jax.__version__, "hardware": HARDWARE,
            "problem": {"batch": BATCH, "kv_lens_uniform": [MIN_LEN, MAX_LEN], "seed": SEED,
                        "kv_lens": b.kv_lens.tolist(), "total_tokens": int(b.kv_lens.sum()),
                        "q_tokens_per_seq": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "page_size": PAGE_SIZE, "pages_per_seq": b.pages_per_seq, "num_pages": b.num_pages,
                        "q_dtype": "bfloat16", "sm_scale": HEAD_DIM ** -0.5,
                        "window": f"{WINDOW} keys (jax sliding_window={WINDOW}; "
                                  f"ours window=({WINDOW - 1}, 0))",
                        "int8": "ours: fl.quantize_kv float32 scales per token and kv head; jax: int8 pages, "
                                "scalar k_scale = v_scale = 1.0"},
            "jax_sliding_window": "masks logits only (kernel.py flash_attention: row - sliding_window >= "
                                  "col); its kv loop starts at block 0 of every sequence: no page is skipped",
            "rows": []}
  counts = {}
  for case, (kv_dtype, window) in CASES.items():
    counts["ours", "-", case] = ours_counts(b, kv_dtype, window)
    for config, blocks in JAX_CONFIGS.items():
      counts["jax", config, case] = jax_counts(b, kv_dtype, blocks)
  for generation in generations:
    device = topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS[generation]).devices[0]
    for (kernel, config, case), count in counts.items():
      kv_dtype, window = CASES[case]
      if kernel == "ours":
        fn = _ours_fn(window)
      else:
        fn = _jax_fn(window, kv_dtype == "int8", JAX_CONFIGS[config])
      row = {"generation": generation, "kernel": kernel, "config": config, "case": case, "kv_dtype": kv_dtype,
             "window": window, **_compile(fn, _args(b, device, kernel, kv_dtype), device), **count}
      print(f"{generation} {kernel} {config} {case}: compiled={row['compiled']}", file=sys.stderr)
      result["rows"].append(row)
  if recorder:
    result["recorder_scaled_down"] = recorder_check()
  return result


def table(result) -> str:
  lines = ["| gen | kernel | config | case | compiled | temp MiB | grid points | kv block iters | "
           "K/V GiB streamed |", "|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    temp = f"{r['temp_bytes'] / 2**20:.2f}" if r["compiled"] else "-"
    status = "yes" if r["compiled"] else "no: " + r["error"][:60].replace("|", "/")
    iters = r.get("kv_block_iterations", "-")
    model = " (model)" if r["kernel"] == "jax" else ""
    lines.append(f"| {r['generation']} | {r['kernel']} | {r['config']} | {r['case']} | {status} | {temp} | "
                 f"{r['grid_points']} | {iters} | {r['kv_bytes_streamed'] / 2**30:.3f}{model} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.paged_tpu", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="write the JSON result here")
  parser.add_argument("--generations", default="v5e,v6e", help="comma-separated, of v5e, v6e")
  parser.add_argument("--recorder", action="store_true",
                      help="also run the interpreter's grid-point recorder on a scaled-down batch")
  args = parser.parse_args(argv)
  result = run(args.generations.split(","), args.recorder)
  if args.out:
    with open(args.out, "w") as f:
      f.write(json.dumps(result, indent=1) + "\n")
  print(table(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
