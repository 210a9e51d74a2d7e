"""What every attention implementation provides.

An impl is a small object registered in `flash_layers.impls.REGISTRY`:

* ``unsupported(request, platform)`` -> the name of the first feature of the
  request it cannot serve on that platform, or None. `attention()` raises
  `UnsupportedError` for explicit impls and "auto" skips to the next candidate.
* ``kernel(request, platform)`` -> what actually runs ("xla", "cudnn",
  "pallas-tpu", ...), for `explain()`.
* ``attend(q, k, v, *, request, args)`` -> ``(out, lse)``. Inputs are already
  validated; ``out [b, q, h, dv]`` in the query dtype, ``lse [b, h, q]`` float32
  (``-inf`` for rows that see no key, whose output is 0). Both are
  differentiable, including through ``lse`` (ring attention combines shards by
  it).

Adding an impl is one module plus one line in `impls/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from flash_layers.errors import UserError
from flash_layers.masks import MaskSpec


class UnsupportedError(UserError, ValueError):
  """An explicitly chosen impl cannot serve this request (feature, dtype or platform); a choice the user
  can change, so train.py reports it as one line."""


@dataclasses.dataclass(frozen=True)
class Request:
  """The static description of one attention call (shapes, dtype, features)."""

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  head_dim_v: int
  dtype: str
  spec: MaskSpec
  has_segment_ids: bool
  scale: float
  softcap: float | None
  has_dense_mask: bool = False
  block_sizes: Any = None


@dataclasses.dataclass(frozen=True)
class Args:
  """The array arguments beside q, k, v (any may be None; offsets may be traced)."""

  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_offset: Any = 0
  kv_offset: Any = 0
  dense_mask: jax.Array | None = None  # bool, broadcastable to [b, h, q, kv]


class Impl(Protocol):
  name: str

  def unsupported(self, request: Request, platform: str) -> str | None: ...

  def kernel(self, request: Request, platform: str) -> str: ...

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, request: Request,
             args: Args) -> tuple[jax.Array, jax.Array]: ...
