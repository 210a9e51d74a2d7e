"""mod_operands on a mesh: their declared layout, how they are split, and how a shard reads them.

A mask_mod or score_mod indexes its operands with *global* indices (batch row, query head), whatever
the shard (contract/mods.py). An operand is replicated on every device unless its layout says that
one of its axes follows the batch or the heads:

    fl.attention(..., mask_mod=fl.masks.prefix_lm(operand=0), mod_operands=(prefix,),
                 mod_operand_axes=(("batch",),))        # prefix [batch]: split with the batch
    mod_operand_axes=(("heads", None),)                  # a T5 table [heads, buckets]

One entry per operand: None (replicated) or a tuple naming each of its axes: "batch" (its size is
the call's batch), "heads" (the call's query heads) or None. Such an axis is split exactly as the
batch or the heads are (each device receives only its rows), and inside the shard the rows are
placed at their global position in a zero buffer of the operand's global shape, so the user's mod
reads ``operand[b]`` with the global ``b`` unchanged. The buffer is the size of the operand (per
row or per head: small next to the activations); its gradient is sliced back to the shard's rows,
so a split operand's gradient needs no all-reduce over the axis it follows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

OPERAND_AXES: tuple[str, ...] = ("batch", "heads")


def check_layouts(layouts, operands: tuple, batch: int, num_heads: int) -> tuple:
  """`mod_operand_axes` normalised to one entry per operand (None: replicated); TypeError /
  ValueError naming the operand otherwise."""
  if layouts is None:
    return (None,) * len(operands)
  if not isinstance(layouts, (tuple, list)) or len(layouts) != len(operands):
    raise ValueError(f"mod_operand_axes must be a tuple with one entry per mod_operand ({len(operands)}); "
                     f"got {layouts!r}")
  sizes = {"batch": batch, "heads": num_heads}
  out = []
  for i, (layout, x) in enumerate(zip(layouts, operands, strict=True)):
    if layout is None:
      out.append(None)
      continue
    layout = tuple(layout) if isinstance(layout, (tuple, list)) else None
    if layout is None or len(layout) != x.ndim:
      raise ValueError(f"mod_operand_axes[{i}] must be None or a tuple naming each of the operand's {x.ndim} "
                       f"axes ({', '.join(map(repr, OPERAND_AXES))} or None); got {layouts[i]!r}")
    for axis, name in enumerate(layout):
      if name is not None and name not in OPERAND_AXES:
        raise ValueError(f"mod_operand_axes[{i}][{axis}] must be one of {OPERAND_AXES} or None; got {name!r}")
      if name is not None and x.shape[axis] != sizes[name]:
        raise ValueError(f"mod_operands[{i}] axis {axis} is declared {name!r}, so its size must be the "
                         f"call's {name} ({sizes[name]}); got {x.shape[axis]}")
    if len([n for n in layout if n is not None]) != len({n for n in layout if n is not None}):
      raise ValueError(f"mod_operand_axes[{i}] names an axis twice: {layout}")
    out.append(layout if any(n is not None for n in layout) else None)
  return tuple(out)


def check_divides(layouts: tuple, shapes: tuple, shards: dict[str, int]) -> None:
  """Refuse, by name, a declared axis that does not split evenly over its mesh axes."""
  for i, (layout, shape) in enumerate(zip(layouts, shapes, strict=True)):
    for axis, name in enumerate(layout or ()):
      if name is not None and shape[axis] % shards[name]:
        raise ValueError(f"mod_operands[{i}] axis {axis} ({name!r}, size {shape[axis]}) does not divide "
                         f"over the {shards[name]} {name} shards of the mesh")


def spec(layout, batch_spec, heads_spec) -> tuple:
  """The operand's PartitionSpec entries: its declared axes split as the batch / heads are."""
  if layout is None:
    return ()
  return tuple(batch_spec if n == "batch" else heads_spec if n == "heads" else None for n in layout)


def embed(local: tuple, layouts: tuple, shapes: tuple, batch_offset, head_offset) -> tuple:
  """Inside the shard: each split operand's rows placed at their global rows of a zero buffer."""
  out = []
  for x, layout, shape in zip(local, layouts, shapes, strict=True):
    if layout is None or tuple(x.shape) == tuple(shape):
      out.append(x)
      continue
    starts = [batch_offset if n == "batch" else head_offset if n == "heads" else 0 for n in layout]
    starts = [jnp.asarray(s, jnp.int32) for s in starts]
    out.append(jax.lax.dynamic_update_slice(jnp.zeros(shape, x.dtype), x, starts))
  return tuple(out)
