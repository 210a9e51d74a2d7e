"""Multi-process start-up: jax.distributed, logging on process 0 only, one line of job info."""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("flash_layers.training")

# Environment variables that make a plain `jax.distributed.initialize()` find its peers
# (set by TPU pod runtimes, SLURM, Open MPI, or by hand).
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Start jax.distributed when this is one process of several (flags or environment).

  On CPU the cross-process collectives go through gloo. Safe to call once per process
  before any other JAX call; a single-process run does nothing.
  """
  explicit = coordinator_address is not None or (num_processes or 1) > 1
  from_env = any(os.environ.get(name) for name in _CLUSTER_ENV)
  if not (explicit or from_env):
    return
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {k: v for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                              ("process_id", process_id)) if v is not None}
  jax.distributed.initialize(**kwargs)


def define_flags() -> None:
  """--coordinator_address, --num_processes, --process_id for train.py and eval.py."""
  from absl import flags
  flags.DEFINE_string("coordinator_address", None, "Multi-process: host:port of process 0 "
                      "(default: from the environment, e.g. on TPU pods and SLURM).")
  flags.DEFINE_integer("num_processes", None, "Multi-process: how many processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")


def initialize_from_flags() -> None:
  from absl import flags
  f = flags.FLAGS
  initialize(f.coordinator_address, f.num_processes, f.process_id)


def setup_logging() -> None:
  """INFO logs on process 0, warnings and errors only elsewhere."""
  level = logging.INFO if jax.process_index() == 0 else logging.WARNING
  # orbax logs every save step by step through absl at INFO; keep its warnings only.
  logging.getLogger("absl").setLevel(logging.WARNING)
  logger = logging.getLogger("flash_layers")
  logger.setLevel(level)
  if not logging.getLogger().handlers and not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)


def log_job_info() -> None:
  devices = jax.devices()
  log.info("jax %s: process %d of %d, %d local / %d global devices (%s, %s)", jax.__version__,
           jax.process_index(), jax.process_count(), jax.local_device_count(), len(devices),
           devices[0].platform, devices[0].device_kind)
