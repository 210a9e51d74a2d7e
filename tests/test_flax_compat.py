"""`fl.attention_fn` inside flax's own attention modules: what flax's attention tests check, our way.

Independent references: the same modules with flax's own attention; for dropout, flax's
attention weights (`nn.dot_product_attention_weights`) multiplied by `fl.dropout_mask`
(the contract's mask; flax's own dropout draws a different one). What attention_fn refuses
is refused by name: sown attention weights from an impl that never materialises them, complex
inputs, and features the chosen impl does not serve.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl

BATCH, LEN, HEADS, FEATURES = 2, 5, 2, 8
TOL = dict(rtol=1e-5, atol=1e-5)
HIGHEST = jax.lax.Precision.HIGHEST


def oracle_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None, **_):
  """flax's attention weights, dropped where `fl.dropout_mask` says, times the values."""
  del dtype, precision, module
  w = nn.dot_product_attention_weights(query, key, bias=bias, mask=mask, precision=HIGHEST)
  if dropout_rate and not deterministic:
    *batch, h, t, s = w.shape
    keep = fl.dropout_mask(dropout_rng, batch=math.prod(batch), num_heads=h, q_len=t, kv_len=s,
                           rate=dropout_rate, broadcast=broadcast_dropout)
    lead = (1,) * len(batch) if broadcast_dropout else tuple(batch)
    w = w * keep.reshape(lead + keep.shape[1:]) / (1 - dropout_rate)
  return jnp.einsum("...hqk,...khd->...qhd", w, value, precision=HIGHEST)


def mha(attention_fn, **kwargs):
  return nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES, attention_fn=attention_fn,
                                         **kwargs)


def inputs(shape=(BATCH, LEN, FEATURES), seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ----------------------------------------------------------------------------
# Decoding with a cache, causal receptive field, dtypes
# ----------------------------------------------------------------------------

@pytest.mark.parametrize(("batch_shape", "x64"), [((BATCH,), False), ((BATCH, 3), True)])
def test_cached_decoding_equals_a_causal_pass(batch_shape, x64):
  """Token-by-token decoding (flax's cache) == one pass with a causal mask, also under jax_enable_x64."""
  with jax.enable_x64(x64):
    x = inputs(batch_shape + (LEN, FEATURES))
    full = mha(nn.dot_product_attention)  # flax's own attention: the reference
    decoder = mha(fl.attention_fn(impl="xla_chunked"), decode=True)
    variables = decoder.init(jax.random.key(1), x)
    params, cache = variables["params"], variables["cache"]
    want = full.apply({"params": params}, x, mask=nn.make_causal_mask(jnp.ones(x.shape[:-1])))
    step = jax.jit(lambda cache, x_t: decoder.apply({"params": params, "cache": cache}, x_t,
                                                    mutable=["cache"]))
    steps = []
    for t in range(LEN):
      y, updated = step(cache, x[..., t:t + 1, :])
      cache = updated["cache"]
      steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=-2), want, **TOL)


def test_causal_receptive_field():
  """With a causal mask, output i depends on inputs j <= i, and on every one of them."""
  x = inputs((1, LEN, FEATURES))
  module = mha(fl.attention_fn(impl="xla_chunked"))
  params = module.init(jax.random.key(1), x)
  mask = nn.make_causal_mask(jnp.ones((1, LEN)))
  jac = jax.jacrev(lambda x: module.apply(params, x, mask=mask))(x)  # [1, L, F, 1, L, F]
  depends = np.abs(np.asarray(jac[0, :, :, 0])).max(axis=(1, 3)) > 1e-6  # [out pos, in pos]
  np.testing.assert_array_equal(depends, np.tril(np.ones((LEN, LEN), bool)))


def test_bfloat16_module_dtype():
  x = inputs()
  ours, theirs = mha(fl.attention_fn(impl="xla_chunked"), dtype=jnp.bfloat16), mha(nn.dot_product_attention)
  params = theirs.init(jax.random.key(1), x)
  got = ours.apply(params, x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), theirs.apply(params, x), atol=0.05, rtol=0.05)


# ----------------------------------------------------------------------------
# Dropout and bias
# ----------------------------------------------------------------------------

class _Pair(nn.Module):
  """Two attention modules on the same input, as flax's explicit-dropout test builds them."""

  rate: float

  @nn.compact
  def __call__(self, x, dropout_rng=None):
    make = lambda: mha(fl.attention_fn(impl="xla_chunked"), dropout_rate=self.rate, deterministic=False,
                       kernel_init=nn.initializers.ones)
    return make()(x, dropout_rng=dropout_rng), make()(x, dropout_rng=dropout_rng)


def test_dropout_keys_in_linen_modules():
  """Keys from the "dropout" stream differ per module and call; an explicit dropout_rng is used as given."""
  x = inputs()
  pair = _Pair(rate=0.5)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  variables = pair.init({"params": k1, "dropout": k2}, x)
  apply = jax.jit(pair.apply)  # one compile per call signature, not op by op
  a, b = apply(variables, x, rngs={"dropout": k2})
  c, d = apply(variables, x, rngs={"dropout": k2})
  e, _ = apply(variables, x, rngs={"dropout": k3})
  assert not np.allclose(a, b)  # two modules, two keys (same weights: only the masks differ)
  np.testing.assert_array_equal(a, c)
  np.testing.assert_array_equal(b, d)
  assert not np.allclose(a, e)
  a, b = apply(variables, x, dropout_rng=k3)
  np.testing.assert_array_equal(a, b)
  # Rate 0, or deterministic: no dropout, so no key is needed and none matters.
  quiet = _Pair(rate=0.0)
  np.testing.assert_array_equal(*quiet.apply(variables, x))
  plain = mha(fl.attention_fn(impl="xla_chunked"), dropout_rate=0.5)
  params = {"params": variables["params"]["MultiHeadDotProductAttention_0"]}
  np.testing.assert_array_equal(plain.apply(params, x, deterministic=True, rngs={"dropout": k2}),
                                plain.apply(params, x, deterministic=True, rngs={"dropout": k3}))


def _linen_loss(attention_fn, bias, broadcast):
  """(params, loss(params)) of a linen module training with dropout and `bias` through `attention_fn`."""
  x = inputs()
  module = mha(functools.partial(attention_fn, bias=bias), dropout_rate=0.3, broadcast_dropout=broadcast)

  def loss(params):
    y = module.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(5)})
    return jnp.sum(jnp.sin(y))

  return module.init(jax.random.key(1), x, deterministic=True), loss


@pytest.mark.parametrize("broadcast", [True, False])
def test_linen_module_trains_with_dropout_and_bias(broadcast):
  """Loss and gradients with dropout and a bias equal the oracle's (flax's weights x fl.dropout_mask)."""
  bias = 0.5 * inputs((BATCH, HEADS, LEN, LEN), seed=3)
  params, loss = _linen_loss(fl.attention_fn(impl="xla_chunked"), bias, broadcast)
  _, oracle_loss = _linen_loss(oracle_attention, bias, broadcast)
  got, got_grad = jax.jit(jax.value_and_grad(loss))(params)
  want, want_grad = jax.jit(jax.value_and_grad(oracle_loss))(params)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got_grad, want_grad)


def _nnx_model(attention_fn):
  return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qkv_features=FEATURES, decode=False,
                                dropout_rate=0.3, attention_fn=attention_fn, rngs=nnx.Rngs(0))


def test_nnx_module_trains_with_dropout_and_bias():
  """nnx.MultiHeadAttention: loss, parameter and bias gradients equal the oracle's, same dropout key."""
  x = inputs()
  bias = 0.5 * inputs((BATCH, HEADS, LEN, LEN), seed=3)

  def loss(attention_fn, model, bias):
    model = nnx.clone(model)
    model.attention_fn = functools.partial(attention_fn, bias=bias)
    return jnp.sum(jnp.sin(model(x, deterministic=False, rngs=nnx.Rngs(dropout=5))))

  def value_and_grads(attention_fn):
    model = _nnx_model(attention_fn)
    return nnx.value_and_grad(functools.partial(loss, attention_fn), argnums=(0, 1))(model, bias)

  got, (got_model, got_bias) = value_and_grads(fl.attention_fn(impl="xla_chunked"))
  want, (want_model, want_bias) = value_and_grads(oracle_attention)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  np.testing.assert_allclose(got_bias, want_bias, rtol=1e-4, atol=1e-6)
  assert np.abs(np.asarray(got_bias)).max() > 1e-3  # the bias gradient is real
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5),
               nnx.to_pure_dict(got_model), nnx.to_pure_dict(want_model))


# ----------------------------------------------------------------------------
# Refusals, by name
# ----------------------------------------------------------------------------

def test_refusals_name_the_feature():
  x = inputs()
  params = mha(nn.dot_product_attention).init(jax.random.key(1), x)
  train = dict(deterministic=False, rngs={"dropout": jax.random.key(0)})
  with pytest.raises(fl.UnsupportedError, match="does not support dropout"):
    mha(fl.attention_fn(impl="xla_native"), dropout_rate=0.1).apply(params, x, **train)
  with pytest.raises(fl.UnsupportedError, match="does not support dropout"):
    _nnx_model(fl.attention_fn(impl="xla_native"))(x, deterministic=False)
  bias = jnp.zeros((BATCH, HEADS, LEN, LEN))
  with pytest.raises(fl.UnsupportedError, match="dense bias"):
    mha(functools.partial(fl.attention_fn(impl="flash_pallas"), bias=bias)).apply(params, x)
  with pytest.raises(fl.UnsupportedError, match="sow_weights"):
    mha(fl.attention_fn(impl="xla_chunked")).apply(params, x, sow_weights=True, mutable=["intermediates"])
  with pytest.raises(TypeError, match="floating-point"):
    mha(fl.attention_fn(impl="xla_chunked")).init(jax.random.key(0), x.astype(jnp.complex64))
