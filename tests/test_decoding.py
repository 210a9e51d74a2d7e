"""Decoding with a KV cache (flash_layers/layers/kv_cache.py): the layers' caches against full, uncached runs.

The oracle is the same layer (or model) run over the whole sequence without a cache: a decoding call
must give the outputs of the matching rows of that run. Cached greedy generation of the example decoder
(examples/decoder.py: two layers, GQA, rotary positions, one sliding-window layer whose cache is a ring
buffer, prompts of different lengths in one batch) must give the uncached run's tokens and logits.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl
from examples import decoder
from flash_layers import lowering
from flash_layers import nnx as flnnx
from flash_layers.layers import kv_cache

# Every impl with traced offsets (the cache index is traced under jit); jax_splash's mask is static.
DECODE_IMPLS = ("reference", "xla_dense", "xla_chunked", "xla_native", "flash_pallas")
# Call lengths: a prefill of 5, single tokens, a chunk of 3 (crossing the ring's wrap-around).
CALLS = ((0, 5), (5, 6), (6, 7), (7, 10), (10, 11), (11, 12))


def _interpreted(impl):
  return lowering.interpret_as("tpu") if impl == "flash_pallas" else contextlib.nullcontext()


def _linen_decode(layer, params, cache, x, calls=CALLS, **call_kwargs):
  @jax.jit
  def feed(cache, chunk):
    y, updated = layer.apply({"params": params, "cache": cache}, chunk, mutable=["cache"], **call_kwargs)
    return y, updated["cache"]

  outs = []
  for lo, hi in calls:
    y, cache = feed(cache, x[:, lo:hi])
    outs.append(y)
  return jnp.concatenate(outs, 1), cache


@pytest.mark.parametrize("window", [None, 3], ids=["full", "ring"])
@pytest.mark.parametrize("impl", ["reference", "xla_dense", "xla_chunked", "xla_native"])
def test_linen_decoding_equals_the_uncached_layer(impl, window):
  layer = fl.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, window=window, rope_theta=1e4,
                                alibi=True, impl=impl, decode=True)
  x = jax.random.normal(jax.random.key(0), (2, 12, 16))
  variables = layer.init(jax.random.key(1), x)
  cache = variables["cache"]
  slots = 12 if window is None else 3
  # GQA-aware: the cache holds the 2 kv heads only; a windowed layer keeps only its window.
  assert cache["cached_key"].shape == (2, slots, 2, 4)
  assert cache["cached_segment_ids"].shape == (2, slots)
  assert int(cache["cache_index"]) == 0
  want = layer.clone(decode=False).apply({"params": variables["params"]}, x)
  got, cache = _linen_decode(layer, variables["params"], cache, x)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  assert int(cache["cache_index"]) == 12


@pytest.mark.parametrize("window", [None, 3], ids=["full", "ring"])
@pytest.mark.parametrize("impl", ["xla_dense", "flash_pallas-tpu", "flash_pallas-gpu"])
def test_a_heads_first_cache_decodes_like_the_uncached_layer(impl, window):
  """cache_layout="heads_first" keeps [batch, kv_heads, slots, head_dim] (what the TPU decode kernel reads
  without a copy); flash_pallas's split-KV decode kernels of both families run the steps here."""
  impl, _, family = impl.partition("-")
  layer = fl.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, window=window, rope_theta=1e4,
                                impl=impl, decode=True, cache_layout="heads_first")
  x = jax.random.normal(jax.random.key(0), (2, 12, 16))
  variables = layer.init(jax.random.key(1), x)
  slots = 12 if window is None else 3
  assert variables["cache"]["cached_key"].shape == (2, 2, slots, 4)
  assert variables["cache"]["cached_segment_ids"].shape == (2, slots)
  want = layer.clone(decode=False).apply({"params": variables["params"]}, x)
  with lowering.interpret_as(family) if family else contextlib.nullcontext():
    got, cache = _linen_decode(layer, variables["params"], variables["cache"], x)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  # The same tokens in flax's layout: the same cache contents, transposed.
  _, flax_cache = _linen_decode(layer.clone(impl="xla_dense", cache_layout="flax"), variables["params"],
                                layer.clone(cache_layout="flax").init(jax.random.key(1), x)["cache"], x)
  np.testing.assert_allclose(cache["cached_key"], flax_cache["cached_key"].swapaxes(1, 2), atol=1e-6)


def test_non_causal_decoding_never_sees_an_unwritten_slot():
  layer = fl.MultiHeadAttention(num_heads=2, impl="xla_dense", decode=True)
  x = jax.random.normal(jax.random.key(0), (1, 6, 8))
  variables = layer.init(jax.random.key(1), x)
  # Each call sees exactly the tokens written so far (its own included): the prefix run's last rows.
  got, _ = _linen_decode(layer, variables["params"], variables["cache"], x, calls=((0, 2), (2, 3), (3, 6)))
  full = layer.clone(decode=False)
  for lo, hi in ((0, 2), (2, 3), (3, 6)):
    want = full.apply({"params": variables["params"]}, x[:, :hi])[:, lo:hi]
    np.testing.assert_allclose(got[:, lo:hi], want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "ring"])
def test_nnx_decoding_equals_the_uncached_layer(window):
  layer = flnnx.MultiHeadAttention(4, 16, num_kv_heads=2, causal=True, window=window, rope_theta=1e4,
                                   impl="xla_dense", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 12, 16))
  want = layer(x)
  layer.init_cache(x.shape)
  assert layer.cached_key[...].shape == (2, 12 if window is None else 3, 2, 4)

  @nnx.jit
  def feed(layer, chunk):
    return layer(chunk, decode=True)

  got = jnp.concatenate([feed(layer, x[:, lo:hi]) for lo, hi in CALLS], 1)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  assert int(layer.cache_index[...]) == 12
  heads_first = flnnx.MultiHeadAttention(4, 16, num_kv_heads=2, causal=True, window=window, rope_theta=1e4,
                                         impl="xla_dense", cache_layout="heads_first", rngs=nnx.Rngs(0))
  heads_first.init_cache(x.shape)
  assert heads_first.cached_key[...].shape == (2, 2, 12 if window is None else 3, 4)
  got = jnp.concatenate([feed(heads_first, x[:, lo:hi]) for lo, hi in CALLS], 1)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_decoding_refuses_what_it_cannot_serve():
  with pytest.raises(ValueError, match="cache_layout must be one of"):
    fl.MultiHeadAttention(num_heads=2, decode=True, cache_layout="bshd")
  with pytest.raises(ValueError, match="global_tokens"):
    fl.MultiHeadAttention(num_heads=2, window=4, global_tokens=1, decode=True)
  layer = fl.MultiHeadAttention(num_heads=2, causal=True, decode=True)
  x = jnp.ones((1, 4, 8))
  variables = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="queries' length"):  # one key and value appended per query
    layer.apply(variables, x[:, :1], x, mutable=["cache"])
  with pytest.raises(ValueError, match="must not be -1"):
    layer.apply(variables, x[:, :1], segment_ids=np.full((1, 1), -1), mutable=["cache"])
  nnx_layer = flnnx.MultiHeadAttention(2, 8, causal=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="init_cache"):
    nnx_layer(x[:, :1], decode=True)
  # jax_splash takes static offsets only: under jit the cache index is traced, and it says so.
  splash = fl.MultiHeadAttention(num_heads=2, causal=True, impl="jax_splash", decode=True)
  variables = splash.init(jax.random.key(0), x)
  with pytest.raises(fl.UnsupportedError, match="traced"):
    jax.jit(lambda v, c: splash.apply(v, c, mutable=["cache"]))(variables, x[:, :1])


def test_a_decoding_step_is_chosen_as_dense_on_cpu():
  q = jax.ShapeDtypeStruct((1, 1, 8, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 8192, 2, 64), jnp.float32)
  explanation = fl.explain(q, kv, kv, causal=True, q_offset=8191)
  assert explanation.impl == "xla_dense" and "decoding" in explanation.reason
  assert fl.explain(jax.ShapeDtypeStruct((1, 8192, 8, 64), jnp.float32), kv, kv).impl == "xla_chunked"


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_cached_greedy_generation_equals_uncached(impl):
  model = decoder.CausalLM(impl=impl, features=16, num_heads=2, num_kv_heads=1)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  # Larger embeddings than the default init, so that greedy decoding does not repeat one token.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 30 if "Embed" in jax.tree_util.keystr(path) else x, params)
  prompts = [[5, 17, 42, 8, 23, 61], [9, 3]]  # of different lengths: the second is left-padded
  steps = 4 if impl == "flash_pallas" else 6
  with _interpreted(impl):
    tokens, logits = decoder.generate(model, params, prompts, steps)
    want_tokens, want_logits = decoder.generate_uncached(model, params, prompts, steps)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  assert len(set(np.asarray(tokens).ravel().tolist())) > 2  # the check is not on one repeated token


def test_cache_layout_and_ring_detection():
  ring_layer = fl.MultiHeadAttention(num_heads=2, causal=True, window=(4, 0))
  assert kv_cache.layout(ring_layer, 100) == kv_cache.Layout(4, ring=True)
  assert kv_cache.layout(ring_layer, 3) == kv_cache.Layout(3, ring=False)
  assert kv_cache.is_ring(ring_layer, 4) and not kv_cache.is_ring(ring_layer, 100)
  bidirectional = fl.MultiHeadAttention(num_heads=2, window=4)
  assert kv_cache.layout(bidirectional, 100) == kv_cache.Layout(100, ring=False)


# fl.attention's q_offset / kv_offset against the float64 oracle: a decoding-shaped call (a few queries
# at the end of a long key sequence, a key block starting before them), static and traced, forward and
# backward (flash_pallas under TPU interpret).
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_offsets_match_the_float64_oracle(impl, traced):
  from flash_layers.testing import reference64
  b, t, s, h, kvh, d = 2, 3, 40, 4, 2, 8
  q_offset, kv_offset = 37, -2
  kq, kk, kv_, kd = jax.random.split(jax.random.key(7), 4)
  q = jax.random.normal(kq, (b, t, h, d))
  k = jax.random.normal(kk, (b, s, kvh, d))
  v = jax.random.normal(kv_, (b, s, kvh, d))
  dout = jax.random.normal(kd, (b, t, h, d))
  seg = np.ones((b, t), np.int32)
  kv_seg = np.ones((b, s), np.int32)
  kv_seg[1, :5] = 0  # row 1's first keys are padding
  slopes = np.asarray(fl.alibi_slopes(h))
  options = dict(causal=True, window=(30, 0), segment_ids=seg, kv_segment_ids=kv_seg, alibi_slopes=slopes)

  def run(q, k, v, q_off, kv_off):
    return fl.attention(q, k, v, impl=impl, q_offset=q_off, kv_offset=kv_off, **options)

  offsets = (jnp.int32(q_offset), jnp.int32(kv_offset)) if traced else (q_offset, kv_offset)
  static = () if traced else (3, 4)  # Python int offsets stay static under the jit
  call = jax.jit(run, static_argnums=static)
  visible = reference64.mask(b, t, s, causal=True, window=(30, 0), segment_ids=seg, kv_segment_ids=kv_seg,
                             q_offset=q_offset, kv_offset=kv_offset)[:, None]
  want = reference64.attention(q, k, v, visible, alibi_slopes=slopes, q_offset=q_offset, kv_offset=kv_offset,
                               dout=np.asarray(dout))
  with _interpreted(impl):
    out = call(q, k, v, *offsets)
    np.testing.assert_allclose(out, want["out"], atol=2e-5, rtol=0)
    grads = jax.jit(jax.grad(lambda q, k, v, *o: jnp.sum(run(q, k, v, *o) * dout), argnums=(0, 1, 2)),
                    static_argnums=static)(q, k, v, *offsets)
  for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
    np.testing.assert_allclose(got, want[name], atol=2e-5, rtol=0, err_msg=name)


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import flash_layers as fl
q = jax.random.normal(jax.random.key(0), (4, 2, 4, 8))
k = v = jax.random.normal(jax.random.key(1), (4, 20, 2, 8))
call = lambda q, k, v, offset, mesh: fl.attention(q, k, v, causal=True, q_offset=offset, mesh=mesh)
want = jax.jit(lambda q, k, v, o: call(q, k, v, o, None))(q, k, v, 15)
sharded = fl.parallel.make_mesh(data=2, tensor=2)
got = jax.jit(lambda q, k, v, o: call(q, k, v, o, sharded))(q, k, v, 15)  # a traced offset
np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
try:
  call(q, k, v, 3, fl.parallel.make_mesh(data=2, sequence=2))
except fl.UnsupportedError as e:
  assert "q_offset" in str(e) and "sequence" in str(e), e
else:
  raise AssertionError("a ring mesh took q_offset")
print("OK")
"""


def test_offsets_on_a_mesh():
  """Batch and heads sharded: a traced q_offset reaches every shard; a ring mesh refuses it by name."""
  import os
  import subprocess
  import sys
  from pathlib import Path

  from conftest import subprocess_xla_flags
  root = Path(__file__).resolve().parent.parent
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root), XLA_FLAGS=subprocess_xla_flags(4))
  proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=root, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
