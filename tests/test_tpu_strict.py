"""The hardware-faithful tier: the TPU kernels under the strict interpreter.

The plain TPU interpreter runs the grid in order on one core, so a kernel that carries a
dependency across a "parallel" grid axis, or reads a buffer a DMA is still writing, passes it
and fails on a chip. Here the flash_pallas TPU kernels run the conformance suite's checks
(forward and dq/dk/dv against the float64 oracle) under `flash_layers.testing.strict`: two
cores per device, the "parallel" axes walked in a random order (several seeds), eager DMAs and
the race detector on. A race fails the test; a revisited output block raises in the
interpreter. Two toy kernels show the tier can fail: a reduction over an axis wrongly marked
"parallel" (a race) and one that returns to an output block it left (a revisit); both give the
right answer under the plain interpreter.

Every new TPU kernel joins STRICT_CONFIGS. The cases are small (each configuration and seed
compiles four interpreted kernels for two simulated cores, about 10 CPU-seconds); see
docs/kernels.md for the tier's measured time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_conformance as conformance
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import flash_layers as fl
from flash_layers.testing import strict

pytestmark = pytest.mark.strict

SEEDS = (0, 1, 2)  # the random walks of the "parallel" grid axes each configuration runs under

# 128-token tiles: every configuration has several q and kv blocks, so the two simulated cores
# and the random order have grid points to share out.
TILES = fl.BlockSizes(128, 128)

STRICT_CONFIGS = [
    # Packed documents with padding, causal, GQA 4:2 at head_dim 128 (the token-major layout:
    # one forward tile holds the group's query heads), ALiBi, two batch rows.
    conformance.Config("strict_causal_packed_gqa_d128_alibi", q_len=300, batch=2, heads=4, kv_heads=2,
                       head_dim=128, causal=True, segments="packed", alibi=True),
    # A window with dropout over packed documents with padding, GQA 4:2 at head_dim 64 (the
    # head-major layout), q_len != kv_len.
    conformance.Config("strict_window_dropout_packed_gqa", q_len=260, kv_len=300, heads=4, kv_heads=2,
                       head_dim=64, window=(40, 9), segments="packed", dropout=0.1),
    # A mask_mod with an SMEM operand (prefix-LM, per-row prefixes) over packed documents, GQA 4:2: its
    # tile flags prune the grid, the plan carries each block row's run of full tiles.
    conformance.Config("strict_prefix_lm_mod_packed_gqa", q_len=300, batch=2, heads=4, kv_heads=2,
                       head_dim=64, segments="packed", mods="prefix_lm"),
    # The split-KV decode kernel (3 queries at the end of a 1,000-slot cache with ragged lengths, GQA
    # 4:2): its grid's batch, kv-head and split axes are "parallel", its partial outputs per split.
    conformance.Config("strict_decode_ragged_causal_gqa", q_len=3, kv_len=1000, batch=3, heads=4, kv_heads=2,
                       head_dim=64, causal=True, q_offset=997, segments="ragged"),
]


@dataclasses.dataclass
class _TiledProblem(conformance.Problem):
  """A conformance problem run with TILES."""

  @property
  def kwargs(self) -> dict:
    return {**super().kwargs, "block_sizes": TILES}


def _problem(cfg: conformance.Config) -> _TiledProblem:
  problem = conformance.make_problem(cfg, "float32")
  return _TiledProblem(**{f.name: getattr(problem, f.name) for f in dataclasses.fields(problem)})


@pytest.mark.parametrize("config", [c.name for c in STRICT_CONFIGS])
def test_tpu_kernels_conform_under_the_strict_interpreter(config):
  """Every seed in one test, so they share one process's compiled core programs (pytest-xdist
  would otherwise compile them again in each worker)."""
  _check_strict(config, SEEDS)


def test_tpu_kernels_conform_under_the_strict_interpreter_on_one_walk():
  """The default tier's version: the forward and both backward kernels (packed GQA at head_dim 128,
  three tiles per axis) under one random walk of the parallel axes; every configuration under every
  seed is the test above, in the second tier."""
  _check_strict(STRICT_CONFIGS[0].name, SEEDS[:1])


def _check_strict(config: str, seeds) -> None:
  problem = _problem(next(c for c in STRICT_CONFIGS if c.name == config))
  for seed in seeds:
    try:
      with strict.interpreting(seed) as races:
        # ("flash_pallas", None): the case's own interpret context is left out, the strict one
        # above forces the TPU family.
        conformance.check_case(("flash_pallas", None), problem)
    except Exception as e:  # a revisited block, an out-of-bounds read, a wrong result
      raise AssertionError(f"{config} seed {seed}: {e}") from e
    assert not races, f"{config} seed {seed}: {races}"


def test_interpret_params_are_checked():
  with pytest.raises(ValueError, match="params apply to platform 'tpu' only"), \
      fl.interpret_as("gpu", params=strict.params(0)):
    pass
  with pytest.raises(ValueError, match="InterpretParams, 'plain' or None; got {'detect_races': True}"), \
      fl.interpret_as("tpu", params={"detect_races": True}):
    pass
  with pytest.raises(ValueError, match="InterpretParams, 'plain' or None; got 'fast'"), \
      fl.interpret_as("tpu", params="fast"):
    pass
  with pytest.raises(ValueError, match="params apply to platform 'tpu' only"), \
      fl.interpret_as("gpu", params="plain"):
    pass


def test_the_plain_interpreter_computes_the_same_without_simulated_memory():
  """params="plain": the same kernel bodies on the same numerics, bit for bit, forward and backward;
  the TPU-semantics interpreter's io callbacks (its simulated memory) are gone from the program."""
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.standard_normal((1, 160, 1, 32)), jnp.float32) for _ in range(4))
  seg = jnp.asarray(np.repeat([1, 2], 80)[None])  # two documents, the second across the tile edge

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda *x: fl.attention(*x, impl="flash_pallas", causal=True, segment_ids=seg,
                                               block_sizes=fl.BlockSizes(128, 128)), q, k, v)
    return out, *vjp(dout)

  results, programs = {}, {}
  for params in (None, "plain"):
    with fl.interpret_as("tpu", params=params):  # a new function each time: jit's trace cache ignores params
      compiled = jax.jit(lambda *x: fwd_bwd(*x)).lower(q, k, v).compile()
    programs[params], results[params] = compiled.as_text(), compiled(q, k, v)
  assert "python_cpu_callback" in programs[None]
  assert "python_cpu_callback" not in programs["plain"]
  for name, a, b in zip(("out", "dq", "dk", "dv"), results[None], results["plain"], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_strict_configs_cover_the_tier():
  """Packed documents with padding, windows, GQA at head_dim 128, dropout and ALiBi, each with
  several blocks per axis under TILES; the decode kernel with ragged cache rows, several kv blocks."""
  features = set().union(*(c.features() for c in STRICT_CONFIGS))
  assert {"dropout", "alibi"} <= features
  assert any(c.window is not None for c in STRICT_CONFIGS)
  assert any(c.causal for c in STRICT_CONFIGS)
  assert any(c.head_dim == 128 and c.kvh < c.heads for c in STRICT_CONFIGS)
  for cfg in STRICT_CONFIGS:
    problem = conformance.make_problem(cfg, "float32")
    if cfg.q_len <= 16:  # the split-KV decode kernel: ragged rows (one empty), several kv blocks
      assert cfg.segments == "ragged" and (problem.seg["kv_segment_ids"] < 0).any(), cfg.name
      assert cfg.s > 4 * TILES.block_kv, cfg.name
      continue
    assert cfg.segments == "packed" and (problem.seg["segment_ids"] == 0).any(), cfg.name  # padding
    assert min(cfg.q_len, cfg.s) > 2 * TILES.block_q, cfg.name
  assert len(SEEDS) >= 3


# ----------------------------------------------------------------------------
# The tier can fail: two broken toy kernels
# ----------------------------------------------------------------------------

ROWS, LANES, STEPS = 8, 128, 4


def _accumulate(x, *, semantics: str, interpret, out_blocks: int = 1):
  """Grid step i adds x's row block i into output block i % out_blocks, zeroed on first visit.

  Correct on a chip only when each output block is visited in one run of consecutive steps
  along a sequential ("arbitrary") axis: the output tile lives in VMEM from the step that first
  maps it until the index changes, then it is written back and never read again.
  """
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) < out_blocks)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += x_ref[...]

  return pl.pallas_call(
      kernel, grid=(STEPS,),
      in_specs=[pl.BlockSpec((ROWS, LANES), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((ROWS, LANES), lambda i: (0, i % out_blocks)),
      out_shape=jax.ShapeDtypeStruct((ROWS, out_blocks * LANES), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=(semantics,)),
      interpret=interpret)(x)


def _toy_problem(out_blocks: int = 1):
  """x and the sums _accumulate should return."""
  x = jnp.arange(STEPS * ROWS * LANES, dtype=jnp.float32).reshape(STEPS * ROWS, LANES)
  blocks = np.asarray(x).reshape(STEPS, ROWS, LANES)
  return x, np.concatenate([blocks[b::out_blocks].sum(0) for b in range(out_blocks)], axis=1)


def test_a_sequential_reduction_passes_the_strict_interpreter():
  """The control: the correct kernel ("arbitrary" axis) is race-free and right under every seed."""
  x, expected = _toy_problem()
  for seed in SEEDS:
    with strict.interpreting(seed) as races:
      out = _accumulate(x, semantics="arbitrary", interpret=strict.params(seed))
      np.testing.assert_array_equal(np.asarray(out), expected)
    assert not races, races


def test_a_reduction_over_a_parallel_axis_is_caught_as_a_race():
  """The reduction axis marked "parallel": on one core in order (the plain interpreter) the sum
  is right; split over two cores, both write the one output block with nothing ordering them."""
  x, expected = _toy_problem()
  np.testing.assert_array_equal(np.asarray(_accumulate(x, semantics="parallel", interpret=True)),
                                expected)
  with strict.interpreting(0) as races:
    jax.block_until_ready(_accumulate(x, semantics="parallel", interpret=strict.params(0)))
  assert races, "the strict interpreter missed a race on the output block"
  assert all(race.buffer.startswith("('hbm'") for race in races), races  # the output, in HBM


def test_a_revisited_output_block_is_refused():
  """Steps 0..3 accumulate into output blocks 0, 1, 0, 1: on a chip, step 2 adds to a VMEM tile
  that no longer holds block 0. The plain interpreter reads the block back and sums right; the
  strict interpreter refuses the revisit."""
  x, expected = _toy_problem(out_blocks=2)
  plain = _accumulate(x, semantics="arbitrary", interpret=True, out_blocks=2)
  np.testing.assert_array_equal(np.asarray(plain), expected)
  with pytest.raises(Exception, match="Revisited block"), strict.interpreting(0):
    jax.block_until_ready(
        _accumulate(x, semantics="arbitrary", interpret=strict.params(0), out_blocks=2))
