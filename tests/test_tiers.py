"""The default tier keeps what docs/testing.md promises, and stays fast (from recorded durations, never a
live clock).

tests/durations.json holds each test's wall seconds as measured on the 2-core CI VM under `-n 2`;
refresh it with `python -m pytest -n 2 -q --write-durations` (then again with `-m slow`), as
docs/testing.md says. This test collects the default tier (pyproject's `-m "not slow"`) and asserts:
- every default-tier test has a recorded duration (a new test is measured before it lands);
- every one recorded above LONG_S seconds is listed in LONG_DEFAULT with the reason it is worth it,
  and every listed one is still there and still long (the list cannot go stale);
- the recorded default tier fits BUDGET_S of wall time on WORKERS workers, less OVERHEAD_S for
  collection, worker start-up and the last test's tail (measured: 19 s over the tests' own time in a
  2-worker run with no ordering).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import profile_plugin
import pytest
import test_conformance as conformance
import tiering

ROOT = Path(__file__).resolve().parent.parent
LONG_S = 10.0
WORKERS = 2
BUDGET_S = 12 * 60
OVERHEAD_S = 45

# Default-tier tests that take more than LONG_S, and why each earns its place there (the cheapest
# test that proves the property it names; its large version is in the second tier).
LONG_DEFAULT: dict[str, str] = {
    "tests/test_training.py::test_train_then_eval_end_to_end":
        "runs the module's reference training run (train.py in a subprocess; the first test to read it "
        "pays it), which the libtpu-quiet, eval and predict tests then read",
    "tests/test_tiers.py::test_default_tier_keeps_what_the_rule_names":
        "collects the default tier in a subprocess (both tests of the module read it)",
    "tests/test_docs_snippets.py::test_snippet_runs[docs/contract.md:7]":
        "the contract page's examples, one chain (every documented call runs)",
    "tests/test_context_parallel.py::test_every_strategy_on_eight_devices_in_one_process":
        "every context-parallel strategy on 8 devices, in one interpreter",
    "tests/test_mask_mods.py::test_named_mask_mods_equal_the_builtin_arguments_in_our_kernels[causal-tpu]":
        "the TPU kernel family's mask_mod path (interpreted, forward and backward)",
    "tests/test_mask_mods.py::test_our_tpu_kernels_take_a_block_masks_tiles_and_reuse_its_flags":
        "a user's BlockMask reaching the TPU kernels' grid (interpreted)",
    "tests/test_parallel.py::test_ring_flash_pallas_compiles_for_v5p_slice":
        "the ring with our Mosaic kernels compiled for a v5p slice",
    "tests/test_tpu_strict.py::test_tpu_kernels_conform_under_the_strict_interpreter_on_one_walk":
        "the forward and both backward TPU kernels under the strict interpreter (races, megacore)",
}


def _collect(*args: str, returncode: int = 0) -> str:
  """`pytest --collect-only -q ARGS` in a subprocess, with the repository's own addopts (the tiers);
  its output, once its exit status is `returncode` (5: nothing selected)."""
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                         *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
                        | {"PYTHONPATH": str(ROOT)})
  assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.fixture(scope="module")
def default_tier() -> list[str]:
  return [line for line in _collect().splitlines() if "::" in line]


def test_default_tier_is_measured_and_fits_its_budget(default_tier):
  tests = default_tier
  seconds = profile_plugin.load_durations()
  missing = [t for t in tests if t not in seconds]
  assert not missing, (f"{len(missing)} default-tier tests have no recorded duration (refresh "
                       f"tests/durations.json: python -m pytest -n 2 -q --write-durations): {missing[:20]}")
  long = {t for t in tests if seconds[t] > LONG_S}
  unlisted = sorted(long - set(LONG_DEFAULT))
  assert not unlisted, (f"default-tier tests over {LONG_S:.0f} s need a reason in LONG_DEFAULT or the "
                        f"`slow` mark: {[(t, seconds[t]) for t in unlisted]}")
  stale = sorted(set(LONG_DEFAULT) - long)
  assert not stale, f"LONG_DEFAULT lists tests that are gone, slow-marked or no longer long: {stale}"
  total = sum(seconds[t] for t in tests)
  assert total <= WORKERS * (BUDGET_S - OVERHEAD_S), (
      f"the default tier records {total:.0f} s of tests: over {WORKERS} workers x ({BUDGET_S} - "
      f"{OVERHEAD_S}) s; move large cases to the second tier (docs/testing.md)")


# What the default tier must hold (docs/testing.md), each as test ids of which at least one must be in it.
KEPT = {
    "a Mosaic AOT compile of the forward, dK/dV and dQ kernels":
        r"test_tpu_aot\.py::test_compiles_to_mosaic_kernels_with_analytic_flops\[.*grad",
    "a Mosaic AOT compile of the decode kernel":
        r"test_tpu_aot\.py::test_(decoding_queries_compile_to_the_split_kv|a_decoding_step_compiles_to_our)",
    "a Mosaic AOT compile of the paged kernel": r"test_paged_tpu\.py::test_compiles_to_our_mosaic_kernel",
    "a Triton lowering of the forward and backward kernels":
        r"test_gpu_lowering\.py::test_forward_and_backward_lower_to_our_triton_kernels",
    "a Triton lowering of the decode kernel":
        r"test_gpu_lowering\.py::test_(decoding_queries_lower_to_the_split_kv|a_decoding_step_lowers_to_our)",
    "a Triton lowering of the paged kernel": r"test_paged_gpu\.py::test_lowers_to_our_triton_kernel",
    "every context-parallel strategy on 8 devices":
        r"test_context_parallel\.py::test_every_strategy_on_eight_devices_in_one_process$",
    "the strict interpreter": r"test_tpu_strict\.py::test_tpu_kernels_conform_under_the_strict_interpreter",
    "a grid-point recorder": r"test_tpu_grid\.py::test_executed_grid_points",
    "training end to end": r"test_training\.py::test_train_then_eval_end_to_end$",
}


def test_default_tier_keeps_what_the_rule_names(default_tier):
  missing = [what for what, pattern in KEPT.items() if not any(re.search(pattern, t) for t in default_tier)]
  assert not missing, f"the default tier lost: {missing}"
  modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")}
  empty = sorted(modules - {t.split("::")[0] for t in default_tier})
  assert not empty, f"modules with no default-tier test: {empty}"
  # Every impl and interpret platform: forward and gradients against the float64 oracle, on a
  # configuration it serves, in float32 and in bfloat16.
  for case in conformance.CASES:
    for dtype in ("float32", "bfloat16"):
      served = [c.name for c in conformance.CONFIGS
                if not c.features() & set(conformance.REFUSED.get(case, ()))]
      ids = {f"tests/test_conformance.py::test_conforms[{conformance._case_id(case)}-{name}-{dtype}]"
             for name in served}
      assert ids & set(default_tier), f"no default-tier {dtype} conformance case for {case}"


def test_a_cases_tier_does_not_depend_on_the_selection():
  # A covering array's second-tier case, selected alone by its id, is still second tier: the array is
  # built over every case of the function, not over the ones a command line selected.
  function = "tests/test_paged.py::test_float32_matches_oracle"
  second = f"{function}[heads_first-reference]"
  assert function in tiering.COVERINGS
  kept = [line for line in _collect(function).splitlines() if line.startswith(function + "[")]
  assert kept and second not in kept
  alone = _collect(second, returncode=5)
  assert "1 deselected" in alone and "::" not in alone, alone[-2000:]
