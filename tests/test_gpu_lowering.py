"""Lower flash_pallas for CUDA on this CPU host and check our Triton kernels are in the module.

No GPU is needed: `lower(lowering_platforms=("cuda",))` runs the Pallas Triton
lowering, which catches shapes and ops Triton cannot take (the interpret-mode
tests cannot). No `interpret_as` here: the dispatcher must pick the GPU family
because the computation is lowered for CUDA.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import flash_layers as fl
from flash_layers.impls.flash_pallas import gpu_config


def _can_lower_triton_for_cuda() -> bool:
  """jaxlib <= 0.10.2 puts the Triton IR in the module for XLA to compile; newer jaxlibs compile it
  while lowering, which needs the CUDA plugin's Triton compiler even on a CPU host."""
  try:
    from jax._src.lib import triton
    from jax._src.lib import version as jaxlib_version
  except ImportError:
    return False
  return jaxlib_version <= (0, 10, 2) or triton.has_compilation_handler("cuda")


pytestmark = pytest.mark.skipif(not _can_lower_triton_for_cuda(),
                                reason="this jaxlib lowers Triton for CUDA only with its CUDA plugin")

TRITON_CALL = re.compile(r"custom_call @(__gpu\$xla\.gpu\.triton|triton_kernel_call_ffi)")
KERNEL_NAME = re.compile(r'name = "(flash_pallas_gpu_[a-z_]+)"')
NUM_WARPS = re.compile(r"num_warps = (\d+)")

FORWARD = ["flash_pallas_gpu_forward"]
FORWARD_BACKWARD = FORWARD + ["flash_pallas_gpu_backward_dkv", "flash_pallas_gpu_backward_dq"]


def _lower_for_cuda(fn, *specs) -> str:
  return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _specs(batch, length, heads, kv_heads, head_dim, dtype=jnp.bfloat16, segments=False):
  specs = [jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype),
           jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), dtype),
           jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), dtype)]
  if segments:
    specs.append(jax.ShapeDtypeStruct((batch, length), jnp.int32))
  return specs


SHAPES = {
    # name: (batch, length, heads, kv_heads, head_dim, attention kwargs, packed segment ids?)
    "d32_mha": (2, 256, 4, 4, 32, {}, False),
    "d64_gqa_causal": (1, 512, 8, 2, 64, {"causal": True}, False),
    "d128_packed_causal": (2, 384, 4, 4, 128, {"causal": True}, True),
    "d64_length_333_window_softcap": (1, 333, 2, 1, 64, {"window": (32, 0), "softcap": 20.0}, False),
    # masked loads: 1000 rows (no block multiple) and head_dim 80 (no power of two), unpadded
    "d80_length_1000_causal": (1, 1000, 4, 2, 80, {"causal": True}, False),
}


@pytest.mark.parametrize("name", SHAPES)
def test_forward_and_backward_lower_to_our_triton_kernels(name):
  batch, length, heads, kv_heads, head_dim, kwargs, segments = SHAPES[name]

  def forward(q, k, v, *seg):
    seg_kwargs = {"segment_ids": seg[0]} if seg else {}
    return fl.attention(q, k, v, impl="flash_pallas", **kwargs, **seg_kwargs)

  def forward_backward(q, k, v, *seg):
    return jax.grad(lambda q, k, v: forward(q, k, v, *seg).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

  specs = _specs(batch, length, heads, kv_heads, head_dim, segments=segments)
  fwd_text = _lower_for_cuda(forward, *specs)
  assert len(TRITON_CALL.findall(fwd_text)) == 1
  assert KERNEL_NAME.findall(fwd_text) == FORWARD
  both_text = _lower_for_cuda(forward_backward, *specs)
  assert len(TRITON_CALL.findall(both_text)) == 3
  assert sorted(KERNEL_NAME.findall(both_text)) == sorted(FORWARD_BACKWARD)


def test_launch_parameters_come_from_the_config_table():
  specs = _specs(1, 256, 2, 2, 128)
  text = _lower_for_cuda(lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas"), *specs)
  assert NUM_WARPS.findall(text) == [str(gpu_config.CONFIG_TABLE[("hopper", 128)].num_warps)]
  override = fl.GpuBlockSizes(num_warps=2)
  text = _lower_for_cuda(lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", block_sizes=override),
                         *specs)
  assert NUM_WARPS.findall(text) == ["2"]


def test_float32_lowers_too():
  specs = _specs(1, 100, 2, 1, 64, dtype=jnp.float32)
  text = _lower_for_cuda(
      lambda q, k, v: jax.grad(lambda q: fl.attention(q, k, v, impl="flash_pallas", causal=True).sum())(q),
      *specs)
  assert sorted(KERNEL_NAME.findall(text)) == sorted(FORWARD_BACKWARD)


def test_dropout_and_alibi_lower_to_our_triton_kernels():
  """The in-kernel hash (int32 multiply, xor, logical shifts) and ALiBi lower through Triton."""
  specs = _specs(2, 384, 4, 2, 64, segments=True)

  def loss(q, k, v, seg):
    out = fl.attention(q, k, v, impl="flash_pallas", causal=True, segment_ids=seg, dropout_rate=0.1,
                       dropout_rng=jax.random.key(0), alibi_slopes=fl.alibi_slopes(4))
    return out.astype(jnp.float32).sum()

  text = _lower_for_cuda(jax.grad(loss, (0, 1, 2)), *specs)
  assert sorted(KERNEL_NAME.findall(text)) == sorted(FORWARD_BACKWARD)


@pytest.mark.parametrize("window", [None, 64], ids=["full_cache", "ring_buffer"])
def test_a_decoding_step_lowers_to_our_triton_kernel(window):
  """One token through `fl.MultiHeadAttention(decode=True)` (GQA, rotary, bfloat16, a 1,024-token cache or
  a 64-key window's ring buffer): the traced cache index reaches our split-KV decode kernel as an offset."""
  layer = fl.MultiHeadAttention(num_heads=8, num_kv_heads=2, causal=True, rope_theta=1e4, impl="flash_pallas",
                                window=None if window is None else (window, 0), decode=True,
                                dtype=jnp.bfloat16)
  shapes = jax.eval_shape(layer.init, jax.random.key(0), jax.ShapeDtypeStruct((2, 1024, 512), jnp.bfloat16))

  def step(params, cache, x):
    y, updated = layer.apply({"params": params, "cache": cache}, x, mutable=["cache"])
    return y, updated["cache"]

  token = jax.ShapeDtypeStruct((2, 1, 512), jnp.bfloat16)
  text = _lower_for_cuda(step, shapes["params"], shapes["cache"], token)
  assert len(TRITON_CALL.findall(text)) == 1
  assert KERNEL_NAME.findall(text) == ["flash_pallas_gpu_decode"]


@pytest.mark.parametrize(("q_len", "heads", "kv_heads", "head_dim", "dtype"), [
    (1, 32, 8, 128, jnp.bfloat16), (16, 8, 1, 64, jnp.float16), (3, 4, 4, 256, jnp.float32)])
def test_decoding_queries_lower_to_the_split_kv_kernel_and_back(q_len, heads, kv_heads, head_dim, dtype):
  """A few queries against a ragged 8,000-slot cache (traced offset, softcap): the forward is the split-KV
  decode kernel, the gradient adds the family's two backward kernels."""
  b, slots = 2, 8000
  specs = [jax.ShapeDtypeStruct((b, q_len, heads, head_dim), dtype),
           jax.ShapeDtypeStruct((b, slots, kv_heads, head_dim), dtype),
           jax.ShapeDtypeStruct((b, slots, kv_heads, head_dim), dtype),
           jax.ShapeDtypeStruct((b, q_len), jnp.int32), jax.ShapeDtypeStruct((b, slots), jnp.int32),
           jax.ShapeDtypeStruct((), jnp.int32)]

  def attend(q, k, v, q_seg, kv_seg, offset):
    return fl.attention(q, k, v, impl="flash_pallas", causal=True, segment_ids=q_seg, kv_segment_ids=kv_seg,
                        q_offset=offset, softcap=20.0)

  assert KERNEL_NAME.findall(_lower_for_cuda(attend, *specs)) == ["flash_pallas_gpu_decode"]
  grad = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert sorted(KERNEL_NAME.findall(_lower_for_cuda(grad, *specs))) == sorted(
      ["flash_pallas_gpu_decode", "flash_pallas_gpu_backward_dkv", "flash_pallas_gpu_backward_dq"])


@pytest.mark.parametrize("mods", ["prefix_lm", "chunked_causal", "score_mod_cap"])
def test_mods_lower_to_our_triton_kernels(mods):
  """A mask_mod (prefix-LM with per-row prefixes in an operand, chunked causal) or a score_mod (a tanh
  cap) inside our three kernels, forward and backward."""
  specs = _specs(2, 512, 4, 2, 64)
  options = {"prefix_lm": dict(mask_mod=fl.masks.prefix_lm(operand=0)),
             "chunked_causal": dict(mask_mod=fl.masks.chunked_causal(128)),
             "score_mod_cap": dict(score_mod=lambda s, *_: 30.0 * jnp.tanh(s / 30.0), causal=True)}[mods]
  operands = (jax.ShapeDtypeStruct((2,), jnp.int32),) if mods == "prefix_lm" else ()

  def loss(q, k, v, *ops):
    return fl.attention(q, k, v, impl="flash_pallas", mod_operands=ops or None, **options).astype(
        jnp.float32).sum()

  text = _lower_for_cuda(jax.grad(loss, (0, 1, 2)), *specs, *operands)
  assert sorted(KERNEL_NAME.findall(text)) == sorted(FORWARD_BACKWARD)


def test_a_gather_in_a_mod_fails_to_lower_naming_it():
  """`fl.masks.document` reads its operand with index arrays: our kernels run it interpreted, but the
  CUDA lowering fails naming the gather and the impls that serve it."""
  q, k, v, seg = _specs(2, 100, 4, 2, 16, segments=True)

  def f(q, k, v, seg):
    return fl.attention(q, k, v, impl="flash_pallas", mask_mod=fl.masks.document(), mod_operands=(seg,))

  with pytest.raises(ValueError, match=r"a gather of more than 64.*GPU \(Triton\).*xla_chunked"):
    _lower_for_cuda(f, q, k, v, seg)
