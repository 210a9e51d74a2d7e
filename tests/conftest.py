"""Test-wide settings: CPU only, quiet libtpu, float64 references available, caches of our own."""

import atexit
import os
import shutil
import tempfile

# Set before jax is imported: tests run on the CPU; libtpu (installed for TPU
# ahead-of-time compiles) must not try to claim a TPU or print warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Compile for the CPU without LLVM's optimisation passes: most of a test's time is compiling
# programs it runs once (an interpreted kernel is an XLA program of thousands of ops), and this
# takes a quarter to a third off that. It changes no HLO pass, so memory analyses and HLO checks
# see the same programs; numerics stay IEEE (XLA's CPU fast-math is off either way). TPU compiles
# (libtpu reads LIBTPU_INIT_ARGS, not XLA_FLAGS) are untouched; subprocesses that set their own
# XLA_FLAGS replace it: they take theirs from subprocess_xla_flags, which keeps it.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_CPU_COMPILE).strip()


def subprocess_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test's child process: `devices` simulated CPU devices, compiled as above."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_CPU_COMPILE}"

# pytest -n 2 runs tests in two processes; each may load libtpu for AOT compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Hermetic caches: what train.py, eval.py and the benchmarks started by tests write to the user's
# cache (JAX's compilation cache, generated datasets) goes to a directory of this test process,
# deleted at exit, never to ~/.cache (training.compile_cache.cache_root reads this variable).
_CACHE = tempfile.mkdtemp(prefix="flash_layers-test-cache-")
os.environ["FLASH_LAYERS_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# The autotuner's cache (flash_layers/tuning): a directory of this test process's own, never the
# user's ~/.cache, and no shipped tables, so "auto" follows its fixed rule in every other test.
_TUNING_DIR = tempfile.mkdtemp(prefix="fl-tuning-")
atexit.register(shutil.rmtree, _TUNING_DIR, True)
os.environ["FLASH_LAYERS_TUNING_DIR"] = _TUNING_DIR
os.environ["FLASH_LAYERS_TUNING_SHIPPED"] = "0"


# Scheduling only: the longest tests start first, so that `pytest -n 2` does not end with one
# worker running a minute-long test while the other idles. Seconds as measured on the 2-core CI VM
# under -n 2 (`--durations`); a stale figure changes the order, never a result. Tests that share an
# expensive module fixture (test_training's reference_run) stay in file order with their module.
LONG_TESTS = {
    "tests/test_parallel.py::test_sharded_equals_unsharded[flash_pallas]": 120,
    "tests/test_training.py::test_four_device_checkpoint_restores_on_two_devices": 87,
    "tests/test_training.py::test_pod_dry_run_compiles_for_two_v5p_2x2x2_slices": 85,
    "tests/test_training.py::test_two_processes_reach_the_loss_of_one": 83,
    "tests/test_tpu_strict.py::test_tpu_kernels_conform_under_the_strict_interpreter"
    "[strict_causal_packed_gqa_d128_alibi]": 80,
    "tests/test_bench.py::test_quick_grid_writes_every_cell_json_and_plots": 78,
    "tests/test_training.py::test_long_docs_config_smoke_trains_on_one_cpu_device": 73,
    "tests/test_parallel.py::test_sharded_equals_unsharded[xla_chunked]": 70,
    "tests/test_memory.py::test_training_memory_plateaus": 69,
    "tests/test_masks.py::test_block_map_matches_brute_force": 50,
    "tests/test_tpu_strict.py::test_tpu_kernels_conform_under_the_strict_interpreter"
    "[strict_window_dropout_packed_gqa]": 48,
    "tests/test_parallel.py::test_sharded_equals_unsharded[reference]": 41,
    "tests/test_conformance.py::test_interpreted_cases_on_random_configs[flash_pallas-tpu]": 35,
    "tests/test_tpu_check.py::test_dry_run_checks_times_and_reports": 35,
    "tests/test_parallel.py::test_multiprocess_sharded_and_ring_agree_with_single_process": 34,
    "tests/test_tpu_aot.py::test_float32_head_dim_256_fits_the_generations_vmem[v6e]": 34,
}


# flax's own test files, run against our layers by tests/test_flax_upstream.py (not collected as they are).
collect_ignore = ["flax_upstream"]


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: -LONG_TESTS.get(item.nodeid, 0))  # stable: the rest keep their order
