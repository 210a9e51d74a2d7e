"""Attention sinks beyond the conformance suite (which checks out, dq, dk, dv and dsinks of every
impl against the float64 oracle): the layers' `use_sinks` parameter trains, the three layer APIs
agree, explain() reports sinks, bad sinks are refused by name."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flash_layers as fl
from flash_layers import haiku as flhk
from flash_layers import nnx as flnnx
from flash_layers.testing import reference64

HEADS, FEATURES, LEN = 4, 32, 24


def _inputs(seed=0, batch=2):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, LEN, FEATURES)), jnp.float32)


def test_zero_sinks_add_one_to_every_denominator():
  """A sink of logit 0 adds exp(0) = 1 to each row's softmax denominator (checked in float64), and
  the layer starts with exactly that."""
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, 8, 2, 16)).astype(np.float32) for _ in range(3))
  out = fl.attention(q, k, v, impl="xla_chunked", sinks=jnp.zeros(2))
  logits = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k) / 4.0
  e = np.exp(logits)
  want = np.einsum("bhts,bshv->bthv", e / (e.sum(-1, keepdims=True) + 1.0), v)
  np.testing.assert_allclose(out, want, atol=1e-5)
  layer = fl.MultiHeadAttention(num_heads=2, use_sinks=True)
  params = layer.init(jax.random.key(0), _inputs())["params"]
  np.testing.assert_array_equal(params["sinks"], np.zeros(2, np.float32))


def test_a_layer_with_sinks_trains_its_sinks():
  """Fitting a target made by a layer with large sinks: the loss falls and the sinks move toward
  them (their gradient is not zero)."""
  x = _inputs(2, batch=4)
  teacher = fl.MultiHeadAttention(num_heads=HEADS, use_sinks=True, impl="xla_chunked")
  t_params = teacher.init(jax.random.key(1), x)["params"]
  t_params = {**t_params, "sinks": jnp.full((HEADS,), 3.0)}
  target = teacher.apply({"params": t_params}, x)
  student = fl.MultiHeadAttention(num_heads=HEADS, use_sinks=True, impl="xla_chunked")
  params = {**t_params, "sinks": jnp.zeros(HEADS)}  # only the sinks differ

  def loss(p):
    return jnp.mean((student.apply({"params": p}, x) - target) ** 2)

  opt = optax.adam(0.05)
  state = opt.init(params)

  @jax.jit
  def step(p, s):
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = opt.update(grads, s, p)
    return value, updates, s

  losses = []
  for _ in range(100):
    value, updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
    losses.append(float(value))
  assert losses[-1] < 0.05 * losses[0], losses[::20]
  assert np.all(np.asarray(params["sinks"]) > 0.5), params["sinks"]  # from 0, toward 3


def test_linen_nnx_and_haiku_layers_agree_with_sinks():
  x = _inputs(3)
  linen = fl.MultiHeadAttention(num_heads=HEADS, use_sinks=True, causal=True)
  variables = linen.init(jax.random.key(0), x)
  variables["params"]["sinks"] = jnp.asarray([0.5, -1.0, 2.0, 0.0])
  want = linen.apply(variables, x)

  layer = flnnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, use_sinks=True, causal=True,
                                   rngs=nnx.Rngs(0))
  assert layer.sinks[...].shape == (HEADS,)
  state = nnx.state(layer, nnx.Param)
  state.replace_by_pure_dict(flnnx.params_from_linen(variables))
  nnx.update(layer, state)
  np.testing.assert_allclose(layer(x), want, atol=1e-5)
  np.testing.assert_allclose(flnnx.params_to_linen(layer)["params"]["sinks"], variables["params"]["sinks"])

  f = hk.transform(lambda x: flhk.MultiHeadAttention(num_heads=HEADS, use_sinks=True, causal=True)(x))
  hk_params = f.init(jax.random.key(0), x)
  assert hk_params["multi_head_attention"]["sinks"].shape == (HEADS,)
  hk_params = flhk.params_from_flax(variables)
  np.testing.assert_allclose(f.apply(hk_params, None, x), want, atol=1e-5)


def test_explain_reports_sinks_and_bad_sinks_are_refused_by_name():
  q = jnp.zeros((1, 16, 4, 8))
  assert "sinks" in str(fl.explain(q, q, q, sinks=jnp.zeros(4)))
  assert "sinks" not in str(fl.explain(q, q, q))
  abstract = jax.ShapeDtypeStruct((4,), jnp.float32)  # explain takes abstract per-head arrays too
  assert fl.explain(q, q, q, sinks=abstract, alibi_slopes=abstract).sinks
  for bad in (jnp.zeros(3), jnp.zeros((1, 4)), jnp.zeros(4, jnp.int32)):
    with pytest.raises(ValueError, match="sinks must be a float array"):
      fl.attention(q, q, q, sinks=bad)


def test_every_impl_matches_the_oracle_on_rows_that_see_nothing():
  """A row with no visible key keeps output 0 with sinks (its lse becomes the sink itself), in every
  impl that runs here without interpretation."""
  rng = np.random.default_rng(4)
  q, k, v = (rng.standard_normal((1, 12, 2, 8)).astype(np.float32) for _ in range(3))
  ids = np.array([[1] * 6 + [2] * 6], np.int32)
  kv_ids = np.array([[1] * 12], np.int32)  # document 2's queries see no key
  sinks = np.asarray([0.3, -0.7], np.float32)
  visible = reference64.mask(1, 12, 12, segment_ids=ids, kv_segment_ids=kv_ids)[:, None]
  want = reference64.attention(q, k, v, visible, sinks=sinks)["out"]
  for impl in ("reference", "xla_native", "xla_dense", "xla_chunked"):
    out = fl.attention(q, k, v, impl=impl, segment_ids=ids, kv_segment_ids=kv_ids, sinks=sinks)
    np.testing.assert_allclose(out, want, atol=1e-5, err_msg=impl)
    assert np.all(np.asarray(out)[0, 6:] == 0), impl
