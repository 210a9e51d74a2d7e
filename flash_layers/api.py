"""The public entry points: `attention()` and `explain()`.

Both validate through `validate.prepare` and choose through `auto.choose`, then either run on one
device (`dispatch.attend`) or, with a mesh, split the call with `parallel.sharded`.
`attention`'s path is `run`, which `layers.attention_fn` shares (it adds flax's
dense mask), so flax's own attention modules shard exactly as `attention` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flash_layers import lowering, validate
from flash_layers.auto import AUTO, choose
from flash_layers.contract import block_info, mods
from flash_layers.contract.sinks import merge_sinks
from flash_layers.dispatch import attend
from flash_layers.impls import REGISTRY, registry
from flash_layers.impls.xla_chunked import chunk_size
from flash_layers.parallel import mesh as mesh_lib
from flash_layers.parallel import operands as operands_lib
from flash_layers.parallel import sharded
from flash_layers.parallel.context import AUTO_STRATEGY, STRATEGIES
from flash_layers.tuning import tuner
from flash_layers.tuning.cache import AUTOTUNE

__all__ = ["AUTO", "Explanation", "attention", "block_mask", "explain"]


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------

def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = AUTO,
              causal: bool = False, segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None,
              window: int | tuple[int, int] | None = None, global_tokens: int = 0,
              scale: float | None = None, softcap: float | None = None, dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, dropout_broadcast: bool = False,
              alibi_slopes: jax.Array | None = None, bias: jax.Array | None = None,
              precision: str | jax.lax.Precision | None = None, block_sizes: Any = None,
              mesh: Any = None, sinks: jax.Array | None = None, mask_mod: Callable | None = None,
              score_mod: Callable | None = None, mod_operands: tuple | None = None,
              block_mask: Any = None, q_offset: int | jax.Array = 0,
              kv_offset: int | jax.Array = 0, mod_operand_axes: tuple | None = None,
              context_parallel: str = AUTO_STRATEGY, mesh_axes: Any = None) -> jax.Array:
  """Scaled dot-product attention with one contract for every impl.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key: [batch, kv_len, num_kv_heads, head_dim]; num_heads % num_kv_heads == 0.
    value: [batch, kv_len, num_kv_heads, head_dim_v].
    impl: one of `IMPLS` or "auto" (see `explain`).
    causal: query i sees key j only if j <= i (positions: with q_offset / kv_offset below).
    segment_ids: int [batch, q_len]; query i sees key j only if their ids are equal
      (padding is an id of its own, e.g. 0).
    kv_segment_ids: int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    window: (left, right) or w for (w, w): query i sees keys i - left ... i + right.
    global_tokens: g > 0 (needs a window): the first g tokens of each document attend, and are
      attended by, the whole document despite the window (Longformer's global attention).
      Positions restart at 0 where the segment id changes; without segment ids the sequence is
      one document. Causal and segment ids still apply. Block-sparse like the window.
    scale: logit scale; head_dim ** -0.5 by default.
    softcap: c > 0 -> logits = c * tanh(logits / c).
    dropout_rate: in [0, 1): after the softmax each probability is kept with probability
      1 - rate and scaled by 1 / (1 - rate), else zeroed. The keep decision is a hash of
      (dropout_rng, batch row, query head, query position, key position), all global, so it
      is the same for every impl, platform, block size and mesh (`flash_layers.dropout_mask`
      returns it). Not served by xla_native.
    dropout_rng: a PRNG key (jax.random.key or a uint32[2] PRNGKey); required when
      dropout_rate > 0.
    dropout_broadcast: one mask shared by every batch row and head.
    alibi_slopes: float [num_heads]: logits[b, h, i, j] += -alibi_slopes[h] * |i - j|
      (`flash_layers.alibi_slopes(num_heads)` gives the standard slopes).
    bias: float, broadcastable to [batch, num_heads, q_len, kv_len], added to the logits;
      differentiable. Served by reference, xla_native, xla_dense and xla_chunked (not
      flash_pallas or jax_splash).
    sinks: float [num_heads]: attention sinks (as in gpt-oss and StreamingLLM), one logit per
      head that joins every row's softmax denominator and contributes no value; differentiable.
      Served by every impl: merged with the impl's output and lse (`contract.sinks.merge_sinks`).
    mask_mod: ``(b, h, q_idx, kv_idx, *mod_operands) -> bool``, an elementwise jnp function of
      global int32 indices (broadcastable arrays): the key is visible only where it is True (and the
      built-in rules allow it). Tiles it hides entirely are skipped. `flash_layers.masks` has named
      ones (causal, sliding window, document, prefix-LM, chunked causal, ...). Not served by
      jax_splash (UnsupportedError names the impls that serve it); flash_pallas's kernels evaluate it
      on their partial tiles, lowered for a TPU or GPU only when it reads operands by scalar index.
    score_mod: ``(score, b, h, q_idx, kv_idx, *mod_operands) -> score``, elementwise, rewrites each
      float32 logit (e.g. a T5 relative-position bias read from a table operand). Differentiable in
      the score and in the floating-point mod_operands. Served by reference, xla_dense and
      xla_chunked; by flash_pallas, whose dQ kernels accumulate the float operands' gradients (up to
      2,048 elements; docs/kernels.md, "Operand gradients").
    mod_operands: a tuple of arrays passed to both mods after the indices (flash_layers/contract/mods.py).
      Gradients reach the floating-point ones.
    mod_operand_axes: on a mesh, one entry per mod_operand: None (replicated on every device) or a
      tuple naming each of its axes "batch", "heads" or None; a "batch" / "heads" axis is split as
      the batch / heads are, and the mods still index it globally (flash_layers/parallel/operands.py).
    q_offset, kv_offset: int positions of query row 0 and key row 0 in one sequence (default 0):
      query i sits at q_offset + i and key j at kv_offset + j for causal, windows, global tokens,
      ALiBi, dropout's hash and the mods' indices. May be traced (decoding: the KV cache's index,
      `fl.MultiHeadAttention(decode=True)`); jax_splash takes static offsets only. Not on a mesh with
      a sequence axis (the ring sets its own).
    block_mask: a `flash_layers.block_mask(mask_mod, ...)`: the mask_mod evaluated on the tile grid
      once, for every layer to reuse (it brings its mask_mod, and its tiles as xla_chunked's chunks).
    Order: logits = scale * q.k + alibi + bias, then score_mod, then softcap, then the mask
      (built-in rules and mask_mod), softmax in float32 (its denominator holding the sinks), then
      dropout.
    precision: of every matmul (q.k and p.v, and those of the gradient), as in `jnp.dot`:
      "default", "high", "highest" (or jax's aliases "bfloat16", "bfloat16_3x",
      "tensorfloat32", "float32") or a `jax.lax.Precision`. None: "highest" (full float32
      products) for float32 inputs, "default" for bfloat16 (whose products are exact anyway).
      What each means per platform: docs/contract.md, "Precision".
    block_sizes: tile sizes: flash_pallas's `BlockSizes` (TPU) or `GpuBlockSizes`, the CPU layouts'
      `CpuBlockSizes`; None for the defaults ("auto" then reads the tuning cache); "autotune": the
      tuned configuration for this device and shape bucket, tuned now on a cache miss
      (`flash_layers.autotune`, docs/tuning.md).
    mesh: a `jax.sharding.Mesh` with axes from ("data", "fsdp", "tensor", "sequence")
      (`flash_layers.make_mesh`); None uses the current mesh (`jax.set_mesh`), if any.
      The call then runs inside `shard_map`: batch over data x fsdp, heads over
      tensor, context parallelism over sequence (`flash_layers.parallel`).
    context_parallel: how a mesh's sequence axis splits the call: "ring", "ulysses", "all_gather",
      "ulysses_ring" (Ulysses inside groups, a ring across them) or "auto" (the cost model of
      `flash_layers.parallel.cost` chooses; `explain` says what and why). docs/sharding.md.
    mesh_axes: which mesh axes split the batch, heads and sequence when the mesh's names are not
      ours: a `flash_layers.MeshAxes` or {"batch": ..., "heads": ..., "sequence": ...}; None: ours,
      else what flax's current `logical_axis_rules` map "batch", "heads" and "length" to.
    Arrays may be NumPy or jax arrays (a bias also a Python number), numbers Python, NumPy or
      concrete 0-d jax values: `validate.prepare` converts each once, with identical results.

  Returns:
    [batch, q_len, num_heads, head_dim_v] in the query's dtype. A query that sees
    no key gets zeros (and zero gradients).
  """
  return run(query, key, value, impl=impl, mesh=mesh, causal=causal, segment_ids=segment_ids,
             kv_segment_ids=kv_segment_ids, window=window, scale=scale, softcap=softcap,
             block_sizes=block_sizes, global_tokens=global_tokens, dropout_rate=dropout_rate,
             dropout_rng=dropout_rng, dropout_broadcast=dropout_broadcast, alibi_slopes=alibi_slopes,
             bias=bias, precision=precision, sinks=sinks, mask_mod=mask_mod, score_mod=score_mod,
             mod_operands=mod_operands, block_mask=block_mask, q_offset=q_offset, kv_offset=kv_offset,
             mod_operand_axes=mod_operand_axes, context_parallel=context_parallel, mesh_axes=mesh_axes)


def run(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = AUTO, mesh: Any = None,
        **options: Any) -> jax.Array:
  """The one path of `attention` and `layers.attention_fn`: validate, then attend here or on the mesh.

  `options` are `validate.prepare`'s keywords: `attention`'s, plus `dense_mask` (flax's boolean
  mask, which only `attention_fn` passes). With a mesh (given or current) the call is split by
  `parallel.sharded`; `block_sizes="autotune"` tunes what each device runs.
  """
  validate.check_impl(impl)
  query, key, value = validate.as_qkv(query, key, value)
  sinks = options.pop("sinks", None)
  sharding = {name: options.pop(name, None) for name in _SHARDING_OPTIONS}
  request, args = validate.prepare(query, key, value, **options)
  sinks = validate.check_sinks(sinks, request.num_heads)
  plan = _plan(request, args, mesh, **sharding)
  if options.get("block_sizes") == AUTOTUNE:  # tune what each device runs, unless the cache has it
    tuner.ensure_tuned(impl, request if plan is None else plan.local)
  if plan is not None:
    out, lse = sharded.sharded_attend(query, key, value, impl=impl, request=request, args=args, plan=plan)
  else:
    out, lse = attend(query, key, value, impl=impl, request=request, args=args)
  if sinks is not None:
    out, _ = merge_sinks(out, lse, sinks)
  return out


_SHARDING_OPTIONS = ("mod_operand_axes", "context_parallel", "mesh_axes")


def _plan(request, args, mesh, *, mod_operand_axes=None, context_parallel=None,
          mesh_axes=None) -> sharded.Plan | None:
  """How the call splits over the given or current mesh (None: one device); the sharding options
  are checked with or without a mesh, so a bad one fails on a laptop too."""
  layouts = operands_lib.check_layouts(mod_operand_axes, args.mod_operands, request.batch, request.num_heads)
  strategy = AUTO_STRATEGY if context_parallel is None else context_parallel
  if strategy not in (*STRATEGIES, AUTO_STRATEGY):
    raise ValueError(f"context_parallel must be one of {(*STRATEGIES, AUTO_STRATEGY)}; got {strategy!r}")
  mesh = sharded.resolve_mesh(mesh)
  if mesh is None:
    return None
  axes = mesh_lib.resolve_axes(mesh, mesh_axes)
  return sharded.make_plan(request, mesh, axes=axes, strategy=strategy, operand_layouts=layouts,
                           operand_shapes=tuple(tuple(x.shape) for x in args.mod_operands))


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What `attention` would run for these arguments, and why."""

  impl: str
  kernel: str
  reason: str
  blocks_visited: int | None = None
  blocks_total: int | None = None
  sharding: str | None = None  # how a call with a mesh is split; None: one device
  grid_steps: int | None = None  # kernel grid steps of the forward pass (TPU kernels), if known
  tuning: str = "default"  # where the configuration came from: "tuned (cache hit)", "shipped", "default"
  block_sizes: Any = None  # the tuned block sizes the impl runs with (None: its defaults)
  sinks: bool = False  # attention sinks, merged with the impl's (out, lse) after it runs
  mods: str | None = None  # the call's mask_mod / score_mod, by name

  @property
  def block_fraction(self) -> float | None:
    if self.blocks_visited is None or not self.blocks_total:
      return None
    return self.blocks_visited / self.blocks_total

  def __str__(self) -> str:
    text = f"{self.impl} [{self.kernel}]: {self.reason}"
    if self.blocks_visited is not None:
      text += (f"; blocks visited {self.blocks_visited}/{self.blocks_total} "
               f"({self.block_fraction:.3f})")
    if self.grid_steps is not None:
      text += f"; grid steps {self.grid_steps}"
    if self.sharding is not None:
      text += f"; {self.sharding}"
    text += f"; configuration: {self.tuning}"
    if self.block_sizes is not None:
      text += f" {self.block_sizes}"
    if self.sinks:
      text += "; sinks merged into the output and lse after the impl"
    if self.mods is not None:
      text += f"; {self.mods}"
    return text


def explain(query: jax.Array, key: jax.Array, value: jax.Array, *, impl: str = AUTO,
            mesh: Any = None, **kwargs: Any) -> Explanation:
  """Which impl and kernel `attention(query, key, value, impl=impl, **kwargs)` runs here, and why.

  Takes the same arguments as `attention` (arrays or `jax.ShapeDtypeStruct`s;
  block counts need concrete segment ids). With a mesh, the impl is the one each
  device runs on its local shard, and `.sharding` says how the call is split.
  """
  validate.check_impl(impl)
  query, key, value = validate.as_qkv(query, key, value)
  sinks = kwargs.pop("sinks", None)
  sharding = {name: kwargs.pop(name, None) for name in _SHARDING_OPTIONS}
  request, args = validate.prepare(query, key, value, **kwargs)
  sinks = validate.check_sinks(sinks, request.num_heads)
  here = lowering.default_platform()
  plan = _plan(request, args, mesh, **sharding)
  name, reason, local, source = choose(impl, request if plan is None else plan.local, here)
  chosen = REGISTRY[name]
  request = dataclasses.replace(request, block_sizes=local.block_sizes)  # the sizes that run
  visited = total = None
  if registry.impl_has(name, "block_stats"):
    stats = chosen.block_stats(request, args, here)
    if stats is not None:
      visited, total = stats
  steps = chosen.grid_steps(request, args, here) if registry.impl_has(name, "grid_steps") else None
  sharding = None if plan is None else plan.describe(request)
  return Explanation(name, chosen.kernel(request, here), reason, visited, total, sharding, steps, source,
                     local.block_sizes if source != "default" else None, sinks is not None,
                     _describe_mods(request, args, name))


def _describe_mods(request, args, impl: str) -> str | None:
  """The call's mods by name; for a block-sparse impl, where its mask_mod's tile flags come from and
  what building them costs."""
  parts = [f"{name}={mods.describe(fn)}" for name, fn in (("mask_mod", request.mask_mod),
                                                          ("score_mod", request.score_mod)) if fn is not None]
  if request.mask_mod is not None and registry.impl_has(impl, "block_stats"):
    if args.mod_tiles is not None:
      # flash_pallas: the TPU kernels take the block mask's tiles (multiples of 128); a kernel whose tiles
      # differ (the GPU's, or block_sizes given) builds flags for its own.
      parts.append("tile flags from the block_mask (a kernel with other tiles builds its own)"
                   if registry.impl_has(impl, "retiles_block_mask") else "tile flags from the block_mask")
    else:
      parts.append(f"tile flags built by this call: mask_mod evaluated on {request.q_len * request.kv_len:,} "
                   "pairs per row (fl.block_mask builds them once for every layer)")
  return ", ".join(parts) or None


def block_mask(mask_mod: Callable, *, batch: int, q_len: int, kv_len: int | None = None,
               num_heads: int = 1, mod_operands: tuple = (), block_q: int = 512,
               block_kv: int = 512) -> block_info.BlockMask:
  """``fl.block_mask``: evaluate ``mask_mod`` on the tile grid of xla_chunked's chunks once, and pass
  the result as ``fl.attention(..., block_mask=bm)`` (or a layer's ``block_mask=``) to every layer:
  the calls then skip the tiles it hides and run the ones it fully shows unmasked, without evaluating
  the mask per tile grid again. block_q / block_kv are chunk targets (`xla_chunked.chunk_size`
  fits them to the lengths). Works under jit (traced operands)."""
  if not callable(mask_mod):
    raise TypeError("mask_mod must be a callable (b, h, q_idx, kv_idx, *mod_operands) -> bool; "
                    f"got {type(mask_mod).__name__}")
  kv_len = q_len if kv_len is None else kv_len
  for name, value in (("batch", batch), ("q_len", q_len), ("kv_len", kv_len), ("num_heads", num_heads),
                      ("block_q", block_q), ("block_kv", block_kv)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"block_mask {name} must be an int >= 1; got {value!r}")
  bq, bk = chunk_size(q_len, block_q), chunk_size(kv_len, block_kv)
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  operands = tuple(jnp.asarray(x) for x in (mod_operands or ()))
  any_, all_ = block_info.tile_flags(mask_mod, operands, batch=batch, heads=jnp.arange(num_heads),
                                     batch_offset=0, q_offset=0, kv_offset=0, q_len=q_len, kv_len=kv_len,
                                     block_q=bq, block_kv=bk, num_q_blocks=nq, num_kv_blocks=nk)
  return block_info.BlockMask(any_, all_, mask_mod, q_len, kv_len, bq, bk)
