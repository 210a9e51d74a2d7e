"""`python -m benchmarks.tpu_grid`: the TPU kernels' grid steps against the tiles that matter.

    python -m benchmarks.tpu_grid --generation v5e --json benchmarks/results/tpu-grid-v5e-32k.json

Traces `jax.value_and_grad` of flash_pallas (TPU kernels, interpreted: nothing runs, no TPU needed)
at 32,768 tokens with the generation's default tiles, reads every pallas_call's grid off the jaxpr
(a dynamic grid bound, sized from the segment ids, is evaluated by running the jaxpr's plain-JAX part
with the kernels stubbed out) and counts, in NumPy from each query's interval of visible keys (not
from `flash_layers.masks`), the tiles holding at least one visible (query, key) pair. Masks: causal,
a window (512, 0), 16 packed documents of 2,048 tokens, and the same with the last 1,000 tokens
padding (segment id 0). `tests/test_tpu_grid.py` asserts the same counts.

    python -m benchmarks.tpu_grid --mods --json benchmarks/results/tpu-grid-mods-v5e-32k.json

counts instead the grid points the forward kernel really executes for a mask_mod -- prefix-LM (5,000
bidirectional keys) and chunked causal (chunks of 8,192) -- with the TPU interpreter's grid-point recorder
(the kernel runs, interpreted, on zeros), against the tiles holding a visible pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

from benchmarks import cpu_dense

T = 32768
DOC = 2048  # 16 packed documents
PAD = 1000  # "padded": the same documents, the last one cut short by 1,000 padding tokens (id 0)
MASKS = ("causal", "window", "packed", "padded")
KERNELS = {"fwd": "flash_layers_fwd", "dkv": "flash_layers_bwd_dkv", "dq": "flash_layers_bwd_dq"}


def key_intervals(mask: str, t: int = T) -> tuple[np.ndarray, np.ndarray]:
  """Per query position, the first and last key it sees (each mask here sees an interval)."""
  i = np.arange(t)
  if mask == "causal":
    return np.zeros(t, np.int64), i
  if mask == "window":  # window=(512, 0)
    return np.maximum(i - 512, 0), i
  start = i // DOC * DOC  # "packed": full attention within each document
  end = start + DOC - 1
  if mask == "padded":  # padding sees padding; the last document ends where it starts
    start = np.where(i >= t - PAD, t - PAD, start)
    end = np.where(i >= t - PAD, t - 1, np.minimum(end, t - PAD - 1))
  return start, end


def visible_tiles(mask: str, block_q: int, block_kv: int, t: int = T) -> int:
  """Tiles of block_q x block_kv that hold at least one visible pair."""
  lo, hi = key_intervals(mask, t)
  kv_first = np.arange(t // block_kv)[None, :] * block_kv
  touches = (lo[:, None] <= kv_first + block_kv - 1) & (hi[:, None] >= kv_first)  # [t, kv blocks]
  return int(touches.reshape(t // block_q, block_q, -1).any(axis=1).sum())


def kernel_grids(mask: str, block_sizes, t: int = T) -> dict[str, tuple[int, ...]]:
  """{kernel name: grid} of value_and_grad at [1, t, 1, 128] bfloat16, dynamic bounds evaluated."""
  import jax
  import jax.numpy as jnp

  import flash_layers as fl

  x = jnp.zeros((1, t, 1, 128), jnp.bfloat16)
  kwargs = dict(impl="flash_pallas", block_sizes=block_sizes)
  if mask == "causal":
    kwargs["causal"] = True
  elif mask == "window":
    kwargs["window"] = (512, 0)
  else:
    ids = np.arange(t) // DOC + 1
    if mask == "padded":
      ids[t - PAD:] = 0
    kwargs["segment_ids"] = jnp.asarray(ids[None], jnp.int32)

  def loss(q, k, v):
    return fl.attention(q, k, v, **kwargs).astype(jnp.float32).sum()

  with fl.interpret_as("tpu"):
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, x, x)
  grids: dict[str, tuple[int, ...]] = {}
  _evaluate(closed.jaxpr, closed.consts, [x, x, x], grids)
  return grids


def _kernel_name(params) -> str:
  name = params.get("name") or params.get("name_and_src_info")
  return name if isinstance(name, str) else name.name


def _evaluate(jaxpr, consts, args, grids):
  """Runs a jaxpr, recording each pallas_call's grid instead of running the kernel."""
  import jax.extend.core as jex_core
  import jax.numpy as jnp

  env = {}

  def read(var):
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "pallas_call":
      mapping = eqn.params["grid_mapping"]
      bounds = iter(int(b) for b in values[:mapping.num_dynamic_grid_bounds])
      grid = tuple(d if isinstance(d, int) else next(bounds) for d in mapping.grid)
      grids[_kernel_name(eqn.params)] = grid
      outs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    elif name in ("pjit", "jit", "closed_call"):
      sub = eqn.params["jaxpr"]
      outs = _evaluate(sub.jaxpr, sub.consts, values, grids)
    elif name in ("custom_vjp_call", "custom_jvp_call"):
      sub = eqn.params["call_jaxpr"]
      outs = _evaluate(sub.jaxpr, sub.consts, values, grids)
    else:
      outs = eqn.primitive.bind(*values, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def measure(mask: str, block_sizes, t: int = T) -> dict:
  """Grid steps, visible tiles and the full grid of each tile kernel for one mask."""
  grids = kernel_grids(mask, block_sizes, t)
  tiles = {"fwd": (block_sizes.block_q, block_sizes.block_kv), "dkv": block_sizes.backward,
           "dq": block_sizes.backward}
  row = {"mask": mask}
  for short, name in KERNELS.items():
    bq, bk = tiles[short]
    row[short] = {"grid": list(grids[name]), "steps": int(np.prod(grids[name])),
                  "visible": visible_tiles(mask, bq, bk, t), "full_grid": (t // bq) * (t // bk)}
  return row


MOD_MASKS = ("prefix_lm", "chunked_causal")


PREFIX, CHUNK = 5000, 8192  # the prefix-LM's bidirectional keys, chunked causal's chunk


def mod_intervals(name: str, t: int = T, prefix: int = PREFIX,
                  chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
  """Per query, the first and last key a mod mask shows (an interval for both)."""
  i = np.arange(t)
  if name == "prefix_lm":
    return np.zeros(t, np.int64), np.maximum(i, prefix - 1)
  return i // chunk * chunk, i


def interval_tiles(lo: np.ndarray, hi: np.ndarray, block_q: int, block_kv: int) -> int:
  t = lo.shape[0]
  kv_first = np.arange(t // block_kv)[None, :] * block_kv
  touches = (lo[:, None] <= kv_first + block_kv - 1) & (hi[:, None] >= kv_first)
  return int(touches.reshape(t // block_q, block_q, -1).any(axis=1).sum())


def executed_points(name: str, block_sizes, t: int = T, prefix: int = PREFIX, chunk: int = CHUNK) -> int:
  """Grid points the forward kernel executes for mask_mod `name` (the TPU interpreter's recorder)."""
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas import tpu as pltpu

  import flash_layers as fl

  mask_mod, operands = ((fl.masks.prefix_lm(operand=0), (np.array([prefix], np.int32),))
                        if name == "prefix_lm" else (fl.masks.chunked_causal(chunk), None))
  points = []

  def record(token, grid_point, core):
    points.append(tuple(int(c) for c in grid_point))
    return token

  x = jnp.zeros((1, t, 1, 128), jnp.bfloat16)
  with fl.interpret_as("tpu", params=pltpu.InterpretParams(grid_point_recorder=record)):
    jax.block_until_ready(fl.attention(x, x, x, impl="flash_pallas", mask_mod=mask_mod,
                                       mod_operands=operands, block_sizes=block_sizes))
  return len(points)


def host() -> str:
  """This machine in words, for a results file: "2-core AMD EPYC VM, CPU only"."""
  return f"{os.cpu_count()}-core {cpu_dense.cpu_model()} VM, CPU only"


def main(argv: list[str] | None = None) -> int:
  from flash_layers.impls.flash_pallas import tpu_config

  parser = argparse.ArgumentParser(prog="python -m benchmarks.tpu_grid", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--generation", default="v5e", choices=sorted(tpu_config.DEFAULT_BLOCK_SIZES))
  parser.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated, of {', '.join(MASKS)}")
  parser.add_argument("--json", metavar="PATH", help="write the rows, with the date, as JSON")
  parser.add_argument("--mods", action="store_true",
                      help="count the forward's executed grid points for mask_mods instead")
  args = parser.parse_args(argv)
  if args.mods:
    blocks = tpu_config.default_block_sizes(args.generation)
    rows = []
    for name in MOD_MASKS:
      points = executed_points(name, blocks)
      tiles = interval_tiles(*mod_intervals(name), blocks.block_q, blocks.block_kv)
      rows.append({"mask_mod": name, "executed_points": points, "visible_tiles": tiles,
                   "full_grid": (T // blocks.block_q) * (T // blocks.block_kv)})
      print(f"{name}: {points:,} grid points executed for {tiles:,} visible tiles "
            f"(full grid {rows[-1]['full_grid']:,})", flush=True)
    if args.json:
      command = "python -m benchmarks.tpu_grid " + " ".join(argv if argv is not None else sys.argv[1:])
      out = {"date": datetime.date.today().isoformat(), "hardware": host(), "command": command,
             "generation": args.generation, "seq_len": T, "block_sizes": str(blocks), "rows": rows}
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0
  masks = [m for m in args.masks.split(",") if m]
  if bad := [m for m in masks if m not in MASKS]:
    parser.error(f"--masks: {bad} not in {MASKS}")
  blocks = tpu_config.default_block_sizes(args.generation)
  rows = [measure(mask, blocks) for mask in masks]
  print(f"{args.generation} tiles {blocks}, {T:,} tokens: grid steps / visible tiles")
  for row in rows:
    cells = (f"{k} {row[k]['steps']:,} / {row[k]['visible']:,} (full grid {row[k]['full_grid']:,})"
             for k in KERNELS)
    print(f"  {row['mask']:8s} " + "  ".join(cells))
  if args.json:
    out = {"date": datetime.date.today().isoformat(), "hardware": host(),
           "command": "python -m benchmarks.tpu_grid " + " ".join(argv if argv is not None else sys.argv[1:]),
           "generation": args.generation, "seq_len": T, "block_sizes": str(blocks), "rows": rows}
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
