"""flash_pallas's autotuning space: the kernels' tiles (GPU: also warps and stages) the tuner times.

The candidates come from the kernel config modules (`tpu_config.candidates`, VMEM-checked and clamped;
`gpu_config.candidates`, shared-memory-checked), their default first. Each half (forward, backward)
is varied with the other at the generation's default, so the tuner times a short list instead of the
full product. `FlashPallas.tuning_space` serves it (a method capability, impls/base.py).
"""

from __future__ import annotations

from collections.abc import Callable

from flash_layers.impls.base import Request


def _around_default(configs: list, forward: Callable, backward: Callable) -> list:
  """None (the defaults) and the configs that keep one half (forward or backward tiles) at the
  default (`configs[0]`)."""
  default = configs[0]
  return [None] + [cfg for cfg in configs[1:]
                   if forward(cfg) == forward(default) or backward(cfg) == backward(default)]


def tpu(request: Request) -> list:
  """TPU tiles, one half at a time."""
  # Lazy: the config modules load only when tuning for their platform (gpu_config imports Pallas).
  from flash_layers.impls.flash_pallas import tpu_config  # noqa: PLC0415
  return _around_default(tpu_config.candidates(request), lambda c: (c.block_q, c.block_kv),
                         lambda c: c.backward)


def gpu(request: Request) -> list:
  """GPU tiles, warps and stages, one half at a time."""
  from flash_layers.impls.flash_pallas import gpu_config  # noqa: PLC0415 (lazy, as in `tpu`)
  return _around_default(
      gpu_config.candidates(request),
      lambda c: (c.block_q, c.block_kv, c.num_warps, c.num_stages),
      lambda c: (c.block_q_bwd, c.block_kv_bwd, c.num_warps_bwd, c.num_stages_bwd))


def space(request: Request, platform: str) -> list:
  """The block sizes to time on `platform` (None first: the defaults); [] on the CPU, where the
  kernels only run interpreted."""
  if platform == "tpu":
    return tpu(request)
  if platform in ("cuda", "rocm", "gpu"):
    return gpu(request)
  return []
