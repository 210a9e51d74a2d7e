"""Mutation check: the fast default test tier catches deliberately injected bugs.

Each mutant below is one small, realistic edit to a file under flash_layers/ (an off-by-one at a tile
edge, a wrong GQA head mapping, a ring rotating the wrong way, ...), written as an exact string
replacement, with the few default-tier tests that must catch it. For each mutant the script

1. checks that the old text occurs exactly once in the file (a mutant whose code moved fails loudly
   instead of silently testing nothing), and applies the edit;
2. runs ``python -m pytest -q -x -p no:cacheprovider -m "not slow" <its tests>`` in a subprocess, under
   a timeout, with bytecode writing off;
3. restores the file byte for byte and its modification time in a ``finally`` (also on Ctrl-C and
   SIGTERM), and checks the restored file's SHA-256 against the original's;
4. records whether the tests failed (the mutant is caught: pytest's exit status 1) and the wall time.

Before any mutant, the union of the selected tests runs once on the unmutated tree (the same command
without -x): a mutant whose tests fail there, or none of whose tests ran (all marked slow since), is
reported as such and not counted as caught. A table is printed and the results are written to
benchmarks/results/mutants-<date>.json. The exit status is 0 only when every mutant was caught.

    python tests/mutants.py                     # every mutant (a few minutes on one core)
    python tests/mutants.py window_edge ring_rotation_direction   # a subset
    python tests/mutants.py --list              # names, files, edits and test selections

Not a pytest module (its name does not start with test_): it edits the package it tests, so it must
never run inside a test session, nor beside another test run on the same working tree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_TIMEOUT_S = 600
PYTEST = ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow")
CONFORMS = "tests/test_conformance.py::test_conforms"


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One injected bug: replace `old` (which must occur exactly once in `path`) by `new`."""

  name: str
  path: str  # relative to the repository root
  old: str
  new: str
  tests: tuple[str, ...]  # pytest node ids (or files) of the default tier that must fail
  bug: str  # what the edit breaks, in words


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="tile_edge_padding",
        path="flash_layers/impls/xla_chunked.py",
        old="(kv_idx < st.request.kv_len)[None, :]",
        new="(kv_idx <= st.request.kv_len)[None, :]",
        tests=("tests/test_xla_chunked.py::test_many_small_chunks[cross_7_to_128]",),
        bug="off-by-one at the last kv chunk's edge: the first padding key of a ragged chunk is visible"),
    Mutant(
        name="tile_visible_causal_edge",
        path="flash_layers/contract/block_info.py",
        old="    vis = vis & (ks <= qe)",
        new="    vis = vis & (ks < qe)",
        tests=("tests/test_xla_chunked.py::test_traced_global_offsets[offsets2]",),
        bug="causal tile test off by one: a tile whose first key is its q block's last query is skipped"),
    Mutant(
        name="split_kv_merge",
        path="flash_layers/impls/flash_pallas/decode.py",
        old=".sum(axis=-3) / jnp.where(total > 0, total, 1.0)[..., None]",
        new=".sum(axis=-3)",
        tests=(f"{CONFORMS}[flash_pallas-gpu-decode_ragged_causal_1k_gqa-float32]",
               f"{CONFORMS}[flash_pallas-tpu-decode_ragged_causal_1k_gqa-float32]"),
        bug="split-KV decode merges the splits' outputs without dividing by the summed weights"),
    Mutant(
        name="segment_tile_boundary",
        path="flash_layers/contract/block_info.py",
        old="ids_overlap = (q_info.lo <= kv_info.hi)",
        new="ids_overlap = (q_info.lo < kv_info.hi)",
        tests=("tests/test_masks.py::test_block_map_edge_cases[packed_causal]",
               "tests/test_xla_chunked.py::test_many_small_chunks[len200_batch3_packed]"),
        bug="segment-id tile flag: a document crossing a tile boundary does not make the next tile visible"),
    Mutant(
        name="gqa_head_mapping",
        path="flash_layers/impls/flash_pallas/tpu_grid.py",
        old="jax.lax.div(q_head, self.group)",
        new="jax.lax.rem(q_head, self.heads // self.group)",
        tests=(f"{CONFORMS}[flash_pallas-tpu-sinks_orphans_causal_gqa_batch2-float32]",
               "tests/test_interpret_mesh.py::test_tpu_interpret_under_a_mesh_runs_and_matches[gqa-data-mesh]"),
        bug="TPU forward grid maps query head h to kv head h % kv_heads (interleaved) instead of h // group"),
    Mutant(
        name="ring_rotation_direction",
        path="flash_layers/parallel/ring.py",
        old="perm = [(i, (i + config.group) % devices)",
        new="perm = [(i, (i - config.group) % devices)",
        tests=("tests/test_context_parallel.py::test_every_strategy_on_eight_devices_in_one_process",),
        bug="the ring passes K/V to the previous device while step i assumes the shard of device me - i"),
    Mutant(
        name="ring_lse_merge",
        path="flash_layers/parallel/ring.py",
        old="total = jnp.logaddexp(lse_acc, lse)",
        new="total = jnp.maximum(lse_acc, lse)",
        tests=("tests/test_context_parallel.py::test_every_strategy_on_eight_devices_in_one_process",),
        bug="the ring combines its steps' logsumexps by max instead of log-add-exp"),
    Mutant(
        name="page_boundary",
        path="flash_layers/impls/paged/xla_chunked.py",
        old="pages_to_stop = -(-stop // spec.page_size)",
        new="pages_to_stop = stop // spec.page_size",
        tests=("tests/test_paged.py::test_xla_chunked_walks_pages_chunk_by_chunk[ragged_gqa]",
               "tests/test_paged.py::test_float32_matches_oracle[ragged_gqa-xla_chunked]"),
        bug="paged walk rounds the last page down: a sequence's partly filled last page is never read"),
    Mutant(
        name="int8_scale",
        path="flash_layers/contract/paged.py",
        old='"int8": 127.0',
        new='"int8": 128.0',
        tests=("tests/test_paged.py::test_quantize_round_trip_error",),
        bug="int8 quantization scales by absmax / 128: the largest element rounds to 128 and clips to 127"),
    Mutant(
        name="int8_v_scale_in_kernel",
        path="flash_layers/impls/flash_pallas/tpu_paged.py",
        old="p = p * jnp.where(ok_row, bufs[3][slot]",
        new="p = p * jnp.where(ok_row, bufs[2][slot]",
        tests=("tests/test_paged.py::test_quantized_pages[ragged_gqa-flash_pallas-tpu-int8]",),
        bug="TPU paged kernel dequantizes int8 values with the keys' scales"),
    Mutant(
        name="window_edge",
        path="flash_layers/contract/mask_rules.py",
        old="(kv_pos <= q_pos + right)",
        new="(kv_pos < q_pos + right)",
        tests=(f"{CONFORMS}[xla_chunked-window_int-float32]",
               "tests/test_xla_chunked.py::test_many_small_chunks[window_asymmetric]"),
        bug="window rule q + right excluded (< instead of <=)"),
    Mutant(
        name="dropout_stream_offset",
        path="flash_layers/impls/flash_pallas/scalar_table.py",
        old="self.streams + batch * self.num_heads + head",
        new="self.streams + batch + head",
        tests=("tests/test_dropout.py::test_block_sizes_do_not_change_the_result",),
        bug="kernels read the dropout stream of (batch row, head) at the wrong offset: rows share streams"),
    Mutant(
        name="online_softmax_rescale",
        path="flash_layers/impls/xla_chunked.py",
        old="acc = correction[..., None] * acc + ",
        new="acc = acc + ",
        tests=("tests/test_xla_chunked.py::test_many_small_chunks[cross_7_to_128]",
               "tests/test_xla_chunked.py::test_lse_cotangent_and_rows_without_keys"),
        bug="online softmax forgets to rescale the output accumulator when the running max grows"),
)


@dataclasses.dataclass
class Run:
  """One pytest subprocess: its exit status, wall time, failed (and, for the baseline, passed) tests
  and output tail."""

  returncode: int | None  # None: killed at the timeout
  seconds: float
  failed: list[str]
  passed: list[str]
  tail: str


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def run_tests(tests: Sequence[str], timeout: float, baseline: bool = False) -> Run:
  """pytest on `tests` in a child process of its own session, so a timeout or Ctrl-C ends the whole
  process group (tests start worker subprocesses of their own). baseline=True drops -x, so that every
  broken test is named, and lists the passed tests too (-rA), so that a selection the marker filter
  emptied shows."""
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
  options = [a for a in PYTEST if a != "-x"] + ["-rA"] if baseline else list(PYTEST)
  command = [sys.executable, *options, *tests]
  start = time.perf_counter()
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=timeout)
    returncode: int | None = proc.returncode
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    output, _ = proc.communicate()
    returncode = None
  except BaseException:  # KeyboardInterrupt, SystemExit from SIGTERM: stop the tests, then restore
    _kill_group(proc)
    proc.communicate()
    raise
  seconds = time.perf_counter() - start
  failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output or "", flags=re.MULTILINE)
  passed = re.findall(r"^PASSED (\S+)", output or "", flags=re.MULTILINE)
  return Run(returncode, seconds, failed, passed, (output or "")[-3000:])


def _kill_group(proc: subprocess.Popen) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)  # the group this script started (start_new_session)


def _status(returncode: int | None) -> str:
  """A mutant run's verdict from pytest's exit status: only 1 (tests failed) means caught."""
  if returncode == 1:
    return "caught"
  if returncode is None:
    return "timeout"
  if returncode == 0:
    return "NOT CAUGHT"
  if returncode == 5:
    return "no test ran (deselected as slow?)"
  return f"error (pytest exit {returncode})"  # 2: collection error or interrupted, 3, 4: usage


@contextlib.contextmanager
def mutated(mutant: Mutant) -> Iterator[None]:
  """The file with the mutant's edit applied; restored byte for byte (and its mtime) on exit."""
  path = ROOT / mutant.path
  original = path.read_bytes()
  digest = _sha256(original)
  stat = path.stat()
  text = original.decode("utf-8")
  count = text.count(mutant.old)
  if count != 1:
    raise RuntimeError(f"mutant {mutant.name}: the old text occurs {count} times in {mutant.path} "
                       f"(must be exactly once; the code moved?): {mutant.old!r}")
  try:
    path.write_bytes(text.replace(mutant.old, mutant.new).encode("utf-8"))
    yield
  finally:
    path.write_bytes(original)
    # The original mtime back: a .pyc written while the mutant was in place (if bytecode writing
    # were on) records the mutant's mtime and size, so it can never pass for the restored source.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    restored = _sha256(path.read_bytes())
    if restored != digest:
      raise RuntimeError(f"{mutant.path} was not restored: sha256 {restored} != {digest}")


def _covers(selection: str, nodeid: str) -> bool:
  """Does a selection entry (a node id or a file) include the test `nodeid`?"""
  return nodeid == selection or nodeid.startswith(selection + "::") or nodeid.startswith(selection + "[")


def _sigterm(signum, frame) -> None:
  raise SystemExit(128 + signum)  # unwinds through the finally blocks: the file is restored


def _git_commit() -> str | None:
  try:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def _select(names: Sequence[str]) -> list[Mutant]:
  by_name = {m.name: m for m in MUTANTS}
  unknown = [n for n in names if n not in by_name]
  if unknown:
    raise SystemExit(f"unknown mutant(s) {unknown}; known: {sorted(by_name)}")
  return [by_name[n] for n in names] if names else list(MUTANTS)


def _print_list(mutants: Sequence[Mutant]) -> None:
  for m in mutants:
    print(f"{m.name}\n  file:  {m.path}\n  edit:  {m.old!r} -> {m.new!r}\n  bug:   {m.bug}")
    for test in m.tests:
      print(f"  test:  {test}")


def _print_table(rows: Sequence[dict]) -> None:
  header = ("mutant", "file", "result", "seconds", "caught by")
  lines = [(r["name"], r["file"], r["status"], f"{r['seconds']:.1f}", ", ".join(r["failed_tests"]) or "-")
           for r in rows]
  widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
  widths[-1] = len(header[-1])  # the last column runs on
  for line in (header, tuple("-" * w for w in widths), *lines):
    print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
  parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
  parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                      help=f"seconds per pytest run (default {DEFAULT_TIMEOUT_S}); a run killed at the "
                           "timeout counts as not caught")
  parser.add_argument("--json", type=Path, default=None,
                      help="where to write the results (default benchmarks/results/mutants-<date>.json)")
  args = parser.parse_args(argv)
  mutants = _select(args.names)
  if args.list:
    _print_list(mutants)
    return 0
  signal.signal(signal.SIGTERM, _sigterm)
  for m in mutants:  # every mutant must still apply before anything runs
    count = (ROOT / m.path).read_text().count(m.old)
    if count != 1:
      raise SystemExit(f"mutant {m.name}: the old text occurs {count} times in {m.path} (must be once)")

  started = time.perf_counter()
  selection = list(dict.fromkeys(t for m in mutants for t in m.tests))
  print(f"baseline: {len(selection)} test selection(s) on the unmutated tree", flush=True)
  baseline = run_tests(selection, args.timeout, baseline=True)
  broken = set(baseline.failed)  # empty when pytest failed otherwise (a test id not found, a timeout)
  baseline_ok = baseline.returncode == 0
  print(f"baseline: {'passed' if baseline_ok else 'FAILED'} in {baseline.seconds:.1f}s", flush=True)
  if not baseline_ok:
    print(baseline.tail)

  rows = []
  for m in mutants:
    row = {"name": m.name, "file": m.path, "old": m.old, "new": m.new, "bug": m.bug, "tests": list(m.tests)}
    if not baseline_ok and (not broken or any(_covers(t, f) for t in m.tests for f in broken)):
      row.update(status="selection broken", caught=False, returncode=None, seconds=0.0, failed_tests=[])
      rows.append(row)
      print(f"{m.name}: skipped, its tests fail on the unmutated tree", flush=True)
      continue
    if not any(_covers(t, p) for t in m.tests for p in baseline.passed):
      row.update(status="no test ran (deselected as slow?)", caught=False, returncode=None, seconds=0.0,
                 failed_tests=[])
      rows.append(row)
      print(f"{m.name}: skipped, none of its tests ran on the unmutated tree", flush=True)
      continue
    print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}", flush=True)
    with mutated(m):
      run = run_tests(m.tests, args.timeout)
    status = _status(run.returncode)
    caught = status == "caught"
    row.update(status=status, caught=caught, returncode=run.returncode, seconds=round(run.seconds, 1),
               failed_tests=run.failed)
    if not caught:
      row["output_tail"] = run.tail
    rows.append(row)
    print(f"{m.name}: {status} in {run.seconds:.1f}s {run.failed}", flush=True)

  total = time.perf_counter() - started
  all_caught = baseline_ok and all(r["caught"] for r in rows)
  print()
  _print_table(rows)
  print(f"\n{sum(r['caught'] for r in rows)} of {len(rows)} mutants caught; baseline "
        f"{'passed' if baseline_ok else 'FAILED'} ({baseline.seconds:.1f}s); total {total:.1f}s")

  today = datetime.date.today()
  out = args.json or RESULTS_DIR / f"mutants-{today.isoformat()}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  report = {
      "date": today.isoformat(), "commit": _git_commit(), "python": sys.version.split()[0],
      "command": shlex.join(["python", *PYTEST]) + " <tests>",
      "baseline": {"tests": selection, "passed": baseline_ok, "returncode": baseline.returncode,
                   "seconds": round(baseline.seconds, 1), "failed_tests": baseline.failed,
                   "passed_tests": baseline.passed},
      "mutants": rows, "mutants_count": len(rows), "caught_count": sum(bool(r["caught"]) for r in rows),
      "all_caught": all_caught, "total_seconds": round(total, 1),
  }
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
  return 0 if all_caught else 1


if __name__ == "__main__":
  try:
    sys.exit(main())
  except KeyboardInterrupt:  # the mutated file was restored on the way out (`mutated`)
    print("interrupted", file=sys.stderr)
    sys.exit(130)
