"""Rotary position embeddings: the rotation itself (against float64 2x2 rotations) and the layer hook."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import rotary


def rotate64(x, positions, theta):
  """Pair (i, i + d/2) of each head turned by positions * theta ** (-2i / d), one 2x2 matrix at a time."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  half = x.shape[-1] // 2
  for i in range(half):
    angle = np.asarray(positions, np.float64)[..., None] * theta ** (-2.0 * i / x.shape[-1])
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., i], x[..., i + half]
    out[..., i], out[..., i + half] = c * a - s * b, s * a + c * b
  return out


def test_rotary_turns_feature_pairs_by_position_angles():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 9, 3, 8)).astype(np.float32)
  positions = np.array([np.arange(9), [0, 1, 2, 0, 1, 2, 3, 0, 0]])
  got = rotary.apply_rotary(jnp.asarray(x), jnp.asarray(positions), 500.0)
  np.testing.assert_allclose(got, rotate64(x, positions, 500.0), atol=1e-5)
  np.testing.assert_array_equal(got[:, :1], x[:, :1])  # position 0 does not turn


def test_rotated_scores_depend_only_on_the_distance():
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))
  score = lambda p, r: float(jnp.sum(rotary.apply_rotary(q, jnp.array([[p]]), 1e4)
                                     * rotary.apply_rotary(k, jnp.array([[r]]), 1e4)))
  assert score(3, 10) == pytest.approx(score(103, 110), abs=1e-4)
  assert abs(score(3, 10) - score(3, 4)) > 1e-3


def test_layer_rotates_queries_and_keys_before_attention():
  """rope_theta + positions = the same layer's projections, rotated, through fl.attention."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 10, 16)), jnp.float32)
  seg = jnp.asarray([[1] * 6 + [2] * 4, [1] * 7 + [0] * 3], jnp.int32)
  positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], list(range(10))], jnp.int32)
  layer = fl.MultiHeadAttention(num_heads=2, impl="reference", rope_theta=100.0, window=3)
  params = nn.meta.unbox(layer.init(jax.random.key(0), x, segment_ids=seg)["params"])
  got = layer.apply({"params": params}, x, segment_ids=seg, positions=positions)

  proj = lambda name: jnp.einsum("ble,ehd->blhd", x, params[name]["kernel"]) + params[name]["bias"]
  q, k = (rotary.apply_rotary(proj(n), positions, 100.0) for n in ("query", "key"))
  out = fl.attention(q, k, proj("value"), impl="reference", segment_ids=seg, window=3)
  want = jnp.einsum("blhd,hde->ble", out, params["out"]["kernel"]) + params["out"]["bias"]
  np.testing.assert_allclose(got, want, atol=1e-5)
  plain = fl.MultiHeadAttention(num_heads=2, impl="reference", window=3)
  assert not np.allclose(got, plain.apply({"params": params}, x, segment_ids=seg), atol=1e-3)


def test_rotary_arguments_are_checked():
  x = jnp.ones((1, 4, 8))
  with pytest.raises(ValueError, match="rope_theta must be a positive number"):
    fl.MultiHeadAttention(num_heads=2, rope_theta=-1.0)
  layer = fl.MultiHeadAttention(num_heads=2, impl="reference")
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="set rope_theta"):
    layer.apply(params, x, positions=jnp.zeros((1, 4), jnp.int32))
  roped = fl.MultiHeadAttention(num_heads=2, impl="reference", rope_theta=10.0)
  with pytest.raises(ValueError, match=r"positions must have shape \[batch, len\] = \(1, 4\)"):
    roped.apply(params, x, positions=jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match="even head_dim"):
    rotary.apply_rotary(jnp.ones((1, 4, 1, 3)), jnp.zeros((1, 4), jnp.int32), 10.0)
