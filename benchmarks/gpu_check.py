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

import contextlib
import dataclasses
import inspect
import itertools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from benchmarks import device_check
from benchmarks.device_check import PASSES, device_description  # noqa: F401  (this check's API)

IMPLS = ("flash_pallas", "cudnn", "xla", "pallas_mha")


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


def _interpret(plan: Plan):
  return (lambda: fl.interpret_as("gpu")) if plan.interpret else contextlib.nullcontext


def conformance(plan: Plan, names) -> list[dict]:
  rows = []
  for name in names:
    b, t, s, h, kvh, d, dv, kwargs, packed = CONFORMANCE[name]
    rng = np.random.default_rng(len(rows))
    kwargs = dict(kwargs)
    if packed:
      kwargs["segment_ids"] = device_check.packed_ids(rng, b, t)
    shapes = [(b, t, h, d), (b, s, kvh, d), (b, s, kvh, dv), (b, t, h, dv)]
    base = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    for dtype in plan.dtypes:
      rows.append(device_check.conformance_row(
          name, "flash_pallas", dtype, base, kwargs, context=_interpret(plan),
          kernel_ok=lambda kernel: kernel.startswith("pallas-gpu")))
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


def flops(batch, heads, length, head_dim, causal, pass_) -> float:
  forward = 4.0 * batch * heads * length * length * head_dim
  return forward * device_check.PASS_FLOPS[pass_] * (0.5 if causal else 1.0)


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
    timed = device_check.time_step(device_check.training_step(fn, pass_), inputs, plan.repeats,
                                   _interpret(plan)())
  except Exception as e:  # unsupported on this device/jax, or out of memory: a cell, not a crash
    return row | device_check.error_row(e)
  return row | {"status": "ok", **timed,
                "tflops": flops(batch, plan.heads, length, head_dim, causal, pass_) / timed["seconds"] / 1e12}


# The headline target cell (H200, bf16): timed first, so a run cut short by its budget still has it.
TARGET = (8192, 128, True)


def timing(plan: Plan, budget_s: float) -> list[dict]:
  shapes = list(itertools.product(plan.lengths, plan.head_dims, plan.causal))
  shapes.sort(key=lambda shape: shape != TARGET)  # stable: the rest keep their order
  cells = [(length, head_dim, causal, pass_, impl)
           for (length, head_dim, causal), pass_, impl in itertools.product(shapes, PASSES, IMPLS)]

  def describe(row):
    return (f"{row['impl']:12s} {row['seq_len']:6d} d{row['head_dim']:<3d} "
            f"{'causal' if row['causal'] else 'full  '} {row['pass']:7s} "
            + (f"{row['seconds'] * 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
               if row["status"] == "ok" else row["status"] + " " + row.get("error", "")))

  return device_check.run_cells(
      cells, budget_s, lambda cell: time_cell(cell[4], *cell[:4], plan),
      lambda cell: dict(zip(("seq_len", "head_dim", "causal", "pass", "impl"), cell, strict=True)),
      describe)


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


def main(argv: list[str] | None = None) -> int:
  args = device_check.parser("python -m benchmarks.gpu_check", __doc__, 330.0).parse_args(argv)

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
  device_check.write_report(args.json, {
      "device": device, "dry_run": args.dry_run, "plan": dataclasses.asdict(plan),
      "conformance": checks, "timing": rows, "table": table})
  return 0 if passed == len(checks) else 1


if __name__ == "__main__":
  sys.exit(main())
