"""flash_layers.host: on a host with libtpu installed and no accelerator, every entry point runs on the
CPU and libtpu prints nothing; a user's own JAX_PLATFORMS is never overridden.

The entry points run as subprocesses with the environment a user has: no JAX_PLATFORMS and none of
the TPU variables conftest.py sets for the test process. On a host with a TPU or a GPU (where the
default does not apply) or without libtpu (nothing to quiet) those cases are skipped.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from flash_layers import host

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300
# What libtpu prints when it loads without a TPU (and what jax prints when it fails to start it).
LIBTPU_NOISE = ("E0000", "TPU_WORKER_HOSTNAMES", "TPU accelerator type", "host bounds",
                "Source Location Trace", "InitGoogle", "libtpu", "Unable to initialize backend")
SET_BY_HOST = ("JAX_PLATFORMS", "TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES")

quiet_case = pytest.mark.skipif(
    host.accelerator_present() or importlib.util.find_spec("libtpu") is None,
    reason="only a host with libtpu installed and no TPU or GPU can show libtpu's probe messages")


def user_env() -> dict:
  test_only = ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_HOST_BOUNDS",
               "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY", "XLA_FLAGS")
  env = {k: v for k, v in os.environ.items() if k not in test_only}
  env["PYTHONPATH"] = str(REPO)
  # Other test processes may hold libtpu's lock; this is not one of the probe's messages.
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  return env


def run_as_user(*args: str) -> str:
  result = subprocess.run([sys.executable, *args], env=user_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-4000:]
  return output


def assert_quiet(output: str):
  for marker in LIBTPU_NOISE:
    assert marker not in output, f"{marker!r} printed:\n{output[:3000]}"


# ----------------------------------------------------------------------------
# Entry points, as a user runs them
# ----------------------------------------------------------------------------

@quiet_case
def test_demo_prints_no_libtpu_lines():
  """The demo's output up to its first comparison: by then jax has started every backend it will (the
  probe happens there, before the demo prints the backend). The comparisons that follow, every impl
  at 1,024 tokens, cost 20 CPU-seconds and start no backend, so the test stops the demo there."""
  demo = subprocess.Popen([sys.executable, "-m", "flash_layers.demo"], cwd=REPO, text=True,
                          env={**user_env(), "PYTHONUNBUFFERED": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  lines = []
  try:
    for line in demo.stdout:
      lines.append(line)
      if line.startswith("auto ->"):
        break
  finally:
    demo.kill()
    demo.wait(timeout=TIMEOUT)
  output = "".join(lines)
  assert "backend: cpu" in output and lines[-1].startswith("auto -> "), output
  assert_quiet(output)


@quiet_case
def test_import_then_devices_is_quiet_and_on_the_cpu():
  output = run_as_user("-c", "import flash_layers, jax, os; "
                             "print(jax.devices(), os.environ.get('JAX_PLATFORMS'))")
  assert "[CpuDevice(id=0)] cpu" in output
  assert_quiet(output)


@quiet_case
def test_tpu_ahead_of_time_benchmark_still_compiles_and_is_quiet():
  """A benchmark entry that loads libtpu on purpose: the TPU compile happens, without the probe's lines."""
  output = run_as_user("-m", "benchmarks.tpu_aot", "--generation", "v5e", "--seq-len", "512", "--heads", "1",
                       "--head-dim", "64", "--mask", "full")
  assert "TPU v5 lite" in output and "flash_layers_fwd" in output, output  # Mosaic kernels, compiled
  assert_quiet(output)


# ----------------------------------------------------------------------------
# The decision (in process)
# ----------------------------------------------------------------------------

@pytest.fixture
def bare_host(monkeypatch):
  """No accelerator, libtpu 'installed', none of the variables set, jax's platform unset in code."""
  monkeypatch.setattr(host, "accelerator_present", lambda: False)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else None)
  for name in (*SET_BY_HOST, "JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE"):
    monkeypatch.setenv(name, "")  # recorded, so whatever the test sets is undone
    monkeypatch.delenv(name)
  before = jax.config.jax_platforms
  jax.config.update("jax_platforms", None)
  yield
  jax.config.update("jax_platforms", before)


def test_cpu_default_applies_without_a_choice_or_an_accelerator(bare_host):
  assert host.default_to_cpu_without_accelerator() is True
  assert os.environ["JAX_PLATFORMS"] == "cpu" and jax.config.jax_platforms == "cpu"


@pytest.mark.parametrize("platforms", ["", "tpu", "cpu,tpu"])
def test_a_users_jax_platforms_stays(bare_host, monkeypatch, platforms):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)  # set, even empty: the user chose
  assert host.default_to_cpu_without_accelerator() is False
  assert os.environ["JAX_PLATFORMS"] == platforms and jax.config.jax_platforms is None


def test_a_platform_chosen_in_code_stays(bare_host):
  jax.config.update("jax_platforms", "cpu,tpu")
  assert host.default_to_cpu_without_accelerator() is False
  assert "JAX_PLATFORMS" not in os.environ and jax.config.jax_platforms == "cpu,tpu"


@pytest.mark.parametrize("why", ["accelerator", "no libtpu", "forced tpu init"])
def test_nothing_changes_where_the_default_does_not_apply(bare_host, monkeypatch, why):
  if why == "accelerator":
    monkeypatch.setattr(host, "accelerator_present", lambda: True)
  elif why == "no libtpu":
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  else:
    monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
  assert host.default_to_cpu_without_accelerator() is False
  with host.quiet_libtpu():
    assert not any(name in os.environ for name in SET_BY_HOST)
  assert jax.config.jax_platforms is None


def test_quiet_libtpu_names_one_host_only_inside_the_block(bare_host):
  """TPU_WORKER_HOSTNAMES must not outlive the load: jax.distributed reads it as 'on a TPU pod'."""
  with host.quiet_libtpu():
    assert os.environ["TPU_HOST_BOUNDS"] == "1,1,1" and os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
  assert "TPU_HOST_BOUNDS" not in os.environ and "TPU_WORKER_HOSTNAMES" not in os.environ


def test_quiet_libtpu_leaves_a_users_tpu_topology(bare_host, monkeypatch):
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-128")
  with host.quiet_libtpu():
    assert "TPU_HOST_BOUNDS" not in os.environ and "TPU_WORKER_HOSTNAMES" not in os.environ
  assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-128"
