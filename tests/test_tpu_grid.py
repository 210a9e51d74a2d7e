"""The TPU kernels' grids hold only the tiles that matter.

The grid of every pallas_call in the jaxpr of ``value_and_grad`` is read off the jaxpr (a
dynamic grid bound, sized from the segment ids, is evaluated by running the jaxpr's plain-JAX
part with the kernels stubbed out) and compared with a NumPy count of the tiles holding at least
one visible (query, key) pair, derived here from each query's interval of visible keys, not
from `flash_layers.masks`.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl

T = 32768
BLOCKS = fl.BlockSizes(512, 512, 256, 512)  # v5e's defaults: forward 512 x 512, backward 256 x 512
MAX_OVERHEAD = 1.25
DOC = 2048  # 16 packed documents
PAD = 1000  # "padded": the same documents, the last one cut short by 1,000 padding tokens (id 0)


def _key_intervals(mask: str) -> tuple[np.ndarray, np.ndarray]:
  """Per query position, the first and last key it sees (each mask here sees an interval)."""
  i = np.arange(T)
  if mask == "causal":
    return np.zeros(T, np.int64), i
  if mask == "window":  # window=(512, 0)
    return np.maximum(i - 512, 0), i
  start = i // DOC * DOC  # "packed": full attention within each document
  end = start + DOC - 1
  if mask == "padded":  # padding sees padding; the last document ends where it starts
    start = np.where(i >= T - PAD, T - PAD, start)
    end = np.where(i >= T - PAD, T - 1, np.minimum(end, T - PAD - 1))
  return start, end


def _visible_tiles(mask: str, block_q: int, block_kv: int) -> int:
  lo, hi = _key_intervals(mask)
  kv_first = np.arange(T // block_kv)[None, :] * block_kv
  touches = (lo[:, None] <= kv_first + block_kv - 1) & (hi[:, None] >= kv_first)  # [T, kv blocks]
  return int(touches.reshape(T // block_q, block_q, -1).any(axis=1).sum())


def _kernel_grids(mask: str) -> dict[str, tuple[int, ...]]:
  """{kernel name: grid} of value_and_grad, dynamic bounds evaluated."""
  x = jnp.zeros((1, T, 1, 128), jnp.bfloat16)
  kwargs = dict(impl="flash_pallas", block_sizes=BLOCKS)
  if mask == "causal":
    kwargs["causal"] = True
  elif mask == "window":
    kwargs["window"] = (512, 0)
  else:
    ids = np.arange(T) // DOC + 1
    if mask == "padded":
      ids[T - PAD:] = 0
    kwargs["segment_ids"] = jnp.asarray(ids[None], jnp.int32)

  def loss(q, k, v):
    return fl.attention(q, k, v, **kwargs).astype(jnp.float32).sum()

  with fl.interpret_as("tpu"):
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, x, x)
  grids: dict[str, tuple[int, ...]] = {}
  _evaluate(closed.jaxpr, closed.consts, [x, x, x], grids)
  return grids


def _kernel_name(params) -> str:
  name = params.get("name") or params.get("name_and_src_info")
  return name if isinstance(name, str) else name.name


def _evaluate(jaxpr, consts, args, grids):
  """Runs a jaxpr, recording each pallas_call's grid instead of running the kernel."""
  env = {}

  def read(var):
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "pallas_call":
      mapping = eqn.params["grid_mapping"]
      bounds = iter(int(b) for b in values[:mapping.num_dynamic_grid_bounds])
      grid = tuple(d if isinstance(d, int) else next(bounds) for d in mapping.grid)
      grids[_kernel_name(eqn.params)] = grid
      outs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    elif name in ("pjit", "jit", "closed_call"):
      sub = eqn.params["jaxpr"]
      outs = _evaluate(sub.jaxpr, sub.consts, values, grids)
    elif name in ("custom_vjp_call", "custom_jvp_call"):
      sub = eqn.params["call_jaxpr"]
      outs = _evaluate(sub.jaxpr, sub.consts, values, grids)
    else:
      outs = eqn.primitive.bind(*values, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


@pytest.mark.parametrize("mask", ["causal", "window", "packed", "padded"])
def test_grid_steps_are_the_visible_tiles(mask):
  grids = _kernel_grids(mask)
  # Besides the three tile kernels, one small kernel computes rowsum(dO * O) per q block.
  assert set(grids) == {"flash_layers_fwd", "flash_layers_bwd_dkv", "flash_layers_bwd_dq",
                        "flash_layers_bwd_delta"}
  assert grids.pop("flash_layers_bwd_delta") == (1, 1, T // 256)
  tiles = {"flash_layers_fwd": _visible_tiles(mask, 512, 512),
           "flash_layers_bwd_dkv": _visible_tiles(mask, 256, 512),
           "flash_layers_bwd_dq": _visible_tiles(mask, 256, 512)}
  for name, grid in grids.items():
    steps = int(np.prod(grid))
    assert tiles[name] <= steps <= MAX_OVERHEAD * tiles[name], (name, grid, steps, tiles[name])


def test_explain_reports_grid_steps():
  q = jax.ShapeDtypeStruct((2, 8192, 3, 64), jnp.bfloat16)
  with fl.interpret_as("tpu"):
    causal = fl.explain(q, q, q, impl="flash_pallas", causal=True, block_sizes=BLOCKS)
  # 16 q blocks: rows (i, 15 - i) take 17 steps each, 8 rows, per batch row and head.
  assert causal.grid_steps == 2 * 3 * 8 * 17 == causal.blocks_visited
  assert "grid steps 816" in str(causal)
