"""jax_splash: JAX's own splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`)
behind our contract.

The kernels are upstream's, unchanged; this module only adapts the call:

* Layout. Splash takes one batch row as ``[heads, len, head_dim]`` (GQA/MQA: K/V with the kv
  heads, never repeated); it is vmapped over the batch.
* Scale. Splash computes ``q . k`` unscaled, so q is multiplied by the scale first (in
  float32, then back to q's dtype); autodiff carries the scale into dq.
* Mask. Splash's mask is static, a NumPy-evaluable `Mask` from which it builds the block-sparse
  schedule at trace time. Causal, windows, static position offsets and the padded tail are one
  rule (`_StaticMask`) that the kernels also evaluate in-register; with nothing masked it is
  splash's `FullMask` (no mask work at all). Segment ids are splash's `SegmentIds`, runtime
  arrays: they mask element-wise inside every visited block but, unlike flash_pallas, never
  skip a block (`explain()` counts blocks accordingly).
* Lengths. Splash needs lengths divisible by its blocks (multiples of 128 here); q and kv are
  padded and the padded keys masked by the same static rule.
* Rows that see no key. Splash's softmax starts from a large negative finite value, so such a
  row gets the mean of the masked values (or 0/0) and a logsumexp near that value. Real
  logsumexps are far above it, so those rows are found from the logsumexp and set to the
  contract's zeros and ``-inf``; their cotangents are zeroed before the backward kernels.
* Differentiable lse. Splash's custom VJP differentiates the output only, and refuses
  residuals under differentiation. A custom VJP here runs splash's forward with residuals
  and splash's dK/dV and dQ kernels with ``di = rowsum(dO * O) - dlse``: the kernels form
  ``dS = P * (dP - di)``, and ``d lse / d S = P``, so the lse cotangent enters exactly there.
  Those two kernel entry points are private to JAX (`_splash_attention_bwd_dkv`, `_dq`);
  their signatures are the same in jax 0.10.2 and 0.11.

Refused (`unsupported` names the feature): dropout, ALiBi, a dense bias, a dense mask,
global tokens (the waiver depends on runtime segment ids), GPU platforms and
`interpret_as("gpu")`; causal or windowed calls with *traced* position offsets (ring
attention) raise `UnsupportedError` while tracing, because splash's mask offset is static.
On a CPU the kernels run in Pallas interpret mode (slow: for testing), like flash_pallas.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flash_layers import lowering
from flash_layers.contract import block_info
from flash_layers.impls import registry
from flash_layers.impls.base import Args, Request, UnsupportedError
from flash_layers.impls.tiling import LANES, BlockSizes, round_up

DEFAULT_BLOCK = 512  # flash_pallas's default tile, so the two compare at equal block sizes


def _splash():
  """The upstream modules (imported when first used: they pull in Pallas's TPU backend)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask
  return kernel, mask


# ----------------------------------------------------------------------------
# The static mask
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Rule:
  """Query row i may see key column j of the padded arrays (hashable, evaluable on NumPy arrays
  at trace time and on jnp arrays inside the kernels)."""

  offset: int  # q_offset - kv_offset: row i sits at key position i + offset
  causal: bool
  window: tuple[int, int] | None
  kv_len: int | None  # keys at or past it are padding; None: no padding

  def __call__(self, q_ids, kv_ids):
    q_pos = q_ids + self.offset if self.offset else q_ids
    visible = None

    def both(a, b):
      return b if a is None else a & b

    if self.causal:
      visible = both(visible, kv_ids <= q_pos)
    if self.window is not None:
      left, right = self.window
      visible = both(visible, kv_ids >= q_pos - left)
      visible = both(visible, kv_ids <= q_pos + right)
    if self.kv_len is not None:
      visible = both(visible, kv_ids < self.kv_len)
    return visible

  @property
  def masks_anything(self) -> bool:
    return self.causal or self.window is not None or self.kv_len is not None


@functools.cache
def _static_mask_class():
  """A splash `Mask` subclass for a `_Rule` (made once, when splash is first imported)."""
  _, mask_lib = _splash()

  class StaticMask(mask_lib.Mask):
    # `q_sequence` and `mask_function` make splash evaluate the mask inside the kernels (no
    # [q, kv] array); `__getitem__` gives NumPy blocks for the block-sparse schedule.
    def __init__(self, rule: _Rule, shape: tuple[int, int]):
      self._shape = shape
      self.q_sequence = np.arange(shape[0], dtype=np.int32)
      self.mask_function = rule

    @property
    def shape(self):
      return self._shape

    def __getitem__(self, idx):
      q_slice, kv_slice = idx
      rows = np.arange(self._shape[0])[q_slice]
      cols = np.arange(self._shape[1])[kv_slice]
      return np.asarray(self.mask_function(rows[:, None], cols[None, :]))

    def __eq__(self, other):
      return (isinstance(other, StaticMask)
              and (other._shape, other.mask_function) == (self._shape, self.mask_function))

    def __hash__(self):
      return hash((self._shape, self.mask_function))

  return StaticMask


def _static_mask(rule: _Rule, shape: tuple[int, int]):
  """A splash `Mask` for `rule` over the padded [q, kv] shape (`FullMask` when nothing is masked)."""
  _, mask_lib = _splash()
  if not rule.masks_anything:
    return mask_lib.FullMask(shape)
  return _static_mask_class()(rule, shape)


# ----------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------

def splash_block_sizes(request: Request):
  """splash `BlockSizes` for the request, each clipped to the 128-rounded length."""
  kernel, _ = _splash()
  sizes = request.block_sizes
  if isinstance(sizes, kernel.BlockSizes):
    return sizes
  if isinstance(sizes, BlockSizes):
    fwd_q, fwd_kv = sizes.block_q, sizes.block_kv
    bwd_q, bwd_kv = sizes.backward
  elif sizes is None:
    fwd_q = fwd_kv = bwd_q = bwd_kv = DEFAULT_BLOCK
  else:  # splash has TPU kernels only: GPU tiles (or anything else) cannot be meant for it
    raise ValueError("block_sizes for impl='jax_splash' (TPU kernels only) must be "
                     "flash_layers.BlockSizes, splash's own BlockSizes or None; got "
                     f"{type(sizes).__name__} {sizes!r}")
  q_cap, kv_cap = round_up(request.q_len, LANES), round_up(request.kv_len, LANES)
  fwd_q, bwd_q = min(fwd_q, q_cap), min(bwd_q, q_cap)
  fwd_kv, bwd_kv = min(fwd_kv, kv_cap), min(bwd_kv, kv_cap)
  return kernel.BlockSizes(block_q=fwd_q, block_kv=fwd_kv, block_kv_compute=fwd_kv,
                           block_q_dkv=bwd_q, block_kv_dkv=bwd_kv, block_kv_dkv_compute=bwd_kv,
                           block_q_dq=bwd_q, block_kv_dq=bwd_kv)


def _padded_lengths(request: Request, sizes) -> tuple[int, int]:
  q_blocks = [b for b in (sizes.block_q, sizes.block_q_dkv, sizes.block_q_dq) if b]
  kv_blocks = [b for b in (sizes.block_kv, sizes.block_kv_dkv, sizes.block_kv_dq) if b]
  return (round_up(request.q_len, math.lcm(LANES, *q_blocks)),
          round_up(request.kv_len, math.lcm(LANES, *kv_blocks)))


# ----------------------------------------------------------------------------
# The kernels, with a differentiable lse
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _SplashCall:
  """One call as splash sees it: the request and what is derived from it while tracing
  (hashable: the custom VJP's static argument)."""

  request: Request
  rule: _Rule
  shape: tuple[int, int]  # padded (q_len, kv_len)
  block_sizes: object  # splash BlockSizes (`splash_block_sizes`)
  interpret: bool


def _kernel(call: _SplashCall):
  """splash's forward kernel (with residuals) and its three block schedules. Built in each trace
  (its schedule arrays are constants of that trace); splash caches the NumPy work per mask."""
  kernel, mask_lib = _splash()
  mask = mask_lib.MultiHeadMask([_static_mask(call.rule, call.shape)] * call.request.num_heads)
  return kernel.make_splash_mha(mask, block_sizes=call.block_sizes, head_shards=1, q_seq_shards=1,
                                save_residuals=True, attn_logits_soft_cap=call.request.softcap,
                                interpret=call.interpret)


def _empty_threshold() -> float:
  kernel, _ = _splash()
  return kernel.DEFAULT_MASK_VALUE / 2  # splash's logsumexp of a row with no visible key <= mask value


def _segments(call: _SplashCall, q_seg, kv_seg):
  if not call.request.has_segment_ids:
    return None
  kernel, _ = _splash()
  return kernel.SegmentIds(q=q_seg, kv=kv_seg)


def _forward(call: _SplashCall, q, k, v, q_seg, kv_seg):
  """splash's ([b, h, T, dv] out, [b, h, T] lse) and the [b, h, T] rows that see no key. The
  output is left as splash wrote it (garbage in empty rows): `_zero_empty` is applied where it
  fuses into a consumer, so no second output-sized buffer is kept."""
  run = _kernel(call)
  out, (lse,) = jax.vmap(lambda q, k, v, seg: run(q, k, v, segment_ids=seg))(
      q, k, v, _segments(call, q_seg, kv_seg))
  return out, lse, lse <= _empty_threshold()


def _zero_empty(x, empty):
  return jnp.where(empty[..., None], jnp.zeros((), x.dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash_attention(call: _SplashCall, q, k, v, q_seg, kv_seg):
  out, lse, empty = _forward(call, q, k, v, q_seg, kv_seg)
  return _zero_empty(out, empty), jnp.where(empty, -jnp.inf, lse)


def _splash_fwd(call: _SplashCall, q, k, v, q_seg, kv_seg):
  out, lse, empty = _forward(call, q, k, v, q_seg, kv_seg)
  # The backward kernels recompute P = exp(S - lse) in every visited block; an empty row's lse
  # becomes 0 there, so its masked logits give P = 0 instead of exp(+inf).
  residuals = (q, k, v, q_seg, kv_seg, out, jnp.where(empty, 0.0, lse), empty)
  return (_zero_empty(out, empty), jnp.where(empty, -jnp.inf, lse)), residuals


def _collapse(info):
  """splash's kernels take partial mask blocks as [n, block_q, block_kv] (what its own call does)."""
  if info is None or info.partial_mask_blocks is None or info.partial_mask_blocks.ndim == 3:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _splash_bwd(call: _SplashCall, residuals, cotangents):
  kernel_lib, _ = _splash()
  q, k, v, q_seg, kv_seg, out, lse, empty = residuals
  d_out, d_lse = cotangents
  d_out = _zero_empty(d_out, empty)
  d_lse = jnp.where(empty, 0.0, d_lse.astype(jnp.float32))
  di = jnp.einsum("bhtd,bhtd->bht", _zero_empty(out, empty).astype(jnp.float32),
                  d_out.astype(jnp.float32)) - d_lse
  run = _kernel(call)
  sizes = call.block_sizes
  common = dict(is_mqa=False, mask_value=kernel_lib.DEFAULT_MASK_VALUE,
                attn_logits_soft_cap=call.request.softcap, q_layout=sizes.q_layout, k_layout=sizes.k_layout,
                v_layout=sizes.v_layout, mask_function=run.kwargs["mask_function"],
                interpret=call.interpret)

  def one_row(q, k, v, seg, lse, d_out, di):
    dq, dk, dv = kernel_lib._splash_attention_bwd_dkv(
        q, k, v, seg, None, lse, d_out, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
        bkv_compute=sizes.block_kv_dkv_compute, mask_info=_collapse(run.dkv_mask_info),
        use_fused_bwd_kernel=sizes.use_fused_bwd_kernel, **common)
    if not sizes.use_fused_bwd_kernel:
      dq = kernel_lib._splash_attention_bwd_dq(
          q, k, v, seg, None, lse, d_out, di, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
          mask_info=_collapse(run.dq_mask_info), **common)
    return dq, dk, dv

  dq, dk, dv = jax.vmap(one_row)(q, k, v, _segments(call, q_seg, kv_seg), lse, d_out, di)
  return dq, dk, dv, None, None


_splash_attention.defvjp(_splash_fwd, _splash_bwd)


# ----------------------------------------------------------------------------
# The impl
# ----------------------------------------------------------------------------

def _static_offset(args: Args, request: Request) -> int:
  """q_offset - kv_offset as a Python int; traced offsets only matter to a static mask."""
  offsets = (args.q_offset, args.kv_offset)
  if all(isinstance(o, (int, np.integer)) for o in offsets):
    return int(offsets[0]) - int(offsets[1])
  if request.spec.causal or request.spec.window is not None:
    raise UnsupportedError(
        "impl='jax_splash' does not support causal or window masks with traced position offsets "
        "(ring attention): splash's mask is static; impls that do: "
        + ", ".join(registry.impls_with("traced_offsets")))
  return 0


def splash_attention(q, k, v, *, request: Request, args: Args, interpret: bool):
  """(out [b, q, h, dv], lse [b, h, q] float32) by JAX's splash kernels."""
  if q.dtype not in (jnp.float32, jnp.bfloat16):
    # float16 / float64: the kernels run in float32, the output returns to the input dtype.
    out, lse = splash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                request=request, args=args, interpret=interpret)
    return out.astype(q.dtype), lse
  sizes = splash_block_sizes(request)
  q_pad, kv_pad = _padded_lengths(request, sizes)
  rule = _Rule(offset=_static_offset(args, request), causal=request.spec.causal,
               window=request.spec.window, kv_len=request.kv_len if kv_pad != request.kv_len else None)
  call = _SplashCall(request=request, rule=rule, shape=(q_pad, kv_pad), block_sizes=sizes,
                     interpret=interpret)

  def to_kernel_layout(x, length):  # [b, len, h, d] -> [b, h, len_pad, d]
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

  q = (q.astype(jnp.float32) * request.scale).astype(q.dtype)  # splash does not scale q.k
  q_seg = kv_seg = None
  if request.has_segment_ids:
    q_seg = jnp.pad(args.q_segment_ids, ((0, 0), (0, q_pad - request.q_len)))
    kv_seg = jnp.pad(args.kv_segment_ids, ((0, 0), (0, kv_pad - request.kv_len)))
  out, lse = _splash_attention(call, to_kernel_layout(q, q_pad), to_kernel_layout(k, kv_pad),
                               to_kernel_layout(v, kv_pad), q_seg, kv_seg)
  return jnp.swapaxes(out[:, :, :request.q_len], 1, 2), lse[:, :, :request.q_len]


class JaxSplash:
  name = "jax_splash"
  # No traced_offsets: splash's mask is static (`_static_offset` refuses traced causal offsets).
  capabilities = frozenset({"block_stats"})
  block_size_types = (BlockSizes,)

  def unsupported(self, request: Request, platform: str) -> str | None:
    forced = lowering.interpreting()
    if forced == "gpu":
      return "interpret_as('gpu') (splash attention has TPU kernels only)"
    if forced is None and platform not in ("tpu", "cpu"):
      return f"the {platform} platform (splash attention has TPU kernels only)"
    for feature, present in (("dense mask", request.has_dense_mask), ("dense bias", request.has_bias),
                             ("dropout", request.has_dropout), ("alibi", request.has_alibi),
                             ("global tokens", request.spec.global_tokens > 0),
                             ("mask_mod", request.mask_mod is not None),
                             ("score_mod", request.score_mod is not None)):
      if present:
        return feature
    return None

  def kernel(self, request: Request, platform: str) -> str:
    interpreted = lowering.interpreting() is not None or platform != "tpu"
    return "splash-tpu" + (" (interpret)" if interpreted else "")

  def block_stats(self, request: Request, args: Args, platform: str) -> tuple[int, int] | None:
    """(blocks visited, blocks total) of the forward schedule over batch and heads. Splash skips
    blocks by the static mask only, so segment ids do not reduce the count."""
    sizes = splash_block_sizes(request)
    return block_info.block_stats(request.batch, request.num_heads, request.q_len, request.kv_len,
                             sizes.block_q, sizes.block_kv, request.spec, None, None,
                             args.q_offset, args.kv_offset)

  def attend(self, q, k, v, *, request: Request, args: Args):
    def run(interpret: bool):
      return lambda q, k, v: splash_attention(q, k, v, request=request, args=args,
                                              interpret=interpret)

    if lowering.interpreting() is not None:
      return run(True)(q, k, v)
    # The lowering platform decides: Mosaic on a TPU, the interpreter on a CPU. There is no
    # GPU branch: lowering for a GPU fails there (and `unsupported` refuses a GPU host).
    return lowering.platform_dependent(q, k, v, tpu=run(False), cpu=run(True))
