"""The layers' paged KV cache (decode=True, cache="paged"; flash_layers/layers/paged_cache.py).

The oracle is the layer run over each whole sequence without a cache: a paged decoding call, whatever the
schedule (sequences prefilled in chunks, joining and leaving, decoding steps mixed with prefill chunks in
one packed call), must give the matching rows of that run, and int8 pages must stay within their
rounding's bound of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flash_layers as fl
from flash_layers import nnx as flnnx

FEATURES, TOKENS, MAX_SEQS, PAGES_PER_SEQ = 16, 8, 3, 4
LENGTHS = (9, 6, 5)  # three sequences; the third joins when the first leaves
# Each call: (sequence, new tokens) in packing order; sequence 2 takes sequence 0's slot after it ends.
SCHEDULE = (((0, 5), (1, 3)), ((1, 2), (0, 1)), ((0, 3), (1, 0)), ((2, 4), (1, 1)), ((2, 1),))
INT8_ATOL = 2e-2  # int8 keys and values: each element off by at most its token-head's absmax / 254


def _layer(**kwargs):
  fields = dict(num_heads=4, num_kv_heads=2, causal=True, rope_theta=1e4, decode=True, cache="paged",
                num_pages=8, page_size=4, impl="xla_chunked")
  return fl.MultiHeadAttention(**{**fields, **kwargs})


def _inputs():
  return [jax.random.normal(jax.random.key(i), (n, FEATURES)) for i, n in enumerate(LENGTHS)]


def _serve(call, xs, alloc, schedule=SCHEDULE):
  """Run `schedule` through `call(tokens [TOKENS, features], batch) -> [TOKENS, features]`: each
  sequence's outputs, concatenated. A sequence is admitted at its first call and released after its last
  token."""
  slots, fed, outs = {}, {}, {i: [] for i in range(len(xs))}
  for step in schedule:
    for seq, n in step:
      if seq not in slots:
        slots[seq], fed[seq] = alloc.admit(), 0
      alloc.grow(slots[seq], n)
    batch = alloc.batch([(slots[seq], n) for seq, n in step])
    rows = [xs[seq][fed[seq]:fed[seq] + n] for seq, n in step]
    used = sum(n for _, n in step)
    y = call(jnp.concatenate(rows + [jnp.zeros((TOKENS - used, FEATURES))]), batch)
    start = 0
    for seq, n in step:
      outs[seq].append(y[start:start + n])
      start, fed[seq] = start + n, fed[seq] + n
      if fed[seq] == len(xs[seq]):
        alloc.release(slots.pop(seq))
    alloc.check_invariants()
  assert fed == {i: len(x) for i, x in enumerate(xs)}
  return [jnp.concatenate(o) for o in outs.values()]


def _linen_serve(layer, xs, alloc):
  variables = layer.init(jax.random.key(7), jnp.zeros((TOKENS, FEATURES)),
                         paged_batch=fl.PagedBatch.empty(MAX_SEQS, PAGES_PER_SEQ))
  params, state = variables["params"], {"cache": variables["cache"]}
  traces = []

  @jax.jit
  def step(params, cache, tokens, batch):
    traces.append(1)
    y, updated = layer.apply({"params": params, "cache": cache}, tokens, paged_batch=batch, mutable=["cache"])
    return y, updated["cache"]

  def call(tokens, batch):
    y, state["cache"] = step(params, state["cache"], tokens, batch)
    return y

  got = _serve(call, xs, alloc)
  assert len(traces) == 1  # fixed shapes: one compile for every schedule step
  want = [layer.clone(decode=False).apply({"params": params}, x[None])[0] for x in xs]
  return got, want, variables["cache"], state["cache"]


@pytest.mark.parametrize("impl,layout,window", [("xla_chunked", "flax", None),
                                                ("reference", "heads_first", 3), ("auto", "flax", (3, 0))])
def test_linen_paged_decoding_equals_the_uncached_layer(impl, layout, window):
  layer = _layer(impl=impl, cache_layout=layout, window=window, use_sinks=True, softcap=20.0)
  alloc = fl.PageAllocator(8, 4, MAX_SEQS, PAGES_PER_SEQ)
  got, want, empty, cache = _linen_serve(layer, _inputs(), alloc)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=2e-6, rtol=0)
  pool = (8, 4, 2, 4) if layout == "flax" else (2, 8, 4, 4)
  assert {k: v.shape for k, v in empty.items()} == {"k_pages": pool, "v_pages": pool, "page_table": (3, 4),
                                                     "kv_lens": (3,)}
  assert not empty["k_pages"].any() and not empty["kv_lens"].any()  # init keeps the empty pool
  # The table and lengths of the last call, as the allocator gave them: sequence 2, 5 tokens, 2 pages.
  assert cache["kv_lens"].tolist() == [5, 0, 0] and cache["page_table"].shape == (3, 4)


def test_int8_pages_stay_within_their_rounding():
  layer = _layer(kv_cache_dtype="int8", window=(3, 0))
  got, want, empty, _ = _linen_serve(layer, _inputs(), fl.PageAllocator(8, 4, MAX_SEQS, PAGES_PER_SEQ))
  assert empty["k_pages"].dtype == jnp.int8 and empty["k_scales"].shape == (8, 4, 2)
  assert empty["v_scales"].dtype == jnp.float32
  for g, w in zip(got, want, strict=True):
    error = float(jnp.max(jnp.abs(g - w)))
    assert 0 < error < INT8_ATOL, error


def test_a_windowed_layer_decodes_in_a_pool_smaller_than_its_sequences():
  """PageAllocator(window=left) frees the pages the layer's window hides: three sequences of 9, 6 and 5
  tokens through 6 pages of 2 (12 token slots for 20 tokens), the outputs still the uncached layer's."""
  layer = _layer(window=(3, 0), num_pages=6, page_size=2)
  alloc = fl.PageAllocator(6, 2, MAX_SEQS, 8, window=3)
  xs = _inputs()
  variables = layer.init(jax.random.key(7), jnp.zeros((TOKENS, FEATURES)),
                         paged_batch=fl.PagedBatch.empty(MAX_SEQS, 8))
  state = {"cache": variables["cache"]}
  step = jax.jit(lambda cache, tokens, batch: layer.apply({"params": variables["params"], "cache": cache},
                                                          tokens, paged_batch=batch, mutable=["cache"]))

  def call(tokens, batch):
    y, updated = step(state["cache"], tokens, batch)
    state["cache"] = updated["cache"]
    return y

  schedule = (((0, 3), (1, 3)), ((0, 1), (1, 1)), ((0, 1), (1, 1)), ((0, 2), (1, 1)), ((0, 2),),
              ((2, 2),), ((2, 3),))
  got = _serve(call, xs, alloc, schedule)
  for g, x in zip(got, xs, strict=True):
    want = layer.clone(decode=False).apply({"params": variables["params"]}, x[None])[0]
    np.testing.assert_allclose(g, want, atol=2e-6, rtol=0)


def test_nnx_paged_decoding_equals_the_uncached_layer():
  layer = flnnx.MultiHeadAttention(num_heads=4, in_features=FEATURES, num_kv_heads=2, causal=True,
                                   rope_theta=1e4, impl="xla_chunked", cache="paged", num_pages=8,
                                   page_size=4, kv_cache_dtype="int8", rngs=nnx.Rngs(0))
  xs = _inputs()
  want = [layer(x[None])[0] for x in xs]
  layer.init_cache(paged_batch=fl.PagedBatch.empty(MAX_SEQS, PAGES_PER_SEQ))
  assert layer.k_pages[...].dtype == jnp.int8 and layer.k_scales[...].shape == (8, 4, 2)

  @nnx.jit
  def step(layer, tokens, batch):
    return layer(tokens, decode=True, paged_batch=batch)

  got = _serve(lambda tokens, batch: step(layer, tokens, batch), xs,
               fl.PageAllocator(8, 4, MAX_SEQS, PAGES_PER_SEQ))
  for g, w in zip(got, want, strict=True):
    assert float(jnp.max(jnp.abs(g - w))) < INT8_ATOL


def test_paged_decoding_refuses_what_it_cannot_serve():
  x = jnp.zeros((TOKENS, FEATURES))
  empty = fl.PagedBatch.empty(MAX_SEQS, PAGES_PER_SEQ)
  with pytest.raises(ValueError, match="cache='paged' needs num_pages"):
    fl.MultiHeadAttention(num_heads=4, decode=True, cache="paged", page_size=4)
  with pytest.raises(ValueError, match="cache must be one of"):
    fl.MultiHeadAttention(num_heads=4, cache="pages")
  with pytest.raises(ValueError, match="kv_cache_dtype is a field of the paged cache"):
    fl.MultiHeadAttention(num_heads=4, decode=True, kv_cache_dtype="int8")
  with pytest.raises(ValueError, match="cache='paged' does not serve alibi"):
    _layer(alibi=True)
  with pytest.raises(TypeError, match="takes paged_batch=, a PagedBatch"):
    _layer().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="paged_batch is the ragged batch of a paged decoding call"):
    _layer(cache="contiguous", num_pages=None, page_size=None).init(jax.random.key(0), x[None],
                                                                     paged_batch=empty)
  with pytest.raises(ValueError, match="packs every sequence's new tokens on one axis"):
    _layer().init(jax.random.key(0), jnp.zeros((2, TOKENS, FEATURES)), paged_batch=empty)
  with pytest.raises(ValueError, match="takes no segment_ids"):
    _layer().init(jax.random.key(0), x, paged_batch=empty, segment_ids=jnp.ones((TOKENS,), jnp.int32))
  with pytest.raises(fl.UnsupportedError, match="does not serve paged attention"):
    _layer(impl="xla_dense").init(jax.random.key(0), x, paged_batch=empty)
  layer = flnnx.MultiHeadAttention(num_heads=4, in_features=FEATURES, cache="paged", num_pages=8, page_size=4,
                                   rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"init_cache\(paged_batch=...\) first"):
    layer(x, decode=True, paged_batch=empty)
