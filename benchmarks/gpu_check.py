"""One prepared GPU check: conformance on the device, then a timing table.

    python -m benchmarks.gpu_check --json benchmarks/results/DATE-DEVICE.json
    python -m benchmarks.gpu_check --dry-run        # CPU, interpret mode, tiny sizes

1. Conformance subset: flash_pallas on the GPU (the Triton kernels, as
   `fl.explain` must confirm) in bfloat16, float16 and float32, forward and
   dq/dk/dv, against the float64 NumPy oracle of the test suite
   (flash_layers.testing.reference64). Pass when the error, relative to the largest
   magnitude of the float64 result, is at most twice that of the `reference` impl
   run in the same dtype on the same device, plus a floor per dtype.
2. Timing, bfloat16, MHA, batch * length = 16k tokens, at 1k/4k/8k/16k tokens,
   head_dim 64 and 128, causal and not, forward and forward+backward, for
     flash_pallas   fl.attention(impl="flash_pallas")  (our Triton kernels)
     cudnn          jax.nn.dot_product_attention(implementation="cudnn")
     xla            jax.nn.dot_product_attention(implementation="xla")
     pallas_mha     jax.experimental.pallas.ops.gpu.attention.mha (a yardstick)
   Each cell: compile, one warm-up run, then the median of `--repeats` runs, each
   on the next of `--input-sets` different inputs and blocked with
   `jax.block_until_ready`; the outputs must be finite and not all zero.
   TFLOP/s counts 4 * b * h * t * s * d FLOPs forward (two matmuls), 3.5 times
   that forward+backward (five more matmuls of the same size), and half of both
   when causal. The markdown table gives TFLOP/s and the throughput ratio to cuDNN.

`--budget-s` bounds the timing phase: cells left when it runs out are reported as
"skipped (budget)", so one run on a borrowed GPU always returns a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import itertools
import json
import pathlib
import platform as host_platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from flash_layers.testing import reference64

IMPLS = ("flash_pallas", "cudnn", "xla", "pallas_mha")
PASSES = ("fwd", "fwd+bwd")
FLOOR = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 5e-4}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run checks and times."""

  dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
  lengths: tuple[int, ...] = (1024, 4096, 8192, 16384)
  head_dims: tuple[int, ...] = (64, 128)
  causal: tuple[bool, ...] = (False, True)
  tokens: int = 16384  # batch * length per timing cell
  heads: int = 16
  repeats: int = 10
  input_sets: int = 3
  interpret: bool = False  # dry run: the GPU kernels in Pallas interpret mode on the CPU


DRY_RUN = Plan(lengths=(128,), head_dims=(64,), causal=(True,), tokens=128, heads=2, repeats=2,
               input_sets=2, interpret=True)


# ----------------------------------------------------------------------------
# 1. Conformance subset
# ----------------------------------------------------------------------------

# name -> (batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v, attention kwargs, packed?)
CONFORMANCE = {
    "len333_causal_gqa": (1, 333, 333, 8, 2, 64, 64, {"causal": True}, False),
    "packed_batch2_gqa": (2, 200, 200, 4, 1, 128, 128, {}, True),
    "cross_causal_128_to_333": (1, 128, 333, 2, 2, 64, 64, {"causal": True}, False),
    "window_softcap_d80_dv32": (1, 200, 200, 2, 1, 80, 32, {"window": (17, 5), "softcap": 5.0}, False),
    "d256_causal_window": (1, 160, 160, 2, 2, 256, 256, {"causal": True, "window": (64, 0)}, False),
    "tiny_packed_causal_gqa": (1, 70, 70, 4, 2, 32, 32, {"causal": True}, True),
}
DRY_RUN_CONFORMANCE = ("tiny_packed_causal_gqa",)


def _float64_oracle():
  """The suite's independent float64 oracle (`flash_layers.testing.reference64`)."""
  return reference64


def _packed_ids(rng, batch, length):
  """Per row: 1-4 documents of random lengths, then a little padding (id 0)."""
  ids = np.zeros((batch, length), np.int32)
  for row in range(batch):
    real = length - int(rng.integers(0, length // 8 + 1))
    cuts = np.sort(rng.choice(np.arange(1, real), size=int(rng.integers(0, 4)), replace=False))
    ids[row, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
  return ids


def _relative_errors(actual: dict, expected: dict) -> dict[str, float]:
  return {name: float(np.abs(actual[name] - expected[name]).max()
                      / max(np.abs(expected[name]).max(), 1e-30))
          for name in ("out", "dq", "dk", "dv")}


def _run_impl(impl: str, dtype: str, arrays, kwargs, interpret: bool) -> dict:
  q, k, v, dout = (jnp.asarray(a, dtype) for a in arrays)

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: fl.attention(q, k, v, impl=impl, **kwargs), q, k, v)
    return (out, *vjp(dout))

  context = fl.interpret_as("gpu") if interpret and impl == "flash_pallas" else _nullcontext()
  with context:
    result = jax.jit(fwd_bwd)(q, k, v, dout)
  return {name: np.asarray(x.astype(jnp.float32), np.float64)
          for name, x in zip(("out", "dq", "dk", "dv"), result, strict=True)}


class _nullcontext:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def conformance(plan: Plan, names) -> list[dict]:
  oracle = _float64_oracle()
  rows = []
  for name in names:
    b, t, s, h, kvh, d, dv, kwargs, packed = CONFORMANCE[name]
    rng = np.random.default_rng(len(rows))
    kwargs = dict(kwargs)
    if packed:
      kwargs["segment_ids"] = _packed_ids(rng, b, t)
    shapes = [(b, t, h, d), (b, s, kvh, d), (b, s, kvh, dv), (b, t, h, dv)]
    base = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    for dtype in plan.dtypes:
      # Round to the dtype first, so float64 sees exactly what the kernels see.
      arrays = [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in base]
      visible = oracle.mask(b, t, s, causal=kwargs.get("causal", False), window=kwargs.get("window"),
                            segment_ids=kwargs.get("segment_ids"),
                            kv_segment_ids=kwargs.get("segment_ids"))[:, None]
      expected = oracle.attention(*arrays[:3], visible, softcap=kwargs.get("softcap"), dout=arrays[3])
      row = {"config": name, "dtype": dtype}
      try:
        with fl.interpret_as("gpu") if plan.interpret else _nullcontext():
          row["kernel"] = fl.explain(*arrays[:3], impl="flash_pallas", **kwargs).kernel
        ours = _relative_errors(_run_impl("flash_pallas", dtype, arrays, kwargs, plan.interpret), expected)
        ref = _relative_errors(_run_impl("reference", dtype, arrays, kwargs, False), expected)
        limits = {n: 2 * ref[n] + FLOOR[dtype] for n in ours}
        row.update(errors=ours, limits=limits,
                   passed=all(ours[n] <= limits[n] for n in ours)
                   and row["kernel"].startswith("pallas-gpu"))
      except Exception as e:  # report, keep going: one run must return everything it can
        row.update(passed=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
      rows.append(row)
      print(f"  conformance {name:26s} {dtype:9s} {'ok  ' if row['passed'] else 'FAIL'} "
            + (", ".join(f"{n} {e:.1e}/{row['limits'][n]:.1e}" for n, e in row["errors"].items())
               if "errors" in row else row.get("error", "")), flush=True)
  return rows


# ----------------------------------------------------------------------------
# 2. Timing
# ----------------------------------------------------------------------------

def _pallas_mha() -> Callable | None:
  """jax's own Pallas GPU flash attention, if this jax has it (its signature moves between versions)."""
  try:
    from jax.experimental.pallas.ops.gpu import attention as mha_module
  except ImportError:
    return None
  mha = getattr(mha_module, "mha", None)
  if mha is None or "segment_ids" not in inspect.signature(mha).parameters:
    return None
  return mha


def _attention_fn(impl: str, causal: bool, interpret: bool) -> Callable | None:
  """q, k, v -> out for one impl; None when this jax/device lacks it."""
  if impl == "flash_pallas":
    return lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", causal=causal)
  if impl in ("cudnn", "xla"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  mha = _pallas_mha()
  if mha is None:
    return None
  kwargs = {"interpret": True} if interpret else {}
  return lambda q, k, v: mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, **kwargs)


def _step(fn: Callable, pass_: str) -> Callable:
  if pass_ == "fwd":
    return jax.jit(fn)

  def loss(q, k, v, cotangent):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def flops(batch, heads, length, head_dim, causal, pass_) -> float:
  forward = 4.0 * batch * heads * length * length * head_dim
  return forward * (3.5 if pass_ == "fwd+bwd" else 1.0) * (0.5 if causal else 1.0)


def _check_outputs(result) -> None:
  for x in jax.tree_util.tree_leaves(result):
    x = np.asarray(x.astype(jnp.float32))
    if not np.all(np.isfinite(x)) or not np.any(x):
      raise FloatingPointError("output is not finite or all zeros")


def time_cell(impl, length, head_dim, causal, pass_, plan: Plan) -> dict:
  batch = max(plan.tokens // length, 1)
  row = {"impl": impl, "seq_len": length, "head_dim": head_dim, "causal": causal, "pass": pass_,
         "batch": batch, "heads": plan.heads, "dtype": "bfloat16"}
  fn = _attention_fn(impl, causal, plan.interpret)
  if fn is None:
    return row | {"status": "unavailable"}
  keys = jax.random.split(jax.random.PRNGKey(length * 1000 + head_dim), plan.input_sets)
  shape = (batch, length, plan.heads, head_dim)
  inputs = []
  for key in keys:
    kq, kk, kv, kc = jax.random.split(key, 4)
    args = [jax.random.normal(kk_, shape, jnp.bfloat16) for kk_ in (kq, kk, kv)]
    if pass_ == "fwd+bwd":
      args.append(jax.random.normal(kc, shape, jnp.float32))
    inputs.append(args)
  try:
    with fl.interpret_as("gpu") if plan.interpret else _nullcontext():
      step = _step(fn, pass_)
      start = time.perf_counter()
      compiled = step.lower(*inputs[0]).compile()
      row["compile_s"] = time.perf_counter() - start
    _check_outputs(jax.block_until_ready(compiled(*inputs[0])))  # warm-up
    times = []
    for i in range(plan.repeats):
      args = inputs[i % len(inputs)]
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    _check_outputs(compiled(*inputs[-1]))
  except Exception as e:  # unsupported on this device/jax, or out of memory: a cell, not a crash
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    return row | {"status": "oom" if "RESOURCE_EXHAUSTED" in text else "error", "error": text}
  return row | {"status": "ok", "seconds": seconds, "runs": len(times),
                "tflops": flops(batch, plan.heads, length, head_dim, causal, pass_) / seconds / 1e12}


# The headline target cell (H200, bf16): timed first, so a run cut short by its budget still has it.
TARGET = (8192, 128, True)


def timing(plan: Plan, budget_s: float) -> list[dict]:
  shapes = list(itertools.product(plan.lengths, plan.head_dims, plan.causal))
  shapes.sort(key=lambda shape: shape != TARGET)  # stable: the rest keep their order
  rows = []
  deadline = time.monotonic() + budget_s
  for (length, head_dim, causal), pass_, impl in itertools.product(shapes, PASSES, IMPLS):
    if time.monotonic() > deadline:
      rows.append({"impl": impl, "seq_len": length, "head_dim": head_dim, "causal": causal,
                   "pass": pass_, "status": "skipped (budget)"})
      continue
    row = time_cell(impl, length, head_dim, causal, pass_, plan)
    rows.append(row)
    print(f"  time {impl:12s} {length:6d} d{head_dim:<3d} {'causal' if causal else 'full  '} "
          f"{pass_:7s} " + (f"{row['seconds'] * 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                            if row["status"] == "ok" else row["status"] + " " + row.get("error", "")),
          flush=True)
  return rows


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
  """One line per (length, head_dim, causal, pass): TFLOP/s per impl and ratios to cuDNN."""
  cells = {}
  for r in rows:
    cells[(r["seq_len"], r["head_dim"], r["causal"], r["pass"], r["impl"])] = r
  keys = sorted({k[:4] for k in cells}, key=lambda k: (k[3], k[1], k[2], k[0]))
  lines = ["| tokens | head_dim | causal | pass | " + " | ".join(f"{i} TFLOP/s" for i in IMPLS)
           + " | flash_pallas / cudnn | pallas_mha / cudnn |",
           "|" + "---|" * (4 + len(IMPLS) + 2)]

  def tflops(key, impl):
    r = cells.get((*key, impl))
    return r["tflops"] if r and r.get("status") == "ok" else None

  for key in keys:
    values = [tflops(key, impl) for impl in IMPLS]
    shown = [f"{v:.3g}" if v is not None else cells.get((*key, impl), {}).get("status", "-")
             for v, impl in zip(values, IMPLS, strict=True)]
    cudnn = values[IMPLS.index("cudnn")]
    ratios = [f"{values[IMPLS.index(i)] / cudnn:.2f}" if cudnn and values[IMPLS.index(i)] else "-"
              for i in ("flash_pallas", "pallas_mha")]
    length, head_dim, causal, pass_ = key
    lines.append(f"| {length} | {head_dim} | {'yes' if causal else 'no'} | {pass_} | "
                 + " | ".join(shown) + " | " + " | ".join(ratios) + " |")
  return "\n".join(lines)


def device_description() -> dict[str, Any]:
  device = jax.devices()[0]
  return {"platform": device.platform, "device_kind": getattr(device, "device_kind", ""),
          "compute_capability": str(getattr(device, "compute_capability", "")),
          "jax": jax.__version__, "python": host_platform.python_version(),
          "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dry-run", action="store_true",
                      help="CPU, Pallas interpret mode, tiny sizes: checks the script itself")
  parser.add_argument("--json", type=pathlib.Path, help="write every row and the device here")
  parser.add_argument("--budget-s", type=float, default=330.0, help="seconds for the timing phase")
  parser.add_argument("--skip-conformance", action="store_true")
  args = parser.parse_args(argv)

  plan = DRY_RUN if args.dry_run else Plan()
  device = device_description()
  if not args.dry_run and device["platform"] != "gpu":
    print(f"no GPU here (jax sees {device['platform']}); use --dry-run", file=sys.stderr)
    return 2
  print(f"# flash_layers GPU check on {device['device_kind'] or device['platform']} "
        f"(jax {device['jax']}, {device['date']}){' [dry run]' if args.dry_run else ''}", flush=True)
  names = DRY_RUN_CONFORMANCE if args.dry_run else tuple(CONFORMANCE)
  checks = [] if args.skip_conformance else conformance(plan, names)
  rows = timing(plan, args.budget_s)
  table = markdown(rows)
  passed = sum(c["passed"] for c in checks)
  print(f"\nconformance: {passed}/{len(checks)} passed\n\n{table}")
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "dry_run": args.dry_run, "plan": dataclasses.asdict(plan),
              "conformance": checks, "timing": rows, "table": table}
    args.json.write_text(json.dumps(report, indent=1))
  return 0 if passed == len(checks) else 1


if __name__ == "__main__":
  sys.exit(main())
