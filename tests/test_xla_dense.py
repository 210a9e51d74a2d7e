"""xla_dense beyond the conformance suite: the lse cotangent, ring offsets, dense masks with GQA,
and the CPU auto rule that picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_xla_chunked import assert_close, chunked_fwd_bwd, random_problem

import flash_layers as fl
from flash_layers import auto, validate
from flash_layers.impls.xla_dense import XlaDense
from flash_layers.testing import reference64


def dense_fwd_bwd(q, k, v, cotangents, **kwargs):
  """(out, lse, dq, dk, dv) of xla_dense with (dout, dlse) cotangents; offsets traced under jit."""
  return chunked_fwd_bwd(XlaDense(), q, k, v, cotangents, **kwargs)


def test_lse_cotangent_softcap_and_rows_without_keys():
  """Ring attention differentiates through lse. Rows whose document has no key get lse = -inf,
  zero output and zero gradients even with a non-zero dlse; GQA (4 heads on 2) and a softcap."""
  _, (q, k, v, dout, dlse) = random_problem(0)
  q_ids = np.repeat([[1, 2, 3, 7]], [20, 20, 20, 10], axis=1).repeat(2, axis=0).astype(np.int32)
  kv_ids = np.repeat([[1, 2, 3]], [30, 30, 30], axis=1).repeat(2, axis=0).astype(np.int32)
  kwargs = dict(causal=True, segment_ids=q_ids, kv_segment_ids=kv_ids)
  visible = reference64.mask(2, 70, 90, **kwargs)[:, None]
  expected = reference64.attention(q, k, v, visible, softcap=3.0, dout=dout, dlse=dlse)
  actual = dense_fwd_bwd(*map(jnp.asarray, (q, k, v)), (jnp.asarray(dout), jnp.asarray(dlse)),
                         causal=True, softcap=3.0, segment_ids=jnp.asarray(q_ids),
                         kv_segment_ids=jnp.asarray(kv_ids))
  assert_close(actual, expected)
  out, lse, dq = actual[:3]
  assert np.all(out[:, 60:] == 0) and np.all(dq[:, 60:] == 0) and np.all(lse[:, :, 60:] == -np.inf)


@pytest.mark.parametrize("offsets", [(100, 37), (0, 70)])
def test_traced_global_offsets(offsets):
  """q_offset / kv_offset are global positions (traced under jit), as the ring passes them."""
  _, (q, k, v, dout, dlse) = random_problem(1)
  kwargs = dict(causal=True, window=(50, 10))
  visible = reference64.mask(2, 70, 90, q_offset=offsets[0], kv_offset=offsets[1], **kwargs)
  expected = reference64.attention(q, k, v, visible[:, None], dout=dout, dlse=dlse)
  actual = dense_fwd_bwd(*map(jnp.asarray, (q, k, v)), (jnp.asarray(dout), jnp.asarray(dlse)),
                         offsets=offsets, **kwargs)
  assert_close(actual, expected)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("mask_shape", [(2, 1, 70, 90), (1, 4, 70, 90), (70, 90)])
def test_dense_mask(mask_shape, kv_heads):
  """flax's dense mask (broadcastable to [b, h, q, kv]), with and without grouped kv heads."""
  rng, (q, k, v, dout, dlse) = random_problem(2, kvh=kv_heads)
  dense = rng.random(mask_shape) < 0.3
  expected = reference64.attention(q, k, v, np.broadcast_to(dense, (2, 4, 70, 90)), dout=dout)
  actual = dense_fwd_bwd(*map(jnp.asarray, (q, k, v)), (jnp.asarray(dout), jnp.zeros_like(dlse)),
                         dense_mask=jnp.asarray(dense))
  assert_close(actual, expected)


def _struct(t: int):
  return jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)


@pytest.mark.parametrize("segments", [False, True])
def test_auto_on_cpu_is_dense_below_the_crossover_and_chunked_from_it(segments):
  short, long = 512, auto.CPU_CHUNKED_MIN_KV_LEN
  kwargs = lambda t: {"segment_ids": jnp.ones((1, t), jnp.int32)} if segments else {}
  e = fl.explain(_struct(short), _struct(short), _struct(short), **kwargs(short))
  assert (e.impl, e.kernel) == ("xla_dense", "xla")
  assert f"kv_len {short} < {long}" in e.reason and "dense" in e.reason
  e = fl.explain(_struct(long), _struct(long), _struct(long), **kwargs(long))
  assert e.impl == "xla_chunked"
  assert f"kv_len {long} >= {long}" in e.reason and "memory" in e.reason
  # Cross-attention: the rule reads the key length, not the query length.
  assert fl.explain(_struct(long), _struct(short), _struct(short)).impl == "xla_dense"


@pytest.mark.parametrize("config", ["decode_ragged_8k_gqa", "decode_ragged_causal_8k_q4_mqa",
                                    "decode_window_at_the_end"])
def test_the_decoding_forward_reads_only_visible_chunks_and_matches_the_oracle(config):
  """Not differentiated and lowered for CPU, a call of <= 16 queries with a mask runs `_dense_bounded`:
  the run of 512-key chunks holding a visible key, merged by an online softmax. Against the float64 oracle
  (out and lse), on the conformance suite's ragged caches (one row empty, one short) and a window that
  hides the cache's head; the jaxpr holds the run-time-bounded loop."""
  import test_conformance as conformance

  from flash_layers.impls import xla_dense
  cfg = conformance.CONFIG_BY_NAME.get(config) or conformance.Config(
      config, q_len=5, kv_len=3072, heads=4, kv_heads=2, causal=True, window=(700, 0), q_offset=3067)
  problem = conformance.make_problem(cfg, "float32")
  q, k, v, _ = (jnp.asarray(a) for a in problem.inputs)
  seg = {name: jnp.asarray(ids) for name, ids in problem.seg.items()}
  kwargs = {key: value for key, value in problem.kwargs.items() if key != "q_offset"}

  def forward(q, k, v, offset):
    request, args = validate.prepare(q, k, v, q_offset=offset, **seg, **kwargs)
    return XlaDense().attend(q, k, v, request=request, args=args)

  jaxpr = str(jax.make_jaxpr(forward)(q, k, v, cfg.q_offset))
  assert "while" in jaxpr and f"{xla_dense.DECODE_CHUNK}" in jaxpr
  out, lse = jax.jit(forward)(q, k, v, cfg.q_offset)
  expected = problem.expected
  err = np.abs(np.asarray(out, np.float64) - expected["out"]).max() / expected["magnitude"]["out"]
  assert err <= conformance.F32_TOL, err
  want_lse = np.asarray(expected["lse"])
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-5, rtol=0)
