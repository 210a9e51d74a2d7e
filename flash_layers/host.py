"""Where jax runs when nobody said, and a quiet libtpu on a host without a TPU.

libtpu is installed for the TPU ahead-of-time compiles (`jax.experimental.topologies`). Left to itself,
jax initializes every backend it knows; with libtpu installed that loads libtpu, which, finding no TPU,
prints warnings (accelerator type, host bounds, an `E0000 ... unexpected worker hostname ...
TPU_WORKER_HOSTNAMES` line and a source-location trace) before jax falls back to the CPU. The same
warnings come when an ahead-of-time compile loads libtpu to describe a TPU slice.

`import flash_layers` calls `default_to_cpu_without_accelerator()` before anything else, so every entry
point (the library, the demo, the benchmarks, train.py, eval.py) stays quiet. It decides from device
files and environment variables only: it never initializes a jax backend. The ahead-of-time compiles
load libtpu on purpose, inside `quiet_libtpu()`.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
from collections.abc import Iterator

# Device files through which the TPU runtime (accel: v2-v5e, vfio: v5p and newer) or a GPU
# driver reaches its chips.
_ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/kfd",
                      "/dev/dxg")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_PCI_NETWORK_OR_STORAGE = ("0x01", "0x02")  # Google's virtual NIC and disks on ordinary GCE VMs

# What tells libtpu which slice this host belongs to; any one set means someone configured it.
_TPU_TOPOLOGY_VARS = ("TPU_ACCELERATOR_TYPE", "TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES")


def accelerator_present() -> bool:
  """Whether this host shows any sign of a TPU or GPU (device files, or a Google PCI device that is
  not a NIC or a disk). Errs towards True: a false True only leaves jax's own platform choice."""
  if any(glob.glob(pattern) for pattern in _ACCELERATOR_FILES):
    return True
  for vendor_file in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor_file) as f:
        vendor = f.read().strip()
      if vendor != _GOOGLE_PCI_VENDOR:
        continue
      with open(os.path.join(os.path.dirname(vendor_file), "class")) as f:
        if not f.read().strip().startswith(_PCI_NETWORK_OR_STORAGE):
          return True
    except OSError:
      return True
  return False


def default_to_cpu_without_accelerator() -> bool:
  """On a host with libtpu installed and no TPU or GPU, run on the CPU unless the user chose.
  Returns whether it set the platform.

  Nothing changes when libtpu is not installed, when the host has a TPU or a GPU, when the user set
  JAX_FORCE_TPU_INIT, or when the user chose the platforms: JAX_PLATFORMS set (even empty: jax's own
  choice), or `jax_platforms` set in code before this import. Otherwise JAX_PLATFORMS becomes "cpu",
  in the environment too, for child processes. (TPU_LIBRARY_PATH says nothing: importing libtpu sets it.)
  """
  if not _libtpu_without_tpu():
    return False
  jax = sys.modules.get("jax")  # imported already: its config may hold a choice made in code
  if "JAX_PLATFORMS" in os.environ or (jax is not None and jax.config.jax_platforms):
    return False
  os.environ["JAX_PLATFORMS"] = "cpu"  # read by jax when imported, and by child processes
  if jax is not None:
    # Too late only if its backends have started: then they are the CPU's already (no accelerator).
    jax.config.update("jax_platforms", "cpu")
  return True


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
  """Load libtpu quietly inside this block on a host without a TPU (for `get_topology_desc`).

  libtpu reads which slice this host belongs to from the environment when it loads; without a TPU
  nothing says, and it prints the probe's warnings. Inside the block, unless one of
  TPU_ACCELERATOR_TYPE, TPU_HOST_BOUNDS, TPU_WORKER_HOSTNAMES is set, this host is one host (1,1,1)
  at localhost; the slice compiled for is the one `get_topology_desc` names. The variables are
  removed afterwards: TPU_WORKER_HOSTNAMES also tells `jax.distributed` that it runs on a TPU pod.
  """
  if not _libtpu_without_tpu() or any(name in os.environ for name in _TPU_TOPOLOGY_VARS):
    yield
    return
  os.environ.update(TPU_HOST_BOUNDS="1,1,1", TPU_WORKER_HOSTNAMES="localhost")
  try:
    yield
  finally:
    for name in ("TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES"):
      os.environ.pop(name, None)


def _libtpu_without_tpu() -> bool:
  return ("JAX_FORCE_TPU_INIT" not in os.environ and importlib.util.find_spec("libtpu") is not None
          and not accelerator_present())
