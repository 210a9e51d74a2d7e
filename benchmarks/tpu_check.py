"""One prepared TPU check: the chip, conformance on it, then device-time benchmarks.

    python -m benchmarks.tpu_check --json benchmarks/results/DATE-tpu-GENERATION.json
    python -m benchmarks.tpu_check --dry-run      # CPU, interpret mode, tiny sizes

1. Environment: jax, jaxlib and libtpu versions, the devices, the chip's generation and its
   peak bfloat16 TFLOP/s (PEAK_BF16_TFLOPS, from Google Cloud's TPU pages).
2. Conformance: flash_pallas and jax_splash on the chip (the Mosaic kernels, as `fl.explain`
   must confirm) in float32 and bfloat16, forward and dq/dk/dv, against the float64 NumPy
   oracle (flash_layers.testing.reference64); the pass rule is the shared harness's
   (benchmarks/device_check.py): at most twice the `reference` impl's error in the same dtype
   on the same chip, plus a floor per dtype.
3. Timing, bfloat16, head_dim 128, GQA 8 query heads to 2 kv heads, batch * length = 64k
   tokens, at 4k, 16k and 64k tokens, forward and forward+backward, for three masks
     causal        causal=True
     window        window=(512, 0) (each token sees itself and the 512 before it)
     16 documents  segment_ids: 16 packed documents of equal length, bidirectional
   and three impls: flash_pallas, jax_splash and xla_native, all through `fl.attention`.
   Each cell: compile, one warm-up run, then the median of `--repeats` runs of one executable
   that applies the step `--inner` times in a loop (so host dispatch is paid once per run and
   the time is the device's), each run on the next of `--input-sets` inputs. TFLOP/s count the
   visible (query, key) pairs only: 4 * b * h * d FLOPs per pair forward (two matmuls), 3.5
   times that forward+backward; MFU is TFLOP/s over the chip's peak.

`--budget-s` bounds the timing phase: cells left are "skipped (budget)", so a run on a borrowed
TPU VM always returns its table. The JSON report and the markdown table are ready to commit to
benchmarks/results/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import itertools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from benchmarks import device_check

IMPLS = ("flash_pallas", "jax_splash", "xla_native")
MASKS = ("causal", "window", "documents")
PASSES = device_check.PASSES
WINDOW = (512, 0)
DOCUMENTS = 16

# Peak dense bfloat16 TFLOP/s per chip, from Google Cloud's TPU documentation
# (https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e, .../tpu7x), keyed by generation.
PEAK_BF16_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0, "tpu7x": 2307.0}
# jax's device_kind -> generation.
GENERATIONS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5": "v5p",
               "tpu v5p": "v5p", "tpu v6 lite": "v6e", "tpu v6e": "v6e", "tpu7x": "tpu7x",
               "tpu v7": "tpu7x"}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run checks and times."""

  dtypes: tuple[str, ...] = ("float32", "bfloat16")
  lengths: tuple[int, ...] = (4096, 16384, 65536)
  masks: tuple[str, ...] = MASKS
  tokens: int = 65536  # batch * length per timing cell
  heads: int = 8
  kv_heads: int = 2
  head_dim: int = 128
  window: tuple[int, int] = WINDOW
  repeats: int = 5
  inner: int = 4  # steps per timed executable
  input_sets: int = 2
  interpret: bool = False  # dry run: on a CPU both impls run their TPU kernels interpreted


DRY_RUN = Plan(dtypes=("float32",), lengths=(256,), masks=("documents",), tokens=256, repeats=1,
               inner=1, input_sets=1, interpret=True)


def generation(device_kind: str) -> str | None:
  return GENERATIONS.get(device_kind.strip().lower())


def environment() -> dict:
  """Versions, devices and the chip's generation and peak."""
  versions = {}
  for package in ("jax", "jaxlib", "libtpu", "libtpu-nightly", "flax"):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[package] = importlib.metadata.version(package)
  devices = jax.devices()
  kind = getattr(devices[0], "device_kind", "")
  gen = generation(kind)
  return device_check.device_description(
      versions=versions, device_count=len(devices), local_device_count=jax.local_device_count(),
      process_count=jax.process_count(), generation=gen,
      cores_per_chip=getattr(devices[0], "num_cores", None),
      peak_bf16_tflops=PEAK_BF16_TFLOPS.get(gen))


# ----------------------------------------------------------------------------
# 1. Conformance
# ----------------------------------------------------------------------------

# name -> (batch, q_len, kv_len, heads, kv_heads, head_dim, attention kwargs, packed?). Features
# both impls serve (jax_splash refuses dropout and ALiBi): several blocks, padding, GQA,
# head_dim 128, causal, windows, packed documents, q_len != kv_len, softcap.
CONFORMANCE = {
    "len1000_causal_gqa_d128": (1, 1000, 1000, 8, 2, 128, {"causal": True}, False),
    "packed_batch2_gqa_d128": (2, 700, 700, 4, 1, 128, {}, True),
    "window_512_0_gqa": (1, 1300, 1300, 4, 2, 128, {"window": (512, 0)}, False),
    "cross_causal_300_to_900": (1, 300, 900, 4, 4, 64, {"causal": True}, False),
    "softcap_packed_causal_d64": (1, 600, 600, 2, 1, 64, {"causal": True, "softcap": 5.0}, True),
    "tiny_packed_causal_gqa": (1, 130, 130, 4, 2, 128, {"causal": True}, True),
}
DRY_RUN_CONFORMANCE = ("tiny_packed_causal_gqa",)
CONFORMANCE_IMPLS = ("flash_pallas", "jax_splash")
KERNELS = {"flash_pallas": "pallas-tpu", "jax_splash": "splash-tpu"}


def _kernel_ok(impl: str, plan: Plan) -> Callable[[str], bool]:
  """On a TPU the compiled Mosaic kernel; on the dry run its interpreted twin."""
  expected = KERNELS[impl] + (" (interpret)" if plan.interpret else "")
  return lambda kernel: kernel == expected


def conformance(plan: Plan, names) -> list[dict]:
  rows = []
  for index, name in enumerate(names):
    b, t, s, h, kvh, d, kwargs, packed = CONFORMANCE[name]
    rng = np.random.default_rng(index)
    kwargs = dict(kwargs)
    if packed:
      kwargs["segment_ids"] = device_check.packed_ids(rng, b, t)
    shapes = [(b, t, h, d), (b, s, kvh, d), (b, s, kvh, d), (b, t, h, d)]
    base = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    for impl, dtype in itertools.product(CONFORMANCE_IMPLS, plan.dtypes):
      rows.append(device_check.conformance_row(
          name, impl, dtype, base, kwargs, kernel_ok=_kernel_ok(impl, plan), label=impl))
  return rows


# ----------------------------------------------------------------------------
# 2. Timing
# ----------------------------------------------------------------------------

def mask_kwargs(mask: str, batch: int, length: int, plan: Plan) -> dict:
  if mask == "causal":
    return {"causal": True}
  if mask == "window":
    return {"window": plan.window}
  if mask == "documents":
    ids = np.repeat(np.arange(1, DOCUMENTS + 1, dtype=np.int32), length // DOCUMENTS)
    return {"segment_ids": jnp.asarray(np.broadcast_to(ids, (batch, length)))}
  raise ValueError(f"mask must be one of {MASKS}; got {mask!r}")


def visible_pairs(mask: str, length: int, window: tuple[int, int] = WINDOW) -> int:
  """(query, key) pairs a query may attend, per batch row and head."""
  if mask == "causal":
    return length * (length + 1) // 2
  if mask == "window":
    i = np.arange(length)
    left, right = window
    return int((np.minimum(i + right, length - 1) - np.maximum(i - left, 0) + 1).sum())
  if mask == "documents":
    return DOCUMENTS * (length // DOCUMENTS) ** 2
  raise ValueError(f"mask must be one of {MASKS}; got {mask!r}")


def flops(batch: int, heads: int, head_dim: int, pairs: int, pass_: str) -> float:
  return 4.0 * batch * heads * head_dim * pairs * device_check.PASS_FLOPS[pass_]


def _repeated(step: Callable, inner: int) -> Callable:
  """`step` applied `inner` times in one executable, each on inputs perturbed by the loop index
  (so the compiler cannot hoist it out of the loop); returns the last result."""
  if inner == 1:
    return step

  def run(*args):
    def body(i, _):
      shift = (i * 1e-3).astype(args[0].dtype)
      return step(args[0] + shift, *args[1:])
    return jax.lax.fori_loop(0, inner, body, step(*args))

  return jax.jit(run)


def time_cell(impl: str, mask: str, length: int, pass_: str, plan: Plan, peak: float | None) -> dict:
  batch = max(plan.tokens // length, 1)
  row = {"impl": impl, "mask": mask, "seq_len": length, "pass": pass_, "batch": batch,
         "heads": plan.heads, "kv_heads": plan.kv_heads, "head_dim": plan.head_dim,
         "dtype": "bfloat16", "inner": plan.inner}
  kwargs = mask_kwargs(mask, batch, length, plan)

  def fn(q, k, v):
    return fl.attention(q, k, v, impl=impl, **kwargs)

  keys = jax.random.split(jax.random.PRNGKey(length), plan.input_sets)
  q_shape = (batch, length, plan.heads, plan.head_dim)
  kv_shape = (batch, length, plan.kv_heads, plan.head_dim)
  inputs = []
  for key in keys:
    kq, kk, kv, kc = jax.random.split(key, 4)
    args = [jax.random.normal(kq, q_shape, jnp.bfloat16), jax.random.normal(kk, kv_shape, jnp.bfloat16),
            jax.random.normal(kv, kv_shape, jnp.bfloat16)]
    if pass_ == "fwd+bwd":
      args.append(jax.random.normal(kc, q_shape, jnp.float32))
    inputs.append(args)
  try:
    step = _repeated(device_check.training_step(fn, pass_), plan.inner)
    timed = device_check.time_step(step, inputs, plan.repeats)
  except Exception as e:  # refused, unsupported or out of memory: a cell, not a crash
    return row | device_check.error_row(e)
  seconds = timed["seconds"] / plan.inner
  tflops = flops(batch, plan.heads, plan.head_dim, visible_pairs(mask, length, plan.window),
                 pass_) / seconds / 1e12
  return row | {"status": "ok", **timed, "seconds": seconds, "tflops": tflops,
                "mfu": tflops / peak if peak else None}


def timing(plan: Plan, budget_s: float, peak: float | None) -> list[dict]:
  cells = list(itertools.product(plan.masks, plan.lengths, PASSES, IMPLS))

  def describe(row):
    shown = row["status"] + " " + row.get("error", "")
    if row["status"] == "ok":
      shown = f"{row['seconds'] * 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s" + (
          f" MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
    return f"{row['impl']:12s} {row['mask']:9s} {row['seq_len']:6d} {row['pass']:7s} {shown}"

  return device_check.run_cells(
      cells, budget_s, lambda cell: time_cell(cell[3], cell[0], cell[1], cell[2], plan, peak),
      lambda cell: dict(zip(("mask", "seq_len", "pass", "impl"), cell, strict=True)), describe)


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
  """One line per (mask, length, pass): ms, TFLOP/s and MFU per impl, and flash_pallas's speed
  relative to jax_splash (> 1: faster)."""
  cells = {(r["mask"], r["seq_len"], r["pass"], r["impl"]): r for r in rows}
  keys = sorted({k[:3] for k in cells}, key=lambda k: (k[2], MASKS.index(k[0]), k[1]))
  lines = ["| mask | tokens | pass | " + " | ".join(f"{i} ms (TFLOP/s, MFU)" for i in IMPLS)
           + " | flash_pallas / jax_splash |",
           "|" + "---|" * (3 + len(IMPLS) + 1)]

  def shown(r):
    if not r or r.get("status") != "ok":
      return (r or {}).get("status", "-")
    mfu = f", {r['mfu']:.0%}" if r.get("mfu") is not None else ""
    return f"{r['seconds'] * 1e3:.3g} ({r['tflops']:.3g}{mfu})"

  for key in keys:
    got = [cells.get((*key, impl)) for impl in IMPLS]
    ours, splash = got[0], got[1]
    ratio = (f"{splash['seconds'] / ours['seconds']:.2f}"
             if ours and splash and ours.get("status") == splash.get("status") == "ok" else "-")
    mask, length, pass_ = key
    lines.append(f"| {mask} | {length} | {pass_} | " + " | ".join(shown(r) for r in got)
                 + f" | {ratio} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  args = device_check.parser("python -m benchmarks.tpu_check", __doc__, 900.0).parse_args(argv)
  plan = DRY_RUN if args.dry_run else Plan()
  env = environment()
  if not args.dry_run and env["platform"] != "tpu":
    print(f"no TPU here (jax sees {env['platform']}); use --dry-run", file=sys.stderr)
    return 2
  print(f"# flash_layers TPU check on {env['device_kind'] or env['platform']} x{env['device_count']} "
        f"(generation {env['generation']}, peak {env['peak_bf16_tflops']} bf16 TFLOP/s; "
        f"jax {env['jax']}, {env['date']}){' [dry run]' if args.dry_run else ''}", flush=True)
  names = DRY_RUN_CONFORMANCE if args.dry_run else tuple(CONFORMANCE)
  checks = [] if args.skip_conformance else conformance(plan, names)
  rows = timing(plan, args.budget_s, env["peak_bf16_tflops"])
  table = markdown(rows)
  passed = sum(c["passed"] for c in checks)
  print(f"\nconformance: {passed}/{len(checks)} passed\n\n{table}")
  device_check.write_report(args.json, {
      "device": env, "dry_run": args.dry_run, "plan": dataclasses.asdict(plan),
      "conformance": checks, "timing": rows, "table": table})
  return 0 if passed == len(checks) else 1


if __name__ == "__main__":
  sys.exit(main())
