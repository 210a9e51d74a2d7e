"""What the benchmarks record about the machine they ran on, and the CPU time of their children."""

from __future__ import annotations

import platform
import resource


def cpu_model() -> str:
  """The processor's model name (Linux), else what `platform` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def children_cpu() -> float:
  """CPU seconds (user + system) of this process's finished children."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime
