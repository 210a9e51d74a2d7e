"""The benchmark command: its grid, its work counts, its outputs (never its timings)."""

import json
import os

import numpy as np
import pytest

import flash_layers as fl
from benchmarks import __main__ as bench_main
from benchmarks import cases, harness, report

REQUIRED = {"impl", "seq_len", "mask", "dtype", "pass", "status"}
STATUSES = {"ok", "unsupported", "not run", "oom", "error"}


def _numpy_visible(kind: str, batch: int, seq_len: int) -> np.ndarray:
  """An independent statement of each mask kind, [batch, q, kv]."""
  i = np.arange(seq_len)[:, None]
  j = np.arange(seq_len)[None, :]
  ok = np.ones((batch, seq_len, seq_len), dtype=bool)
  if kind == "causal":
    ok &= j <= i
  if kind == "window":
    ok &= np.abs(i - j) <= cases.WINDOW
  if kind == "packed":
    seg = cases.doc_segment_ids(batch, seq_len)
    ok &= seg[:, :, None] == seg[:, None, :]
  return ok


@pytest.mark.parametrize("kind", cases.MASK_KINDS)
def test_visible_work_counts_pairs_and_tiles(kind):
  batch, seq_len, block = 2, 1024, 128
  vis = _numpy_visible(kind, batch, seq_len)
  pairs, tiles = cases.visible_work(cases.mask_kwargs(kind, batch, seq_len), batch, seq_len,
                                    (block, block))
  n = seq_len // block
  assert pairs == vis.sum()
  assert tiles == vis.reshape(batch, n, block, n, block).any(axis=(2, 4)).sum()


def test_packed_documents_fill_the_row_with_bounded_lengths():
  seg = cases.doc_segment_ids(3, 4096)
  assert seg.shape == (3, 4096) and seg.dtype == np.int32
  for row in seg:
    _, lengths = np.unique(row, return_counts=True)
    assert (np.diff(row) >= 0).all() and len(lengths) > 3
    assert lengths[:-1].min() >= cases.DOC_LENGTHS[0] and lengths.max() <= cases.DOC_LENGTHS[1]


def test_flops_count_two_matmuls_forward_and_five_more_halves_backward():
  shape = cases.Shape(batch=1, heads=2, head_dim=8)
  assert cases.attention_flops(10, shape, "fwd") == 4 * 10 * 2 * 8
  assert cases.attention_flops(10, shape, "fwd+bwd") == 3.5 * 4 * 10 * 2 * 8


def test_quick_grid_writes_every_cell_json_and_plots(tmp_path, capsys):
  json_path, plot_dir = tmp_path / "rows.json", tmp_path / "plots"
  # A dense impl, the chunked one and the interpreted kernels: each kind of row (CI time).
  impls = ("reference", "xla_chunked", "flash_pallas")
  assert bench_main.main(["--quick", "--impls", ",".join(impls), "--json", str(json_path),
                          "--plots", str(plot_dir)]) == 0
  table = capsys.readouterr().out
  rows = json.loads(json_path.read_text())
  assert table.count("\n") >= len(rows)  # header + one line per row

  cells = {(r["impl"], r["seq_len"], r["mask"], r["dtype"], r["pass"]) for r in rows}
  assert cells == {(i, n, m, "float32", p) for i in impls for n in (128, 256)
                   for m in ("causal", "packed") for p in cases.PASSES}
  for r in rows:
    assert r.keys() >= REQUIRED and r["status"] in STATUSES, r
    vis = _numpy_visible(r["mask"], r["batch"], r["seq_len"])
    assert r["visible_pairs"] == vis.sum()
    if r.get("blocks_ideal") is not None:
      # An exact-or-conservative block map visits every tile holding a visible pair.
      assert r["blocks_total"] >= r["blocks_visited"] >= r["blocks_ideal"] >= r["blocks_lower_bound"] > 0
    if r["status"] == "ok":
      assert r["time_s"] > 0 and r["cpu_s"] >= 0 and r["runs"] >= 1 and r["temp_bytes"] >= 0
      assert r["gflops_per_s"] == pytest.approx(r["flops"] / r["time_s"] / 1e9)
  # The dense impls serve every mask kind here; they must have run.
  for r in rows:
    if r["impl"] == "reference":
      assert r["status"] == "ok", r
  pngs = sorted(os.listdir(plot_dir))
  assert pngs == sorted(f"{m}-float32-{p}.png" for m in ("time", "cpu-time", "memory")
                        for p in ("fwd", "fwd_bwd"))
  assert all((plot_dir / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_cells_over_the_memory_limit_are_compiled_not_run():
  config = harness.Config(impls=("reference",), lengths=(256,), masks=("full",),
                          passes=("fwd",), shape=cases.Shape(1, 2, 16), mem_limit_bytes=1)
  (row,) = harness.run_grid(config, harness.local_target())
  assert row["status"] == "not run" and "memory" in row["reason"]
  # A dense [heads, q, kv] float32 logits buffer at least.
  assert row["temp_bytes"] >= 2 * 256 * 256 * 4


def test_unsupported_cells_are_reported_not_raised(monkeypatch):
  impl = fl.impls.REGISTRY["xla_native"]
  monkeypatch.setattr(impl, "unsupported", lambda request, platform: "everything (test)")
  config = harness.Config(impls=("xla_native",), lengths=(128,), masks=("causal",),
                          passes=("fwd",), shape=cases.Shape(1, 1, 8))
  (row,) = harness.run_grid(config, harness.local_target())
  assert row["status"] == "unsupported" and "everything (test)" in row["reason"]


def _row(impl, n, status="ok", temp=None, **extra):
  return {"impl": impl, "seq_len": n, "mask": "full", "dtype": "float32", "pass": "fwd",
          "target": "cpu", "status": status, "temp_bytes": temp, **extra}


def test_merge_keeps_measured_rows_and_takes_later_ones(tmp_path):
  first = [_row("reference", 512, time_s=1.0), _row("reference", 1024, "not run")]
  second = [_row("reference", 512, "not run"), _row("reference", 1024, time_s=2.0)]
  paths = []
  for i, rows in enumerate((first, second)):
    paths.append(str(tmp_path / f"{i}.json"))
    report.write_json(rows, paths[-1])
  merged = {r["seq_len"]: r for r in bench_main.merge(paths)}
  assert merged[512]["time_s"] == 1.0 and merged[1024]["time_s"] == 2.0


def test_targets_reads_memory_ratio_and_growth():
  mib = 2 ** 20
  rows = [_row("xla_chunked", 1024, temp=10 * mib), _row("xla_chunked", 4096, temp=40 * mib),
          _row("reference", 4096, temp=4000 * mib)]
  line = next(x for x in report.targets(rows).splitlines() if x.startswith("| xla_chunked"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[4:] == ["4096", "40.0", "4000", "100", "2.00"]  # 4x over two doublings: linear


def test_cpu_dense_runs_every_variant_side_by_side(tmp_path, capsys):
  """`python -m benchmarks.cpu_dense` on a tiny shape: one row per (variant, mask), ratios to flax."""
  from benchmarks import cpu_dense

  out = tmp_path / "dense.json"
  assert cpu_dense.main(["--shapes", "1x16x2x8", "--masks", "none,segments", "--rounds", "1",
                         "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert {(r["variant"], r["mask"]) for r in rows} == {
      (v, m) for v in cpu_dense.DEFAULT_VARIANTS for m in ("none", "segments")}
  assert all(r["cpu_ms"] >= 0 and r["auto_picks"] == "xla_dense" for r in rows)
  assert all(r["flax_cpu_over_ours"] == 1.0 for r in rows if r["variant"] == "flax")
  assert result["meta"]["cpus"] == os.cpu_count()
  assert "| [1, 16, 2, 8] | segments | fwd+bwd | xla_dense |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cpu_dense.main(["--shapes", "16x2x8"])


def test_cpu_dense_forward_pass_and_whole_call_variants(tmp_path):
  """`--passes fwd,fwd+bwd` and the `<impl>@whole` variants (the impl on the whole call, not looped)."""
  from benchmarks import cpu_dense

  out = tmp_path / "loop.json"
  assert cpu_dense.main(["--shapes", "2x16x2x8", "--masks", "segments", "--rounds", "1", "--passes",
                         "fwd,fwd+bwd", "--variants", "xla_chunked,xla_chunked@whole,xla_dense@whole",
                         "--json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert {(r["variant"], r["pass"]) for r in rows} == {
      (v, p) for v in ("xla_chunked", "xla_chunked@whole", "xla_dense@whole") for p in ("fwd", "fwd+bwd")}
  with pytest.raises(SystemExit):
    cpu_dense.main(["--passes", "bwd"])


def test_quickstart_benchmark_runs_readme_command_one_in_stages():
  from benchmarks import quickstart
  command = quickstart.readme_command()
  assert "train.py --config configs/quickstart.py" in command and quickstart.WORKDIR in command
  names = [name for name, _ in quickstart.stages(command)]
  assert names == ["install", "train", "eval"]
  install = dict(quickstart.stages(command))["install"]
  assert install.count("pip install") == 3


def test_eval_cost_e2e_summary_keeps_every_run_and_rounds_done(tmp_path):
  import argparse

  from benchmarks import eval_cost
  run = lambda cpu: {"cpu_s": cpu, "wall_s": 2 * cpu}
  runs = {512: {"cold": [run(10.0), run(12.0), run(11.0)], "warm": [run(8.0), run(9.0), run(7.0)]},
          4096: {"cold": [run(16.0), run(18.0), run(17.0)], "warm": [run(12.0), run(12.6), run(11.2)]}}
  args = argparse.Namespace(json=str(tmp_path / "e2e.json"), e2e_config="configs/quickstart.py", rounds=3)
  result = eval_cost._write_e2e(args, [512, 4096], runs, {512: {"accuracy": 1.0}})
  assert json.loads((tmp_path / "e2e.json").read_text())["summary"] == result["summary"]
  assert result["rounds_done"] == 3 and len(result["cases"]) == 4
  # ratios of the medians (17/11, 12/8), and per round
  assert result["summary"]["ratio_cpu_cold"] == round(17 / 11, 3)
  assert result["summary"]["ratio_cpu_warm"] == 1.5
  assert result["summary"]["ratio_cpu_warm_rounds"] == [1.5, 1.4, 1.6]
  # a run stopped mid-way: what finished is kept, no ratio without both lengths
  partial = {512: {"cold": [run(10.0)], "warm": []}, 4096: {"cold": [], "warm": []}}
  result = eval_cost._write_e2e(args, [512, 4096], partial, {})
  assert result["rounds_done"] == 0 and result["summary"] == {} and len(result["cases"]) == 1


def test_decode_cpu_times_both_layers_and_says_what_runs(tmp_path):
  """benchmarks/decode_cpu.py on a tiny case: both layers timed per step, the ratio of their medians, and
  "auto"'s choice for a decoding step (xla_dense on a CPU) recorded with each row."""
  from benchmarks import decode_cpu
  out = tmp_path / "decode.json"
  result = decode_cpu.main(["--cache-lens", "1024", "--batch", "1", "--features", "32", "--num-heads", "2",
                            "--steps", "3", "--warmup", "1", "--json", str(out)])
  (row,) = result["rows"]
  assert row["cache_len"] == 1024 and row["ours_runs"].startswith("xla_dense")
  assert row["first_index"] == 512  # half the cache written (--fill 0.5)
  for kind in ("flash_layers", "flax"):
    assert row[kind]["cpu_ms"] > 0 and row[kind]["wall_ms"] > 0
  assert row["ratio_cpu"] == round(row["flash_layers"]["cpu_ms"] / row["flax"]["cpu_ms"], 3)
  assert json.loads(out.read_text())["rows"] == result["rows"]
