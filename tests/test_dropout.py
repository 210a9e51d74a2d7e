"""Dropout's keep mask (one hash for every impl), ALiBi slopes, and the argument checks.

The conformance suite checks every impl against the float64 oracle fed `fl.dropout_mask`;
here: the mask's statistics, that it depends on global indices only (not on block sizes,
chunks or slicing), that auto avoids impls without dropout, and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import auto, dispatch, validate
from flash_layers.impls.xla_chunked import XlaChunked


def _mask(key=None, **kwargs):
  base = dict(batch=2, num_heads=3, q_len=96, kv_len=80, rate=0.5)
  return np.asarray(fl.dropout_mask(jax.random.key(0) if key is None else key, **{**base, **kwargs}))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_kept_fraction_is_binomial(rate):
  mask = _mask(rate=rate, batch=4, num_heads=4, q_len=128, kv_len=128)
  n = mask.size
  sigma = np.sqrt(n * rate * (1 - rate))
  assert abs(mask.sum() - n * (1 - rate)) <= 5 * sigma, (mask.mean(), 1 - rate)
  # Per row too: no row is (nearly) all kept or all dropped.
  per_row = mask.mean(-1)
  assert per_row.min() > (1 - rate) - 0.35 and per_row.max() < (1 - rate) + 0.35


def _disagreement(a, b):
  return float(np.mean(a != b))


def test_different_keys_rows_and_heads_give_independent_masks():
  """Two independent masks of keep probability 1/2 disagree on half their entries."""
  mask = _mask()
  other = _mask(jax.random.key(1))
  n = mask[0, 0].size
  bound = 5 * np.sqrt(0.25 / n)
  for a, b in ((mask, other), (mask[0], mask[1]), (mask[:, 0], mask[:, 1]), (mask[:, 1], mask[:, 2])):
    assert abs(_disagreement(a, b) - 0.5) <= bound
  # Shifted by one query or key position, the mask is unrelated too (no stripes).
  assert abs(_disagreement(mask[..., 1:, :], mask[..., :-1, :]) - 0.5) <= bound
  assert abs(_disagreement(mask[..., 1:], mask[..., :-1]) - 0.5) <= bound


def test_broadcast_shares_one_mask_and_raw_keys_equal_typed_keys():
  shared = _mask(broadcast=True)
  assert shared.shape == (1, 1, 96, 80)
  np.testing.assert_array_equal(_mask(jax.random.PRNGKey(7)), _mask(jax.random.key(7)))


def test_mask_uses_global_positions():
  """The mask of a slice (given its offsets) is the slice of the mask: what ring shards use."""
  full = _mask(q_len=96, kv_len=80)
  part = _mask(q_len=32, kv_len=24, q_offset=40, kv_offset=50)
  np.testing.assert_array_equal(part, full[:, :, 40:72, 50:74])


def _inputs(b=2, t=72, s=72, h=4, kvh=2, d=32):
  ks = jax.random.split(jax.random.key(42), 4)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, s, kvh, d))
  v = jax.random.normal(ks[2], (b, s, kvh, d))
  return q, k, v, jax.random.normal(ks[3], (b, t, h, d))


def _fwd_bwd(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return [np.asarray(x) for x in (out, *vjp(do))]


KW = dict(causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(5), alibi_slopes=fl.alibi_slopes(4))


def test_block_sizes_do_not_change_the_result():
  """Same key: reference, xla_chunked at several chunk shapes and the Pallas kernels (interpreted)
  at different tile sizes agree to float32 rounding (a different mask would differ by O(1))."""
  q, k, v, do = _inputs(b=2, t=40, s=40, h=4, kvh=2, d=16)
  expected = _fwd_bwd(lambda q, k, v: fl.attention(q, k, v, impl="reference", **KW), q, k, v, do)

  def chunked(bq, bk):
    def f(q, k, v):
      request, args = validate.prepare(q, k, v, **KW)
      return XlaChunked(bq, bk).attend(q, k, v, request=request, args=args)[0]
    return f

  runs = {f"chunked {bq}x{bk}": chunked(bq, bk) for bq, bk in ((16, 24), (40, 8))}
  for name, sizes in (("gpu", fl.GpuBlockSizes(16, 32, 32, 16)), ("gpu", fl.GpuBlockSizes(32, 16, 16, 32))):
    def pallas(q, k, v, name=name, sizes=sizes):
      with fl.interpret_as(name):
        return fl.attention(q, k, v, impl="flash_pallas", block_sizes=sizes, **KW)
    runs[f"{name} {sizes}"] = pallas
  for name, fn in runs.items():
    actual = _fwd_bwd(jax.jit(fn), q, k, v, do)
    for a, e, what in zip(actual, expected, ("out", "dq", "dk", "dv"), strict=True):
      np.testing.assert_allclose(a, e, atol=2e-5, rtol=0, err_msg=f"{name}: {what}")


def test_tpu_block_sizes_do_not_change_the_result():
  q, k, v, do = _inputs(b=1, t=140, s=140, h=1, kvh=1, d=16)  # a whole block and a tail at 128
  kw = {**KW, "alibi_slopes": fl.alibi_slopes(1)}
  results = []
  for sizes in (fl.BlockSizes(128, 128, 128, 256), fl.BlockSizes(256, 128, 256, 128)):
    with fl.interpret_as("tpu"):
      fn = jax.jit(lambda q, k, v, sizes=sizes: fl.attention(q, k, v, impl="flash_pallas", block_sizes=sizes,
                                                             **kw))
      results.append(_fwd_bwd(fn, q, k, v, do))
  expected = _fwd_bwd(lambda q, k, v: fl.attention(q, k, v, impl="reference", **kw), q, k, v, do)
  for actual in results:
    for a, e in zip(actual, expected, strict=True):
      np.testing.assert_allclose(a, e, atol=2e-5, rtol=0)


def test_lse_is_the_normaliser_before_dropout():
  q, k, v, _ = _inputs()
  for impl in ("reference", "xla_chunked"):
    lses = []
    for kw in ({}, {"dropout_rate": 0.5, "dropout_rng": jax.random.key(3)}):
      request, args = validate.prepare(q, k, v, causal=True, **kw)
      lses.append(np.asarray(dispatch.attend(q, k, v, impl=impl, request=request, args=args)[1]))
    np.testing.assert_allclose(lses[1], lses[0], rtol=1e-6)


def test_auto_picks_an_impl_with_dropout_and_xla_native_refuses():
  q, k, v, _ = _inputs()
  key = jax.random.key(0)
  # CPU, short: xla_dense serves dropout itself.
  assert fl.explain(q, k, v).impl == "xla_dense"
  assert fl.explain(q, k, v, dropout_rate=0.1, dropout_rng=key).impl == "xla_dense"
  # GPU: cuDNN (xla_native) comes first when eligible, and is passed over for dropout.
  half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  plain, _ = validate.prepare(*half)
  dropped, _ = validate.prepare(*half, dropout_rate=0.1, dropout_rng=key)
  assert auto.resolve("auto", plain, "cuda")[0] == "xla_native"
  assert auto.resolve("auto", dropped, "cuda")[0] == "flash_pallas"
  with pytest.raises(fl.UnsupportedError, match="dropout"):
    fl.attention(q, k, v, impl="xla_native", dropout_rate=0.1, dropout_rng=key)
  with pytest.raises(fl.UnsupportedError, match="dense bias"):
    fl.attention(q, k, v, impl="flash_pallas", bias=jnp.zeros((72, 72)))
  # Rate 0 is no dropout: every impl serves it, with or without a key.
  assert fl.explain(q, k, v, dropout_rate=0.0, dropout_rng=key, impl="xla_native").impl == "xla_native"


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout_rate": 1.0, "dropout_rng": jax.random.key(0)}, ValueError,
     r"dropout_rate must be in \[0, 1\)"),
    ({"dropout_rate": -0.1, "dropout_rng": jax.random.key(0)}, ValueError, "dropout_rate"),
    ({"dropout_rate": "0.1", "dropout_rng": jax.random.key(0)}, TypeError, "dropout_rate"),
    ({"dropout_rate": 0.1}, ValueError, "dropout_rng is required"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.zeros((3,), jnp.uint32)}, TypeError,
     "dropout_rng must be a PRNG key"),
    ({"dropout_rate": 0.1, "dropout_rng": 0}, TypeError, "dropout_rng"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0), "dropout_broadcast": 1}, TypeError,
     "dropout_broadcast"),
    ({"alibi_slopes": jnp.ones((3,))}, ValueError,
     r"alibi_slopes must be a float array \[num_heads\]=\(4,\)"),
    ({"alibi_slopes": jnp.ones((4,), jnp.int32)}, ValueError, "alibi_slopes"),
    ({"bias": jnp.ones((2, 4, 72, 71))}, ValueError, "bias must broadcast"),
    ({"bias": jnp.ones((72, 72), jnp.int32)}, ValueError, "bias must be a float array"),
    ({"bias": [[0.0]]}, TypeError, "bias must be an array"),
])
def test_errors_name_the_argument(kwargs, error, match):
  q, k, v, _ = _inputs()
  with pytest.raises(error, match=match):
    validate.prepare(q, k, v, **kwargs)


def test_bias_of_any_rank_broadcasts():
  q, k, v, _ = _inputs(b=1, t=8, s=8, h=2, kvh=2, d=8)
  bias = jax.random.normal(jax.random.key(1), (8, 8))
  expected = fl.attention(q, k, v, impl="reference", bias=bias[None, None])
  for impl in ("reference", "xla_chunked", "xla_native"):
    np.testing.assert_allclose(fl.attention(q, k, v, impl=impl, bias=bias), expected, atol=1e-6)


def test_alibi_slopes_are_the_papers():
  """Press et al. 2022: 2^(-8k/n) for n a power of two; otherwise the largest power of two's
  slopes, then every other slope of twice that."""
  np.testing.assert_allclose(fl.alibi_slopes(8), [2.0 ** -k for k in range(1, 9)])
  np.testing.assert_allclose(fl.alibi_slopes(4), [2.0 ** -(2 * k) for k in range(1, 5)])
  np.testing.assert_allclose(fl.alibi_slopes(12), [2.0 ** -k for k in range(1, 9)]
                             + [2.0 ** -(k + 0.5) for k in range(4)])
  assert fl.alibi_slopes(1).tolist() == [2.0 ** -8]
  with pytest.raises(ValueError, match="num_heads"):
    fl.alibi_slopes(0)
