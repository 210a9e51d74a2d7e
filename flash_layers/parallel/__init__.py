"""Sharded attention on device meshes.

* `make_mesh(data, fsdp, tensor, sequence)` -- a mesh with our named axes.
* `LOGICAL_RULES` -- the default logical-axis rules, for `flax.linen.logical_axis_rules`.
* `MeshAxes` -- which axes of a mesh with other names split the batch, heads and sequence.
* `attention(..., mesh=mesh)` (in `api.py`) runs inside `shard_map` through
  `sharded.py`, with a context-parallel strategy over "sequence" (`context.py`: the ring,
  Ulysses, all-gather, Ulysses inside a ring; `cost.py` chooses).
"""

from flash_layers.parallel.context import STRATEGIES
from flash_layers.parallel.mesh import AXES, BATCH_AXES, LOGICAL_RULES, MeshAxes, current_mesh, make_mesh

__all__ = ["AXES", "BATCH_AXES", "LOGICAL_RULES", "STRATEGIES", "MeshAxes", "current_mesh", "make_mesh"]
