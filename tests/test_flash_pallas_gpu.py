"""Focused checks of the flash_pallas GPU (Triton) kernels, run in Pallas interpret mode on the CPU.

The conformance suite covers the contract feature by feature; these tests cover
what only this family has: global position offsets and the lse cotangent (ring
attention), tile-size overrides, the config table, the refusals, and the block
skipping explain() reports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import dispatch, validate
from flash_layers.contract import block_info, mask_rules
from flash_layers.impls.flash_pallas import gpu, gpu_config


def _inputs(b=1, t=40, s=40, h=4, kvh=2, d=32, dv=None, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k = jax.random.normal(keys[1], (b, s, kvh, d), dtype)
  v = jax.random.normal(keys[2], (b, s, kvh, dv or d), dtype)
  return q, k, v


def _attend(impl, q, k, v, **kwargs):
  """(out, lse) through the internal entry point that takes position offsets."""
  request, args = validate.prepare(q, k, v, **kwargs)
  return dispatch.attend(q, k, v, impl=impl, request=request, args=args)


def _out_and_lse_loss(impl, **kwargs):
  """A scalar that depends on both outputs, so gradients flow through out and lse."""
  def loss(q, k, v):
    out, lse = _attend(impl, q, k, v, **kwargs)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out * weights) + jnp.sum(jnp.sin(lse))
  return loss


@pytest.mark.parametrize("kwargs", [
    dict(causal=True, q_offset=24, kv_offset=8),  # a ring shard below the diagonal
    dict(causal=True, window=(5, 0), q_offset=0, kv_offset=20),  # rows that see nothing
    dict(segment_ids=np.array([[1] * 20 + [2] * 20]), causal=True, q_offset=3, kv_offset=3),
])
def test_offsets_and_lse_cotangent_match_reference(kwargs):
  q, k, v = _inputs()
  with fl.interpret_as("gpu"):
    out, lse = _attend("flash_pallas", q, k, v, **kwargs)
    grads = jax.jit(jax.grad(_out_and_lse_loss("flash_pallas", **kwargs), (0, 1, 2)))(q, k, v)
  ref_out, ref_lse = _attend("reference", q, k, v, **kwargs)
  ref_grads = jax.jit(jax.grad(_out_and_lse_loss("reference", **kwargs), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-5)
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
    np.testing.assert_allclose(got, want, atol=5e-5, err_msg=name)


def test_interior_and_edge_blocks_with_small_tiles():
  # 16-token tiles over 45 queries and 70 keys, band [-40, 0] with offsets: several interior
  # blocks, masked edges before (window) and after (diagonal) them, ragged last blocks.
  kwargs = dict(causal=True, window=(40, 20), q_offset=30, kv_offset=5)
  tiles = fl.GpuBlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)
  q, k, v = _inputs(t=45, s=70, h=2, kvh=1, d=16)
  with fl.interpret_as("gpu"):
    out, lse = _attend("flash_pallas", q, k, v, block_sizes=tiles, **kwargs)
    loss = _out_and_lse_loss("flash_pallas", block_sizes=tiles, **kwargs)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  ref_out, ref_lse = _attend("reference", q, k, v, **kwargs)
  ref_grads = jax.jit(jax.grad(_out_and_lse_loss("reference", **kwargs), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  finite = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(lse), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-5)
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
    np.testing.assert_allclose(got, want, atol=5e-5, err_msg=name)


def test_traced_offsets_give_the_same_result():
  q, k, v = _inputs(t=24, s=24)

  def run(q_offset, kv_offset):
    return _attend("flash_pallas", q, k, v, causal=True, q_offset=q_offset, kv_offset=kv_offset)[0]

  with fl.interpret_as("gpu"):
    traced = jax.jit(run)(jnp.int32(30), jnp.int32(20))
    static = run(30, 20)
  np.testing.assert_allclose(traced, static, atol=1e-6)
  np.testing.assert_allclose(static, _attend("reference", q, k, v, causal=True, q_offset=30,
                                             kv_offset=20)[0], atol=2e-5)


def test_rows_that_see_no_key_get_zeros_and_zero_gradients():
  q, k, v = _inputs(t=33, s=33, h=2, kvh=2)
  seg = np.array([[1] * 20 + [7] * 13])
  kv_seg = np.array([[1] * 33])  # queries of document 7 see no key

  def loss(q, k, v):
    return jnp.sum(fl.attention(q, k, v, impl="flash_pallas", segment_ids=seg, kv_segment_ids=kv_seg))

  with fl.interpret_as("gpu"):
    out = fl.attention(q, k, v, impl="flash_pallas", segment_ids=seg, kv_segment_ids=kv_seg)
    dq, dk, dv = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  assert np.all(np.asarray(out[:, 20:]) == 0)
  assert np.all(np.asarray(dq[:, 20:]) == 0)
  assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
  assert np.abs(np.asarray(out[:, :20])).max() > 0


def test_block_size_override_changes_tiles_not_results():
  block_sizes = fl.GpuBlockSizes(block_q=16, block_kv=32, block_q_bwd=32, block_kv_bwd=16, num_warps=2)
  q, k, v = _inputs(t=70, s=70, d=64, dv=32)
  seg = np.array([[1] * 30 + [2] * 40])

  def loss(impl, **extra):
    return lambda q, k, v: jnp.sum(jnp.sin(fl.attention(q, k, v, impl=impl, causal=True, segment_ids=seg,
                                                        **extra)))

  with fl.interpret_as("gpu"):
    got = jax.jit(jax.grad(loss("flash_pallas", block_sizes=block_sizes), (0, 1, 2)))(q, k, v)
    request, _ = validate.prepare(q, k, v, block_sizes=block_sizes)
    assert gpu.block_shape(request, "cuda") == (16, 32)
  want = jax.jit(jax.grad(loss("reference"), (0, 1, 2)))(q, k, v)
  for got_x, want_x in zip(got, want, strict=True):
    np.testing.assert_allclose(got_x, want_x, atol=5e-5)


def test_bad_block_sizes_name_the_field():
  with pytest.raises(ValueError, match="block_q"):
    fl.GpuBlockSizes(block_q=48)
  with pytest.raises(ValueError, match="num_warps"):
    fl.GpuBlockSizes(num_warps=3)
  with pytest.raises(TypeError, match="GpuBlockSizes"):
    gpu_config.override(gpu_config.CONFIG_TABLE[("hopper", 64)], {"block_q": 64})
  # The TPU family's sizes are for the TPU kernels: the GPU keeps its table entry.
  hopper64 = gpu_config.CONFIG_TABLE[("hopper", 64)]
  assert gpu_config.override(hopper64, fl.BlockSizes()) == hopper64


def test_config_table_covers_generations_and_head_dims():
  for generation in ("hopper", "ampere", "ada"):
    for bucket in (64, 128, 256):
      assert isinstance(gpu_config.CONFIG_TABLE[(generation, bucket)], fl.GpuBlockSizes)
  # No GPU here: Hopper defaults; tiles shrink to short sequences but never below 16.
  assert gpu_config.gpu_generation() == "hopper"
  q, k, v = _inputs(t=5, s=300, d=128, dtype=jnp.bfloat16)
  request, _ = validate.prepare(q, k, v)
  assert gpu.block_shape(request, "cuda") == (16, gpu_config.CONFIG_TABLE[("hopper", 128)].block_kv)
  assert [gpu_config.generation_of(c) for c in ("9.0", "10.0", "8.0", "8.7", "8.6", "8.9", "12.0")] == [
      "hopper", "hopper", "ampere", "ampere", "ada", "ada", "ada"]


def _smem(cfg, d, itemsize):
  """Shared memory per program by the explicit count: resident tiles + (stages - 1) pipelined
  buffers of the streamed tiles + the probability tile(s), x bytes per element; max of 3 kernels."""
  fwd_bufs, bwd_bufs = max(cfg.num_stages - 1, 1), max(cfg.num_stages_bwd - 1, 1)
  forward = cfg.block_q * d + fwd_bufs * cfg.block_kv * 2 * d + cfg.block_q * cfg.block_kv
  dkv = cfg.block_kv_bwd * 2 * d + bwd_bufs * cfg.block_q_bwd * 2 * d + 2 * cfg.block_q_bwd * cfg.block_kv_bwd
  dq = cfg.block_q_bwd * 2 * d + bwd_bufs * cfg.block_kv_bwd * 2 * d + cfg.block_q_bwd * cfg.block_kv_bwd
  return itemsize * max(forward, dkv, dq)


@pytest.mark.parametrize("generation", ["hopper", "ampere", "ada"])
def test_every_table_entry_fits_its_shared_memory(generation):
  budget = {"hopper": 227 * 1024, "ampere": 163 * 1024, "ada": 99 * 1024}[generation]
  for bucket in (64, 128, 256):
    cfg = gpu_config.CONFIG_TABLE[(generation, bucket)]
    assert gpu_config.shared_memory_bytes(cfg, bucket, bucket, 2) == _smem(cfg, bucket, 2)
    assert _smem(cfg, bucket, 2) <= budget, (generation, bucket, _smem(cfg, bucket, 2) / 1024)
  # Hopper's d128 forward uses most of it (192 KiB): the table is not sized far below the budget.
  assert _smem(gpu_config.CONFIG_TABLE[("hopper", 128)], 128, 2) == 192 * 1024


def test_float32_tiles_are_cut_to_fit():
  q, k, v = _inputs(t=4096, s=4096, h=1, kvh=1, d=128)
  request, _ = validate.prepare(q, k, v)
  cfg = gpu_config.config(request)
  assert _smem(gpu_config.CONFIG_TABLE[("hopper", 128)], 128, 4) > 227 * 1024  # as tabled: too big
  assert _smem(cfg, 128, 4) <= 227 * 1024 and cfg.block_q == 128


def test_refuses_only_what_it_cannot_do():
  q, k, v = _inputs(d=512)
  with fl.interpret_as("gpu"), pytest.raises(fl.UnsupportedError, match="head_dim > 256"):
    fl.attention(q, k, v, impl="flash_pallas")
  request, _ = validate.prepare(*_inputs(), dense_mask=np.ones((1, 1, 40, 40), bool))
  assert gpu.unsupported(request) == "dense mask"
  request, _ = validate.prepare(*_inputs(d=256, dv=80, dtype=jnp.bfloat16), causal=True, window=3,
                                softcap=1.0, segment_ids=np.ones((1, 40), np.int32))
  assert gpu.unsupported(request) is None


def _shapes(b, t, h, d):
  spec = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  return spec, spec, spec


def test_explain_reports_block_skipping_for_packed_documents():
  # 16 documents of 512 tokens packed in one 8,192-token row.
  seg = np.repeat(np.arange(1, 17, dtype=np.int32), 512)[None]
  with fl.interpret_as("gpu"):
    info = fl.explain(*_shapes(1, 8192, 1, 64), impl="flash_pallas", segment_ids=seg)
  assert info.kernel == "pallas-gpu (interpret)"
  assert info.block_fraction <= 0.078, str(info)


def test_explain_reports_about_half_the_blocks_for_causal():
  with fl.interpret_as("gpu"):
    info = fl.explain(*_shapes(2, 4096, 4, 128), impl="flash_pallas", causal=True)
  assert 0.45 <= info.block_fraction <= 0.55, str(info)
  hopper128 = gpu_config.CONFIG_TABLE[("hopper", 128)]
  block_q, block_kv = hopper128.block_q, hopper128.block_kv
  assert info.blocks_total == 2 * 4 * (4096 // block_q) * (4096 // block_kv)


def _walk_eqns(jaxpr, in_kernel=False, in_loop=False):
  """(eqn, inside a pallas_call kernel?, inside a loop of that kernel?) for every equation."""
  for eqn in jaxpr.eqns:
    yield eqn, in_kernel, in_loop
    kernel = in_kernel or eqn.primitive.name == "pallas_call"
    loop = in_loop or (in_kernel and eqn.primitive.name == "while")
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _walk_eqns(sub, kernel, loop)


def _grad_jaxpr(t, **kwargs):
  q = jax.ShapeDtypeStruct((1, t, 8, 80), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 2, 80), jnp.bfloat16)
  loss = lambda q, k, v: fl.attention(q, k, v, impl="flash_pallas", **kwargs).astype(jnp.float32).sum()  # noqa: E731
  with fl.interpret_as("gpu"):
    return jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, kv, kv).jaxpr


def test_causal_loops_have_no_cond_and_lengths_need_no_padded_copies():
  eqns = list(_walk_eqns(_grad_jaxpr(1000, causal=True)))
  loops = [e for e, kernel, _ in eqns if kernel and e.primitive.name == "while"]
  assert len(loops) == 6  # forward, dK/dV, dQ: an interior loop and an edge loop each
  assert not [e for e, _, in_loop in eqns if in_loop and e.primitive.name == "cond"]
  # 1000 tokens and head_dim 80 are no block multiple / power of two: masked loads, no HBM copies.
  assert not [e for e, kernel, _ in eqns if not kernel and e.primitive.name in ("pad", "slice")]
  # Packed documents keep the block map, whose `full` flag picks the element mask per tile.
  packed = list(_walk_eqns(_grad_jaxpr(1000, causal=True, segment_ids=np.ones((1, 1000), np.int32))))
  assert [e for e, _, in_loop in packed if in_loop and e.primitive.name == "cond"]


def test_arithmetic_block_ranges_match_a_brute_force_count():
  """`masks.visible_block_range` (the GPU kernels' ranges) against the visible pairs counted
  position by position: [lo, hi) spans exactly the blocks with a visible pair, [full_lo, full_hi)
  exactly the whole blocks with every pair visible, for q blocks walking kv blocks and kv blocks
  walking q blocks, with offsets."""
  rng = np.random.default_rng(0)
  for _ in range(120):
    q_len, kv_len = (int(x) for x in rng.integers(1, 90, 2))
    block_q, block_kv = (int(x) for x in rng.choice([16, 32], 2))
    window = None if rng.integers(3) == 0 else tuple(int(x) for x in rng.integers(0, 50, 2))
    spec = mask_rules.MaskSpec(causal=bool(rng.integers(2)), window=window)
    q_offset, kv_offset = (int(x) for x in rng.integers(-40, 40, 2))
    # One shape for every case (eager jax compiles per shape), cut to the lengths.
    vis = np.asarray(mask_rules.visible((q_offset + np.arange(96))[:, None],
                                      (kv_offset + np.arange(96))[None, :], spec))[:q_len, :kv_len]
    for by_q in (True, False):
      own = (q_len, block_q, q_offset) if by_q else (kv_len, block_kv, kv_offset)
      other = (kv_len, block_kv, kv_offset) if by_q else (q_len, block_q, q_offset)
      pairs = vis if by_q else vis.T
      band = mask_rules.band(spec, transpose=not by_q)
      # All own blocks at once: `visible_block_range` is element-wise.
      starts = np.arange(0, own[0], own[1])
      first, last = own[2] + starts, own[2] + np.minimum(starts + own[1], own[0]) - 1
      ranges = block_info.visible_block_range(first, last, band, other[2], other[0], other[1], xp=np)
      ranges = np.stack([np.broadcast_to(x, first.shape) for x in ranges], axis=-1)  # no band: scalars
      for b, (lo, full_lo, full_hi, hi) in enumerate(ranges.tolist()):
        rows = pairs[b * own[1]:(b + 1) * own[1]]
        tiles = [rows[:, c * other[1]:(c + 1) * other[1]] for c in range(-(-other[0] // other[1]))]
        seen = [c for c, tile in enumerate(tiles) if tile.any()]
        full = [c for c, tile in enumerate(tiles) if (c + 1) * other[1] <= other[0] and tile.all()]
        assert (lo, hi) == ((seen[0], seen[-1] + 1) if seen else (0, 0))
        assert list(range(full_lo, full_hi)) == full
