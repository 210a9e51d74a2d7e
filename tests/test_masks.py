"""block_info.block_map against brute force over the dense mask (built by the float64 reference, not
mask_rules.py)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash_layers.contract import block_info, mask_rules
from flash_layers.testing import reference64


def brute_force(q_len, kv_len, block_q, block_kv, dense):
  """(visible, full) per block from a dense [b, q_len, kv_len] mask; padding counts as not visible."""
  b = dense.shape[0]
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  padded = np.zeros((b, nq * block_q, nk * block_kv), bool)
  padded[:, :q_len, :kv_len] = dense
  tiles = padded.reshape(b, nq, block_q, nk, block_kv)
  return tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))


def consecutive_docs(rng, batch, length):
  """Packed documents 1, 2, 3, ... in order, no padding: the case the map must get exactly."""
  cuts = np.sort(rng.integers(0, length + 1, size=(batch, int(rng.integers(0, 5)))), axis=1)
  return (1 + (np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1)).astype(np.int32)


@st.composite
def problems(draw):
  q_len = draw(st.integers(1, 90))
  kv_len = draw(st.one_of(st.just(q_len), st.integers(1, 90)))
  kind = draw(st.sampled_from(["none", "consecutive", "padded", "random"]))
  if kind == "consecutive":
    kv_len = q_len  # self-attention over the same packed row
  window = draw(st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 40))))
  global_tokens = 0 if window is None else draw(st.sampled_from([0, 0, 1, 3, 20]))
  return dict(global_tokens=global_tokens,
      q_len=q_len, kv_len=kv_len, block_q=draw(st.sampled_from([1, 8, 13, 16, 32, 128])),
      block_kv=draw(st.sampled_from([1, 8, 16, 24, 32, 128])), causal=draw(st.booleans()),
      window=window, kind=kind, batch=draw(st.integers(1, 3)),
      q_offset=draw(st.integers(0, 64)), kv_offset=draw(st.integers(0, 64)),
      seed=draw(st.integers(0, 2**31 - 1)))


def segments(p, rng):
  b, t, s = p["batch"], p["q_len"], p["kv_len"]
  if p["kind"] == "none":
    return None, None
  if p["kind"] == "consecutive":
    ids = consecutive_docs(rng, b, t)
    return ids, ids
  if p["kind"] == "padded":  # consecutive documents, then padding with id 0
    q_ids = consecutive_docs(rng, b, t)
    q_ids[:, t - int(rng.integers(0, t // 2 + 1)):] = 0
    kv_ids = q_ids if s == t else consecutive_docs(rng, b, s)
    return q_ids, kv_ids
  return (rng.integers(0, 4, size=(b, t)).astype(np.int32),
          rng.integers(0, 4, size=(b, s)).astype(np.int32))


def check_block_map(p):
  rng = np.random.default_rng(p["seed"])
  q_ids, kv_ids = segments(p, rng)
  g = p.get("global_tokens", 0)
  spec = mask_rules.MaskSpec(causal=p["causal"], window=p["window"], global_tokens=g)
  dense = reference64.mask(p["batch"], p["q_len"], p["kv_len"], causal=p["causal"],
                                 window=p["window"], segment_ids=q_ids, kv_segment_ids=kv_ids,
                                 q_offset=p["q_offset"], kv_offset=p["kv_offset"], global_tokens=g)
  true_visible, true_full = brute_force(p["q_len"], p["kv_len"], p["block_q"], p["block_kv"], dense)
  # With global tokens the impls see encoded segment ids (validate.prepare does this).
  encode = (lambda ids: mask_rules.encode_global(jnp.asarray(ids), g)) if g else jnp.asarray
  bm = block_info.block_map(p["q_len"], p["kv_len"], p["block_q"], p["block_kv"], spec,
                       None if q_ids is None else encode(q_ids),
                       None if kv_ids is None else encode(kv_ids), p["q_offset"], p["kv_offset"])
  visible = np.broadcast_to(np.asarray(bm.visible), true_visible.shape)
  full = np.broadcast_to(np.asarray(bm.full), true_full.shape)

  # Never skip a block that holds a visible pair; never skip the element mask where one is needed.
  assert np.all(visible >= true_visible), f"visible misses blocks: {np.argwhere(true_visible & ~visible)}"
  assert np.all(true_full >= full), f"full claims blocks with hidden pairs: {np.argwhere(full & ~true_full)}"
  # Exact where the map promises it: causal and windows alone (any offsets), and consecutive
  # packed documents (with causal only when queries and keys share positions).
  positions_only = p["kind"] == "none"
  # Padding (id 0) after the documents is kept apart from their ids, so it stays exact with it.
  same_row = p["kind"] == "consecutive" or (p["kind"] == "padded" and p["kv_len"] == p["q_len"])
  packed_exact = same_row and p["window"] is None and (not p["causal"] or p["q_offset"] == p["kv_offset"])
  if (positions_only or packed_exact) and not g:
    np.testing.assert_array_equal(visible, true_visible)
  # A block is "full" only without padded tails, and then exactly when every pair is visible
  # (with global tokens, conservatively: a block mixing global rows and band rows is masked).
  if not g:
    np.testing.assert_array_equal(full, true_full)
  check_index_lists(np.asarray(bm.visible), np.asarray(bm.kv_index), np.asarray(bm.kv_count))
  check_index_lists(np.swapaxes(np.asarray(bm.visible), 1, 2), np.asarray(bm.q_index),
                    np.asarray(bm.q_count))
  return bm


def check_index_lists(visible, index, count):
  """Per row: the visible columns in order, then the last one repeated."""
  for row in np.ndindex(*visible.shape[:2]):
    cols = np.flatnonzero(visible[row])
    assert count[row] == len(cols)
    np.testing.assert_array_equal(index[row][:len(cols)], cols)
    if len(cols):
      assert np.all(index[row][len(cols):] == cols[-1])


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(problems())
def test_block_map_matches_brute_force(p):
  check_block_map(p)


@pytest.mark.parametrize("p", [
    # Ring attention: a kv shard wholly in the future of the q shard -> nothing visible.
    dict(q_len=64, kv_len=64, block_q=16, block_kv=16, causal=True, window=None, kind="none",
         batch=1, q_offset=0, kv_offset=64, seed=0),
    # ... and wholly in its past -> everything, and every block full.
    dict(q_len=64, kv_len=64, block_q=16, block_kv=16, causal=True, window=None, kind="none",
         batch=1, q_offset=128, kv_offset=0, seed=0),
    # Tails on both axes with a window (0, 0): only the diagonal.
    dict(q_len=100, kv_len=100, block_q=32, block_kv=32, causal=False, window=(0, 0), kind="none",
         batch=1, q_offset=0, kv_offset=0, seed=0),
    dict(q_len=333, kv_len=333, block_q=128, block_kv=128, causal=True, window=None,
         kind="consecutive", batch=3, q_offset=0, kv_offset=0, seed=3),
], ids=["future_shard", "past_shard", "diagonal_with_tails", "packed_causal"])
def test_block_map_edge_cases(p):
  bm = check_block_map(p)
  if p["kv_offset"] == 64:
    assert int(bm.kv_count.max()) == 0
  if p["q_offset"] == 128:
    assert bool(bm.full.all())


def test_block_map_under_jit_with_traced_offsets():
  """Ring attention passes traced offsets; the map must agree with the eager one."""
  spec = mask_rules.MaskSpec(causal=True, window=(40, 3))
  ids = jnp.asarray(consecutive_docs(np.random.default_rng(1), 2, 150))
  make = lambda qo, ko: block_info.block_map(150, 150, 32, 16, spec, ids, ids, qo, ko)
  traced = jax.jit(make)(jnp.int32(37), jnp.int32(5))
  eager = make(37, 5)
  for a, b in zip(traced, eager, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_global_tokens_visit_a_few_percent_of_tiles_at_16k():
  # Longformer's shape: 16,384 tokens, window 512 each side, one global token (no segment ids).
  spec = mask_rules.MaskSpec(window=(512, 512), global_tokens=1)
  bm = block_info.block_map(16384, 16384, 512, 512, spec)
  visible = np.asarray(bm.visible[0])
  assert visible[0].all() and visible[:, 0].all()  # the global token's row and column
  band = np.abs(np.arange(32)[:, None] - np.arange(32)[None, :]) <= 1
  np.testing.assert_array_equal(visible, band | (np.arange(32) == 0)[:, None] | (np.arange(32) == 0)[None])
  with pytest.raises(ValueError, match="global_tokens=1 needs a window"):
    from flash_layers import validate
    x = jnp.zeros((1, 8, 1, 4))
    validate.prepare(x, x, x, global_tokens=1)


def test_block_stats_counts_over_batch_and_heads():
  spec = mask_rules.MaskSpec(causal=True)
  # 4 x 4 blocks, causal: the 10 lower-triangle ones; batch 3 and 2 heads share the map.
  assert block_info.block_stats(3, 2, 256, 256, 64, 64, spec) == (3 * 2 * 10, 3 * 2 * 16)
  ids = jnp.asarray([[1] * 128 + [2] * 128, [1] * 256])
  visited, total = block_info.block_stats(2, 1, 256, 256, 64, 64, spec, ids, ids)
  assert (visited, total) == (3 + 3 + 10, 2 * 16)
  traced = jax.jit(lambda i: block_info.block_stats(2, 1, 256, 256, 64, 64, spec, i, i) is None)
  assert traced(ids)
