"""The CPU layout of xla_dense and xla_chunked (impls/cpu_loop.py): one batch row and kv head at a time.

The conformance suite checks the looped impls against the float64 oracle; here the loop is checked
against the same impl run on the whole call (the layout every other platform lowers), with every
operand the loop has to slice at once, and the platform choice is read from the lowered programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash_layers import validate
from flash_layers.impls import REGISTRY, cpu_loop


def _problem(b=3, t=40, s=48, h=6, kvh=2, d=8, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, kvh, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, kvh, d)), jnp.float32)
  q_ids = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
  kwargs = dict(causal=True, segment_ids=q_ids, kv_segment_ids=kv_ids,
                dense_mask=jnp.asarray(rng.random((b, h, t, s)) < 0.8),
                bias=jnp.asarray(rng.standard_normal((1, h, t, s)), jnp.float32),
                alibi_slopes=jnp.asarray(rng.random(h), jnp.float32), dropout_rate=0.2,
                dropout_rng=jax.random.key(3), q_offset=8, kv_offset=0)
  return (q, k, v), kwargs


@pytest.mark.parametrize("impl", ["xla_dense", "xla_chunked"])
def test_loop_equals_whole_call(impl):
  """Looped and whole-call forward, lse and gradients (q, k, v, bias) agree: GQA 6 on 2 heads, 3 rows
  with their own segments, a per-row-and-head dense mask, a shared per-head bias, ALiBi, dropout
  (global rows and heads in the hash) and a query offset. (xla_dense loops its undifferentiated
  forward only.)"""
  (q, k, v), kwargs = _problem()
  bias = kwargs.pop("bias")
  chosen = REGISTRY[impl]

  def run(q, k, v, bias, looped):
    request, args = validate.prepare(q, k, v, bias=bias, **kwargs)
    if impl == "xla_dense":
      return chosen._attend(q, k, v, request=request, args=args, looped=looped)
    if looped:
      return cpu_loop.per_row_and_head(chosen._attend, q, k, v, request=request, args=args)
    return chosen._attend(q, k, v, request=request, args=args)

  def loss(looped):
    def f(q, k, v, bias):
      out, lse = run(q, k, v, bias, looped)
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(lse > -jnp.inf, lse, 0.0) ** 2), (out, lse)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

  # The forward alone (xla_dense loops only this one: under differentiation it runs whole).
  out_a, lse_a = jax.jit(lambda *x: run(*x, True))(q, k, v, bias)
  out_b, lse_b = jax.jit(lambda *x: run(*x, False))(q, k, v, bias)
  np.testing.assert_allclose(out_a, out_b, atol=2e-6)
  np.testing.assert_array_equal(lse_a == -np.inf, lse_b == -np.inf)
  np.testing.assert_allclose(jnp.where(lse_a > -jnp.inf, lse_a, 0), jnp.where(lse_b > -jnp.inf, lse_b, 0),
                             atol=2e-6)
  (_, (out_a, lse_a)), grads_a = loss(True)(q, k, v, bias)
  (_, (out_b, lse_b)), grads_b = loss(False)(q, k, v, bias)
  np.testing.assert_allclose(out_a, out_b, atol=2e-6)
  np.testing.assert_array_equal(lse_a == -np.inf, lse_b == -np.inf)
  np.testing.assert_allclose(jnp.where(lse_a > -jnp.inf, lse_a, 0), jnp.where(lse_b > -jnp.inf, lse_b, 0),
                             atol=2e-6)
  for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads_a, grads_b, strict=True):
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)


def test_chunked_backward_from_statistics_loops():
  """xla_chunked's `attention_backward` (ring attention's) loops too and equals the whole-call one."""
  (q, k, v), kwargs = _problem(seed=1)
  chosen = REGISTRY["xla_chunked"]
  request, args = validate.prepare(q, k, v, **kwargs)
  out, lse = chosen.attend(q, k, v, request=request, args=args)
  d_out = jnp.cos(out)
  delta = jnp.einsum("bthd,bthd->bht", d_out, out)
  backward = jax.jit(lambda *x: chosen.attention_backward(*x, request=request, args=args))
  looped = backward(q, k, v, lse, delta, d_out)
  whole = chosen._backward(q, k, v, lse, delta, d_out, request=request, args=args)
  for name, a, b in zip(("dq", "dk", "dv"), looped, whole, strict=True):
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)


def _lowered_text(impl: str, platform: str, t: int) -> str:
  (q, k, v), _ = _problem(b=2, t=t, s=t, h=4, kvh=2)
  request, args = validate.prepare(q, k, v, causal=True)
  chosen = REGISTRY[impl]
  f = jax.jit(lambda q, k, v: chosen.attend(q, k, v, request=request, args=args))
  return f.trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("impl", ["xla_dense", "xla_chunked"])
def test_cpu_lowering_loops_and_cuda_does_not(impl):
  """Chosen by the platform the program is lowered for: the CPU program's logits are one kv head's
  [2 query heads, 256, 256] inside the loops; a CUDA lowering (from this CPU host) keeps every row and
  head in one [2 rows, 2 kv heads, 2, 256, 256] array (xla_dense's batch, xla_chunked's vmap).
  (xla_chunked runs a one-row step without vmap, so its step's logits have no batch axis.)"""
  assert cpu_loop.CACHE_BYTES < 4 * 2 * 4 * 256 * 256  # the whole call's logits do not fit: loop
  cpu, cuda = _lowered_text(impl, "cpu", 256), _lowered_text(impl, "cuda", 256)
  per_head = {"xla_dense": "tensor<1x1x2x256x256xf32>", "xla_chunked": "tensor<1x2x256x256xf32>"}[impl]
  whole = "tensor<2x2x2x256x256xf32>"  # [b, kvh, g, t, s]
  assert per_head in cpu and whole not in cpu
  assert whole in cuda and per_head not in cuda


@pytest.mark.parametrize("impl", ["xla_dense", "xla_chunked"])
def test_logits_that_fit_in_cache_run_whole_on_cpu(impl):
  """[2, 4 heads, 64, 64] float32 logits are 128 KiB, under `CACHE_BYTES`: no loop, the whole call."""
  cpu = _lowered_text(impl, "cpu", 64)
  assert "tensor<2x2x2x64x64xf32>" in cpu and "tensor<1x1x2x64x64xf32>" not in cpu
