"""mask_mod / score_mod beyond the conformance suite: named mask_mods against the built-in arguments,
tile skipping, the layers and attention_fn, a learned relative bias, and every refusal and bad input.
(tests/test_conformance.py checks every impl's numbers and gradients against the float64 oracle.)"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import flash_layers as fl
import flash_layers.haiku as fl_haiku
import flash_layers.nnx as fl_nnx
from flash_layers.impls.tiling import CpuBlockSizes

B, T, H, KVH, D = 2, 100, 4, 2, 16
SEG = np.ones((B, T), np.int32)
SEG[0, 40:] = 2
SEG[1, 70:] = 3
SEG[1, 90:] = 0

# (impl, block sizes): xla_chunked also with small chunks, one batch row and kv head per step (the
# CPU loop) so fully visible chunks take the unmasked branch.
SERVING = [("reference", None), ("xla_dense", None), ("xla_dense", CpuBlockSizes(loop_bytes=0)),
           ("xla_native", None), ("xla_chunked", None), ("xla_chunked", CpuBlockSizes(32, 16, loop_bytes=0))]


def _qkv(seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, KVH, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, T, KVH, D)), jnp.float32)
  return q, k, v


BUILTIN_PAIRS = {
    "causal": (dict(causal=True), dict(mask_mod=fl.masks.causal())),
    "window": (dict(window=(5, 3)), dict(mask_mod=fl.masks.sliding_window(5, 3))),
    "document": (dict(segment_ids=SEG), dict(mask_mod=fl.masks.document(), mod_operands=(SEG,))),
    "document_causal": (dict(segment_ids=SEG, causal=True),
                        dict(mask_mod=fl.masks.document() & fl.masks.causal(), mod_operands=(SEG,))),
}


@pytest.mark.parametrize("rule", sorted(BUILTIN_PAIRS))
@pytest.mark.parametrize(("impl", "sizes"), SERVING, ids=lambda x: str(x) if x is None or isinstance(x, str)
                         else "small_chunks_looped")
def test_named_mask_mods_equal_the_builtin_arguments(impl, sizes, rule):
  q, k, v = _qkv()
  builtin, named = BUILTIN_PAIRS[rule]
  kw = {} if sizes is None else {"block_sizes": sizes}

  def run(options):
    def loss(q, k, v):
      out = fl.attention(q, k, v, impl=impl, **options, **kw)
      return jnp.sum(out ** 2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  (out_a, grads_a), (out_b, grads_b) = run(builtin), run(named)
  np.testing.assert_array_equal(out_a, out_b)
  for a, b in zip(grads_a, grads_b, strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["tpu", "gpu"])
@pytest.mark.parametrize("rule", sorted(BUILTIN_PAIRS))
def test_named_mask_mods_equal_the_builtin_arguments_in_our_kernels(family, rule):
  """flash_pallas (interpreted): a named mask_mod visits the same tiles as the built-in argument, in the
  same order (the GPU kernels walk a block list full blocks first, as they walk an arithmetic range:
  interior, then edges): identical outputs; gradients equal to float32 rounding."""
  q, k, v = _qkv()
  builtin, named = BUILTIN_PAIRS[rule]

  def run(options):
    f = lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", **options)  # noqa: E731
    def loss(q, k, v):
      out = f(q, k, v)
      return jnp.sum(out ** 2), out

    with fl.interpret_as(family):  # one program: the output and its gradients
      (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  (out_a, grads_a), (out_b, grads_b) = run(builtin), run(named)
  np.testing.assert_array_equal(out_a, out_b)
  for a, b in zip(grads_a, grads_b, strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_impls_refuse_what_they_cannot_serve_by_name_and_say_who_serves_it():
  q, k, v = _qkv()
  table = jnp.zeros((H, 9), jnp.float32)

  def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, jnp.clip(kv_idx - q_idx, -4, 4) + 4]

  with fl.interpret_as("tpu"):
    for options, feature in ((dict(mask_mod=fl.masks.causal()), "mask_mod"),
                             (dict(score_mod=lambda s, *_: s), "score_mod")):
      with pytest.raises(fl.UnsupportedError, match=rf"jax_splash.*{feature}.*impls that do: .*xla_chunked"):
        fl.attention(q, k, v, impl="jax_splash", **options)
  # Our kernels accumulate a score_mod's float operands' gradients in one float32 partial per program,
  # of at most kernel_mods.MAX_GRAD_ELEMENTS elements.
  for platform in ("tpu", "gpu"):
    refusal = r"flash_pallas.*score_mod operand gradients of mod_operands of 4096 elements.*impls that do"
    with fl.interpret_as(platform), pytest.raises(fl.UnsupportedError, match=refusal):
      fl.attention(q, k, v, impl="flash_pallas", score_mod=relative_bias,
                   mod_operands=(jnp.zeros((H, 1024), jnp.float32),))
  with pytest.raises(fl.UnsupportedError, match="xla_native.*score_mod"):
    fl.attention(q, k, v, impl="xla_native", score_mod=lambda s, *_: s)
  # The TPU kernels hold the operands in scalar memory, beside the block plan.
  with fl.interpret_as("tpu"), pytest.raises(fl.UnsupportedError, match=r"mod_operands of 200000 elements"):
    fl.attention(q, k, v, impl="flash_pallas", mask_mod=fl.masks.prefix_lm(operand=0),
                 mod_operands=(np.zeros(200_000, np.int32),))
  # "auto" for a TPU or a GPU runs a mask_mod and a learned score_mod table in our kernels.
  from flash_layers import auto, validate
  for options in (dict(mask_mod=fl.masks.causal()), dict(score_mod=relative_bias, mod_operands=(table,))):
    for platform in ("tpu", "cuda"):
      assert auto.resolve("auto", validate.prepare(q, k, v, **options)[0], platform)[0] == "flash_pallas"


def _visible_tiles(visible: np.ndarray, bq: int, bk: int) -> int:
  """Tiles [bq, bk] of a [t, s] element mask that hold a visible pair."""
  t, s = visible.shape
  padded = np.zeros((-(-t // bq) * bq, -(-s // bk) * bk), bool)
  padded[:t, :s] = visible
  return int(padded.reshape(padded.shape[0] // bq, bq, -1, bk).any((1, 3)).sum())


@pytest.mark.parametrize("name", ["chunked_causal", "prefix_lm", "block_table"])
def test_xla_chunked_visits_only_the_tiles_a_mask_mod_shows(name):
  """explain's count comes from the block map xla_chunked runs: exactly the tiles holding a visible
  pair (computed here from the element mask in NumPy)."""
  t, bq, bk = 4096, 256, 256
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  table = np.random.default_rng(1).random((t // 512, t // 512)) < 0.3
  mods = {"chunked_causal": (fl.masks.chunked_causal(1000), (), (j <= i) & (i // 1000 == j // 1000)),
          "prefix_lm": (fl.masks.prefix_lm(operand=0), (np.array([700], np.int32),), (j <= i) | (j < 700)),
          "block_table": (fl.masks.block_table(0, 512, 512), (table,), table[i // 512, j // 512])}
  mask_mod, operands, visible = mods[name]
  q = jax.ShapeDtypeStruct((1, t, 1, 32), jnp.float32)
  ex = fl.explain(q, q, q, impl="xla_chunked", mask_mod=mask_mod, mod_operands=operands,
                  block_sizes=CpuBlockSizes(bq, bk))
  assert ex.blocks_visited == _visible_tiles(visible, bq, bk)
  assert ex.blocks_total == (t // bq) * (t // bk)
  assert "mask_mod=masks." in str(ex)


def test_named_mask_mods_hash_by_value_and_describe_themselves():
  assert fl.masks.causal() == fl.masks.causal()
  assert hash(fl.masks.sliding_window(4)) == hash(fl.masks.sliding_window(4, 4))
  assert fl.masks.prefix_lm(operand=0) != fl.masks.prefix_lm(operand=1)
  assert (fl.masks.document() & fl.masks.causal()).describe() == (
      "(masks.Document(operand=0, kv_operand=0) & masks.Causal())")
  i, j = jnp.arange(12)[:, None], jnp.arange(12)[None, :]
  np.testing.assert_array_equal(fl.masks.dilated(3)(0, 0, i, j), (i - j) % 3 == 0)
  np.testing.assert_array_equal((fl.masks.sliding_window(2) | fl.masks.global_tokens(1))(0, 0, i, j),
                                (abs(i - j) <= 2) | (i < 1) | (j < 1))


@pytest.mark.parametrize(("factory", "args", "match"), [
    (fl.masks.sliding_window, (-1,), "left"),
    (fl.masks.chunked_causal, (0,), "chunk"),
    (fl.masks.dilated, (1.5,), "dilation"),
    (fl.masks.prefix_lm, (), "exactly one"),
    (fl.masks.document, ("0",), "operand"),
    (fl.masks.block_table, (0, 0, 8), "block_q"),
    (fl.masks.all_of, (), "one or more"),
])
def test_named_mask_mods_refuse_bad_arguments(factory, args, match):
  with pytest.raises(ValueError, match=match):
    factory(*args)


def test_bad_mods_are_refused_by_name():
  q, k, v = _qkv()
  with pytest.raises(TypeError, match="mask_mod must be a callable"):
    fl.attention(q, k, v, mask_mod="causal")
  with pytest.raises(TypeError, match="score_mod must be a callable"):
    fl.attention(q, k, v, score_mod=1.0)
  with pytest.raises(TypeError, match="mod_operands must be a tuple"):
    fl.attention(q, k, v, score_mod=lambda s, *_: s, mod_operands=np.ones(3))
  with pytest.raises(ValueError, match="mod_operands were given without"):
    fl.attention(q, k, v, mod_operands=(np.ones(3),))
  with pytest.raises(TypeError, match=r"mod_operands\[0\] must be an array"):
    fl.attention(q, k, v, score_mod=lambda s, *_: s, mod_operands=("x",))
  with pytest.raises(TypeError, match="mask_mod must return a bool array"):
    fl.attention(q, k, v, impl="xla_chunked", mask_mod=lambda b, h, i, j: i - j)
  with pytest.raises(TypeError, match="score_mod must return a floating-point array"):
    fl.attention(q, k, v, impl="reference", score_mod=lambda s, b, h, i, j: i > j)
  # On a mesh the operands' layout is declared by name (tests/test_context_parallel.py runs them).
  with pytest.raises(ValueError, match=r"mod_operand_axes\[0\] must be None or a tuple"):
    fl.attention(q, k, v, score_mod=lambda s, *_: s, mod_operands=(np.ones(3),), mod_operand_axes=("batch",))


def test_a_relative_bias_table_trains_through_score_mod():
  """A T5-style table [heads, buckets] read by a score_mod learns the table that made the targets:
  the loss falls below 5% of its start (xla_chunked, several chunks, the CPU loop)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 96, 2, 8)), jnp.float32) for _ in range(3))

  def rel_bias(score, b, h, i, j, table):
    return score + table[h, jnp.clip(i - j, -4, 4) + 4]

  def attend(table):
    return fl.attention(q, k, v, impl="xla_chunked", score_mod=rel_bias, mod_operands=(table,),
                        block_sizes=CpuBlockSizes(32, 32, loop_bytes=0))

  target = attend(jnp.asarray(rng.standard_normal((2, 9)) * 2, jnp.float32))
  loss = jax.jit(lambda table: jnp.mean((attend(table) - target) ** 2))
  step = jax.jit(lambda table: table - 20.0 * jax.grad(loss)(table))
  table = jnp.zeros((2, 9), jnp.float32)
  start = float(loss(table))
  for _ in range(150):
    table = step(table)
  assert float(loss(table)) < 0.05 * start


def test_layers_take_mods_and_their_operands():
  """linen, NNX and Haiku layers with mask_mod/score_mod fields: the same output as the built-in
  arguments (causal) and as fl.attention with the same mods (prefix-LM operand)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 32)), jnp.float32)
  prefix = np.array([5, 12], np.int32)
  layer = fl.MultiHeadAttention(num_heads=4, impl="xla_chunked", causal=True)
  params = layer.init(jax.random.key(0), x)
  modded = fl.MultiHeadAttention(num_heads=4, impl="xla_chunked", mask_mod=fl.masks.causal())
  np.testing.assert_array_equal(layer.apply(params, x), modded.apply(params, x))

  prefix_layer = fl.MultiHeadAttention(num_heads=4, impl="xla_chunked",
                                       mask_mod=fl.masks.prefix_lm(operand=0))
  out = prefix_layer.apply(params, x, mod_operands=(prefix,))
  causal_out = layer.apply(params, x)
  assert not np.allclose(out, causal_out)  # the prefix rows see more than the causal ones

  nnx_layer = fl_nnx.MultiHeadAttention(num_heads=4, in_features=32, impl="xla_chunked",
                                        mask_mod=fl.masks.prefix_lm(operand=0), rngs=nnx.Rngs(0))
  nnx.update(nnx_layer, nnx.State(fl_nnx.params_from_linen(params["params"])))
  np.testing.assert_allclose(nnx_layer(x, mod_operands=(prefix,)), out, rtol=1e-6, atol=1e-6)

  def hk_forward(x):
    return fl_haiku.MultiHeadAttention(num_heads=4, impl="xla_chunked",
                                       mask_mod=fl.masks.prefix_lm(operand=0))(x, mod_operands=(prefix,))

  hk_params = fl_haiku.params_from_flax(params["params"])
  np.testing.assert_allclose(hk.transform(hk_forward).apply(hk_params, None, x), out, rtol=1e-6, atol=1e-6)
  with pytest.raises(TypeError, match="mask_mod must be a callable"):
    fl.MultiHeadAttention(num_heads=4, mask_mod=True).init(jax.random.key(0), x)


def test_attention_fn_takes_mods():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 32)), jnp.float32)
  causal = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fl.attention_fn(impl="xla_dense"))
  params = causal.init(jax.random.key(0), x)
  expected = causal.apply(params, x, mask=nn.make_causal_mask(jnp.ones((2, 24))))
  modded = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=fl.attention_fn(impl="xla_dense", mask_mod=fl.masks.causal()))
  np.testing.assert_allclose(modded.apply(params, x), expected, rtol=1e-6, atol=1e-6)


def test_a_prebuilt_block_mask_is_reused_by_every_layer(monkeypatch):
  """fl.block_mask evaluates the mask_mod on the tile grid once; two attention calls (two layers)
  given it evaluate no tile flags of their own, and give what the mask_mod alone gives."""
  from flash_layers.contract import block_info

  q, k, v = _qkv()
  prefix = jnp.array([10, 60], jnp.int32)
  mm = fl.masks.prefix_lm(operand=0)
  calls = []
  real = block_info.tile_flags
  monkeypatch.setattr(block_info, "tile_flags", lambda *a, **kw: calls.append(1) or real(*a, **kw))

  @jax.jit
  def two_layers(q, k, v, prefix):
    bm = fl.block_mask(mm, batch=B, q_len=T, mod_operands=(prefix,), block_q=32, block_kv=16)
    x = fl.attention(q, k, v, impl="xla_chunked", block_mask=bm, mod_operands=(prefix,))
    return fl.attention(x, k, v, impl="xla_chunked", block_mask=bm, mod_operands=(prefix,))

  out = two_layers(q, k, v, prefix)
  assert len(calls) == 1
  x = fl.attention(q, k, v, impl="reference", mask_mod=mm, mod_operands=(prefix,))
  expected = fl.attention(x, k, v, impl="reference", mask_mod=mm, mod_operands=(prefix,))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  bm = fl.block_mask(mm, batch=B, q_len=T, mod_operands=(prefix,), block_q=32, block_kv=16)
  assert (bm.block_q, bm.block_kv, bm.any.shape) == (32, 16, (B, 4, 7))
  ex = fl.explain(q, k, v, impl="xla_chunked", block_mask=bm, mod_operands=(prefix,))
  assert ex.blocks_visited == int(bm.tiles_visited) * H
  assert "tile flags from the block_mask" in str(ex)
  built = fl.explain(q, k, v, impl="xla_chunked", mask_mod=mm, mod_operands=(prefix,))
  assert "mask_mod evaluated on 10,000 pairs per row" in str(built)


def test_block_mask_mismatches_are_refused():
  q, k, v = _qkv()
  bm = fl.block_mask(fl.masks.causal(), batch=B, q_len=T, block_q=32, block_kv=32)
  with pytest.raises(ValueError, match="mask_mod differs from the block_mask"):
    fl.attention(q, k, v, block_mask=bm, mask_mod=fl.masks.sliding_window(3))
  with pytest.raises(ValueError, match="block_mask was built for q_len 100, kv_len 100"):
    fl.attention(q[:, :50], k[:, :50], v[:, :50], block_mask=bm)
  with pytest.raises(ValueError, match="differ from the block_mask's tiles"):
    fl.attention(q, k, v, impl="xla_chunked", block_mask=bm, block_sizes=CpuBlockSizes(64, 64))
  with pytest.raises(TypeError, match="block_mask must be a flash_layers.block_mask"):
    fl.attention(q, k, v, block_mask=np.ones((2, 4, 4), bool))
  with pytest.raises(ValueError, match="block_mask q_len must be an int >= 1"):
    fl.block_mask(fl.masks.causal(), batch=1, q_len=0)
  # Served by every impl that serves mask_mod: the dense ones evaluate the mask elementwise.
  np.testing.assert_array_equal(fl.attention(q, k, v, impl="xla_dense", block_mask=bm),
                                fl.attention(q, k, v, impl="xla_dense", causal=True))


def test_our_tpu_kernels_take_a_block_masks_tiles_and_reuse_its_flags():
  """Given `block_mask=` (tiles multiples of 128), the TPU kernels tile by it and read its flags instead
  of evaluating the mask_mod on their tiles again (no `lax.map` of `block_info.tile_flags` in the call); the
  output and gradients equal the reference's."""
  t = 1024
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 32)), jnp.float32) for _ in range(3))
  prefix = np.array([300], np.int32)
  mask_mod = fl.masks.prefix_lm(operand=0)
  bm = fl.block_mask(mask_mod, batch=1, q_len=t, mod_operands=(prefix,), block_q=256, block_kv=256)

  def f(q, k, v, impl, **kw):
    return fl.attention(q, k, v, impl=impl, mod_operands=(prefix,), **kw)

  with fl.interpret_as("tpu"):
    with_bm = str(jax.make_jaxpr(lambda q, k, v: f(q, k, v, "flash_pallas", block_mask=bm))(q, k, v))
    without = str(jax.make_jaxpr(lambda q, k, v: f(q, k, v, "flash_pallas", mask_mod=mask_mod))(q, k, v))
    assert "scan" not in with_bm and "scan" in without
    got = jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, "flash_pallas", block_mask=bm) ** 2),
                             argnums=(0, 1, 2))(q, k, v)
  want = jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, "reference", mask_mod=mask_mod) ** 2),
                            argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_explain_takes_shapes_for_mod_operands():
  """An AOT user explains a call before any array exists: a prefix-LM operand given as a
  ShapeDtypeStruct names the kernel and leaves the counts that need its values unknown."""
  q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
  prefix = jax.ShapeDtypeStruct((2,), jnp.int32)
  e = fl.explain(q, q, q, impl="flash_pallas", mask_mod=fl.masks.prefix_lm(operand=0), mod_operands=(prefix,))
  assert e.impl == "flash_pallas" and e.kernel.startswith("pallas-")
  assert e.grid_steps is None and e.blocks_visited is None
  concrete = fl.explain(q, q, q, impl="flash_pallas", mask_mod=fl.masks.prefix_lm(operand=0),
                        mod_operands=(jnp.array([100, 900], jnp.int32),))
  assert concrete.blocks_visited is not None and concrete.blocks_visited < concrete.blocks_total
