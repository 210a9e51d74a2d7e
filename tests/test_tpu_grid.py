"""The TPU kernels' grids hold only the tiles that matter.

The grid of every pallas_call in the jaxpr of ``value_and_grad`` is read off the jaxpr (a
dynamic grid bound, sized from the segment ids, is evaluated by running the jaxpr's plain-JAX
part with the kernels stubbed out) and compared with a NumPy count of the tiles holding at least
one visible (query, key) pair, derived from each query's interval of visible keys, not
from `flash_layers.masks` (both in `benchmarks/tpu_grid.py`, whose results file docs/kernels.md
and the README quote).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from benchmarks import tpu_grid
from flash_layers.impls.flash_pallas import tpu_config

T = tpu_grid.T
GENERATION = "v5e"
BLOCKS = tpu_config.default_block_sizes(GENERATION)  # read from the kernels' own per-generation table
MAX_OVERHEAD = 1.25
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
RESULTS_FILE = RESULTS / "tpu-grid-v5e-32k-2026-12-03.json"


@pytest.mark.parametrize("mask", ["causal", "window", "packed", "padded"])
def test_grid_steps_are_the_visible_tiles(mask):
  grids = tpu_grid.kernel_grids(mask, BLOCKS)
  # Besides the three tile kernels, one small kernel computes rowsum(dO * O) per q block.
  assert set(grids) == {"flash_layers_fwd", "flash_layers_bwd_dkv", "flash_layers_bwd_dq",
                        "flash_layers_bwd_delta"}
  assert grids.pop("flash_layers_bwd_delta") == (1, 1, T // BLOCKS.block_q_bwd)
  tiles = {"flash_layers_fwd": tpu_grid.visible_tiles(mask, BLOCKS.block_q, BLOCKS.block_kv),
           "flash_layers_bwd_dkv": tpu_grid.visible_tiles(mask, *BLOCKS.backward),
           "flash_layers_bwd_dq": tpu_grid.visible_tiles(mask, *BLOCKS.backward)}
  for name, grid in grids.items():
    steps = int(np.prod(grid))
    assert tiles[name] <= steps <= MAX_OVERHEAD * tiles[name], (name, grid, steps, tiles[name])
  # The results file the docs quote holds these very counts (rerun `python -m benchmarks.tpu_grid
  # --generation v5e --json ...` when the kernels or the tiles change).
  recorded = json.loads(RESULTS_FILE.read_text())
  assert recorded["block_sizes"] == str(BLOCKS)
  row = next(r for r in recorded["rows"] if r["mask"] == mask)
  for short, name in tpu_grid.KERNELS.items():
    assert (row[short]["steps"], row[short]["visible"]) == (int(np.prod(grids[name])), tiles[name])


def test_explain_reports_grid_steps():
  q = jax.ShapeDtypeStruct((2, 8192, 3, 64), jnp.bfloat16)
  v4 = tpu_config.default_block_sizes("v4")  # square 512 x 512 forward tiles
  assert (v4.block_q, v4.block_kv) == (512, 512)
  with fl.interpret_as("tpu"):
    causal = fl.explain(q, q, q, impl="flash_pallas", causal=True, block_sizes=v4)
  # 16 q blocks: rows (i, 15 - i) take 17 steps each, 8 rows, per batch row and head.
  assert causal.grid_steps == 2 * 3 * 8 * 17 == causal.blocks_visited
  assert "grid steps 816" in str(causal)


@pytest.mark.parametrize("name", tpu_grid.MOD_MASKS)
def test_executed_grid_points_of_a_mask_mod_are_its_visible_tiles(name):
  """32,768 tokens, the forward kernel under the TPU interpreter with its grid-point recorder (the grid
  points it really executes, not the static grid): a mask_mod's empty tiles never enter the grid.
  Prefix-LM (5,000 bidirectional keys) and chunked causal (chunks of 8,192); the visible tiles are
  counted in NumPy from each query's interval of keys, not from flash_layers. The results file the
  docs quote holds these counts (`python -m benchmarks.tpu_grid --mods --json ...`)."""
  points = tpu_grid.executed_points(name, BLOCKS)
  tiles = tpu_grid.interval_tiles(*tpu_grid.mod_intervals(name), BLOCKS.block_q, BLOCKS.block_kv)
  assert tiles <= points <= MAX_OVERHEAD * tiles, (points, tiles)
  recorded = json.loads((RESULTS / "tpu-grid-mods-v5e-32k-2026-12-04.json").read_text())
  assert recorded["block_sizes"] == str(BLOCKS)
  row = next(r for r in recorded["rows"] if r["mask_mod"] == name)
  assert (row["executed_points"], row["visible_tiles"]) == (points, tiles)


@pytest.mark.parametrize("name", tpu_grid.MOD_MASKS)
def test_executed_grid_points_of_a_mask_mod_at_small_tiles(name):
  """The property above at the smallest size that shows it: 1,024 tokens in 128 x 128 tiles (8 per
  axis), a 300-key prefix and 256-token chunks, so that empty, partial and full tiles all occur.
  The 32k case with the kernels' own tiles (what the docs quote) is its second-tier version."""
  blocks, t, prefix, chunk = fl.BlockSizes(128, 128), 1024, 300, 256
  points = tpu_grid.executed_points(name, blocks, t, prefix, chunk)
  tiles = tpu_grid.interval_tiles(*tpu_grid.mod_intervals(name, t, prefix, chunk), 128, 128)
  assert tiles < (t // 128) ** 2  # some tiles are empty ...
  assert tiles <= points <= MAX_OVERHEAD * tiles, (points, tiles)  # ... and never enter the grid
