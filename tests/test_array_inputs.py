"""Every public entry point takes NumPy arrays, jax arrays and Python numbers alike, with identical results.

A seeded sweep: each entry point is called once with NumPy inputs (and NumPy/Python scalars where a
number is taken) and once with the same values as jax arrays, at batch 1 and 2 and at lengths on
and off xla_chunked's chunk boundaries; the two results must be bit-identical. The calls run
eagerly, as a user's would: under `jax.jit` every argument is a tracer already, which hides a NumPy
array's trouble. FLASH_LAYERS_ARRAY_SWEEP=1 adds longer lengths and more impls.
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl
import flash_layers.nnx as fl_nnx
from flash_layers import models
from flash_layers.impls import xla_chunked

WIDE = os.environ.get("FLASH_LAYERS_ARRAY_SWEEP", "") not in ("", "0")
CHUNK = xla_chunked.DEFAULT_BLOCK_Q
# (batch, length, impl): batch 1 and 2; a length <= CHUNK is one whole chunk, CHUNK + 8 two padded
# ones. Each case compiles its impl twice, so the default sweep is a small cover of the grid.
CASES = [(1, 16, "xla_chunked"), (2, CHUNK + 8, "xla_chunked"), (2, 13, "xla_dense")]
if WIDE:
  CASES += [(b, t, impl) for b in (1, 2) for t in (16, 13, CHUNK, CHUNK + 8)
            for impl in ("xla_chunked", "xla_dense", "reference", "auto", "xla_native")]
SHAPES = [(1, 16), (2, 13)] + ([(2, 16), (1, CHUNK), (2, CHUNK + 8)] if WIDE else [])
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 8


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _segments(rng, batch, length):
  """Two documents and a padded tail per row (id 0)."""
  seg = np.ones((batch, length), np.int32)
  seg[:, length // 2:] = 2
  seg[:, length - length // 5:] = 0
  return seg


def _qkv(seed, batch, length):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, length, HEADS, HEAD_DIM), np.float32)
  k = rng.standard_normal((batch, length, KV_HEADS, HEAD_DIM), np.float32)
  v = rng.standard_normal((batch, length, KV_HEADS, HEAD_DIM), np.float32)
  return rng, q, k, v


def _as_jax(tree):
  return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, tree)


# ----------------------------------------------------------------------------
# fl.attention and fl.explain
# ----------------------------------------------------------------------------

def _jax_reference(q, k, v, seg, causal):
  mask = seg[:, None, :, None] == seg[:, None, None, :]
  if causal:
    mask &= jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
  return jax.nn.dot_product_attention(q, k, v, mask=mask)


@pytest.mark.parametrize("batch,length,impl", CASES)
def test_attention_numpy_equals_jax(batch, length, impl):
  rng, q, k, v = _qkv(batch * 1000 + length, batch, length)
  seg, causal = _segments(rng, batch, length), bool(length % 2)
  got = fl.attention(q, k, v, impl=impl, segment_ids=seg, causal=np.bool_(causal))
  q, k, v, seg = (jnp.asarray(x) for x in (q, k, v, seg))
  want = fl.attention(q, k, v, impl=impl, segment_ids=seg, causal=causal)
  _same(got, want)
  # Right, not only equal: jax's own attention with the same mask.
  np.testing.assert_allclose(want, _jax_reference(q, k, v, seg, causal), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla_chunked"] + (["reference", "auto", "xla_dense"] if WIDE else []))
def test_every_array_argument_numpy_equals_jax(impl):
  """Segment ids, ALiBi slopes, bias, the dropout key and the numbers beside them."""
  rng, q, k, v = _qkv(1, 1, 16)
  kwargs = dict(segment_ids=_segments(rng, 1, 16), scale=np.float32(0.25),
                alibi_slopes=np.asarray(fl.alibi_slopes(HEADS)), dropout_rate=np.float64(0.25),
                dropout_rng=np.asarray(jax.random.PRNGKey(2)),
                bias=0.5 * rng.standard_normal((1, HEADS, 16, 16), np.float32))
  got = fl.attention(q, k, v, impl=impl, **kwargs)
  jax_kwargs = {**_as_jax(kwargs), "scale": 0.25, "dropout_rate": 0.25}
  want = fl.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl, **jax_kwargs)
  _same(got, want)


def test_python_scalars_where_numbers_or_broadcast_arrays_go():
  """A Python float bias broadcasts like a 0-d array; window and offsets given as NumPy ints."""
  rng, q, k, v = _qkv(7, 2, 16)
  got = fl.attention(q, k, v, impl="reference", bias=0.75, window=np.array([3, 1]),
                     global_tokens=np.int64(0), causal=np.bool_(False), softcap=np.float64(20.0))
  want = fl.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl="reference",
                      bias=jnp.full((1, 1, 1, 1), 0.75, jnp.float32), window=(3, 1), softcap=20.0)
  _same(got, want)


@pytest.mark.parametrize("batch,length", SHAPES)
def test_explain_numpy_equals_jax(batch, length):
  rng, q, k, v = _qkv(3, batch, length)
  seg = _segments(rng, batch, length)
  for impl in ("auto", "xla_chunked"):
    got = fl.explain(q, k, v, impl=impl, segment_ids=seg, window=np.int32(4))
    want = fl.explain(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl,
                      segment_ids=jnp.asarray(seg), window=4)
    assert got == want
    # Abstract arguments (segment ids included) choose the same impl, without block counts.
    q_abs, kv_abs = jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)
    abstract = fl.explain(q_abs, kv_abs, kv_abs, impl=impl, window=4,
                          segment_ids=jax.ShapeDtypeStruct(seg.shape, np.int16))
    assert (abstract.impl, abstract.kernel) == (got.impl, got.kernel)


# ----------------------------------------------------------------------------
# The regression: NumPy segment ids at batch 1 and a whole number of chunks
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl,length",
                         [("xla_chunked", 16), ("auto", 1024)] + ([("xla_chunked", CHUNK)] if WIDE else []))
def test_numpy_segment_ids_at_batch_1_whole_chunks(impl, length):
  """Was TracerArrayConversionError: xla_chunked indexed the NumPy ids with a traced chunk index
  once the size-1 batch axis was squeezed ("auto" takes xla_chunked from 1,024 keys on a CPU)."""
  _, q, k, v = _qkv(11, 1, length)
  seg = np.ones((1, length), np.int32)
  got = fl.attention(q, k, v, impl=impl, segment_ids=seg)
  want = jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------
# The layers, attention_fn, the models, dropout_mask
# ----------------------------------------------------------------------------

FEATURES = HEADS * HEAD_DIM


def _layer_inputs(batch, length):
  rng = np.random.default_rng(batch + length)
  x = rng.standard_normal((batch, length, FEATURES), np.float32)
  return x, _segments(rng, batch, length)


@pytest.mark.parametrize("batch,length", SHAPES[:1] + (SHAPES[1:] if WIDE else []))
def test_linen_layer_numpy_equals_jax(batch, length):
  layer = fl.MultiHeadAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, impl="xla_chunked",
                                dropout_rate=0.25)
  x, seg = _layer_inputs(batch, length)
  params = layer.init(jax.random.key(0), jnp.asarray(x))
  rngs = {"dropout": jax.random.key(1)}
  got = layer.apply(params, x, segment_ids=seg, deterministic=False, rngs=rngs)
  want = layer.apply(params, jnp.asarray(x), segment_ids=jnp.asarray(seg), deterministic=False, rngs=rngs)
  _same(got, want)


@pytest.mark.parametrize("batch,length", SHAPES[:1])
def test_nnx_layer_numpy_equals_jax(batch, length):
  layer = fl_nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, impl="xla_chunked",
                                    rngs=nnx.Rngs(0))
  x, seg = _layer_inputs(batch, length)
  _same(layer(x, segment_ids=seg), layer(jnp.asarray(x), segment_ids=jnp.asarray(seg)))


@pytest.mark.parametrize("batch,length", SHAPES[1:2])
def test_haiku_layer_numpy_equals_jax(batch, length):
  hk = pytest.importorskip("haiku")
  from flash_layers import haiku as fl_haiku

  x, seg = _layer_inputs(batch, length)
  fwd = hk.transform(lambda x, seg: fl_haiku.MultiHeadAttention(HEADS, num_kv_heads=KV_HEADS,
                                                                impl="reference")(x, segment_ids=seg))
  params = fwd.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(seg))
  _same(fwd.apply(params, None, x, seg), fwd.apply(params, None, jnp.asarray(x), jnp.asarray(seg)))


@pytest.mark.parametrize("batch,length", SHAPES[1:2])
def test_attention_fn_numpy_equals_jax(batch, length):
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fl.attention_fn(impl="xla_dense"))
  x, seg = _layer_inputs(batch, length)
  mask = seg[:, None, :, None] == seg[:, None, None, :]
  params = layer.init(jax.random.key(0), jnp.asarray(x))
  got = layer.apply(params, x, mask=mask)
  want = layer.apply(params, jnp.asarray(x), mask=jnp.asarray(mask))
  _same(got, want)
  # The function itself, called directly with NumPy q/k/v and a NumPy mask.
  _, q, k, v = _qkv(5, batch, length)
  fn = fl.attention_fn(impl="xla_dense")
  mask = np.repeat(mask, HEADS, axis=1)
  _same(fn(q, k, v, mask=mask), fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask)))


@pytest.mark.parametrize("family", ["bert"] + (["modernbert"] if WIDE else []))
def test_models_numpy_equals_jax(family):
  small = dict(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=32,
               num_labels=3, impl="reference")
  model = models.Bert(**small) if family == "bert" else models.ModernBert(**small)
  batch, length = 1, 16
  ids = np.random.default_rng(0).integers(1, 40, (batch, length)).astype(np.int32)
  seg = _segments(None, batch, length)
  params = jax.jit(lambda ids: model.init(jax.random.key(0), ids, method=model.init_everything))(ids)
  got = model.apply(params, ids, seg, max_docs=2)
  want = model.apply(params, jnp.asarray(ids), jnp.asarray(seg), max_docs=2)
  _same(got, want)


def test_dropout_mask_numpy_equals_jax():
  key = jax.random.PRNGKey(3)
  got = fl.dropout_mask(np.asarray(key), batch=np.int64(2), num_heads=np.int32(2), q_len=np.int64(8),
                        kv_len=8, rate=np.float32(0.5), q_offset=np.int64(3), kv_offset=np.int32(1))
  want = fl.dropout_mask(key, batch=2, num_heads=2, q_len=8, kv_len=8, rate=0.5, q_offset=3, kv_offset=1)
  _same(got, want)
  assert got.shape == (2, 2, 8, 8) and 0 < float(got.mean()) < 1
