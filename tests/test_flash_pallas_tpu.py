"""Focused checks of the flash_pallas TPU (Mosaic) kernels, run in TPU interpret mode on the CPU.

The conformance suite covers the contract feature by feature; these tests cover
what only this family has: position offsets (also traced) and the lse cotangent
(ring attention), different forward and backward tiles, that invisible blocks are
skipped and not merely masked, the block-size table and its validation, the
refusals, and the block counts explain() reports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import auto, dispatch, validate
from flash_layers.impls.flash_pallas import tpu, tpu_config


def _inputs(b=1, t=40, s=None, h=4, kvh=2, d=32, dv=None, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k = jax.random.normal(keys[1], (b, s or t, kvh, d), dtype)
  v = jax.random.normal(keys[2], (b, s or t, kvh, dv or d), dtype)
  return q, k, v


def _attend(impl, q, k, v, **kwargs):
  """(out, lse) through the internal entry point that takes position offsets."""
  if impl == "reference":  # the oracle has no tiles; an explicit impl given some would raise
    kwargs = {key: val for key, val in kwargs.items() if key != "block_sizes"}
  request, args = validate.prepare(q, k, v, **kwargs)
  return dispatch.attend(q, k, v, impl=impl, request=request, args=args)


def _loss(impl, **kwargs):
  """A scalar that depends on out and on lse, so gradients flow through both."""
  def loss(q, k, v, q_offset=0, kv_offset=0):
    out, lse = _attend(impl, q, k, v, q_offset=q_offset, kv_offset=kv_offset, **kwargs)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(jnp.sin(lse))
  return loss


def _run(impl, q, k, v, q_offset=0, kv_offset=0, **kwargs):
  """out, lse and the gradients of `_loss`, in one compiled function (offsets traced)."""
  def run(q, k, v, q_offset, kv_offset):
    out, lse = _attend(impl, q, k, v, q_offset=q_offset, kv_offset=kv_offset, **kwargs)
    grads = jax.grad(_loss(impl, **kwargs), (0, 1, 2))(q, k, v, q_offset, kv_offset)
    return out, lse, grads
  return jax.jit(run)(q, k, v, jnp.int32(q_offset), jnp.int32(kv_offset))


def _assert_close(actual, expected, atol):
  for a, e in zip(actual, expected, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), atol=atol)


@pytest.mark.parametrize("kwargs", [
    # A ring shard below the diagonal; fwd and bwd tiles differ (q padded to lcm(128, 256)).
    dict(causal=True, block_sizes=fl.BlockSizes(128, 128, 256, 128)),
    # Rows that see nothing (lse -inf) next to rows that do.
    dict(causal=True, window=(5, 0), block_sizes=fl.BlockSizes(256, 128, 128, 256)),
    dict(segment_ids=np.array([[1] * 150 + [2] * 150]), causal=True, softcap=3.0),
])
def test_traced_offsets_and_lse_cotangent_match_reference(kwargs):
  q, k, v = _inputs(t=300)
  with fl.interpret_as("tpu"):
    out, lse, grads = _run("flash_pallas", q, k, v, q_offset=40, kv_offset=25, **kwargs)
  ref_out, ref_lse, ref_grads = _run("reference", q, k, v, q_offset=40, kv_offset=25, **kwargs)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
  finite = np.isfinite(ref_lse)
  assert finite.all() != ("window" in kwargs)  # the window case has rows that see nothing
  _assert_close([out, np.asarray(lse)[finite]], [ref_out, np.asarray(ref_lse)[finite]], 2e-5)
  _assert_close(grads, ref_grads, 5e-5)


def test_bfloat16_gqa_head_dim_v():
  q, k, v = _inputs(t=200, s=260, h=4, kvh=1, d=64, dv=32, dtype=jnp.bfloat16)
  kwargs = dict(window=(40, 10))
  with fl.interpret_as("tpu"):
    out, _, grads = _run("flash_pallas", q, k, v, **kwargs)
  ref_out, _, ref_grads = _run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), **kwargs)
  assert out.dtype == jnp.bfloat16 and out.shape == (1, 200, 4, 32)
  _assert_close([out], [ref_out], 3e-2)
  for g, r in zip(grads, ref_grads, strict=True):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=0.05 * float(jnp.abs(r).max()))


def _pallas_grids(jaxpr) -> dict[str, tuple]:
  """{kernel name: grid} of every pallas_call in a jaxpr and the jaxprs it calls."""
  grids = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = eqn.params.get("name") or eqn.params.get("name_and_src_info")
      grids[name if isinstance(name, str) else name.name] = eqn.params["grid_mapping"].grid
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          grids.update(_pallas_grids(sub))
  return grids


def test_gqa_group_shares_the_forward_tile():
  """head_dim 128 (token-major): one forward program and one dQ program per (batch row, kv head,
  q block) run both query heads of a group against one K/V tile; several blocks, traced
  offsets, ALiBi per head."""
  q, k, v = _inputs(t=300, h=4, kvh=2, d=128)
  kwargs = dict(causal=True, alibi_slopes=fl.alibi_slopes(4),
                block_sizes=fl.BlockSizes(128, 128, 128, 128))
  with fl.interpret_as("tpu"):
    out, lse, grads = _run("flash_pallas", q, k, v, q_offset=40, kv_offset=25, **kwargs)
    explained = fl.explain(q, k, v, impl="flash_pallas", **kwargs)
    grad = jax.grad(_loss("flash_pallas", **kwargs), (0, 1, 2))
    grids = _pallas_grids(jax.make_jaxpr(grad)(q, k, v, jnp.int32(40), jnp.int32(25)).jaxpr)
  # 3 q blocks: rows (0, 2) and (1) of 1 + 3 and 2 steps -> 2 rows x 4 steps per kv head, where
  # one program per query head would take twice as many.
  assert explained.grid_steps == 2 * 2 * 4
  # (batch, q tiles, rows, steps): the forward and dQ grids hold one q tile per kv head (the
  # steps are a dynamic bound: the offsets are traced); dK/dV runs the group's heads innermost.
  assert grids["flash_layers_fwd"][:3] == grids["flash_layers_bwd_dq"][:3] == (1, 2, 2)
  assert grids["flash_layers_bwd_dkv"][:3] + grids["flash_layers_bwd_dkv"][4:] == (1, 2, 2, 2)
  ref_out, ref_lse, ref_grads = _run("reference", q, k, v, q_offset=40, kv_offset=25, **kwargs)
  _assert_close([out, lse], [ref_out, ref_lse], 2e-5)
  _assert_close(grads, ref_grads, 5e-5)


@pytest.mark.parametrize(("generation", "heads", "kv_heads", "expected"), [
    ("v5e", 8, 2, ((512, 1024), 4)),  # the generation's tiles, the whole group
    ("v5e", 16, 1, ((512, 1024), 8)),  # at most MAX_TILE_HEADS
    ("v4", 8, 1, ((128, 512), 8)),  # 16 MiB of VMEM: block_q halves until 8 heads fit
])
def test_forward_tile_heads_fit_the_vmem_budget(monkeypatch, generation, heads, kv_heads, expected):
  monkeypatch.setattr(tpu_config, "tpu_generation", lambda: generation)
  q = jax.ShapeDtypeStruct((1, 8192, heads, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 8192, kv_heads, 128), jnp.bfloat16)
  request, _ = validate.prepare(q, kv, kv)
  blocks = tpu_config.default_block_sizes(generation)
  tiles = tpu_config.forward_tiles(request, (blocks.block_q, blocks.block_kv), token_major=True)
  assert tiles == expected
  (block_q, block_kv), group = tiles
  budget = 3 * tpu_config.VMEM_CAPACITY[generation] // 4
  assert tpu_config.vmem_need(128, 128, block_q, block_kv, 2, group) <= budget
  if block_q < blocks.block_q:  # shrunk: twice the rows would not have fitted
    assert tpu_config.vmem_need(128, 128, 2 * block_q, block_kv, 2, group) > budget


@pytest.mark.parametrize(("generation", "heads", "kv_heads", "expected"), [
    ("v5e", 8, 2, 4),  # the whole group
    ("v5e", 16, 1, 8),  # at most MAX_TILE_HEADS
    ("v4", 8, 1, 4),  # 16 MiB of VMEM: block_q_bwd stays 256, the heads halve until they fit
])
def test_dq_tile_heads_fit_the_vmem_budget(monkeypatch, generation, heads, kv_heads, expected):
  monkeypatch.setattr(tpu_config, "tpu_generation", lambda: generation)
  q = jax.ShapeDtypeStruct((1, 8192, heads, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 8192, kv_heads, 128), jnp.bfloat16)
  request, _ = validate.prepare(q, kv, kv)
  bwd = tpu_config.default_block_sizes(generation).backward
  assert tpu_config.dq_tile_heads(request, bwd, token_major=True) == expected
  budget = 3 * tpu_config.VMEM_CAPACITY[generation] // 4
  assert tpu_config.vmem_need(128, 128, *bwd, 2, expected) <= budget
  if expected < min(heads // kv_heads, tpu_config.MAX_TILE_HEADS):  # shrunk: twice the heads did not fit
    assert tpu_config.vmem_need(128, 128, *bwd, 2, 2 * expected) > budget


def test_invisible_blocks_are_skipped_not_masked():
  """NaN keys/values in kv blocks no query may see: a kernel that computed them, even masked,
  would carry NaN into p @ v (0 * NaN) and dS; skipped blocks leave every result finite."""
  q, k, v = _inputs(t=256, s=512, h=2, kvh=1)
  q_seg = jnp.asarray([[1] * 128 + [2] * 128])
  kv_seg = jnp.asarray([[1] * 128 + [7] * 256 + [2] * 128])  # the middle 2 blocks: document 7
  poison = (kv_seg == 7)[0][None, :, None, None]
  k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
  kwargs = dict(segment_ids=q_seg, kv_segment_ids=kv_seg, block_sizes=fl.BlockSizes(128, 128))
  with fl.interpret_as("tpu"):
    out, _, (dq, dk, dv) = _run("flash_pallas", q, k_bad, v_bad, **kwargs)
    explained = fl.explain(q, k, v, impl="flash_pallas", **kwargs)
  assert (explained.blocks_visited, explained.blocks_total) == (2 * 2, 2 * 2 * 4)
  ref_out, _, (ref_dq, ref_dk, ref_dv) = _run("reference", q, k, v, **kwargs)
  _assert_close([out, dq], [ref_out, ref_dq], 5e-5)
  keep = ~np.asarray(poison)[0, :, 0, 0]
  _assert_close([dk[:, keep], dv[:, keep]], [ref_dk[:, keep], ref_dv[:, keep]], 5e-5)
  assert np.all(np.asarray(dk)[:, ~keep] == 0) and np.all(np.asarray(dv)[:, ~keep] == 0)


def test_explain_counts_packed_documents_and_causal_blocks():
  q = jax.ShapeDtypeStruct((1, 8192, 1, 64), jnp.bfloat16)
  packed = np.repeat(np.arange(1, 17), 512)[None]  # 16 documents of 512 tokens
  with fl.interpret_as("tpu"):
    docs = fl.explain(q, q, q, impl="flash_pallas", segment_ids=packed)
    causal = fl.explain(q, q, q, impl="flash_pallas", causal=True)
  assert docs.kernel == "pallas-tpu (interpret)"
  # A perfect block diagonal is 16 / 256 = 0.0625 of the blocks; the target allows 1.25x that.
  assert docs.blocks_visited / docs.blocks_total <= 0.078
  assert abs(causal.blocks_visited / causal.blocks_total - 0.5) < 0.05  # 136/256 at 512 tiles


def test_block_sizes_table_and_validation():
  assert set(tpu_config.DEFAULT_BLOCK_SIZES) == {"v4", "v5e", "v5p", "v6e"}
  assert tpu_config.default_block_sizes("v6e") == tpu_config.DEFAULT_BLOCK_SIZES["v6e"]
  assert tpu_config.default_block_sizes(None) == tpu_config.GENERIC_BLOCK_SIZES
  assert fl.BlockSizes(256, 512).backward == (256, 512)
  with pytest.raises(ValueError, match="block_kv.*multiple of 128"):
    fl.BlockSizes(block_q=128, block_kv=200)
  with pytest.raises(ValueError, match="block_q_bwd"):
    fl.BlockSizes(block_q_bwd=0)
  with pytest.raises(TypeError, match="block_q must be an int"):
    fl.BlockSizes(block_q=128.0)
  q, k, v = _inputs(t=16)
  with fl.interpret_as("tpu"), pytest.raises(TypeError, match="block_sizes must be"):
    fl.attention(q, k, v, impl="flash_pallas", block_sizes=(128, 128))


def test_short_sequences_shrink_the_tiles():
  q, k, v = _inputs(t=7, s=300)
  request, _ = validate.prepare(q, k, v, block_sizes=fl.BlockSizes(512, 1024))
  assert tpu.block_shape(request, "tpu") == (128, 384)


def test_float16_runs_in_float32_and_dense_masks_are_refused():
  q, k, v = _inputs(t=16, dtype=jnp.float16)
  with fl.interpret_as("tpu"):
    out = fl.attention(q, k, v, impl="flash_pallas", causal=True)
  assert out.dtype == jnp.float16
  ref = fl.attention(*(x.astype(jnp.float32) for x in (q, k, v)), impl="reference", causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-3)
  request, _ = validate.prepare(*_inputs(t=16), dense_mask=np.ones((16, 16), bool))
  assert tpu.unsupported(request) == "dense mask"
  with pytest.raises(fl.UnsupportedError, match="dense mask"):
    auto.resolve("flash_pallas", request, "tpu")


def test_block_plans_grow_linearly_and_oversized_ones_are_refused():
  # 262,144 tokens, causal + packed documents: 2 words per q block and 4 per block of segment ids.
  q = jax.ShapeDtypeStruct((1, 262144, 1, 64), jnp.bfloat16)
  seg = np.repeat(np.arange(32, dtype=np.int32), 8192)[None]  # 32 documents of 8,192 tokens
  served, _ = validate.prepare(q, q, q, causal=True, segment_ids=seg)
  assert tpu.unsupported(served) is None
  assert tpu_config.plan_words(served, (512, 512)) == 2 * 512 + 4 * (512 + 512)
  # 2^26 tokens at 512-token tiles: 2 x 131,072 plan words, more than SMEM's share.
  q = jax.ShapeDtypeStruct((1, 2**26, 1, 64), jnp.bfloat16)
  too_big, _ = validate.prepare(q, q, q, causal=True)
  assert "block plan of 262144 int32 words" in tpu.unsupported(too_big)
  assert auto.resolve("auto", too_big, "tpu")[0] == "xla_chunked"
  larger_tiles, _ = validate.prepare(q, q, q, causal=True, block_sizes=fl.BlockSizes(1024, 1024))
  assert tpu.unsupported(larger_tiles) is None
  assert auto.resolve("auto", larger_tiles, "tpu")[0] == "flash_pallas"
