"""Sharded attention on device meshes.

* `make_mesh(data, fsdp, tensor, sequence)` -- a mesh with our named axes.
* `LOGICAL_RULES` -- the default logical-axis rules, for `flax.linen.logical_axis_rules`.
* `attention(..., mesh=mesh)` (in `api.py`) runs inside `shard_map` through
  `sharded.py`, with ring attention over "sequence" (`ring.py`).
"""

from flash_layers.parallel.mesh import AXES, BATCH_AXES, LOGICAL_RULES, current_mesh, make_mesh

__all__ = ["AXES", "BATCH_AXES", "LOGICAL_RULES", "current_mesh", "make_mesh"]
