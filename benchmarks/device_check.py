"""The harness shared by the one-command device checks (`gpu_check`, `tpu_check`).

A device check runs two phases and writes one report:

1. conformance on the device: an impl's forward and dq/dk/dv against the float64 NumPy
   oracle (`flash_layers.testing.reference64`), in each dtype; a row passes when its error,
   relative to the largest float64 magnitude, is at most twice that of the `reference` impl
   run in the same dtype on the same device, plus a floor per dtype, and `fl.explain` names
   the kernel family the check expects;
2. timing cells: compile, one warm-up run (outputs must be finite and not all zero), then the
   median of `repeats` runs, each on the next of `input_sets` inputs, blocked with
   `jax.block_until_ready`; a cell that fails (unsupported, out of memory) is a row, not a
   crash, and cells left when the time budget runs out are "skipped (budget)".

The checks add what differs per platform: the impls, the cases, the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform as host_platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flash_layers as fl
from flash_layers.testing import reference64

PASSES = ("fwd", "fwd+bwd")
# Conformance floor per dtype, added to twice the reference impl's own error.
FLOOR = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 5e-4}
# FLOPs of a pass relative to the forward's two matmuls: the backward adds five more of the same
# size and recomputes nothing else a flash kernel would count (the convention of FlashAttention).
PASS_FLOPS = {"fwd": 1.0, "fwd+bwd": 3.5}
GRADS = ("out", "dq", "dk", "dv")


# ----------------------------------------------------------------------------
# Conformance
# ----------------------------------------------------------------------------

def packed_ids(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  """Per row: 1-4 documents of random lengths, then a little padding (id 0)."""
  ids = np.zeros((batch, length), np.int32)
  for row in range(batch):
    real = length - int(rng.integers(0, length // 8 + 1))
    cuts = np.sort(rng.choice(np.arange(1, real), size=int(rng.integers(0, 4)), replace=False))
    ids[row, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
  return ids


def relative_errors(actual: dict, expected: dict) -> dict[str, float]:
  """Per tensor: worst |actual - expected| over the largest |expected|."""
  return {name: float(np.abs(actual[name] - expected[name]).max()
                      / max(np.abs(expected[name]).max(), 1e-30))
          for name in GRADS}


def run_fwd_bwd(impl: str, dtype: str, arrays, kwargs: dict, context=None) -> dict:
  """out, dq, dk, dv of `impl` (float64 NumPy) in one compiled function, traced in `context`."""
  q, k, v, dout = (jnp.asarray(a, dtype) for a in arrays)

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: fl.attention(q, k, v, impl=impl, **kwargs), q, k, v)
    return (out, *vjp(dout))

  with context if context is not None else contextlib.nullcontext():
    result = jax.jit(fwd_bwd)(q, k, v, dout)
  return {name: np.asarray(x.astype(jnp.float32), np.float64)
          for name, x in zip(GRADS, result, strict=True)}


def conformance_row(name: str, impl: str, dtype: str, base, kwargs: dict, *,
                    kernel_ok: Callable[[str], bool], context: Callable[[], Any] | None = None,
                    label: str | None = None) -> dict:
  """Check `impl` on one problem in `dtype`: q, k, v, dout are `base` rounded to `dtype`.

  context: a factory of the context the impl is traced in (e.g. `fl.interpret_as`);
  kernel_ok: whether `fl.explain(...).kernel` names the kernel this check is about.
  """
  fresh = context if context is not None else contextlib.nullcontext
  # Round to the dtype first, so float64 sees exactly what the kernels see.
  arrays = [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in base]
  b, t = arrays[0].shape[:2]
  s = arrays[1].shape[1]
  segment_ids = kwargs.get("segment_ids")
  visible = reference64.mask(b, t, s, causal=kwargs.get("causal", False), window=kwargs.get("window"),
                             segment_ids=segment_ids,
                             kv_segment_ids=kwargs.get("kv_segment_ids", segment_ids))[:, None]
  expected = reference64.attention(*arrays[:3], visible, softcap=kwargs.get("softcap"),
                                   dout=arrays[3])
  row = {"config": name, "dtype": dtype} | ({"impl": impl} if label is not None else {})
  try:
    with fresh():
      row["kernel"] = fl.explain(*arrays[:3], impl=impl, **kwargs).kernel
    ours = relative_errors(run_fwd_bwd(impl, dtype, arrays, kwargs, fresh()), expected)
    ref = relative_errors(run_fwd_bwd("reference", dtype, arrays, kwargs), expected)
    limits = {n: 2 * ref[n] + FLOOR[dtype] for n in ours}
    row.update(errors=ours, limits=limits,
               passed=all(ours[n] <= limits[n] for n in ours) and kernel_ok(row["kernel"]))
  except Exception as e:  # report, keep going: one run must return everything it can
    row.update(passed=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  print(f"  conformance {label + ' ' if label else ''}{name:26s} {dtype:9s} "
        f"{'ok  ' if row['passed'] else 'FAIL'} "
        + (", ".join(f"{n} {e:.1e}/{row['limits'][n]:.1e}" for n, e in row["errors"].items())
           if "errors" in row else row.get("error", "")), flush=True)
  return row


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------

def training_step(fn: Callable, pass_: str) -> Callable:
  """jit of fn (q, k, v -> out) for "fwd"; of the gradients of sum(out * cotangent) for "fwd+bwd"."""
  if pass_ == "fwd":
    return jax.jit(fn)

  def loss(q, k, v, cotangent):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def check_outputs(result) -> None:
  for x in jax.tree_util.tree_leaves(result):
    x = np.asarray(x.astype(jnp.float32))
    if not np.all(np.isfinite(x)) or not np.any(x):
      raise FloatingPointError("output is not finite or all zeros")


def time_step(step: Callable, inputs: list, repeats: int, context=None) -> dict:
  """Compile `step` (traced in `context`), warm it up, then the median of `repeats` runs.

  Raises what the compile or a run raises; `error_row` turns that into a row.
  """
  with context if context is not None else contextlib.nullcontext():
    start = time.perf_counter()
    compiled = step.lower(*inputs[0]).compile()
    compile_s = time.perf_counter() - start
  check_outputs(jax.block_until_ready(compiled(*inputs[0])))  # warm-up
  times = []
  for i in range(repeats):
    args = inputs[i % len(inputs)]
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  check_outputs(compiled(*inputs[-1]))
  return {"compile_s": compile_s, "seconds": statistics.median(times), "runs": len(times)}


def error_row(e: Exception) -> dict:
  """A failed cell: "oom" when the device ran out of memory, else "error", with the message."""
  text = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
  return {"status": "oom" if "RESOURCE_EXHAUSTED" in text else "error", "error": text}


def run_cells(cells: Iterable, budget_s: float, run: Callable[[Any], dict],
              skipped: Callable[[Any], dict], describe: Callable[[dict], str]) -> list[dict]:
  """run(cell) for each cell until `budget_s` seconds have passed; the rest: skipped(cell)."""
  rows = []
  deadline = time.monotonic() + budget_s
  for cell in cells:
    if time.monotonic() > deadline:
      rows.append(skipped(cell) | {"status": "skipped (budget)"})
      continue
    row = run(cell)
    rows.append(row)
    print("  time " + describe(row), flush=True)
  return rows


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def device_description(**extra: Any) -> dict[str, Any]:
  device = jax.devices()[0]
  return {"platform": device.platform, "device_kind": getattr(device, "device_kind", ""),
          "compute_capability": str(getattr(device, "compute_capability", "")),
          "jax": jax.__version__, "python": host_platform.python_version(),
          "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")} | extra


def parser(prog: str, doc: str, budget_s: float) -> argparse.ArgumentParser:
  """The options every device check takes."""
  p = argparse.ArgumentParser(prog=prog, description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dry-run", action="store_true",
                 help="CPU, Pallas interpret mode, tiny sizes: checks the script itself")
  p.add_argument("--json", type=pathlib.Path, help="write every row and the device here")
  p.add_argument("--budget-s", type=float, default=budget_s, help="seconds for the timing phase")
  p.add_argument("--skip-conformance", action="store_true")
  return p


def write_report(path: pathlib.Path | None, report: dict) -> None:
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
