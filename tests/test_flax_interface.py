"""flax's module interface on our layers: the fields and call arguments of flax's
`MultiHeadDotProductAttention` / `nnx.MultiHeadAttention` that a model passes, with flax's meaning.

The oracle is flax's own module with the same weights (ours take flax's parameter trees as they are):
separate key and value inputs, a dense boolean mask, `qkv_features`, `normalize_qk` and `sow_weights`
must give flax's outputs and sown probabilities. Dropout arguments (`dropout_rng`, the `deterministic`
field, `broadcast_dropout`) are checked against the contract's own mask (`fl.dropout_mask`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl
from flash_layers import nnx as flnnx

TOL = dict(atol=2e-6, rtol=0)
X = jax.random.normal(jax.random.key(0), (2, 5, 8))
K_IN = jax.random.normal(jax.random.key(1), (2, 7, 8))
V_IN = jax.random.normal(jax.random.key(2), (2, 7, 6))
MASK = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 5, 7))


@pytest.mark.parametrize("normalize_qk", [False, True])
def test_linen_layer_equals_flax_with_flax_arguments(normalize_qk):
  theirs = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, normalize_qk=normalize_qk)
  ours = fl.MultiHeadAttention(num_heads=2, qkv_features=8, normalize_qk=normalize_qk, impl="xla_dense")
  variables = theirs.init(jax.random.key(4), X, K_IN, V_IN)
  assert jax.tree.map(jnp.shape, nn.meta.unbox(ours.init(jax.random.key(4), X, K_IN, V_IN))) == \
      jax.tree.map(jnp.shape, variables)
  want, sown = theirs.apply(variables, X, K_IN, V_IN, mask=MASK, sow_weights=True,
                            mutable=["intermediates"])
  got, ours_sown = ours.apply(variables, X, K_IN, V_IN, mask=MASK, sow_weights=True,
                              mutable=["intermediates"])
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(ours_sown["intermediates"]["attention_weights"][0],
                             sown["intermediates"]["attention_weights"][0], **TOL)
  # inputs_k as a keyword, as flax's call takes it
  np.testing.assert_allclose(ours.apply(variables, X, inputs_k=K_IN, inputs_v=V_IN, mask=MASK), want, **TOL)


@pytest.mark.parametrize("normalize_qk", [False, True])
def test_nnx_layer_equals_flax_with_flax_arguments(normalize_qk):
  theirs = nnx.MultiHeadAttention(2, 8, 8, decode=False, normalize_qk=normalize_qk, rngs=nnx.Rngs(0))
  ours = flnnx.MultiHeadAttention(2, 8, 8, normalize_qk=normalize_qk, impl="xla_dense", rngs=nnx.Rngs(1))
  state = nnx.state(theirs, nnx.Param)
  assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param).to_pure_dict()) == \
      jax.tree.map(jnp.shape, state.to_pure_dict())
  nnx.update(ours, state)
  k_in = K_IN[..., :8]
  v_in = jax.random.normal(jax.random.key(5), (2, 7, 8))
  want = theirs(X, k_in, v_in, mask=MASK, sow_weights=True)
  got = ours(X, k_in, v_in, mask=MASK, sow_weights=True)
  np.testing.assert_allclose(got, want, **TOL)
  want_w = nnx.pop(theirs, nnx.Intermediate).to_pure_dict()["attention_weights"][0]
  got_w = nnx.pop(ours, nnx.Intermediate).to_pure_dict()["attention_weights"][0]
  np.testing.assert_allclose(got_w, want_w, **TOL)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_attention_fn_sows_flax_weights(kind):
  if kind == "linen":
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8,
                                             attention_fn=fl.attention_fn("xla_dense"))
    reference = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    variables = reference.init(jax.random.key(0), X, K_IN)
    weights = [m.apply(variables, X, K_IN, mask=MASK, sow_weights=True, mutable=["intermediates"])[1]
               ["intermediates"]["attention_weights"][0] for m in (module, reference)]
  else:
    module = nnx.MultiHeadAttention(2, 8, 8, decode=False, attention_fn=fl.attention_fn("reference"),
                                    rngs=nnx.Rngs(0))
    reference = nnx.MultiHeadAttention(2, 8, 8, decode=False, rngs=nnx.Rngs(0))
    weights = []
    for m in (module, reference):
      m(X, K_IN, mask=MASK, sow_weights=True)
      weights.append(nnx.pop(m, nnx.Intermediate).to_pure_dict()["attention_weights"][0])
  np.testing.assert_allclose(weights[0], weights[1], **TOL)


def test_sow_weights_is_refused_by_impls_that_never_materialise_them():
  layer = fl.MultiHeadAttention(num_heads=2, impl="xla_chunked")
  variables = layer.init(jax.random.key(0), X)
  with pytest.raises(fl.UnsupportedError, match="sow_weights with impl 'xla_chunked'.*reference"):
    layer.apply(variables, X, sow_weights=True, mutable=["intermediates"])
  # a call that sows nothing is unaffected
  layer.apply(variables, X)


def test_sown_weights_hold_sinks_and_sum_below_one():
  layer = fl.MultiHeadAttention(num_heads=2, impl="reference", use_sinks=True,
                                sinks_init=nn.initializers.ones)
  variables = layer.init(jax.random.key(0), X)
  _, sown = layer.apply(variables, X, sow_weights=True, mutable=["intermediates"])
  weights = sown["intermediates"]["attention_weights"][0]
  # With a sink of logit 1 in each row's denominator, a row's probabilities sum to 1 - p(sink).
  q = nn.meta.unbox(variables)["params"]
  query = jnp.einsum("btf,fhd->bthd", X, q["query"]["kernel"]) + q["query"]["bias"]
  key = jnp.einsum("btf,fhd->bthd", X, q["key"]["kernel"]) + q["key"]["bias"]
  logits = jnp.einsum("bthd,bshd->bhts", query, key, precision="highest") / 2.0
  total = jnp.exp(logits).sum(-1)
  np.testing.assert_allclose(weights.sum(-1), total / (total + jnp.e), rtol=1e-5)


def _kept(layer, variables, **call):
  _, sown = layer.apply(variables, X, sow_weights=True, mutable=["intermediates"], **call)
  return np.asarray(sown["intermediates"]["attention_weights"][0]) != 0


@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_arguments_follow_flax(broadcast):
  """dropout_rng is the key of the contract's mask; the deterministic field makes calls stochastic by
  default; broadcast_dropout shares one mask over batch rows and heads (fl.dropout_mask's broadcast)."""
  layer = fl.MultiHeadAttention(num_heads=2, impl="reference", dropout_rate=0.5, deterministic=False,
                                broadcast_dropout=broadcast)
  variables = layer.init(jax.random.key(0), X)
  key = jax.random.key(7)
  keep = np.asarray(fl.dropout_mask(key, batch=2, num_heads=2, q_len=5, kv_len=5, rate=0.5,
                                    broadcast=broadcast))
  kept = _kept(layer, variables, dropout_rng=key)
  np.testing.assert_array_equal(kept, np.broadcast_to(keep, kept.shape))
  np.testing.assert_array_equal(layer.apply(variables, X, dropout_rng=key),
                                layer.apply(variables, X, dropout_rng=key))
  assert not np.allclose(layer.apply(variables, X, dropout_rng=key),
                         layer.apply(variables, X, dropout_rng=jax.random.key(8)))
  assert _kept(layer, variables, deterministic=True).all()  # the call's argument wins over the field


def test_flax_fields_are_checked():
  with pytest.raises(ValueError, match="qkv_features"):
    fl.MultiHeadAttention(num_heads=3, qkv_features=8).init(jax.random.key(0), X)
  with pytest.raises(ValueError, match="disagree"):
    fl.MultiHeadAttention(num_heads=2, qkv_features=8, head_dim=8).init(jax.random.key(0), X)
  with pytest.raises(TypeError, match="normalize_qk"):
    fl.MultiHeadAttention(num_heads=2, normalize_qk="yes")
  with pytest.raises(ValueError, match="once"):
    fl.MultiHeadAttention(num_heads=2).init(jax.random.key(0), X, K_IN, inputs_k=K_IN)
  zero_out = fl.MultiHeadAttention(num_heads=2, out_kernel_init=nn.initializers.zeros,
                                   out_bias_init=nn.initializers.ones)
  params = nn.meta.unbox(zero_out.init(jax.random.key(0), X))["params"]
  assert not np.any(params["out"]["kernel"]) and np.all(params["out"]["bias"] == 1)
  assert np.any(params["query"]["kernel"])


@pytest.mark.parametrize("batch_shape", [(), (2, 3)])
def test_any_number_of_batch_dims(batch_shape):
  """flax's layouts: [batch..., length, features] with no batch dim, or several, as one flattened batch."""
  layer = fl.MultiHeadAttention(num_heads=2, causal=True, impl="xla_dense")
  x = jax.random.normal(jax.random.key(0), batch_shape + (5, 8))
  flat = x.reshape((-1, 5, 8))
  variables = layer.init(jax.random.key(1), flat)
  mask = jnp.tril(jnp.ones((5, 5), bool))[None]  # [heads|1, q, kv], shared by every batch dim
  got = layer.apply(variables, x, mask=mask)
  assert got.shape == batch_shape + (5, 8)
  np.testing.assert_allclose(got.reshape(flat.shape), layer.apply(variables, flat, mask=mask[None]), **TOL)
  nnx_layer = flnnx.MultiHeadAttention(2, 8, causal=True, impl="xla_dense", rngs=nnx.Rngs(0))
  np.testing.assert_allclose(nnx_layer(x).reshape(flat.shape), nnx_layer(flat), **TOL)
