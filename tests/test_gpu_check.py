"""The GPU check script dry-runs on the CPU: interpret mode, tiny sizes, every phase and the report."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_dry_run_checks_times_and_reports(tmp_path, capsys):
  path = tmp_path / "gpu_check.json"
  assert gpu_check.main(["--dry-run", "--json", str(path)]) == 0
  report = json.loads(path.read_text())
  assert report["dry_run"] is True

  checks = report["conformance"]
  assert {c["dtype"] for c in checks} == {"bfloat16", "float16", "float32"}
  for check in checks:
    assert check["passed"], check
    assert check["kernel"] == "pallas-gpu (interpret)"
    assert set(check["errors"]) == {"out", "dq", "dk", "dv"}

  timed = {(r["impl"], r["pass"]): r for r in report["timing"]}
  assert set(timed) == {(impl, p) for impl in gpu_check.IMPLS for p in gpu_check.PASSES}
  for impl in ("flash_pallas", "xla"):  # cuDNN needs a GPU; jax's mha may be absent
    for pass_ in gpu_check.PASSES:
      row = timed[(impl, pass_)]
      assert row["status"] == "ok", row
      assert row["seconds"] > 0 and row["tflops"] > 0

  out = capsys.readouterr().out
  assert "| tokens | head_dim | causal | pass |" in out
  assert report["table"] in out


def test_flops_count_causal_as_half_and_backward_as_two_and_a_half_more():
  full = gpu_check.flops(1, 2, 1024, 64, False, "fwd")
  assert full == 4 * 2 * 1024 * 1024 * 64
  assert gpu_check.flops(1, 2, 1024, 64, True, "fwd") == full / 2
  assert gpu_check.flops(1, 2, 1024, 64, False, "fwd+bwd") == 3.5 * full


def test_markdown_reports_ratio_to_cudnn():
  measured = {"flash_pallas": 300.0, "cudnn": 400.0, "xla": 50.0, "pallas_mha": 200.0}
  rows = [{"impl": impl, "seq_len": 8192, "head_dim": 128, "causal": True, "pass": "fwd+bwd",
           "status": "ok", "tflops": tflops} for impl, tflops in measured.items()]
  table = gpu_check.markdown(rows)
  assert table.splitlines()[-1] == "| 8192 | 128 | yes | fwd+bwd | 300 | 400 | 50 | 200 | 0.75 | 0.50 |"
