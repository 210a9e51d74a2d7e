"""jax_splash beyond the conformance suite: the lse cotangent, static position offsets, what it
refuses and what `explain` says. Small shapes, Pallas interpret mode; the reference impl is the
independent check (itself checked against float64 by the conformance suite)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import dispatch, validate
from flash_layers.impls import REGISTRY, registry

B, T, S, H, KVH, D = 1, 200, 160, 2, 1, 32


def _inputs(t=T, s=S):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (B, t, H, D)), jax.random.normal(keys[1], (B, s, KVH, D)),
          jax.random.normal(keys[2], (B, s, KVH, D)))


def test_lse_cotangent_and_static_offsets_match_reference():
  """Ring attention's use: positions offset (q starts 48 keys later), the lse differentiated,
  segment ids with queries of a document no key is in (lse -inf, output 0, no NaN)."""
  q, k, v = _inputs()
  q_seg = np.ones((B, T), np.int32)
  q_seg[:, -30:] = 7  # no key has id 7
  kv_seg = np.ones((B, S), np.int32)
  w = jax.random.normal(jax.random.key(1), (B, T, H, D))
  u = jax.random.normal(jax.random.key(2), (B, H, T))

  def loss_and_lse(impl, q, k, v):
    request, args = validate.prepare(q, k, v, causal=True, segment_ids=jnp.asarray(q_seg),
                                     kv_segment_ids=jnp.asarray(kv_seg), q_offset=48, kv_offset=0)
    out, lse = dispatch.attend(q, k, v, impl=impl, request=request, args=args)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out * w) + jnp.sum(finite * u), (out, lse)

  grads, results = {}, {}
  for impl in ("jax_splash", "reference"):
    with fl.interpret_as("tpu"):
      fn = jax.jit(jax.value_and_grad(lambda q, k, v, impl=impl: loss_and_lse(impl, q, k, v),
                                      argnums=(0, 1, 2), has_aux=True))
      (_, results[impl]), grads[impl] = fn(q, k, v)
  (out, lse), (ref_out, ref_lse) = results["jax_splash"], results["reference"]
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
  assert np.isinf(lse[:, :, -30:]).all() and np.all(np.asarray(lse) < np.inf)
  np.testing.assert_allclose(jnp.where(jnp.isinf(lse), 0, lse), jnp.where(jnp.isinf(ref_lse), 0, ref_lse),
                             atol=2e-5)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  assert np.all(np.asarray(out)[:, -30:] == 0)
  for got, want in zip(grads["jax_splash"], grads["reference"], strict=True):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=5e-5)


def test_runs_interpreted_on_a_cpu_and_explains_itself():
  """On a CPU jax_splash is the interpreted TPU kernels (the platform_dependent branch for the
  CPU); user block sizes are honoured. Splash skips blocks by the static mask only: segment ids
  do not lower the count `explain` reports."""
  q, k, v = _inputs(t=256, s=256)
  seg = jnp.asarray(np.repeat([[1, 2]], 128, axis=1), jnp.int32)
  want = fl.attention(q, k, v, impl="reference", causal=True, segment_ids=seg)
  for sizes in (None, fl.BlockSizes(128, 128)):
    got = jax.jit(lambda q, k, v, sizes=sizes: fl.attention(
        q, k, v, impl="jax_splash", causal=True, segment_ids=seg, block_sizes=sizes))(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5)
  e = fl.explain(q, k, v, impl="jax_splash", causal=True, segment_ids=seg,
                 block_sizes=fl.BlockSizes(128, 128))
  assert (e.impl, e.kernel) == ("jax_splash", "splash-tpu (interpret)")
  assert (e.blocks_visited, e.blocks_total) == (3 * B * H, 4 * B * H)  # causal: 3 of 2 x 2 tiles
  assert REGISTRY["jax_splash"].kernel(validate.prepare(q, k, v)[0], "tpu") == "splash-tpu"


@pytest.mark.parametrize("kwargs,feature", [
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "dropout"),
    ({"alibi_slopes": np.ones(H, np.float32)}, "alibi"),
    ({"bias": np.zeros((1, 1, T, S), np.float32)}, "dense bias"),
    ({"window": 8, "global_tokens": 2}, "global tokens"),
], ids=["dropout", "alibi", "bias", "global_tokens"])
def test_refuses_by_name(kwargs, feature):
  q, k, v = _inputs()
  with pytest.raises(fl.UnsupportedError, match=feature) as excinfo:
    fl.attention(q, k, v, impl="jax_splash", **kwargs)
  assert "reference" in str(excinfo.value)  # it names impls that can


def test_refuses_gpus_and_traced_offsets():
  q, k, v = _inputs()
  request, args = validate.prepare(q, k, v, causal=True)
  assert "cuda" in REGISTRY["jax_splash"].unsupported(request, "cuda")
  with fl.interpret_as("gpu"), pytest.raises(fl.UnsupportedError, match="interpret_as"):
    fl.attention(q, k, v, impl="jax_splash")

  @jax.jit
  def ring_step(q, k, v, q_offset):  # the ring passes traced offsets; splash's mask is static
    return dispatch.attend(q, k, v, impl="jax_splash", request=request,
                           args=validate.prepare(q, k, v, causal=True, q_offset=q_offset)[1])

  with pytest.raises(fl.UnsupportedError, match="traced position offsets") as excinfo:
    ring_step(q, k, v, jnp.int32(64))
  # It names the impls that do, as the registry knows them.
  assert str(excinfo.value).endswith("impls that do: " + ", ".join(registry.impls_with("traced_offsets")))
