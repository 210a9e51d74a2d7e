"""What every attention implementation provides.

An impl is a small object satisfying `Impl`, registered in `flash_layers.impls.registry`
(`impls/__init__.py` registers the shipped ones):

* ``name`` -> its name in `fl.IMPLS`; ``capabilities`` -> the optional capabilities below that it
  offers (a frozenset of names).
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

The computation every impl performs (the contract, written once):

  logits = scale * q.k^T + alibi + bias   (alibi[h, i, j] = -slope[h] * |i - j|, global positions)
  logits = score_mod(logits, b, h, i, j, *mod_operands)  (if any; flash_layers/contract/mods.py)
  logits = c * tanh(logits / c)           (softcap c, if any)
  logits = -inf where the mask hides the key (causal, window, segments, dense mask, mask_mod)
  p = softmax(logits) in float32;  lse = logsumexp(logits)  (the normaliser *before* dropout)
  p = p * keep / (1 - rate)               (dropout; keep from `flash_layers.dropout.keep`)
  out = p v

lse is the pre-dropout normaliser because dropout is linear in p: ring attention merges
per-shard outputs by their lse and gets exactly the dropped-out global softmax.

Optional capabilities, each named in the impl's ``capabilities`` (`CAPABILITIES`) and checked
when it is registered (`impls/registry.py`: a declared method must exist with the signature below,
a defined one must be declared); callers ask the registry (`registry.impl_has`,
`registry.impls_with`), never ``getattr``:

* ``attention_backward(q, k, v, lse, delta, d_out, *, request, args)`` -> ``(dq, dk, dv)``: the
  gradients from given row statistics (``lse`` the normaliser and ``delta`` = rowsum(dO * O) -
  dlse of the whole softmax the rows belong to), without the forward; ring attention's backward
  calls it with the global statistics (`dispatch.attend_backward`; xla_dense's serves impls
  without one).
* ``block_stats(request, args, platform)`` -> ``(blocks visited, blocks total)`` or None, and
  ``grid_steps(request, args, platform)`` -> int or None: what `explain()` reports.
* ``decode_unserved(request, platform)`` -> None when the impl serves `request` on its decode path
  (a few queries against a long cache), else why not: "auto" puts such an impl first for decoding.
* ``tuning_space(request, platform)`` -> the block sizes the autotuner times for the impl there, its
  defaults (None) first; [] when nothing is tunable (tuning/candidates.py builds on it).
* ``cpu_loop_tile(request)`` -> (tile_q, tile_kv): the logits tile whose size decides the CPU loop
  (impls/cpu_loop.py) for impls that run it; the tuner's small check forces the same decision.

Features (a claim, no method; the tests check each by running it):

* ``traced_offsets``: causal and window masks whose position offsets are known only at run time (a
  ring attention step); the conformance and ring tests hold it.
* ``sow_weights``: materialises the attention probabilities, so a layer can sow them.
* ``mod_gathers``: evaluates mods on whole arrays, so a mod may index its operands with arrays (a
  gather), which the Pallas kernels cannot lower.
* ``dropout``: serves attention dropout (``unsupported`` says so for each request too; the training
  config refuses an impl without it before any compile).
* ``sharded_mods``: a mod sees the *global* batch row and head on a shard of a mesh (Args.batch_offset,
  head_offset); parallel/sharded.py refuses mods on a batch or head split for an impl without it.
* ``retiles_block_mask``: a kernel whose tiles may differ from a prebuilt block_mask's builds its own
  tile flags for them (explain says so).

Besides capabilities, an impl may set ``block_size_types``: the block-size classes it reads (default
none); sizes of another class given to it explicitly raise (`validate.check_block_sizes`).

Adding an impl is one module plus one line in `impls/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from flash_layers.contract.mask_rules import MaskSpec
from flash_layers.errors import UserError


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
  dropout_rate: float = 0.0  # 0: no dropout
  dropout_broadcast: bool = False  # one mask for every batch row and head
  has_alibi: bool = False
  has_bias: bool = False
  # The precision of every matmul (`jax.lax.Precision`, as in `jnp.dot`): DEFAULT, HIGH or HIGHEST.
  # `validate.prepare` resolves the user's None: HIGHEST, except DEFAULT for bfloat16 inputs.
  precision: jax.lax.Precision = jax.lax.Precision.HIGHEST
  # The user's mods (flash_layers/contract/mods.py): callables, hashed by identity (define one once and
  # reuse it, or each call is a new trace).
  mask_mod: Any = None
  score_mod: Any = None
  # A prebuilt block_mask's (block_q, block_kv) (mods.block_mask): xla_chunked's chunks then.
  block_mask_tiles: tuple[int, int] | None = None
  # The dtypes of mod_operands (names): whether a score_mod's operands take gradients (the floating ones).
  mod_operand_dtypes: tuple[str, ...] = ()
  mod_operand_words: int = 0  # their elements, all together (a TPU kernel holds them in SMEM)

  @property
  def has_mods(self) -> bool:
    return self.mask_mod is not None or self.score_mod is not None

  @property
  def has_float_score_operands(self) -> bool:
    """A score_mod with floating-point operands: the loss's gradient reaches them."""
    return self.score_mod is not None and any(
        jnp.issubdtype(jnp.dtype(d), jnp.floating) for d in self.mod_operand_dtypes)

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0


@dataclasses.dataclass(frozen=True)
class Args:
  """The array arguments beside q, k, v (any may be None; offsets may be traced)."""

  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_offset: Any = 0
  kv_offset: Any = 0
  dense_mask: jax.Array | None = None  # bool, broadcastable to [b, h, q, kv]
  dropout_seed: jax.Array | None = None  # int32[2] from the dropout key (flash_layers.dropout)
  batch_offset: Any = 0  # global index of the first batch row / query head held here (sharded
  head_offset: Any = 0   # calls), so the dropout hash sees global indices
  alibi_slopes: jax.Array | None = None  # float32 [num_heads] of the heads held here
  bias: jax.Array | None = None  # float, rank 4, broadcastable to [b, h, q, kv]
  mod_operands: tuple = ()  # arrays passed to mask_mod and score_mod (flash_layers/contract/mods.py)
  # A mask_mod's (any, all) tile flags [b|1, nq, nk] for an impl's tiles, when its caller built them
  # (xla_chunked: once per call, before the CPU loop); None: built where needed.
  mod_tiles: tuple | None = None


# The optional capabilities an impl may declare. Methods: the registry checks that a declared one
# exists and takes the arguments below. Features: a claim the tests check by running it.
METHOD_CAPABILITIES = ("attention_backward", "block_stats", "grid_steps", "decode_unserved", "tuning_space",
                       "cpu_loop_tile")
FEATURE_CAPABILITIES = ("traced_offsets", "sow_weights", "mod_gathers", "dropout", "retiles_block_mask",
                        "sharded_mods")
CAPABILITIES = METHOD_CAPABILITIES + FEATURE_CAPABILITIES


class Impl(Protocol):
  """What every impl provides (see the module docstring)."""

  name: str
  capabilities: frozenset[str]  # the optional capabilities it offers, from CAPABILITIES

  def unsupported(self, request: Request, platform: str) -> str | None: ...

  def kernel(self, request: Request, platform: str) -> str: ...

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, request: Request,
             args: Args) -> tuple[jax.Array, jax.Array]: ...


class AttentionBackward(Protocol):
  """Capability "attention_backward": the backward alone, from given row statistics."""

  def attention_backward(self, q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array,
                         delta: jax.Array, d_out: jax.Array, *, request: Request, args: Args
                         ) -> tuple[jax.Array, jax.Array, jax.Array]: ...


class BlockStats(Protocol):
  """Capability "block_stats": (blocks visited, blocks total) over batch and heads, for explain()."""

  def block_stats(self, request: Request, args: Args, platform: str) -> tuple[int, int] | None: ...


class GridSteps(Protocol):
  """Capability "grid_steps": the forward kernel's grid steps over batch and heads, for explain()."""

  def grid_steps(self, request: Request, args: Args, platform: str) -> int | None: ...
