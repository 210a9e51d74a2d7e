"""Test-wide settings: CPU only, quiet libtpu, float64 references available, caches of our own."""

import atexit
import os
import shutil
import tempfile

import profile_plugin  # tests/ is on sys.path (pytest's rootdir-relative conftest import)
import pytest
import tiering

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


# Two tiers (docs/testing.md). The default tier, which the README's test command and CI's first step
# run, is every test not marked `slow` (pyproject's addopts: -m "not slow"); the second tier,
# `python -m pytest -n 2 -q -m slow`, holds the large and exhaustive versions, and CI runs it too.
#
# Scheduling only: tests recorded in tests/durations.json at LONG_TEST_S or more start first, longest
# first, so that `pytest -n 2` does not end with one worker running a minute-long test while the other
# idles; the rest keep file order (module fixtures stay together). A stale figure changes the order,
# never a result. pyproject's addopts shuffle by module (pytest-random-order), and then this order is not
# used: it was markedly slower on the 2-core VM (docs/benchmarks.md).
LONG_TEST_S = 5.0


# flax's own test files, run against our layers by tests/test_flax_upstream.py (not collected as they are).
collect_ignore = ["flax_upstream"]


def pytest_addoption(parser):
  profile_plugin.add_options(parser)


def pytest_configure(config):
  if config.getoption("--profile-out") or config.getoption("--write-durations"):
    config.pluginmanager.register(profile_plugin.Profiler(config), "flash_layers_profile")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(config, items):
  covered = tiering.covering_keeps(items)
  for item in items:
    if any(item.nodeid == name or (name.endswith("[") and item.nodeid.startswith(name))
           for name in tiering.SECOND_TIER) or (
        item.nodeid.split("[")[0] in tiering.COVERINGS and item.nodeid not in covered):
      item.add_marker(tiering.SLOW)
  shuffled = config.getoption("random_order_enabled", False) or not str(
      config.getoption("random_order_bucket", "default:")).startswith("default:")
  if shuffled:  # pytest-random-order's order stands
    return
  seconds = profile_plugin.load_durations()
  long = {nodeid: s for nodeid, s in seconds.items() if s >= LONG_TEST_S}
  items.sort(key=lambda item: -long.get(item.nodeid, 0.0))  # stable: the rest keep their order
