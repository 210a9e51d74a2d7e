"""Ahead-of-time compiles of flash_pallas for real TPUs (v4, v5e, v5p, v6e), on this CPU host.

`jax.experimental.topologies` gives TPU devices without a TPU; lowering with inputs placed on
one of them runs the dispatcher's TPU branch and the real Mosaic compiler in libtpu. Each
compile must contain our three kernels as `tpu_custom_call`s (not an interpreted fallback),
and XLA's cost analysis must report the FLOPs of our CostEstimates, which must equal the
analytic count: visible (query, key) pairs x (2 head_dim + 2 head_dim_v) per head forward,
x (4 head_dim + 4 head_dim_v) for dK/dV and x (4 head_dim + 2 head_dim_v) for dQ.

The shapes are chosen to cover head_dim 32/64/128, 1,000/2,048/8,192 tokens, causal and packed
segment ids, GQA and MQA, in bfloat16, with a few compiles per generation.

`impl="jax_splash"` (JAX's splash attention behind our contract) compiles the same way, forward
and forward + backward, to splash's own Mosaic kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import flash_layers as fl  # noqa: E402

pytestmark = pytest.mark.aot
pytest.importorskip("libtpu")
topologies = pytest.importorskip("jax.experimental.topologies")

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
KERNELS = ("flash_layers_fwd", "flash_layers_bwd_delta", "flash_layers_bwd_dkv", "flash_layers_bwd_dq")


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  tokens: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  packed: bool = False  # segment ids (traced: values unknown at compile time)
  grad: bool = True  # forward + backward (jax.grad), else forward only
  mesh: bool = True  # compile under set_mesh: the generation's block sizes; else the generic ones


SHAPES = [
    Shape("fwd_causal_2048_d64", 2048, 4, 4, 64, causal=True, grad=False, mesh=False),
    Shape("grad_causal_2048_d64", 2048, 4, 4, 64, causal=True),
    Shape("grad_causal_packed_1000_d32_mqa", 1000, 4, 1, 32, causal=True, packed=True),
    Shape("grad_packed_8192_d128_gqa", 8192, 4, 2, 128, packed=True),
    Shape("grad_causal_4096_d256", 4096, 2, 2, 256, causal=True),  # the generation's tiles, largest VMEM
]


@functools.cache
def _devices(generation: str):
  """The 4 chips of the generation's slice (a 2x2 topology)."""
  return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation]).devices


def _device(generation: str):
  return _devices(generation)[0]


def _compile(generation: str, shape: Shape, dtype=jnp.bfloat16, impl="flash_pallas", **kwargs):
  device = _device(generation)
  placed = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((1, shape.tokens, shape.heads, shape.head_dim), dtype, sharding=placed)
  kv = jax.ShapeDtypeStruct((1, shape.tokens, shape.kv_heads, shape.head_dim), dtype, sharding=placed)
  seg = jax.ShapeDtypeStruct((1, shape.tokens), jnp.int32, sharding=placed)

  def attention(q, k, v, seg):
    return fl.attention(q, k, v, impl=impl, causal=shape.causal,
                        segment_ids=seg if shape.packed else None, **kwargs)

  f = attention
  if shape.grad:
    f = jax.grad(lambda *a: attention(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  if shape.mesh:
    with jax.sharding.set_mesh(jax.sharding.Mesh([device], ("x",))):
      return jax.jit(f).lower(q, kv, kv, seg).compile()
  return jax.jit(f).lower(q, kv, kv, seg).compile()


def _mosaic_kernels(hlo: str) -> list[str]:
  """Names of the Mosaic custom calls in a compiled module, one entry per call."""
  calls = re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\"", hlo)
  return sorted(re.sub(r"\.\d+$", "", name) for name in calls)


def _visible_pairs(shape: Shape) -> int:
  """Causal or full pairs (segment ids are not known at compile time: the estimate ignores
  them, an upper bound for packed sequences)."""
  t = shape.tokens
  return t * (t + 1) // 2 if shape.causal else t * t


def _expected_flops(shape: Shape) -> float:
  d = shape.head_dim
  per_pair = 4 * d + (8 * d + 6 * d if shape.grad else 0)
  return _visible_pairs(shape) * shape.heads * per_pair


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_compiles_to_mosaic_kernels_with_analytic_flops(generation, shape):
  compiled = _compile(generation, shape)
  hlo = compiled.as_text()
  expected = sorted(KERNELS) if shape.grad else ["flash_layers_fwd"]
  assert _mosaic_kernels(hlo) == expected, hlo[:2000]
  # The interpreted kernels would show up as loops or host callbacks, never as tpu_custom_call.
  assert "callback" not in hlo
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # A little work besides the pairs (rowsum(dO * O), the block plan): under 1%.
  np.testing.assert_allclose(cost["flops"], _expected_flops(shape), rtol=0.01)


def test_v5e_float32_with_every_feature():
  """float32, softcap, a window, GQA and head_dim_v != head_dim compile too (other kernel code)."""
  device = _device("v5e")
  placed = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((2, 1000, 4, 80), jnp.float32, sharding=placed)
  k = jax.ShapeDtypeStruct((2, 1000, 2, 80), jnp.float32, sharding=placed)
  v = jax.ShapeDtypeStruct((2, 1000, 2, 48), jnp.float32, sharding=placed)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32, sharding=placed)

  def loss(q, k, v, seg):
    out = fl.attention(q, k, v, impl="flash_pallas", causal=True, window=(256, 0), softcap=30.0,
                       segment_ids=seg, block_sizes=fl.BlockSizes(256, 512, 256, 256))
    return out.sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)


@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_float32_head_dim_256_fits_the_generations_vmem(generation):
  """The largest tiles of each generation (v6e: 1,024 x 1,024 forward) in float32 at head_dim 256:
  the VMEM limit we set must hold them (a compile that overflows VMEM fails)."""
  shape = Shape("grad_causal_4096_d256_f32", 4096, 2, 2, 256, causal=True)
  compiled = _compile(generation, shape, dtype=jnp.float32)
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_gqa_forward_streams_kv_once_per_group(generation):
  """8 query heads on 2 kv heads at head_dim 128 (token-major), forward + backward: the forward's
  and the dQ kernel's q tiles hold a group's 4 heads, so their CostEstimates (in the lowered
  module) count each K/V tile once per q block and kv head: q, out, lse (dQ: q, dO, dQ, lse, D)
  once, plus K and V x q blocks. With one program per query head they would count K and V 4x as
  often."""
  from flash_layers.impls.flash_pallas import tpu_config  # noqa: PLC0415

  device = _device(generation)
  placed = jax.sharding.SingleDeviceSharding(device)
  t, d = 2048, 128
  q = jax.ShapeDtypeStruct((1, t, 8, d), jnp.bfloat16, sharding=placed)
  kv = jax.ShapeDtypeStruct((1, t, 2, d), jnp.bfloat16, sharding=placed)

  def loss(q, k, v):
    return fl.attention(q, k, v, impl="flash_pallas", causal=True).astype(jnp.float32).sum()

  with jax.sharding.set_mesh(jax.sharding.Mesh([device], ("x",))):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)
    compiled = lowered.compile()
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)
  estimates = {name: int(nbytes) for nbytes, name in re.findall(
      r'bytes_accessed\\22:(\d+)[^\n]*?kernel_name = "(\w+)"', lowered.as_text())}
  q_bytes, kv_bytes = t * 8 * d * 2, 2 * t * 2 * d * 2  # q (= out); K and V together
  blocks = tpu_config.DEFAULT_BLOCK_SIZES[generation]
  num_q, num_q_bwd = t // blocks.block_q, t // blocks.backward[0]
  assert estimates["flash_layers_fwd"] == 2 * q_bytes + 8 * t * 4 + kv_bytes * num_q
  assert estimates["flash_layers_bwd_dq"] == 3 * q_bytes + 2 * 8 * t * 4 + kv_bytes * num_q_bwd


def test_cpu_lowering_interprets_instead():
  """The same call lowered for this CPU host runs the TPU kernels interpreted: no Mosaic."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  lowered = jax.jit(lambda q: fl.attention(q, q, q, impl="flash_pallas", causal=True)).lower(q)
  assert "tpu_custom_call" not in lowered.as_text()


def test_dropout_and_alibi_compile_with_no_extra_memory():
  """Dropout and ALiBi inside the Mosaic kernels (v5e, 16k tokens, forward + backward): still our
  three kernels, and compiled temporaries at most 1.2x those without (no [q, kv] mask exists)."""
  shape = Shape("grad_causal_packed_16k_d64", 16384, 4, 4, 64, causal=True, packed=True)
  plain = _compile("v5e", shape)
  extra = _compile("v5e", shape, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                   alibi_slopes=fl.alibi_slopes(4))
  assert _mosaic_kernels(extra.as_text()) == sorted(KERNELS)
  without = plain.memory_analysis().temp_size_in_bytes
  with_dropout = extra.memory_analysis().temp_size_in_bytes
  assert with_dropout <= 1.2 * without, (with_dropout, without)


@pytest.mark.parametrize("impl", ["auto", "flash_pallas"])
def test_flax_attention_fn_on_a_batch_sharded_v5e_slice(impl):
  """flax's own `nn.MultiHeadDotProductAttention` with `fl.attention_fn`, its inputs batch-sharded over
  the 4 chips of a v5e:2x2 slice under `jax.set_mesh`, forward + backward: attention_fn takes
  `fl.attention`'s mesh path (shard_map), so GSPMD never meets a Mosaic kernel it cannot partition,
  and each chip runs our kernels on its batch row."""
  import flax.linen as nn  # noqa: PLC0415

  mesh = fl.make_mesh(data=4, devices=_devices("v5e"))
  layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=256,
                                          attention_fn=fl.attention_fn(impl=impl, causal=True))
  x = jax.ShapeDtypeStruct((4, 256, 128), jnp.bfloat16)
  params = jax.eval_shape(layer.init, jax.random.key(0), x)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated), params)
  x = jax.ShapeDtypeStruct(x.shape, x.dtype,
                           sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))

  def loss(params, x):
    return layer.apply(params, x).astype(jnp.float32).sum()

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  hlo = compiled.as_text()
  assert _mosaic_kernels(hlo) == sorted(KERNELS), hlo[:2000]
  assert "callback" not in hlo
  # Each chip's kernels see its own batch row: the forward kernel's output is [1, ...], not [4, ...].
  outputs = re.findall(r"= ([^\n]*?) custom-call\([^\n]*custom_call_target=\"tpu_custom_call\"", hlo)
  assert len(outputs) == len(KERNELS) and not any("[4," in o for o in outputs), outputs


SPLASH_SHAPES = [
    Shape("fwd_causal_packed_2048_d128_gqa", 2048, 4, 2, 128, causal=True, packed=True, grad=False),
    Shape("grad_causal_packed_2048_d128_gqa", 2048, 4, 2, 128, causal=True, packed=True),
]


@pytest.mark.parametrize("shape", SPLASH_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_jax_splash_compiles_to_splash_kernels(generation, shape):
  """The TPU branch of jax_splash is splash's Mosaic kernels: its forward with residuals (our
  custom VJP keeps the logsumexp) and, for the gradient, its dK/dV and dQ kernels; nothing
  interpreted."""
  hlo = _compile(generation, shape, impl="jax_splash").as_text()
  expected = ["splash_mha_fwd_segmented_residuals"]
  if shape.grad:
    expected += ["splash_mha_dkv_segmented_no_residuals", "splash_mha_dq_segmented_no_residuals"]
  assert _mosaic_kernels(hlo) == sorted(expected), hlo[:2000]
  assert "callback" not in hlo


def test_262k_tokens_on_one_v5p_chip_keep_temporaries_linear():
  """262,144 causal + packed tokens, 2 heads of 64 (head-major operands), forward + backward on
  one v5p: the plan and the temporaries stay linear in the length. Aliasing dQ into a head-major
  dO copy once made XLA keep one more q-sized float32 buffer here (+128 MiB: 772 -> 900 MiB)."""
  shape = Shape("grad_causal_packed_262144_d64", 262144, 2, 2, 64, causal=True, packed=True)
  compiled = _compile("v5p", shape)
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)
  memory = compiled.memory_analysis()
  q_bytes = shape.tokens * shape.heads * shape.head_dim * 2
  # 772 MiB is 12.06 bfloat16 q-sized buffers (64 MiB each); with the alias it was 14.06.
  assert memory.temp_size_in_bytes <= 12.25 * q_bytes, memory.temp_size_in_bytes / 2**20


@pytest.mark.parametrize("cache_layout", ["flax", "heads_first"])
@pytest.mark.parametrize("window", [None, 128], ids=["full_cache", "ring_buffer"])
def test_a_decoding_step_compiles_to_our_mosaic_kernel(window, cache_layout):
  """One token through `fl.MultiHeadAttention(decode=True)` (GQA, rotary, bfloat16, a 2,048-token cache or
  the ring buffer of a 128-key window): the traced cache index reaches our split-KV decode kernel as an
  offset."""
  placed = jax.sharding.SingleDeviceSharding(_device("v5e"))
  layer = fl.MultiHeadAttention(num_heads=8, num_kv_heads=2, causal=True, rope_theta=1e4, impl="flash_pallas",
                                window=None if window is None else (window, 0), decode=True,
                                dtype=jnp.bfloat16, cache_layout=cache_layout)
  shapes = jax.eval_shape(layer.init, jax.random.key(0), jax.ShapeDtypeStruct((4, 2048, 512), jnp.bfloat16))
  on_chip = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed), tree)
  token = jax.ShapeDtypeStruct((4, 1, 512), jnp.bfloat16, sharding=placed)

  def step(params, cache, x):
    y, updated = layer.apply({"params": params, "cache": cache}, x, mutable=["cache"])
    return y, updated["cache"]

  compiled = jax.jit(step, donate_argnums=1).lower(on_chip(shapes["params"]), on_chip(shapes["cache"]),
                                                   token).compile()
  assert _mosaic_kernels(compiled.as_text()) == ["flash_layers_decode"]
  slots = 2048 if window is None else window
  want = (4, slots, 2, 64) if cache_layout == "flax" else (4, 2, slots, 64)
  assert shapes["cache"]["cached_key"].shape == want


@pytest.mark.parametrize("generation", list(TOPOLOGIES))
@pytest.mark.parametrize("head_dim", [64, 256])
def test_decoding_queries_compile_to_the_split_kv_kernel(generation, head_dim):
  """4 queries per row against a ragged 8,192-slot cache (segment ids, traced offset, softcap, GQA 8 on
  2): the decode kernel forward, the family's two backward kernels for the gradient, on every generation."""
  placed = jax.sharding.SingleDeviceSharding(_device(generation))
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  b, t, slots = 2, 4, 8192
  specs = (spec((b, t, 8, head_dim)), spec((b, slots, 2, head_dim)), spec((b, slots, 2, head_dim)),
           spec((b, t), jnp.int32), spec((b, slots), jnp.int32), spec((), jnp.int32))

  def attend(q, k, v, q_seg, kv_seg, offset):
    return fl.attention(q, k, v, impl="flash_pallas", causal=True, segment_ids=q_seg, kv_segment_ids=kv_seg,
                        q_offset=offset, softcap=30.0)

  assert _mosaic_kernels(jax.jit(attend).lower(*specs).compile().as_text()) == ["flash_layers_decode"]
  grad = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert _mosaic_kernels(jax.jit(grad).lower(*specs).compile().as_text()) == sorted(
      ["flash_layers_decode", "flash_layers_bwd_dkv", "flash_layers_bwd_dq"])


def test_a_head_major_cache_reaches_the_decode_kernel_without_a_copy():
  """The decode kernel reads the cache head-major: passed as `k.swapaxes(1, 2)` of a [b, kv_heads, slots, d]
  cache, XLA cancels the transposes (no temporaries); flax's [b, slots, kv_heads, d] layout costs a copy."""
  placed = jax.sharding.SingleDeviceSharding(_device("v5e"))
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  b, slots, kvh, d = 4, 8192, 8, 128
  cache_bytes = b * slots * kvh * d * 2
  common = (spec((b, 1, 32, d)),)
  rest = (spec((b, 1), jnp.int32), spec((b, slots), jnp.int32), spec((), jnp.int32))

  def attend(heads_first):
    def f(q, k, v, q_seg, kv_seg, offset):
      if heads_first:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
      return fl.attention(q, k, v, impl="flash_pallas", causal=True, segment_ids=q_seg,
                          kv_segment_ids=kv_seg, q_offset=offset)
    return f

  head_major = jax.jit(attend(True)).lower(*common, spec((b, kvh, slots, d)), spec((b, kvh, slots, d)),
                                           *rest).compile()
  flax_layout = jax.jit(attend(False)).lower(*common, spec((b, slots, kvh, d)), spec((b, slots, kvh, d)),
                                             *rest).compile()
  assert _mosaic_kernels(head_major.as_text()) == ["flash_layers_decode"]
  assert head_major.memory_analysis().temp_size_in_bytes < cache_bytes / 64
  assert flax_layout.memory_analysis().temp_size_in_bytes >= cache_bytes


MOD_OPTIONS = {
    "prefix_lm": dict(mask_mod=fl.masks.prefix_lm(operand=0)),  # per-row prefixes: an SMEM operand
    "chunked_causal": dict(mask_mod=fl.masks.chunked_causal(512)),
    "score_mod_cap": dict(score_mod=lambda s, *_: 30.0 * jnp.tanh(s / 30.0), causal=True),
}


@pytest.mark.parametrize("generation", list(TOPOLOGIES))
@pytest.mark.parametrize("mods", sorted(MOD_OPTIONS))
def test_mods_compile_into_our_mosaic_kernels(generation, mods):
  """A mask_mod (evaluated on partial tiles; its empty tiles out of the grid) or a score_mod (and its
  derivative in both backward kernels), forward and backward, compiled by Mosaic for every generation."""
  placed = jax.sharding.SingleDeviceSharding(_device(generation))
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  operands = (spec((2,), jnp.int32),) if mods == "prefix_lm" else ()

  def loss(q, k, v, *ops):
    return fl.attention(q, k, v, impl="flash_pallas", mod_operands=ops or None,
                        **MOD_OPTIONS[mods]).astype(jnp.float32).sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
      spec((2, 2048, 4, 128)), spec((2, 2048, 2, 128)), spec((2, 2048, 2, 128)), *operands).compile()
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)


def test_a_131k_token_mask_mod_plan_fits_one_v5p_chip():
  """Prefix-LM at 131,072 tokens (per-row prefixes): the block plan the kernels read from scalar memory
  is 4 words per block row (first tile, tiles, first full tile, full tiles), and the forward and
  backward compile for one v5p chip."""
  placed = jax.sharding.SingleDeviceSharding(_device("v5p"))
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  x = spec((1, 131072, 1, 128))

  def loss(q, k, v, prefix):
    return fl.attention(q, k, v, impl="flash_pallas", mask_mod=fl.masks.prefix_lm(operand=0),
                        mod_operands=(prefix,)).astype(jnp.float32).sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, spec((1,), jnp.int32)).compile()
  assert _mosaic_kernels(compiled.as_text()) == sorted(KERNELS)


def test_a_gather_in_a_mod_fails_to_compile_for_a_tpu_naming_it():
  """`fl.masks.document` reads its operand with index arrays (a gather Mosaic cannot lower): the TPU
  lowering fails naming it and the impls that serve it; interpreted, our kernels run it."""
  placed = jax.sharding.SingleDeviceSharding(_device("v5e"))
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731

  def f(q, k, v, ids):
    return fl.attention(q, k, v, impl="flash_pallas", mask_mod=fl.masks.document(), mod_operands=(ids,))

  with pytest.raises(ValueError, match=r"a gather of more than 64.*TPU \(Mosaic\).*xla_chunked"):
    jax.jit(f).lower(spec((1, 512, 2, 128)), spec((1, 512, 2, 128)), spec((1, 512, 2, 128)),
                     spec((1, 512), jnp.int32)).compile()
