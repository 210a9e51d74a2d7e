"""What the benchmarks record about the machine they ran on, and the CPU time of their children."""

from __future__ import annotations

import resource

from flash_layers.tuning.cache import cpu_model  # noqa: F401  (benchmarks record it beside their numbers)


def children_cpu() -> float:
  """CPU seconds (user + system) of this process's finished children."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime
