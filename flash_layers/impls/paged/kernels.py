"""flash_pallas for paged attention: the kernel family of the platform the call is lowered for.

A TPU lowering runs `flash_pallas/tpu_paged.py` (Mosaic), a CUDA or ROCm lowering
`flash_pallas/gpu_paged.py` (Triton), anything else the TPU kernel interpreted; `fl.interpret_as`
forces a family, interpreted. Each family module provides:

* ``LAYOUT``: the pool layout its kernel reads ("heads_first" or "flax"); pages given in the other
  layout are transposed first, a copy of the pool per call, which explain() names.
* ``unsupported(spec) -> str | None``: the first feature of the call it cannot serve.
* ``paged_attention(q, k_pages, v_pages, k_scales, v_scales, page_table, kv_lens, cu_q_lens, num_seqs,
  *, spec, interpret) -> (out, lse)`` with pages and scales in ``LAYOUT`` and num_seqs an int32 scalar.
* ``grid_points(spec, page_table, kv_lens, cu_q_lens, num_seqs) -> int | None``: the grid steps that do
  work, from concrete arrays (None when its grid does not show them).
"""

from __future__ import annotations

import functools
import importlib

import jax

from flash_layers import lowering
from flash_layers.contract import paged
from flash_layers.contract.paged import PagedSpec
from flash_layers.impls.flash_pallas import family_for

_FAMILY_MODULES = {"tpu": "flash_layers.impls.flash_pallas.tpu_paged",
                   "gpu": "flash_layers.impls.flash_pallas.gpu_paged"}
_NAMES = {"tpu": "pallas-tpu paged (Mosaic)", "gpu": "pallas-gpu paged (Triton)"}


@functools.cache
def family_module(family: str):
  return importlib.import_module(_FAMILY_MODULES[family])


def _in_layout(spec: PagedSpec, family: str, pages, scales):
  layout = family_module(family).LAYOUT
  convert = paged.to_heads_first if layout == "heads_first" else paged.to_flax
  return convert(pages, spec.layout), None if scales is None else convert(scales, spec.layout)


class PagedKernels:
  name = "flash_pallas"

  def unsupported(self, spec: PagedSpec, platform: str) -> str | None:
    family, _ = family_for(platform)
    return family_module(family).unsupported(spec)

  def kernel(self, spec: PagedSpec, platform: str) -> str:
    family, interpreted = family_for(platform)
    name = _NAMES[family] + (" (interpret)" if interpreted else "")
    if spec.layout != family_module(family).LAYOUT:
      name += f"; the pool is transposed to {family_module(family).LAYOUT!r} each call (keep it so)"
    return name

  def grid_points(self, spec: PagedSpec, arrays, platform: str) -> int | None:
    family, _ = family_for(platform)
    return family_module(family).grid_points(spec, arrays["page_table"], arrays["kv_lens"],
                                             arrays["cu_q_lens"], arrays["num_seqs"])

  def attend(self, q, k_pages, v_pages, *, spec: PagedSpec, arrays) -> tuple[jax.Array, jax.Array]:
    def run(family: str, interpret: bool):
      def go(q, k_pages, v_pages):
        kp, ks = _in_layout(spec, family, k_pages, arrays["k_scales"])
        vp, vs = _in_layout(spec, family, v_pages, arrays["v_scales"])
        return family_module(family).paged_attention(
            q, kp, vp, ks, vs, arrays["page_table"], arrays["kv_lens"], arrays["cu_q_lens"],
            arrays["num_seqs"], spec=spec, interpret=interpret)
      return go

    forced = lowering.interpreting()
    if forced is not None:
      return run(forced, True)(q, k_pages, v_pages)
    gpu = run("gpu", False)
    return lowering.platform_dependent(q, k_pages, v_pages, tpu=run("tpu", False), cuda=gpu, rocm=gpu,
                                       default=run("tpu", True))
