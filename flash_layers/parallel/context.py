"""What every context-parallel strategy is given: `CPConfig`, and the strategies' names.

A strategy runs inside `shard_map` (parallel/sharded.py) on one device's contiguous shard of the
sequence and returns that shard's (out, lse); docs/sharding.md compares them.

* ``ring``         -- K/V travel around the sequence axis, queries stay (parallel/ring.py).
* ``ulysses``      -- two all-to-alls swap the sequence split for a head split, so each device
                      attends the whole sequence with a slice of the heads (parallel/ulysses.py).
* ``all_gather``   -- K/V gathered along the sequence axis, each device attends its own queries
                      (parallel/all_gather.py); the backward reduce-scatters dK/dV.
* ``ulysses_ring`` -- Ulysses inside groups of consecutive devices, a ring across the groups.
* ``auto``         -- chosen per call by the cost model (parallel/cost.py).
"""

from __future__ import annotations

import dataclasses

from flash_layers.impls import Request

STRATEGIES: tuple[str, ...] = ("ring", "ulysses", "all_gather", "ulysses_ring")
AUTO_STRATEGY = "auto"


@dataclasses.dataclass(frozen=True)
class CPConfig:
  """One sharded call's context-parallel step, as a strategy sees it."""

  impl: str  # the impl every inner call runs (dispatch.attend)
  # The shard_map block's request with the *global* q_len / kv_len: batch and (kv) heads are this
  # device's (data, fsdp) and tensor shard's.
  request: Request
  axis: str  # the sequence mesh axis
  size: int  # devices along it
  group: int = 1  # ulysses_ring: devices per Ulysses group (consecutive along `axis`)
