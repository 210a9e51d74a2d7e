"""The TPU check script dry-runs on the CPU (interpreted kernels, tiny sizes): every phase and
the report; its FLOP counts and chip table are checked against independent counts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import tpu_check
from flash_layers.testing import reference64


def test_dry_run_checks_times_and_reports(tmp_path, capsys):
  path = tmp_path / "tpu_check.json"
  assert tpu_check.main(["--dry-run", "--json", str(path)]) == 0
  report = json.loads(path.read_text())
  assert report["dry_run"] is True
  assert report["device"]["versions"]["jax"] == report["device"]["jax"]

  checks = report["conformance"]
  assert {(c["impl"], c["dtype"]) for c in checks} == {("flash_pallas", "float32"),
                                                       ("jax_splash", "float32")}
  for check in checks:
    assert check["passed"], check
    assert check["kernel"] == tpu_check.KERNELS[check["impl"]] + " (interpret)"
    assert set(check["errors"]) == {"out", "dq", "dk", "dv"}

  timed = {(r["impl"], r["pass"]): r for r in report["timing"]}
  assert set(timed) == {(impl, p) for impl in tpu_check.IMPLS for p in tpu_check.PASSES}
  for row in timed.values():
    assert row["status"] == "ok", row
    assert row["seconds"] > 0 and row["tflops"] > 0 and row["mfu"] is None  # no peak for a CPU
    assert (row["heads"], row["kv_heads"], row["head_dim"]) == (8, 2, 128)

  out = capsys.readouterr().out
  assert "| mask | tokens | pass |" in out
  assert report["table"] in out


@pytest.mark.parametrize("mask", tpu_check.MASKS)
def test_visible_pairs_match_the_float64_oracle_mask(mask):
  length = 1024
  kwargs = tpu_check.mask_kwargs(mask, 1, length, tpu_check.Plan())
  ids = np.asarray(kwargs["segment_ids"]) if "segment_ids" in kwargs else None
  visible = reference64.mask(1, length, length, causal=kwargs.get("causal", False),
                             window=kwargs.get("window"), segment_ids=ids)
  assert tpu_check.visible_pairs(mask, length) == int(visible.sum())


def test_flops_and_mfu_table():
  assert tpu_check.flops(2, 8, 128, 1000, "fwd") == 4 * 2 * 8 * 128 * 1000
  assert tpu_check.flops(2, 8, 128, 1000, "fwd+bwd") == 3.5 * 4 * 2 * 8 * 128 * 1000
  assert tpu_check.generation("TPU v5 lite") == "v5e" and tpu_check.generation("TPU v6e") == "v6e"
  assert tpu_check.PEAK_BF16_TFLOPS["v5e"] == 197.0
  rows = [{"impl": impl, "mask": "causal", "seq_len": 4096, "pass": "fwd", "status": "ok",
           "seconds": seconds, "tflops": tflops, "mfu": tflops / 197.0}
          for impl, seconds, tflops in (("flash_pallas", 0.002, 98.5), ("jax_splash", 0.003, 65.7),
                                        ("xla_native", 0.004, 49.2))]
  assert tpu_check.markdown(rows).splitlines()[-1] == (
      "| causal | 4096 | fwd | 2 (98.5, 50%) | 3 (65.7, 33%) | 4 (49.2, 25%) | 1.50 |")


def test_repeated_step_runs_inner_times_on_shifted_inputs():
  """The timed executable applies the step `inner` times, the i-th on q shifted by i * 1e-3 (so
  nothing is hoisted), and returns the last step's result."""
  calls = []

  def step(q, k):
    calls.append(None)  # traced once per distinct call site: the first step and the loop body
    return q * k

  q, k = jnp.zeros((4,), jnp.float32), jnp.full((4,), 2.0)
  out = tpu_check._repeated(step, 3)(q, k)
  np.testing.assert_allclose(np.asarray(out), 2 * 2e-3, rtol=1e-6)
  assert len(calls) == 2
  assert tpu_check._repeated(step, 1) is step
  text = str(jax.make_jaxpr(tpu_check._repeated(step, 3))(q, k))
  assert "while" in text or ("scan" in text and "unroll=1" in text)  # one loop, not unrolled
